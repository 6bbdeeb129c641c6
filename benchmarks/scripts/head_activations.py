"""The exited steps' LM head weight-only (the default) or on W8A8 (`lm_head_activations="int8"`), on the packaged
SmolLM2 with the default twins, in one process: each head is swapped into the same river between calls.

    python benchmarks/scripts/head_activations.py                # µs per exited head call, each head
    python benchmarks/scripts/head_activations.py --fidelity     # + teacher-forced match / KL, test and train prompts
    python benchmarks/scripts/head_activations.py --captured     # + decode speed captured, both heads interleaved

Cost: `RiverLMHead.exited_logits` (with the default exact top-4) on one decode position, 2000 calls per head,
interleaved, median µs. Fidelity: the captured_decode.py prompts (three chat prompts and the first three GSM8K test
questions) and the first six GSM8K train questions, 64 tokens each, full quantization (tau=-1) and the confidence
signal at 0.3. Captured: transformers' compiled static-cache backbone and the river's captured steps at confidence
0.3 with each head (dynamo keeps a graph for each), on the test prompts, 64 new tokens, interleaved over `--rounds`
after a warm-up round that compiles; median decode tok/s.
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
from river_hf.kernels.quantize import RiverQuantLinear
from river_hf.loading.models import build_chat_inputs, load_model_and_tokenizer

from captured_decode import CHAT, interleaved_rates


def w8a8_head(head) -> RiverQuantLinear:
    """The original head on fbgemm's W8A8 kernel, 8 bits per row, as `lm_head_activations="int8"` builds it where
    'fastest' times it faster."""
    return RiverQuantLinear.from_linear(head.base_head, nbits=8, group_size=None, backend="w8a8_cpu",
                                        activations="int8")


def use(head, variant: tuple) -> None:
    """Swap a head variant, (quantized head, exact top-k), into the river's head."""
    head.quantized_head, head.exact_top_k = variant


def head_cost(head, heads: dict, hidden_size: int, calls: int = 2000) -> dict[str, float]:
    """Median µs of one exited head call (batch 1, one position) with each head variant, name -> (quantized head,
    exact top-k), interleaved."""
    hidden = torch.randn(1, 1, hidden_size, dtype=torch.bfloat16)
    times = {name: [] for name in heads}
    with torch.inference_mode():
        for _ in range(calls):
            for name, variant in heads.items():
                use(head, variant)
                started = time.perf_counter()
                head.exited_logits(hidden)
                times[name].append(time.perf_counter() - started)
    return {name: statistics.median(values[calls // 10:]) * 1e6 for name, values in times.items()}


def captured_speeds(model, head, heads: dict, inputs: list[dict], rounds: int, tau: float = 0.3) -> dict[str, float]:
    """Median decode tok/s of the compiled backbone and the captured river with each head variant, interleaved."""
    fixed = dict(max_new_tokens=64, min_new_tokens=64, do_sample=False, cache_implementation="static",
                 compile_config=compile_config_for("cpu"))
    def swap_in(variant):
        return lambda: use(head, variant)
    systems = {"backbone compiled": (GenerationConfig(**fixed), lambda: None)}
    systems.update({f"river, {name} head": (RiverConfig(tau=tau, **fixed), swap_in(variant))
                    for name, variant in heads.items()})
    return interleaved_rates(model, systems, inputs, rounds)


def print_fidelity(model, head, heads: dict, references: dict) -> None:
    for prompts, refs in references.items():
        for name, variant in heads.items():
            use(head, variant)
            for tau in (-1.0, 0.3):
                fid = measure_fidelity(model, refs, RiverSettings(tau=tau, exit_signal="confidence"))
                print(f"{prompts} prompts, {name} head, tau {tau:4}: teacher-forced match {fid.match:.4f} "
                      f"({round(fid.match * fid.positions)}/{fid.positions}), KL {fid.kl:.4f}", flush=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fidelity", action="store_true")
    parser.add_argument("--captured", action="store_true")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=2000, help="exited head calls per head for the cost")
    args = parser.parse_args(argv)
    model, tokenizer = load_model_and_tokenizer(None, dtype=torch.bfloat16)
    test_texts = CHAT + load_prompts(3).prompts
    references = {}
    if args.fidelity:  # the backbone's side first, before the river exists
        for name, texts in (("test", test_texts), ("train", load_prompts(6, split="train").prompts)):
            prompts = [build_chat_inputs(tokenizer, text)["input_ids"] for text in texts]
            references[name] = backbone_references(model, prompts, 64, progress=True)
    build_river(model, RiverQuantConfig(), progress=False)
    head = river_lm_head(model)
    heads = {"weight-only": (head.quantized_head, head.exact_top_k), "W8A8": (w8a8_head(head), head.exact_top_k)}
    print(f"weight-only head kernel: {heads['weight-only'][0].backend}; W8A8 head kernel: {heads['W8A8'][0].backend}")
    for name, micros in head_cost(head, heads, model.config.hidden_size, args.calls).items():
        print(f"exited head call, {name}: {micros:7.1f} µs", flush=True)
    if args.captured:
        inputs = [build_chat_inputs(tokenizer, text) for text in test_texts]
        for name, rate in captured_speeds(model, head, heads, inputs, args.rounds).items():
            print(f"captured, {name}: {rate:.1f} tok/s", flush=True)
    print_fidelity(model, head, heads, references)


if __name__ == "__main__":
    main()
