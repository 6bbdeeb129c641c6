"""One decode step's sibling linears (q/k/v, gate/up) as separate GEMVs against one stacked GEMV, compiled as a
captured step compiles them (inductor), at SmolLM2's sizes (576 features in; q 576, k and v 192, gate and up 1536 out).

    python benchmarks/scripts/stacked_gemv.py                     # 8 layers' weights cycled, 300 timed rounds
    python benchmarks/scripts/stacked_gemv.py --hidden 2048 --outputs 2048,512,512 --mlp 8192   # Llama-3.2-1B's

Each case is a module holding `--copies` layers' linears (distinct weights, so they stream from memory as in a
step through many layers), compiled once; the cases take turns round by round and the median µs per layer is
printed. The 8-bit layer's q/k/v are as `backend="fastest"` builds SmolLM2's default twins on the Ice Lake Xeon
(int8pack for q, dense bf16 for k and v); stacked, all three run on int8pack (river_hf.kernels.shared_inputs).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from river_hf.kernels.quantize import RiverQuantLinear

INT8, DENSE8, INT4 = (8, None, "int8pack_cpu"), (8, None, "dense"), (4, 64, "int4pack_cpu")


class Layers(nn.Module):
    """`copies` sets of twin linears reading `hidden` features, [(out_features, nbits, group_size, backend)] each."""

    def __init__(self, hidden: int, specs: list[tuple], copies: int):
        super().__init__()
        self.sets = nn.ModuleList(nn.ModuleList(
            RiverQuantLinear.from_linear(nn.Linear(hidden, out, bias=False), nbits=bits, group_size=group,
                                         backend=backend) for out, bits, group, backend in specs)
            for _ in range(copies))

    def forward(self, x):
        return [linear(x) for linears in self.sets for linear in linears]


def cases(hidden: int, q: int, kv: int, mlp: int) -> dict[str, list[tuple]]:
    return {"8-bit q,k,v (int8pack q, dense k and v)": [(q, *INT8), (kv, *DENSE8), (kv, *DENSE8)],
            "8-bit q/k/v stacked (int8pack)": [(q + 2 * kv, *INT8)],
            "8-bit gate,up (int8pack)": [(mlp, *INT8), (mlp, *INT8)],
            "8-bit gate/up stacked": [(2 * mlp, *INT8)],
            "4-bit q,k,v (int4pack)": [(q, *INT4), (kv, *INT4), (kv, *INT4)],
            "4-bit q/k/v stacked": [(q + 2 * kv, *INT4)],
            "4-bit gate,up (int4pack)": [(mlp, *INT4), (mlp, *INT4)],
            "4-bit gate/up stacked": [(2 * mlp, *INT4)]}


def main(argv=None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--outputs", default="576,192,192", help="q, k, v out_features (k and v alike)")
    parser.add_argument("--mlp", type=int, default=1536, help="gate and up out_features")
    parser.add_argument("--copies", type=int, default=8, help="layers' weights cycled per case")
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=30)
    args = parser.parse_args(argv)
    q, kv, _ = (int(size) for size in args.outputs.split(","))
    torch.manual_seed(0)
    compiled = {name: torch.compile(Layers(args.hidden, specs, args.copies))
                for name, specs in cases(args.hidden, q, kv, args.mlp).items()}
    x = torch.randn(1, 1, args.hidden, dtype=torch.bfloat16)
    samples = {name: [] for name in compiled}
    with torch.no_grad():
        for step in range(args.warmup + args.rounds):  # the first call of each compiles
            for name, layers in compiled.items():
                started = time.perf_counter()
                layers(x)
                if step >= args.warmup:
                    samples[name].append((time.perf_counter() - started) / args.copies * 1e6)
    medians = {name: statistics.median(values) for name, values in samples.items()}
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, compiled, {args.copies} layers cycled")
    for name, micros in medians.items():
        print(f"{name:44s} {micros:8.1f} µs per layer")
    return medians


if __name__ == "__main__":
    main()
