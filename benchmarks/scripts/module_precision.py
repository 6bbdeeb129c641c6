"""Which linears of a twin tolerate 4 bits? Teacher-forced match of full quantization (tau=-1: every decode step
leaves after the start layer and runs the twins) with 4-bit or 8-bit twins per kind of linear, and each mix's
byte limit.

    python benchmarks/scripts/module_precision.py [--prompts 16] [--tokens 64] [--output PATH]

Two rivers of the same model (the packaged SmolLM2 by default) are built, one with 8-bit twins (one scale per row,
the int8 kernel's layout) and one with 4-bit group-64 twins, both with the 8-bit LM head. Then the 8-bit river's twin
linears are swapped, one kind at a time (q, k, v, o, gate, up, down: every river layer's linear of that kind), for
the 4-bit river's, and the other way round; plus all-8, all-4 and the defaults' mix (4-bit in the first quarter of
the river layers). Each mix is measured on GSM8K test prompts (chat template) along the backbone's own greedy
continuations, as the bench measures fidelity. The byte limit is the backbone's weight bytes per decoded token over
the mix's (`river_hf.bench.bytes`): what a purely memory-bound step could gain. Both rivers take `backend="auto"`
(the int8 and int4 kernels), not the measured "fastest": on an AVX2 CPU that falls back to bf16 (`dense`) for
8-bit linears at small shapes, and the byte limit would then count bf16 bytes, not the mix's bits.
"""

from __future__ import annotations

import argparse

import torch
from tqdm.auto import tqdm

from river_hf import RiverQuantConfig, build_river, river_layers
from river_hf.bench.bytes import byte_table
from river_hf.bench.data import load_prompts
from river_hf.bench.fidelity import backbone_references, measure_fidelity
from river_hf.bench.records import write_record
from river_hf.bench.run import environment
from river_hf.core.config import AUTO_SHALLOW_SHARE
from river_hf.loading.models import build_chat_inputs, load_model_and_tokenizer
from river_hf.core.settings import RiverSettings

KINDS = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
         "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}


def mixes(num_twins: int) -> dict:
    """name -> (twin index, kind) -> True where that linear is 4-bit."""
    shallow = int(num_twins * AUTO_SHALLOW_SHARE)
    table = {"all 8-bit": lambda i, kind: False, "all 4-bit": lambda i, kind: True,
             f"defaults (4-bit in the first {shallow})": lambda i, kind: i < shallow}
    for name in KINDS:
        table[f"8-bit, {name} 4-bit"] = lambda i, kind, name=name: kind == name
    for name in KINDS:
        table[f"4-bit, {name} 8-bit"] = lambda i, kind, name=name: kind != name
    return table


def submodule(module, path: str):
    for part in path.split("."):
        module = getattr(module, part)
    return module


def use_mix(eights: list, fours: list, eight_linears: list[dict], is_four) -> None:
    """Give each twin of the 8-bit river (`eights`) the 4-bit river's linear (from `fours`) where `is_four` says so,
    and its own 8-bit one (`eight_linears`: path -> linear, per twin) elsewhere."""
    for index, (twin, four_twin) in enumerate(zip(eights, fours)):
        for kind, path in KINDS.items():
            linear = submodule(four_twin, path) if is_four(index, kind) else eight_linears[index][path]
            parent_path, _, name = path.rpartition(".")
            setattr(submodule(twin, parent_path), name, linear)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64, help="Positions per prompt (the backbone's continuation).")
    parser.add_argument("--model", default=None, help="A hub id or local path (default: the packaged SmolLM2).")
    parser.add_argument("--output", default=None, help="A JSON file for the results.")
    args = parser.parse_args(argv)

    model, tokenizer = load_model_and_tokenizer(args.model)
    other, _ = load_model_and_tokenizer(args.model)
    prompts = [build_chat_inputs(tokenizer, text)["input_ids"] for text in load_prompts(args.prompts).prompts]
    references = backbone_references(model, prompts, args.tokens, progress=True)
    build_river(model, RiverQuantConfig(nbits=8, group_size=None, backend="auto"))
    build_river(other, RiverQuantConfig(nbits=4, group_size=64, backend="auto"))
    eights = [layer.twin for layer in river_layers(model) if layer.twin is not None]
    fours = [layer.twin for layer in river_layers(other) if layer.twin is not None]
    eight_linears = [{path: submodule(twin, path) for path in KINDS.values()} for twin in eights]
    start_layer = len(river_layers(model)) - len(eights)
    results = {}
    for name, is_four in tqdm(mixes(len(eights)).items(), desc="mixes"):
        use_mix(eights, fours, eight_linears, is_four)
        fidelity = measure_fidelity(model, references, RiverSettings(tau=-1))
        table = byte_table(model)
        results[name] = {"match": fidelity.match, "kl": fidelity.kl, "positions": fidelity.positions,
                         "byte_limit": table.at_depth(table.num_layers) / table.at_depth(start_layer)}
    use_mix(eights, fours, eight_linears, lambda i, kind: False)  # as built
    print(f"CPU capability {torch.backends.cpu.get_cpu_capability()}; {args.prompts} prompts x {args.tokens} positions")
    print("| twins (8-bit LM head) | match | KL | byte limit |\n|---|---:|---:|---:|")
    for name, result in results.items():
        print(f"| {name} | {100 * result['match']:.2f}% | {result['kl']:.4f} | {result['byte_limit']:.2f}x |")
    record = {"environment": environment(), "arguments": vars(args), "mixes": results}
    if args.output:
        write_record(record, args.output)
    return record


if __name__ == "__main__":
    main()
