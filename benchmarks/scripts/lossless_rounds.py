"""How noisy one lossless round's cost per token is: what the fallback rule's margin is sized from.

    python benchmarks/scripts/lossless_rounds.py [--prompts 3] [--max-new-tokens 128] [--k 4 8] [--nbits auto]

Lossless generate with the fallback off (`draft_fallback=False`, so every round drafts), on GSM8K test prompts with
the chat template, the packaged SmolLM2 by default. Per round: (draft seconds + verification seconds) / tokens the
round appended, divided by t_plain (the mean of the lossless mode's own 3 plain probe steps, timed on the same
prompt just before). Printed per k: the mean of that ratio, its relative spread (sd / mean) across the rounds of all
prompts, and how often the first 2 and 3 rounds of a call, pooled as the rule pools them, looked dearer than a plain
step although the whole call was cheaper: the false alarms a margin-free rule would act on. Time it on a quiet machine.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from river_hf import RiverConfig, RiverQuantConfig, build_river
from river_hf.bench.data import load_prompts
from river_hf.cli.commands.common import nbits_arg
from river_hf.lossless.draft_control import PROBE_STEPS
from river_hf.lossless.decode import forget_fallbacks
from river_hf.loading.models import build_chat_inputs, load_model_and_tokenizer


def plain_step_seconds(model, inputs: dict) -> float:
    """t_plain as the fallback rule measures it: the lossless mode's own plain backbone steps that open a call (a
    call of 1 + PROBE_STEPS tokens is only those), their mean."""
    # a fresh river's fallback memory: otherwise the call reuses the t_plain an earlier call measured, taking no steps
    forget_fallbacks(model)
    config = RiverConfig(tau=0.3, exit_signal="confidence", lossless=True, max_new_tokens=1 + PROBE_STEPS,
                         min_new_tokens=1 + PROBE_STEPS, return_dict_in_generate=True)
    record = model.generate(**inputs, generation_config=config).cache.drafts
    assert record.plain_steps == PROBE_STEPS and not record.rounds
    return record.plain_seconds / record.plain_steps


def round_ratios(model, inputs: dict, k: int, new_tokens: int) -> tuple[list[float], list[tuple[float, int]]]:
    """Per round of one call: cost per appended token over t_plain; and (seconds, tokens) per round."""
    t_plain = plain_step_seconds(model, inputs)
    config = RiverConfig(tau=0.3, exit_signal="confidence", lossless=True, num_draft_tokens=k, draft_fallback=False,
                         max_new_tokens=new_tokens, min_new_tokens=new_tokens, return_dict_in_generate=True)
    rounds = model.generate(**inputs, generation_config=config).cache.drafts.rounds
    costs = [((r.draft_seconds + r.verify_seconds) / t_plain, r.committed) for r in rounds if r.committed]
    return [seconds / tokens for seconds, tokens in costs], costs


def pooled(costs: list[tuple[float, int]]) -> float:
    return sum(s for s, _ in costs) / sum(t for _, t in costs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--nbits", type=nbits_arg, default="auto")
    args = parser.parse_args()
    model, tokenizer = load_model_and_tokenizer(args.model)
    model = build_river(model, RiverQuantConfig(nbits=args.nbits))
    prompts = [build_chat_inputs(tokenizer, p, model.device) for p in load_prompts(args.prompts).prompts]
    round_ratios(model, prompts[0], args.k[0], 16)  # warm-up (and the row probes, once per row count)
    print(f"torch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads, "
          f"nbits={args.nbits}")
    for k in args.k:
        ratios, alarms = [], {2: 0, 3: 0}
        for inputs in prompts:
            call, costs = round_ratios(model, inputs, k, args.max_new_tokens)
            ratios += call
            for first in alarms:
                alarms[first] += pooled(costs[:first]) > 1.0 and pooled(costs) < 1.0
        mean = statistics.fmean(ratios)
        print(f"k={k}: {len(ratios)} rounds, cost per token / t_plain: mean {mean:.3f}, relative spread "
              f"{statistics.stdev(ratios) / mean:.3f}; calls cheaper than plain overall whose first 2 / 3 rounds "
              f"looked dearer: {alarms[2]} / {alarms[3]} of {len(prompts)}")


if __name__ == "__main__":
    main()
