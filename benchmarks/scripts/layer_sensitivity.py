"""Which river layers can take 4-bit twins? Each layer's cost in fidelity, alone, measured, against the rule
`nbits="auto"` follows (4-bit for the first quarter of the river layers, 8-bit after: a rule by position).

    python benchmarks/scripts/layer_sensitivity.py                        # SmolLM2, 6 GSM8K train prompts x 48 tokens
    python benchmarks/scripts/layer_sensitivity.py --prompts 6 --tokens 48 --output sensitivity.json

The river is built twice, all-4-bit (group 64) and all-8-bit (per row, with the 8-bit LM head), and its twins are
swapped layer by layer, so every configuration below shares the same quantized weights. Starting from all-8-bit twins,
each river layer in turn gets its 4-bit twin alone; teacher-forced match and KL(backbone || river) are measured at full
quantization (tau=-1: every decode step runs the twins from the start layer), on GSM8K *train* prompts (the benches'
prompts come from its test split), against the backbone's own greedy continuation (river_hf.bench.fidelity). A layer
whose 4-bit twin adds little KL is one a measured schedule would make 4-bit; the printout ends with the layers the
measurement picks beside the ones the positional rule picks, and the KL each set adds (summed one layer at a time).
"""

from __future__ import annotations

import argparse
import json

import torch

from river_hf import RiverQuantConfig, build_river, is_river, remove_river
from river_hf.bench.data import load_prompts
from river_hf.bench.fidelity import backbone_references, measure_fidelity
from river_hf.core.settings import RiverSettings
from river_hf.core.twins import river_layers
from river_hf.loading.models import build_chat_inputs, load_model_and_tokenizer

FULL_QUANTIZATION = RiverSettings(tau=-1.0)


def twins_at(model, bits: int) -> list:
    """Every river layer's twin (None where a layer has none) with all twins at `bits`; leaves that river built."""
    if is_river(model):
        remove_river(model)
    # 8 bits: one group per row, as the defaults' 8-bit twins (the int8 kernel's layout; 64 would be ignored, warned)
    build_river(model, RiverQuantConfig(nbits=bits, group_size=64 if bits == 4 else None), progress=False)
    return [layer.twin for layer in river_layers(model)]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="A hub id or local path (default: the packaged SmolLM2).")
    parser.add_argument("--prompts", type=int, default=6, help="GSM8K train prompts")
    parser.add_argument("--tokens", type=int, default=48, help="teacher-forced positions per prompt")
    parser.add_argument("--output", default=None, help="a JSON record of every row")
    args = parser.parse_args(argv)

    model, tokenizer = load_model_and_tokenizer(args.model, dtype=torch.bfloat16)
    prompts = [build_chat_inputs(tokenizer, text)["input_ids"]
               for text in load_prompts(args.prompts, split="train").prompts]
    references = backbone_references(model, prompts, args.tokens, progress=True)
    four_bit = twins_at(model, 4)
    eight_bit = twins_at(model, 8)  # the river left on the model; its twins are swapped below
    layers = river_layers(model)

    def fidelity_with_4bit(index: int | None) -> dict:
        for i, layer in enumerate(layers):
            layer.twin = four_bit[i] if i == index else eight_bit[i]
        measured = measure_fidelity(model, references, FULL_QUANTIZATION)
        return {"match": measured.match, "kl": measured.kl}

    baseline = fidelity_with_4bit(None)
    print(f"all twins 8-bit: match {baseline['match']:.4f}, KL {baseline['kl']:.4f}", flush=True)
    rows = []
    for index, layer in enumerate(layers):
        if layer.twin is None:  # before the start layer: no twin
            continue
        row = {"layer": index, **fidelity_with_4bit(index)}
        row["added_kl"] = row["kl"] - baseline["kl"]
        rows.append(row)
        print(f"layer {index:2d} alone 4-bit: match {row['match']:.4f}, KL {row['kl']:.4f} "
              f"({row['added_kl']:+.4f})", flush=True)
    result = {"baseline": baseline, "rows": rows, "prompts": args.prompts, "tokens": args.tokens,
              **compare_with_rule(rows, len(layers))}
    if args.output:
        with open(args.output, "w") as handle:
            json.dump(result, handle, indent=1)
    return result


def compare_with_rule(rows: list[dict], num_layers: int) -> dict:
    """The layers `nbits="auto"` makes 4-bit and the same number picked by least added KL, with their summed KL."""
    start_layer = num_layers - len(rows)
    by_rule = RiverQuantConfig().resolved_nbits(num_layers)
    rule = [start_layer + i for i, bits in enumerate(by_rule) if bits == 4]
    measured = sorted(row["layer"] for row in sorted(rows, key=lambda row: row["added_kl"])[:len(rule)])
    added = {row["layer"]: row["added_kl"] for row in rows}
    summary = {"rule_layers": rule, "rule_added_kl": sum(added[i] for i in rule),
               "measured_layers": measured, "measured_added_kl": sum(added[i] for i in measured)}
    print(f"4-bit by the rule: layers {rule}, added KL {summary['rule_added_kl']:.4f}; by this measurement: layers "
          f"{measured}, added KL {summary['measured_added_kl']:.4f}")
    return summary


if __name__ == "__main__":
    main()
