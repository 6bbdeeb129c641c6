"""Time one twin linear layer against the bf16 `nn.Linear` it replaces: batch-1 GEMV (x [1, K]), as in decoding.

    python benchmarks/scripts/bench_kernels.py                       # SmolLM2-135M's MLP size and a 2048x8192 weight
    python benchmarks/scripts/bench_kernels.py --sizes 576x1536 --rounds 400

Each configuration gets --weights distinct copies of its layer and a timed round calls every copy once, so no weight
stays in cache between calls (as in a real forward pass through many layers). Rounds interleave the configurations,
so a noisy neighbour slows all of them alike; the table reports the median time per call. The slow 'hqq' fallback
runs on the smallest size only and is timed on its own afterwards: interleaved, its per-call dequantization churns
caches and memory and slowed every other layer by ~50%.
HQQ quantization is slow on CPU (~15 s for 2048x8192), so each configuration quantizes one weight and copies it:
the kernels' speed does not depend on the values.
With optimum-quanto installed (`pip install optimum-quanto`), its weight-only qint4 / qint8 linears (group 64 /
per row, bf16 activations) run too: the candidate twin backend issue 11 asked about.
`w8a8_cpu` (fbgemm's dynamic int8 linear) is the one layer here that also rounds its activations (to 7 bits per
token): it is timed with its bf16 -> fp32 -> bf16 casts, as a twin runs it.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
import warnings

import torch
from torch import nn

from river_hf.kernels.quantize import RiverQuantLinear

BASELINE = "bf16 nn.Linear"
# (label, from_linear kwargs, slow reference: smallest size only, timed on its own)
CONFIGS = [
    ("int4pack_cpu, 4-bit g64", dict(nbits=4, group_size=64, backend="int4pack_cpu"), False),
    ("int8pack_cpu, 8-bit per-row", dict(nbits=8, group_size=None, backend="int8pack_cpu"), False),
    ("w8a8_cpu, 8-bit per-row, int8 activations",
     dict(nbits=8, group_size=None, backend="w8a8_cpu", activations="int8"), False),
    ("hqq fallback, 4-bit g64", dict(nbits=4, group_size=64, backend="hqq"), True),
]


def parse_sizes(text: str) -> list[tuple[int, int]]:
    """"576x1536,2048x8192" -> [(576, 1536), (2048, 8192)]: in_features x out_features."""
    sizes = []
    for item in text.split(","):
        in_features, out_features = (int(v) for v in item.lower().split("x"))
        sizes.append((in_features, out_features))
    return sizes


def make_layers(base: nn.Linear, configs: list, copies: int) -> dict[str, list[nn.Module]]:
    """label -> `copies` distinct twins of `base` (own memory each)."""
    layers = {}
    for label, kwargs, _ in configs:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the 'hqq' backend warns that it is slow: that is what we measure
            twin = RiverQuantLinear.from_linear(base, **kwargs)
        layers[label] = [copy.deepcopy(twin) for _ in range(copies)]
    return layers


def quanto_layers(base: nn.Linear, copies: int) -> dict[str, list[nn.Module]]:
    """label -> `copies` optimum-quanto linears of `base` (qint4 group 64, qint8 per row); {} without quanto."""
    try:
        from optimum.quanto import freeze, qint4, qint8, quantize
    except ImportError:
        return {}
    def one(weights) -> nn.Module:  # quanto's tensors cannot be deep-copied: quantize each copy (it is cheap)
        holder = nn.Sequential(copy.deepcopy(base).to(torch.bfloat16))
        quantize(holder, weights=weights)  # quanto's default group size for 4-bit weights is 64
        freeze(holder)
        return holder[0]

    return {label: [one(weights) for _ in range(copies)]
            for label, weights in (("optimum-quanto qint4 g64", qint4), ("optimum-quanto qint8 per-row", qint8))}


def time_round(layers: list[nn.Module], x: torch.Tensor) -> float:
    """Microseconds per call, over one call to each layer."""
    start = time.perf_counter()
    for layer in layers:
        layer(x)
    return (time.perf_counter() - start) / len(layers) * 1e6


def interleaved_medians(layers: dict[str, list[nn.Module]], x: torch.Tensor, warmup: int, rounds: int):
    """label -> median microseconds per call, the labels taking turns round by round."""
    samples: dict[str, list[float]] = {label: [] for label in layers}
    labels = list(layers)
    for step in range(warmup + rounds):
        order = labels[step % len(labels):] + labels[:step % len(labels)]  # rotate: no fixed first/last slot
        for label in order:
            elapsed = time_round(layers[label], x)
            if step >= warmup:
                samples[label].append(elapsed)
    return {label: statistics.median(times) for label, times in samples.items()}


@torch.no_grad()  # not inference_mode: quanto's weight tensors cannot be used inside it
def bench_size(in_features: int, out_features: int, args, smallest: bool) -> dict[str, float]:
    """label -> median microseconds per GEMV call."""
    base = nn.Linear(in_features, out_features, bias=False)
    x = torch.randn(1, in_features, dtype=torch.bfloat16)  # [1, K]: one decoding step
    fast = {BASELINE: [copy.deepcopy(base).to(torch.bfloat16) for _ in range(args.weights)]}
    fast.update(make_layers(base, [c for c in CONFIGS if not c[2]], args.weights))
    fast.update(quanto_layers(base, args.weights))
    results = interleaved_medians(fast, x, args.warmup, args.rounds)
    if smallest:
        slow = make_layers(base, [c for c in CONFIGS if c[2]], args.weights)
        results.update(interleaved_medians(slow, x, min(args.warmup, 3), max(1, args.rounds // 10)))
    return results


def print_table(results: dict[tuple[int, int], dict[str, float]]) -> None:
    print("| weight (in x out) | layer | median µs / call | speed-up vs bf16 |")
    print("|---|---|---:|---:|")
    for (in_features, out_features), timings in results.items():
        baseline = timings[BASELINE]
        for label, micros in timings.items():
            print(f"| {in_features}x{out_features} | {label} | {micros:.1f} | {baseline / micros:.2f}x |")


def main(argv: list[str] | None = None) -> dict[tuple[int, int], dict[str, float]]:
    """Runs the benchmark, prints the table, returns {(in, out): {layer: median µs per call}}."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="576x1536,2048x8192", help="in_features x out_features, comma-separated")
    parser.add_argument("--weights", type=int, default=12, help="distinct copies cycled per configuration")
    parser.add_argument("--rounds", type=int, default=200, help="timed rounds (one call per copy each)")
    parser.add_argument("--warmup", type=int, default=20, help="untimed rounds first")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    sizes = parse_sizes(args.sizes)
    smallest = min(sizes, key=lambda size: size[0] * size[1])
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"CPU capability {torch.backends.cpu.get_cpu_capability()}, batch-1 GEMV, {args.weights} weights cycled\n")
    results = {size: bench_size(*size, args, smallest=size == smallest) for size in sizes}
    print_table(results)
    return results


if __name__ == "__main__":
    main()
