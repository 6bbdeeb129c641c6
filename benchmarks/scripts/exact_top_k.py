"""What `RiverQuantConfig(lm_head_exact_top_k=K)` costs and buys on the packaged SmolLM2 (default twins otherwise).

    python benchmarks/scripts/exact_top_k.py                    # cost: µs per exited head call, K = 0, 4, 8, 16
    python benchmarks/scripts/exact_top_k.py --fidelity         # + teacher-forced match / KL at each K
    python benchmarks/scripts/exact_top_k.py --fidelity --prompts train --nbits 8   # other prompts, all-8-bit twins
    python benchmarks/scripts/exact_top_k.py --captured         # + decode speed captured, K = 0 and 4 interleaved

Cost: the exited step's head (`RiverLMHead.exited_logits`) on one decode position, each K in turn, interleaved, 2000
calls per K after a warm-up, median µs. Fidelity: the captured_decode.py prompts (`--prompts test`: its three chat
prompts and the first three GSM8K test questions; `--prompts train`: the first six GSM8K train questions instead),
64 tokens each, full quantization (tau=-1) and the confidence signal at 0.3, each K on the same twins, with `--nbits`
(default: the defaults' "auto"; 8: all-8-bit twins).
Captured (`--captured`): transformers' compiled static-cache backbone and the river's captured steps at confidence 0.3
with K = 0 and K = 4 (the head's `exact_top_k` set between calls: dynamo keeps a graph for each), on the test prompts,
64 new tokens, interleaved over `--rounds` after a warm-up that compiles; median decode tok/s.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from transformers import GenerationConfig

from river_hf import RiverConfig, RiverQuantConfig, RiverSettings, build_river, compile_config_for
from river_hf.bench.data import load_prompts
from river_hf.bench.fidelity import backbone_references, measure_fidelity
from river_hf.core.lm_head import river_lm_head
from river_hf.loading.models import build_chat_inputs, load_model_and_tokenizer

from captured_decode import CHAT, interleaved_rates

KS = (0, 4, 8, 16)


def head_cost(head, hidden_size: int, calls: int = 2000) -> dict[int, float]:
    """Median µs of one exited head call (batch 1, one position) at each K, interleaved."""
    hidden = torch.randn(1, 1, hidden_size, dtype=torch.bfloat16)
    times = {k: [] for k in KS}
    with torch.inference_mode():
        for _ in range(calls):
            for k in KS:
                head.exact_top_k = k
                started = time.perf_counter()
                head.exited_logits(hidden)
                times[k].append(time.perf_counter() - started)
    return {k: statistics.median(values[calls // 10:]) * 1e6 for k, values in times.items()}


def captured_speeds(model, head, inputs: list[dict], rounds: int) -> dict[str, float]:
    """Median decode tok/s of the compiled backbone and the captured river at K = 0 and 4, interleaved."""
    fixed = dict(max_new_tokens=64, min_new_tokens=64, do_sample=False, cache_implementation="static",
                 compile_config=compile_config_for("cpu"))
    def top_k(k: int):
        def setup():
            head.exact_top_k = k
        return setup
    systems = {"backbone compiled": (GenerationConfig(**fixed), top_k(0)),
               "river K=0": (RiverConfig(tau=0.3, **fixed), top_k(0)),
               "river K=4": (RiverConfig(tau=0.3, **fixed), top_k(4))}
    return interleaved_rates(model, systems, inputs, rounds)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nbits", default="auto", type=lambda text: text if text == "auto" else int(text))
    parser.add_argument("--fidelity", action="store_true")
    parser.add_argument("--prompts", choices=["test", "train"], default="test")
    parser.add_argument("--captured", action="store_true")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    model, tokenizer = load_model_and_tokenizer(None, dtype=torch.bfloat16)
    references = None
    if args.fidelity:  # the backbone's side first, before the river exists
        texts = CHAT + load_prompts(3).prompts if args.prompts == "test" else load_prompts(6, split="train").prompts
        prompts = [build_chat_inputs(tokenizer, text)["input_ids"] for text in texts]
        references = backbone_references(model, prompts, 64, progress=True)
    build_river(model, RiverQuantConfig(nbits=args.nbits), progress=False)
    head = river_lm_head(model)
    for k, micros in head_cost(head, model.config.hidden_size).items():
        print(f"exited head call, K={k:2d}: {micros:7.1f} µs", flush=True)
    if args.captured:
        inputs = [build_chat_inputs(tokenizer, text) for text in CHAT + load_prompts(3).prompts]
        for name, rate in captured_speeds(model, head, inputs, args.rounds).items():
            print(f"captured, {name}: {rate:.1f} tok/s", flush=True)
    for k in KS if references else ():
        head.exact_top_k = k
        for tau in (-1.0, 0.3):
            fid = measure_fidelity(model, references, RiverSettings(tau=tau, exit_signal="confidence"))
            print(f"{args.prompts} prompts, nbits {args.nbits}, K={k:2d}, tau {tau:4}: "
                  f"teacher-forced match {fid.match:.4f} "
                  f"({round(fid.match * fid.positions)}/{fid.positions}), KL {fid.kl:.4f}", flush=True)


if __name__ == "__main__":
    main()
