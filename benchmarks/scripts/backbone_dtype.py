"""Which backbone dtype is fastest on this machine? Times plain `generate` of the packaged SmolLM2-135M loaded in
bfloat16 and in float32, interleaved after a warm-up, on GSM8K prompts: decode tokens/s and prefill time.

    python benchmarks/scripts/backbone_dtype.py                     # 3 prompts x 3 rounds x 64 new tokens
    python benchmarks/scripts/backbone_dtype.py --rounds 5 --max-new-tokens 128

A decode step is a batch-1 GEMV per weight, memory-bound, so bf16 (half the bytes) should win it everywhere; a
prompt is a GEMM, compute-bound, where bf16 without AVX-512-BF16 is slow. The end-to-end column adds both for the
measured prompt length and --max-new-tokens. The last line is what `river_hf.fastest_dtype` (the CLI's `--dtype
auto`) chooses from one GEMV at the model's MLP shape, to compare with the whole-generate measurement above.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from transformers import GenerationConfig

from river_hf.kernels import backbone_dtype
from river_hf.bench.data import load_prompts
from river_hf.bench.speed import interleaved
from river_hf.loading.models import build_chat_inputs, load_model_and_tokenizer

DTYPES = backbone_dtype.CANDIDATES


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--model", default=None, help="A hub id or local path (default: the packaged SmolLM2).")
    args = parser.parse_args(argv)

    models = {name: load_model_and_tokenizer(args.model, dtype=dtype) for name, dtype in DTYPES.items()}
    tokenizer = models["bfloat16"][1]
    prompts = [build_chat_inputs(tokenizer, text) for text in load_prompts(args.prompts).prompts]
    fixed = GenerationConfig(max_new_tokens=args.max_new_tokens, min_new_tokens=args.max_new_tokens, do_sample=False)
    timings = interleaved(None, {name: fixed for name in DTYPES}, prompts, rounds=args.rounds,
                          models={name: model for name, (model, _) in models.items()})
    print(f"CPU capability {torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}; {len(prompts)} prompts x {args.rounds} rounds x {args.max_new_tokens} tokens")
    print("| dtype | decode tok/s | prefill ms | end to end s |\n|---|---:|---:|---:|")
    results = {}
    for name, runs in timings.items():
        rate = statistics.median(t.decode_tokens_per_s for t in runs)
        prefill = statistics.median(t.prefill_s for t in runs)
        results[name] = {"decode_tokens_per_s": rate, "prefill_s": prefill}
        print(f"| {name} | {rate:.1f} | {prefill * 1000:.0f} | {prefill + (args.max_new_tokens - 1) / rate:.2f} |")
    choice = backbone_dtype.choose(backbone_dtype.mlp_shape(models["bfloat16"][0].config))
    print(f"fastest_dtype chooses {choice.describe()}")
    results["fastest_dtype"] = choice.dtype
    return results


if __name__ == "__main__":
    main()
