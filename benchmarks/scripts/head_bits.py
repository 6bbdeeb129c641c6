"""The exited steps' LM head at 8 bits per row or 4 bits (group 64), each with the exact top-k recompute
(`lm_head_exact_top_k`) at several k, swapped into one river with the default twins (`nbits="auto"`) in one process.

    python benchmarks/scripts/head_bits.py                          # µs per exited head call, each variant (SmolLM2)
    python benchmarks/scripts/head_bits.py --fidelity               # + teacher-forced match / KL, test + train prompts
    python benchmarks/scripts/head_bits.py --captured               # + decode speed captured, every variant interleaved
    python benchmarks/scripts/head_bits.py --random-model llama-3.2-1b --captured --tau -1   # a 1B shape, speed only

A 4-bit head reads half the 8-bit head's bytes (SmolLM2: 28M of its 135M weights; a 1B Llama: 262M of 1.24B). On
its own it cost 14 pp of match (benchmarks/README.md, "Twin precision per layer"); the exact top-k recomputes the k
logits it ranks highest from the original head's rows, so it only changes a greedy token the original head would
pick from the same hidden state when that token falls out of its top k.

Cost, fidelity and captured speed as head_activations.py measures them (the same functions): `RiverLMHead.exited_logits`
per call, interleaved, median µs; teacher-forced match on the captured_decode.py test prompts and six GSM8K train
questions at full quantization (tau=-1) and the confidence signal at 0.3; median decode tok/s of the compiled
backbone and the captured river with each variant (`--tau`, default 0.3), interleaved over `--rounds` after a warm-up
round that compiles. `--random-model NAME` takes a random-weight shape of river_hf.bench.shapes and its random prompts
instead (speed only: random weights say nothing about fidelity).
"""

from __future__ import annotations

import argparse

import torch

from river_hf import RiverQuantConfig, build_river
from river_hf.bench.data import load_prompts
from river_hf.bench.fidelity import backbone_references
from river_hf.bench.shapes import random_model, random_prompts
from river_hf.core.lm_head import river_lm_head
from river_hf.kernels.quantize import RiverQuantLinear
from river_hf.loading.models import build_chat_inputs, load_model_and_tokenizer

from captured_decode import CHAT
from head_activations import captured_speeds, head_cost, print_fidelity, w8a8_head

DEFAULT_TOP_KS = (4, 64)


def head_variants(head, top_ks, w8a8: bool = False) -> dict[str, tuple]:
    """name -> (quantized head, exact top-k) at each k of `top_ks`: an 8-bit per-row copy of the original head, with
    `w8a8` the same on fbgemm's W8A8 kernel, and a 4-bit copy (group 64); weight-only kernels timed like the twins'."""
    heads = {"8-bit": RiverQuantLinear.from_linear(head.base_head, nbits=8, group_size=None, backend="fastest")}
    if w8a8:
        heads["8-bit W8A8"] = w8a8_head(head)
    heads["4-bit"] = RiverQuantLinear.from_linear(head.base_head, nbits=4, group_size=64, backend="fastest")
    return {f"{name}, k={k}": (quantized, k) for k in top_ks for name, quantized in heads.items()}


def smollm2_references(model, tokenizer) -> dict:
    """The backbone's teacher-forcing references on the test and train prompts (before the river exists)."""
    references = {}
    for name, texts in (("test", CHAT + load_prompts(3).prompts), ("train", load_prompts(6, split="train").prompts)):
        prompts = [build_chat_inputs(tokenizer, text)["input_ids"] for text in texts]
        references[name] = backbone_references(model, prompts, 64, progress=True)
    return references


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--random-model", default=None, help="a shape of river_hf.bench.shapes (speed only)")
    parser.add_argument("--top-ks", type=int, nargs="+", default=list(DEFAULT_TOP_KS))
    parser.add_argument("--w8a8", action="store_true", help="also the 8-bit head on fbgemm's W8A8 kernel (VNNI CPUs)")
    parser.add_argument("--fidelity", action="store_true")
    parser.add_argument("--captured", action="store_true")
    parser.add_argument("--tau", type=float, default=0.3, help="the captured river's confidence tau (-1: every step)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=2000, help="exited head calls per variant for the cost")
    args = parser.parse_args(argv)
    if args.random_model and args.fidelity:
        parser.error("--fidelity needs the packaged SmolLM2: random weights say nothing about fidelity")
    if args.random_model:
        model = random_model(args.random_model)
        inputs = random_prompts(model.config.vocab_size, 2)
    else:
        model, tokenizer = load_model_and_tokenizer(None, dtype=torch.bfloat16)
        inputs = [build_chat_inputs(tokenizer, text) for text in CHAT + load_prompts(3).prompts]
    references = smollm2_references(model, tokenizer) if args.fidelity else {}
    build_river(model, RiverQuantConfig(), progress=False)
    head = river_lm_head(model)
    heads = head_variants(head, args.top_ks, args.w8a8)
    # each variant is its own graph per path (a module and an int dynamo guards on): more than its default limit of 8
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 4 * (len(heads) + 1))
    print("kernels: " + ", ".join(f"{name}: {quantized.backend}" for name, (quantized, _) in heads.items()))
    for name, micros in head_cost(head, heads, model.config.hidden_size, args.calls).items():
        print(f"exited head call, {name}: {micros:7.1f} µs", flush=True)
    if args.captured:
        for name, rate in captured_speeds(model, head, heads, inputs, args.rounds, args.tau).items():
            print(f"captured (tau {args.tau}), {name}: {rate:.1f} tok/s", flush=True)
    print_fidelity(model, head, heads, references)


if __name__ == "__main__":
    main()
