"""Does one `matmulnbits_cpu` call per group of linears sharing an input (q/k/v, gate/up;
river_hf.kernels.shared_inputs) make decoding faster than one call per linear? Measured in one process, interleaved,
on a random-weight model.

    python benchmarks/scripts/shared_inputs.py                      # Llama-3.2-1B's shape, 4 rounds of 32 tokens
    python benchmarks/scripts/shared_inputs.py --random-model smollm2-135m --backend matmulnbits_cpu
    python benchmarks/scripts/shared_inputs.py --group-everything   # also q/k/v grouped where "fastest" left them apart

The river: 4-bit twins (group 64), `activations="int8"`, backbone LM head. The systems take turns after a
warm-up: the backbone, full quantization (tau=-1: every step leaves after layer 0) with the groups fused, and the
same with every member on its own session again; with `--group-everything` a fourth, where the sibling sets the
build left apart (e.g. q/k/v on torch's int4 kernel) are grouped on `matmulnbits_cpu` too. Prints ms/token per
round and the medians' ratios. Export GOMP_SPINCOUNT=10000 before Python for the setting docs/activations.md
recommends (torch's OpenMP threads spinning after each region slow ONNX Runtime's second thread).
"""

from __future__ import annotations

import argparse
import statistics

import torch
from transformers import GenerationConfig

from river_hf import RiverConfig, RiverQuantConfig, build_river
from river_hf.bench.shapes import SHAPES, random_model, random_prompts
from river_hf.bench.speed import time_generate
from river_hf.core.twins import river_layers
from river_hf.kernels.quantize import RiverQuantLinear, plain_rounding
from river_hf.kernels.shared_inputs import GroupMember, group_siblings, sibling_groups, unfuse

EVERYTHING = "full-quant, every set grouped"


def members_and_groups(model) -> list[tuple[RiverQuantLinear, GroupMember]]:
    return [(module, module.kernel_inputs) for layer in river_layers(model) if layer.twin is not None
            for module in layer.twin.modules()
            if isinstance(module, RiverQuantLinear) and isinstance(module.kernel_inputs, GroupMember)]


def forced_groups(model) -> list[tuple]:
    """The sibling sets the build left apart, grouped anyway: (parent, names, built members, grouped members); the
    built ones are put back in place."""
    forced = []
    for layer in river_layers(model):
        for parent, names in sibling_groups(layer.twin) if layer.twin is not None else []:
            built = [parent._modules[name] for name in names]
            if not isinstance(built[0].kernel_inputs, GroupMember):
                forced.append((parent, names, built, group_siblings(parent, names)))
                parent._modules.update(zip(names, built))
    return forced


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--random-model", choices=sorted(SHAPES), default="llama-3.2-1b")
    parser.add_argument("--backend", choices=["fastest", "matmulnbits_cpu", "auto"], default="fastest")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--group-everything", action="store_true",
                        help="Also time every sibling set grouped on matmulnbits_cpu, those 'fastest' left apart.")
    args = parser.parse_args(argv)

    model = random_model(args.random_model)
    with plain_rounding():  # random weights: HQQ's optimizer would only cost minutes
        build_river(model, RiverQuantConfig(nbits=4, group_size=64, backend=args.backend, activations="int8",
                                            quantize_lm_head=False), progress=False)
    fused = members_and_groups(model)
    forced = forced_groups(model) if args.group_everything else []
    if not fused and not forced:
        raise SystemExit("No group was fused on this machine (backend 'fastest' timed it slower): nothing to compare "
                         "(--group-everything times them grouped anyway).")
    for layer in river_layers(model):
        if layer.twin is not None:
            unfuse(layer.twin)  # every member gets its own session, kept for the unfused system
    own_sessions = [module.kernel_inputs for module, _ in fused]
    inputs = random_prompts(model.config.vocab_size, 1)[0]
    fixed = dict(max_new_tokens=args.max_new_tokens, min_new_tokens=args.max_new_tokens, do_sample=False)
    systems = {"backbone": None, "full-quant, groups fused": True, "full-quant, one call per linear": False}
    if forced:
        systems[EVERYTHING] = True

    def run(name: str) -> float:
        use_groups = systems[name]
        for (module, member), session in zip(fused, own_sessions):
            module.kernel_inputs = member if use_groups else session
        for parent, names, built, grouped in forced:
            parent._modules.update(zip(names, grouped if name == EVERYTHING else built))
        config = GenerationConfig(**fixed) if use_groups is None else RiverConfig(tau=-1.0, exit_signal="cosine",
                                                                                  **fixed)
        return 1000.0 / time_generate(model, inputs, config).decode_tokens_per_s

    for name in systems:  # warm-up
        run(name)
    ms = {name: [] for name in systems}
    for _ in range(args.rounds):
        for name in systems:
            ms[name].append(run(name))
    median = {name: statistics.median(values) for name, values in ms.items()}
    print(f"{args.random_model}, CPU capability {torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} "
          f"threads, torch {torch.__version__}; {len(fused)} linears in groups")
    for name, values in ms.items():
        print(f"{name:32s} {median[name]:7.2f} ms/token, {median['backbone'] / median[name]:.2f}x the backbone "
              f"(rounds: {', '.join(f'{value:.1f}' for value in values)})")
    for parent, names, built, _ in forced:
        parent._modules.update(zip(names, built))  # the model leaves as it was built
    return {"ms_per_token": median, "rounds": ms, "members": len(fused), "forced_sets": len(forced)}


if __name__ == "__main__":
    main()
