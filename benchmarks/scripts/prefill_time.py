"""Is a river's prompt as fast as the backbone's? Times the prompt pass (time to the first token) of plain `generate`
and of river `generate` calls on the same model, interleaved after a warm-up, on GSM8K prompts.

    python benchmarks/scripts/prefill_time.py                        # 3 prompts x 4 rounds
    python benchmarks/scripts/prefill_time.py --rounds 10 --model PATH

The bench's prefill column times one prompt per run, which a noisy machine spreads widely; this times only prompts,
many of them, so the medians can settle issue 10's "never slower than the backbone's prompt, ±5%".
"""

from __future__ import annotations

import argparse
import statistics

import torch
from transformers import GenerationConfig

from river_hf import RiverConfig, RiverQuantConfig, build_river
from river_hf.bench.data import load_prompts
from river_hf.bench.speed import interleaved
from river_hf.loading.models import build_chat_inputs, load_model_and_tokenizer


def systems() -> dict[str, GenerationConfig]:
    one_token = {"max_new_tokens": 1, "min_new_tokens": 1, "do_sample": False}
    return {"backbone": GenerationConfig(**one_token),
            "river, tau=-1 (full quantization)": RiverConfig(tau=-1.0, **one_token),
            "river, the defaults": RiverConfig(**one_token)}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--model", default=None, help="A hub id or local path (default: the packaged SmolLM2).")
    args = parser.parse_args(argv)

    model, tokenizer = load_model_and_tokenizer(args.model, dtype=torch.bfloat16)
    build_river(model, RiverQuantConfig(backend="fastest"))  # the defaults: kernels and prompt exit chosen by timing
    prompts = [build_chat_inputs(tokenizer, text) for text in load_prompts(args.prompts).prompts]
    timings = interleaved(model, systems(), prompts, rounds=args.rounds)
    print(f"CPU capability {torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads; "
          f"{len(prompts)} prompts x {args.rounds} rounds, prompt lengths "
          f"{sorted(p['input_ids'].shape[1] for p in prompts)}")
    print("| system | prompt ms (median) | vs backbone |\n|---|---:|---:|")
    results = {name: statistics.median(t.prefill_s for t in runs) for name, runs in timings.items()}
    for name, seconds in results.items():
        print(f"| {name} | {seconds * 1000:.1f} | {seconds / results['backbone']:.3f}x |")
    return results


if __name__ == "__main__":
    main()
