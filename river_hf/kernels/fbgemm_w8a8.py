"""The `w8a8_cpu` kernel: fbgemm's dynamic int8 linear (each token's activations rounded to 8 bits, or 7) on HQQ's
8-bit codes.

fbgemm keeps its packed weight in a TorchScript object dynamo cannot trace, so the call is an `OpaqueCall`
(river_hf.kernels.opaque_calls): a captured decode step keeps one graph through it.
"""

from __future__ import annotations

import warnings

import torch

from .cpu_flags import this_cpu_features
from .opaque_calls import OpaqueCall


def w8a8_reduce_range(features: list[str] | None) -> bool:
    """Whether fbgemm's dynamic int8 linear must round activations to 7 bits (its `reduce_range`) on a CPU with these
    instruction sets (`cpu_flags.cpu_features`; None: unknown). Without AVX512-VNNI fbgemm sums its u8 x s8 products
    in pairs into int16 (vpmaddubsw), which saturates for 8-bit activations; with it (vpdpbusd, int32 sums) they
    keep 8 bits, which on SmolLM2 gave a W8A8 LM head 96.1% teacher-forced match against 94.2% at 7 bits (weight-only
    head: 95.7%; benchmarks/avx512.md). fbgemm has no AVX-VNNI (AVX2-width) kernels, so only avx512_vnni counts."""
    return "avx512_vnni" not in (features or [])


# Read once, from /proc/cpuinfo. Public so a test or a measurement can set it (benchmarks/scripts/w8a8_head.py compares
# both grids): every call reads it, captured ones included.
W8A8_REDUCE_RANGE = w8a8_reduce_range(this_cpu_features())


def prepack(buffers, nbits):
    """int8 codes and per-row scales -> what `matmul` reads: fbgemm's linear on its packed weight (remade from the
    buffers when they change) and the zero-point correction."""
    rows = buffers["qweight"].shape[0]
    with warnings.catch_warnings():  # torch 2.13 marks quantized tensors deprecated; only the packed weight is kept
        warnings.simplefilter("ignore")
        weight = torch._make_per_channel_quantized_tensor(
            buffers["qweight"], buffers["kernel_scale"].double(), torch.zeros(rows, dtype=torch.long), 0)
        packed = torch.ops.quantized.linear_prepack(weight, None)
    return {"linear": FbgemmLinear(packed, rows), "zero_shift": buffers["zero_shift"]}


class FbgemmLinear(OpaqueCall):
    """fbgemm's dynamic int8 linear on one packed weight."""

    def __init__(self, packed, out_features: int):
        super().__init__(out_features)
        self.packed = packed

    def compute(self, x: torch.Tensor) -> torch.Tensor:  # the grid is read per call: a measurement may switch it
        return torch.ops.quantized.linear_dynamic(x, self.packed, W8A8_REDUCE_RANGE)

    def __reduce__(self):
        return FbgemmLinear, (self.packed, self.out_features)


def matmul(inputs, group, x):  # x: [M, K] fp32 -> [M, N] fp32
    if x.shape[0] == 1:  # a decode step: fbgemm's per-tensor activation scale is already per token
        y = inputs["linear"](x)
    else:  # fbgemm takes one scale per tensor: give every row the same range, so each token keeps its own grid
        peak = x.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12)  # [M, 1]
        y = inputs["linear"](x / peak) * peak
    # The rank-1 zero-point correction: HQQ's 8-bit grid is asymmetric, fbgemm's weight symmetric
    zero_shift = inputs["zero_shift"]  # fp32 as packed; a model-wide .to(dtype) may have cast it
    zero_shift = zero_shift if zero_shift.dtype == torch.float32 else zero_shift.float()
    return torch.addcmul(y, x.sum(dim=-1, keepdim=True), zero_shift)
