"""Is decoding faster under `torch.inference_mode` than under transformers' `no_grad`, and does the river gain more?

    python benchmarks/scripts/inference_mode.py [--prompts 3] [--rounds 2] [--max-new-tokens 128] [--no-lossless]
        [--output PATH]

A river's `generate` runs under `torch.inference_mode` (`river_hf.core.generation.GENERATE_IN_INFERENCE_MODE`). This
switches that flag off and on between calls, on one river model (the packaged SmolLM2 with the default
`RiverQuantConfig()`), GSM8K test prompts with the chat template, batch 1, greedy, every call `max_new_tokens` long:
- the backbone (a plain `GenerationConfig`: the river model's untouched backbone, as the bench times it);
- the defaults (`RiverConfig()`: tau "auto");
- lossless mode (`RiverConfig(lossless=True)`, k=8), unless `--no-lossless`;
each under both modes, interleaved after a warm-up call of each. Prints the median decode tok/s of each, each
system's ratio to the backbone of the same mode, and each mode's gain; `--output` writes the raw timings as JSON.
Time it on a quiet machine.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from transformers import GenerationConfig
from tqdm.auto import tqdm

import river_hf.core.generation as generation
from river_hf import RiverConfig, RiverQuantConfig, build_river
from river_hf.bench.data import load_prompts
from river_hf.bench.records import write_record
from river_hf.bench.run import environment
from river_hf.bench.speed import time_generate
from river_hf.loading.models import build_chat_inputs, load_model_and_tokenizer

MODES = {"no_grad": False, "inference_mode": True}  # the value of GENERATE_IN_INFERENCE_MODE


def system_configs(max_new_tokens: int, lossless: bool) -> dict:
    fixed = dict(max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False)
    systems = {"backbone": GenerationConfig(**fixed), "defaults": RiverConfig(**fixed)}
    if lossless:
        systems["lossless k=8"] = RiverConfig(lossless=True, **fixed)
    return systems


def time_in_mode(model, inputs: dict, config, mode: str) -> float:
    """Decode tok/s of one generate call with the river's generate in `mode`."""
    generation.GENERATE_IN_INFERENCE_MODE = MODES[mode]
    try:
        return time_generate(model, inputs, config).decode_tokens_per_s
    finally:
        generation.GENERATE_IN_INFERENCE_MODE = True


def measure(model, prompts: list[dict], systems: dict, rounds: int) -> dict[str, dict[str, list[float]]]:
    """rates[system][mode]: decode tok/s per call, in the order A B C ... for every prompt and round."""
    runs = [(name, mode) for name in systems for mode in MODES]
    for name, mode in runs:  # warm-up: allocation, kernel choice, the defaults' exit-gain measurement
        time_in_mode(model, prompts[0], systems[name], mode)
    rates = {name: {mode: [] for mode in MODES} for name in systems}
    with tqdm(total=rounds * len(prompts) * len(runs), desc="interleaved calls") as bar:
        for _ in range(rounds):
            for inputs in prompts:
                for name, mode in runs:
                    rates[name][mode].append(time_in_mode(model, inputs, systems[name], mode))
                    bar.update(1)
    return rates


def report(rates: dict) -> None:
    median = {name: {mode: statistics.median(values) for mode, values in by_mode.items()}
              for name, by_mode in rates.items()}
    print(f"CPU capability {torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}")
    print("| system | no_grad tok/s | inference_mode tok/s | gain | "
          "vs backbone, no_grad | vs backbone, inference_mode |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, by_mode in median.items():
        ratios = [by_mode[mode] / median["backbone"][mode] for mode in MODES]
        print(f"| {name} | {by_mode['no_grad']:.1f} | {by_mode['inference_mode']:.1f} | "
              f"{by_mode['inference_mode'] / by_mode['no_grad']:.3f}x | {ratios[0]:.3f}x | {ratios[1]:.3f}x |")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--no-lossless", action="store_true", help="Leave lossless mode out.")
    parser.add_argument("--output", default=None, help="A JSON file for the raw timings.")
    parser.add_argument("--model", default=None, help="A hub id or local path (default: the packaged SmolLM2).")
    args = parser.parse_args(argv)

    model, tokenizer = load_model_and_tokenizer(args.model)
    build_river(model, RiverQuantConfig())
    prompts = [build_chat_inputs(tokenizer, prompt, model.device) for prompt in load_prompts(args.prompts).prompts]
    rates = measure(model, prompts, system_configs(args.max_new_tokens, not args.no_lossless), args.rounds)
    report(rates)
    record = {"environment": environment(), "arguments": vars(args), "decode_tokens_per_s": rates}
    if args.output:
        write_record(record, args.output)
    return record


if __name__ == "__main__":
    main()
