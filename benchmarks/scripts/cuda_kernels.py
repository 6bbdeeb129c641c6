"""The twin kernels a GPU offers, timed as `backend="fastest"` times them: batch-1 GEMVs at a model shape's layer
sizes, each candidate's round of cache-cold weight copies captured as a CUDA graph (the kernels' GPU time, as in a
captured decode step), interleaved. Each time is also a share of its byte limit: the bytes the kernel reads (its
packed buffers) at the bandwidth a device-to-device copy reaches here.

    python benchmarks/scripts/cuda_kernels.py --shape llama-3.2-1b --output kernels.json   # on a GPU
    python benchmarks/scripts/cuda_kernels.py --shape tiny-test --device cpu               # the same code on CPU

Candidates: every kernel `kernels.choice.candidates` offers for the width (CUDA: 'dense', i.e. cuBLAS on the bf16
weight, the backbone's own GEMV; tinygemm for 4 bits; gemlite's kernels with gemlite installed), 4-bit twins in
groups of 64 and 8-bit ones per row, as a river builds them.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from river_hf.bench.shapes import SHAPES
from river_hf.kernels import choice
from river_hf.kernels.registry import KERNELS

WIDTHS = ((4, 64), (8, None))  # (bits, group size) of a default river's twins and of its quantized LM head


def layer_sizes(shape: str) -> dict[str, tuple[int, int]]:
    """name -> (out_features, in_features) of a decoder layer's linears and the LM head."""
    s = SHAPES[shape]
    hidden, kv = s["hidden_size"], s["hidden_size"] // s["num_attention_heads"] * s["num_key_value_heads"]
    return {"q_proj / o_proj": (hidden, hidden), "k_proj / v_proj": (kv, hidden),
            "gate_proj / up_proj": (s["intermediate_size"], hidden), "down_proj": (hidden, s["intermediate_size"]),
            "lm_head": (s["vocab_size"], hidden)}


def copy_bandwidth(device: torch.device, megabytes: int = 1024) -> float:
    """Bytes per second a device-to-device copy moves (read + write), the best of 5: the byte limit's bandwidth."""
    source = torch.empty(megabytes << 20, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    best = float("inf")
    for _ in range(5):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        target.copy_(source)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * source.numel() / best


def packed_bytes(name: str, nbits: int, group_size: int | None, out_features: int, in_features: int,
                 device: torch.device) -> int:
    """The bytes kernel `name` reads per call: its packed buffers (one pack of a random weight)."""
    group = None if KERNELS[name].per_row else group_size
    codes = torch.randint(0, 2 ** nbits, (out_features, in_features), dtype=torch.uint8, device=device)
    groups = in_features // group if group else 1
    scale = torch.rand(out_features, groups, device=device) + 1e-3
    buffers = KERNELS[name].pack(codes, scale, torch.full_like(scale, 2.0 ** (nbits - 1)), group, nbits)
    return sum(t.numel() * t.element_size() for t in buffers.values())


def time_shape(shape: str, device: torch.device, bandwidth: float) -> list[dict]:
    rows = []
    for layer, (out_features, in_features) in layer_sizes(shape).items():
        for nbits, group_size in WIDTHS:
            names = choice.candidates(nbits, group_size, out_features, in_features, device)
            timings = choice.time_candidates(names, nbits, group_size, out_features, in_features, device, rows=1)
            for name in names:
                nbytes = packed_bytes(name, nbits, group_size, out_features, in_features, device)
                rows.append({"layer": layer, "out_features": out_features, "in_features": in_features,
                             "nbits": nbits, "kernel": name, "microseconds": timings[name],
                             "speedup_vs_dense": timings["dense"] / timings[name],
                             "byte_limit_share": nbytes / bandwidth / (timings[name] * 1e-6)})
    return rows


def print_table(rows: list[dict]) -> None:
    print("| layer | out x in | bits | kernel | µs / GEMV | vs dense (bf16) | share of byte limit |")
    print("|---|---|---:|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['layer']} | {r['out_features']}x{r['in_features']} | {r['nbits']} | {r['kernel']} | "
              f"{r['microseconds']:.1f} | {r['speedup_vs_dense']:.2f}x | {r['byte_limit_share']:.0%} |")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", action="append", choices=sorted(SHAPES), help="model shapes (repeatable)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--output", default=None, help="JSON record")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    bandwidth = copy_bandwidth(device, 1024 if device.type == "cuda" else 64)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"{name}, torch {torch.__version__}: device-to-device copy {bandwidth / 1e9:.0f} GB/s\n")
    record = {"device": name, "torch": torch.__version__, "copy_bytes_per_s": bandwidth, "shapes": {}}
    for shape in args.shape or ["llama-3.2-1b"]:
        print(f"{shape}:")
        record["shapes"][shape] = rows = time_shape(shape, device, bandwidth)
        print_table(rows)
        print()
        if args.output:  # after each shape: a run cut short by its time limit keeps what it measured
            with open(args.output, "w") as file:
                json.dump(record, file, indent=1)
    return record


if __name__ == "__main__":
    main()
