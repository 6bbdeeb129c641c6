"""The gemlite twin kernels on CUDA: gemlite's Triton GEMVs (HQQ's own fast CUDA backend) for HQQ's codes.

Why: torch has one fast weight-only kernel on CUDA, tinygemm (`aten._weight_int4pack_mm`, 2-4 bits). Without another,
8-bit twins and the 8-bit LM head ran on 'hqq', which dequantizes the whole weight on every call (slower than the
bf16 layer it replaces: issue 31's 0.81x on an H200). gemlite runs both widths as a torch custom op
(`gemlite::forward_functional`, with a fake implementation), so torch.compile traces it and CUDA graphs capture it.

- `gemlite_int8_cuda` (8 bits, one group per row): gemlite's symmetric int8 weight-only GEMV (its `A16W8` layer),
  fed HQQ's codes minus 128 and fp32 per-row scales, plus the rank-1 zero-point correction the CPU int8 kernel uses:
  y = s * (x @ (W_q - 128)^T) + s * (128 - zero) * sum(x), exactly HQQ's (W_q - zero) * s. Not HQQ's asymmetric
  layout: gemlite holds zeros in the activations' dtype, and bf16 rounds an 8-bit zero near 128 by up to half a step,
  the same for every weight of the row.
- `gemlite_int4_cuda` (2 and 4 bits, grouped): HQQ's layout as it is (gemlite's `A16Wn_HQQ_INT`): codes packed eight
  to an int32 over K, bf16 scale and zero per group (zero near 8: bf16 keeps it within 1/64 of a step).

gemlite reads the GPU's compute capability when it is imported, so nothing here imports it before a layer is packed
on CUDA, and `available()` only looks for the package. Written and unit-tested without a GPU (the layouts, the
correction, the read-back); tests/test_cuda_kernels.py checks them against HQQ's weight on a GPU.
"""

from __future__ import annotations

import importlib.util

import torch

REQUIRED_MODULE = "gemlite"
MIN_IN_FEATURES = 32  # gemlite's GemLiteLinearTriton.MIN_SIZE: in_features must be a multiple of it
_INT8_MID = 128  # HQQ's 8-bit codes 0..255 -> the symmetric kernel's int8 codes -128..127
_PACKED_BITS = 32  # gemlite's default packing word (GemLiteLinearTriton.PACKING_BITWIDTH)
# What the kernels take and give, and the dtype of their bf16 tensors: the backbones' dtype on GPUs. A module
# setting, not a constant, for one reason: Triton's CPU interpreter mis-emulates bf16, so
# tests/gemlite_interpreted.py checks the layouts in float16 (the same programs, another dtype flag).
ACTIVATION_DTYPE = torch.bfloat16


def available() -> bool:
    return importlib.util.find_spec(REQUIRED_MODULE) is not None


def shape_problem(out_features: int, in_features: int, group_size: int | None) -> str | None:
    if in_features % MIN_IN_FEATURES:
        return f"`in_features`={in_features} is not a multiple of {MIN_IN_FEATURES}"
    return None


def _meta(layer, device) -> torch.Tensor:
    """gemlite's integer settings of a packed layer (its `get_meta_args()`: bits, group size, layouts, modes), kept as
    a buffer so that a layer packed again from its codes compares equal and `prepack` needs no gemlite object."""
    return torch.tensor(layer.get_meta_args(), dtype=torch.int32, device=device)


def pack_int8(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size, nbits: int) -> dict:
    """HQQ's per-row 8-bit codes [N, K], scale and zero [N, 1] -> gemlite's int8 layer's tensors + the correction."""
    from gemlite.helper import A16W8  # imports need a GPU

    signed = (codes.to(torch.uint8) ^ _INT8_MID).view(torch.int8)  # code c -> c - 128: the top bit flipped
    layer = A16W8(device=codes.device, dtype=ACTIVATION_DTYPE).from_weights(signed, scales=scale[:, :1].float())
    return {"qweight": layer.W_q.data,  # [K, N] int8 (a transposed view of [N, K])
            "kernel_scale": layer.scales.data,  # fp32, one per row
            "zero_shift": (scale[:, 0] * (_INT8_MID - zero[:, 0])).to(ACTIVATION_DTYPE),  # [N]
            "kernel_meta": _meta(layer, codes.device)}


def pack_int4(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size, nbits: int) -> dict:
    """HQQ's 2/4-bit codes [N, K], scale and zero [N, G] -> gemlite's HQQ layer's tensors (packed over K)."""
    from gemlite.helper import A16Wn_HQQ_INT  # imports need a GPU

    layer = A16Wn_HQQ_INT(device=codes.device, dtype=ACTIVATION_DTYPE, W_nbits=nbits).from_weights(
        codes.to(torch.uint8), scale, zero)
    return {"qweight": layer.W_q.data,  # [K * nbits / 32, N] int32
            "kernel_scale": layer.scales.data, "kernel_zero": layer.zeros.data,  # [G, N] bf16 (zero: -zero * scale)
            "kernel_meta": _meta(layer, codes.device)}


def prepack(buffers: dict, nbits: int) -> dict:
    """What the matmul reads: gemlite's tensor and integer arguments (the integers read once here, not per call)."""
    weight, zeros, shift = buffers["qweight"], buffers.get("kernel_zero"), buffers.get("zero_shift")
    # A model-wide `.to(dtype)` casts float buffers: give gemlite the dtypes it was packed with (its meta_args say)
    scale_dtype = torch.float32 if zeros is None else ACTIVATION_DTYPE
    if zeros is None:  # the int8 layer has no zeros: gemlite takes an empty placeholder
        zeros = torch.empty((1, 0), dtype=torch.int32, device=weight.device)
    meta_scale = torch.zeros((), dtype=torch.float32, device=weight.device)  # only gemlite's fp4 formats use it
    return {"tensor_args": [weight, buffers["kernel_scale"].to(scale_dtype), zeros.to(
                ACTIVATION_DTYPE if zeros.is_floating_point() else zeros.dtype), meta_scale],
            "meta_args": [int(value) for value in buffers["kernel_meta"].tolist()],
            "zero_shift": None if shift is None else shift.to(ACTIVATION_DTYPE)}


def matmul(inputs: dict, group, x: torch.Tensor) -> torch.Tensor:  # x: [M, K] bf16 -> [M, N] bf16
    y = torch.ops.gemlite.forward_functional(x, None, inputs["tensor_args"], inputs["meta_args"], -1)
    if inputs["zero_shift"] is None:
        return y
    return torch.addcmul(y, x.sum(dim=-1, keepdim=True), inputs["zero_shift"])  # the rank-1 zero-point correction


def codes_int8(module) -> torch.Tensor:
    return module.qweight.t().to(torch.int16) + _INT8_MID  # [N, K] in 0..255


def codes_int4(module) -> torch.Tensor:
    """The [N, K] codes unpacked from gemlite's words: code k of a row sits at bits (k % per_word) * nbits of word
    k // per_word (gemlite's pack_weights_over_cols)."""
    nbits = module.nbits
    per_word = _PACKED_BITS // nbits
    words = module.qweight.t()  # [N, K / per_word]
    shifts = torch.arange(per_word, device=words.device, dtype=words.dtype) * nbits
    return ((words.unsqueeze(-1) >> shifts) & (2 ** nbits - 1)).reshape(words.shape[0], -1)
