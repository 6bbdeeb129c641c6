"""Sweep tau on a model: decode speed (interleaved, in one process) and teacher-forced fidelity vs the backbone.

    python examples/tau_sweep.py                          # packaged SmolLM2-135M, GSM8K questions
    python examples/tau_sweep.py --taus -1 0.97 0.98 0.99 --nbits 4 --prompts 3 --max-new-tokens 128

Prints a markdown table: tau, decode tok/s (median over prompts and rounds) and its ratio to the backbone, mean
exit depth, next-token match and KL(backbone || river), with the twin configuration beside it.
"""

import argparse
import json
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import GenerationConfig

import river_hf
from river_hf import RiverConfig, RiverQuantConfig
from river_hf.bench.fidelity import backbone_references, measure_fidelity
from river_hf.bench.speed import interleaved, median_rate
from river_hf.models import build_chat_inputs, load_model_and_tokenizer
from river_hf.router import RiverSettings

GSM8K = Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "gsm8k" / "test.jsonl"


def gsm8k_questions(path: Path, count: int) -> list[str]:
    with open(path) as lines:
        return [json.loads(line)["question"] for _, line in zip(range(count), lines)]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--taus", type=float, nargs="+", default=[-1, 0.97, 0.975, 0.98, 0.985, 0.99])
    parser.add_argument("--nbits", type=int, default=4)
    parser.add_argument("--group-size", type=lambda v: None if v == "none" else int(v), default=64)
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--fidelity-prompts", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--data", type=Path, default=GSM8K)
    args = parser.parse_args(argv)

    model, tokenizer = load_model_and_tokenizer(args.model, dtype=torch.bfloat16)
    quant = RiverQuantConfig(nbits=args.nbits, group_size=args.group_size)
    river_hf.build_river(model, quant)
    questions = gsm8k_questions(args.data, max(args.prompts, args.fidelity_prompts))
    prompts = [build_chat_inputs(tokenizer, q) for q in questions]

    fixed = dict(max_new_tokens=args.max_new_tokens, min_new_tokens=args.max_new_tokens, do_sample=False)
    systems = {"backbone": GenerationConfig(**fixed), **{f"tau={t:g}": RiverConfig(tau=t, **fixed) for t in args.taus}}
    with tqdm(total=len(systems) * args.prompts * args.rounds, desc="speed (interleaved)") as bar:
        timings = interleaved(model, systems, prompts[:args.prompts], rounds=args.rounds, progress=bar.update)
    references = backbone_references(model, [p["input_ids"] for p in prompts[:args.fidelity_prompts]])
    fidelity = {t: measure_fidelity(model, references, RiverSettings(tau=t))
                for t in tqdm(args.taus, desc="fidelity (teacher-forced)")}
    print_table(args, quant, timings, fidelity, len(river_hf.river_layers(model)))


def print_table(args, quant, timings, fidelity, num_layers):
    base = median_rate(timings["backbone"])
    print(f"\ntwins: {quant.nbits}-bit HQQ, group {quant.group_size}, from layer {quant.start_layer}; "
          f"{args.max_new_tokens} new tokens, {args.prompts} prompts x {args.rounds} rounds (speed), "
          f"{args.fidelity_prompts} prompts x 64 tokens (fidelity)\n")
    print(f"| system | decode tok/s | vs backbone | mean exit depth (of {num_layers}) | next-token match | KL |")
    print("|---|---:|---:|---:|---:|---:|")
    print(f"| backbone | {base:.1f} | 1.00x | {num_layers} | 100% | 0 |")
    for tau, fid in fidelity.items():
        rate = median_rate(timings[f"tau={tau:g}"])
        print(f"| river tau={tau:g} | {rate:.1f} | {rate / base:.2f}x | {fid.mean_exit_depth:.1f} | "
              f"{fid.match:.1%} | {fid.kl:.4f} |")


if __name__ == "__main__":
    main()
