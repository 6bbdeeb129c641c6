"""The `w8a8_cpu` kernel's matmul: fbgemm's dynamic int8 linear (activations rounded per token), as a captured step
can trace it.

fbgemm keeps its packed weight in an opaque TorchScript object, which dynamo cannot put in a graph: called directly,
`torch.ops.quantized.linear_dynamic` broke every captured decode step in two at each W8A8 linear (measured on the AMX
Xeon: a SmolLM2 river with a W8A8 LM head compiled in 50 s instead of 11 and ran 1.84x the compiled backbone instead
of 1.93x weight-only; docs/activations.md). So under torch.compile the call goes through `river_hf::w8a8_linear`, a
custom op that takes the packed weight's *handle* (an int the graph keeps as a constant) and looks the weight up at
run time. Eager calls skip the op's dispatch and call fbgemm directly (a few µs a call at batch-1 decoding).

A handle lives as long as its module's `kernel_inputs` (a weak registry), and a module packed again (a loaded state
dict, `.to()`) gets a new one, which dynamo's guard on the constant notices.
"""

from __future__ import annotations

import itertools
import warnings
import weakref

import torch

from .cpu_flags import this_cpu_features


def w8a8_reduce_range(features: list[str] | None) -> bool:
    """Whether fbgemm's dynamic int8 linear must round activations to 7 bits (its `reduce_range`) on a CPU with these
    instruction sets (`cpu_flags.cpu_features`; None: unknown). Without AVX512-VNNI fbgemm sums its u8 x s8 products
    in pairs into int16 (vpmaddubsw), which saturates for 8-bit activations; with it (vpdpbusd, int32 sums) they
    keep 8 bits, which on SmolLM2 gave a W8A8 LM head 96.1% teacher-forced match against 94.2% at 7 bits (weight-only
    head: 95.7%; benchmarks/avx512.md). fbgemm has no AVX-VNNI (AVX2-width) kernels, so only avx512_vnni counts."""
    return "avx512_vnni" not in (features or [])


# Read once: the kernel passes it on every call, and a captured graph keeps it as a constant. Public so a test or a
# measurement can set it (benchmarks/scripts/w8a8_head.py compares both grids).
W8A8_REDUCE_RANGE = w8a8_reduce_range(this_cpu_features())


class PackedWeight:
    """fbgemm's packed weight and the handle a captured graph names it by."""

    def __init__(self, packed):
        self.packed = packed
        self.handle = next(_HANDLES)
        PACKED_WEIGHTS[self.handle] = self


_HANDLES = itertools.count()
# handle -> PackedWeight, for as long as a module's kernel_inputs hold it
PACKED_WEIGHTS: "weakref.WeakValueDictionary[int, PackedWeight]" = weakref.WeakValueDictionary()


@torch.library.custom_op("river_hf::w8a8_linear", mutates_args=())
def w8a8_linear(x: torch.Tensor, handle: int, out_features: int, reduce_range: bool) -> torch.Tensor:
    """x [M, K] fp32 -> [M, out_features] fp32 through the packed weight registered under `handle`."""
    return torch.ops.quantized.linear_dynamic(x, PACKED_WEIGHTS[handle].packed, reduce_range)


@w8a8_linear.register_fake
def _(x, handle, out_features, reduce_range):
    return x.new_empty(x.shape[0], out_features)


def prepack(buffers, nbits):
    """int8 codes and per-row scales -> what `matmul` reads: fbgemm's packed weight (remade from the buffers when
    they change, as a new handle) and the zero-point correction."""
    rows = buffers["qweight"].shape[0]
    with warnings.catch_warnings():  # torch 2.13 marks quantized tensors deprecated; only the packed weight is kept
        warnings.simplefilter("ignore")
        weight = torch._make_per_channel_quantized_tensor(
            buffers["qweight"], buffers["kernel_scale"].double(), torch.zeros(rows, dtype=torch.long), 0)
        packed = torch.ops.quantized.linear_prepack(weight, None)
    return {"packed": PackedWeight(packed), "zero_shift": buffers["zero_shift"], "out_features": rows}


def _linear_dynamic(inputs, x):
    if torch.compiler.is_compiling():
        return w8a8_linear(x, inputs["packed"].handle, inputs["out_features"], W8A8_REDUCE_RANGE)
    return torch.ops.quantized.linear_dynamic(x, inputs["packed"].packed, W8A8_REDUCE_RANGE)


def matmul(inputs, group, x):  # x: [M, K] fp32 -> [M, N] fp32
    if x.shape[0] == 1:  # a decode step: fbgemm's per-tensor activation scale is already per token
        y = _linear_dynamic(inputs, x)
    else:  # fbgemm takes one scale per tensor: give every row the same range, so each token keeps its own grid
        peak = x.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12)  # [M, 1]
        y = _linear_dynamic(inputs, x / peak) * peak
    # The rank-1 zero-point correction: HQQ's 8-bit grid is asymmetric, fbgemm's weight symmetric
    zero_shift = inputs["zero_shift"]  # fp32 as packed; a model-wide .to(dtype) may have cast it
    zero_shift = zero_shift if zero_shift.dtype == torch.float32 else zero_shift.float()
    return torch.addcmul(y, x.sum(dim=-1, keepdim=True), zero_shift)
