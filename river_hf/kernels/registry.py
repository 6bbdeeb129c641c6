"""The weight-only kernels a twin linear runs on: how each packs HQQ's (codes, scale, zero), runs a matmul, and reads
its codes back. `river_hf.kernels.quantize` quantizes and builds the module; `river_hf.kernels.choice` measures which
kernel is fastest on this machine for a layer's shape.

| backend             | device | nbits   | kernel                                                                  |
|---------------------|--------|---------|-------------------------------------------------------------------------|
| `int4pack_cpu`      | CPU    | 2, 3, 4 | `aten._weight_int4pack_mm_for_cpu` (bf16 activations, bf16 scales)      |
| `int8pack_cpu`      | CPU    | 8       | `aten._weight_int8pack_mm` (bf16) + a rank-1 zero-point correction      |
| `int8pack_fp32_cpu` | CPU    | 8       | the same kernel with fp32 activations and scales (no bf16 conversions) |
| `w8a8_cpu`          | CPU    | 8       | fbgemm's dynamic int8 linear: activations quantized per token (W8A8)    |
| `matmulnbits_cpu`   | CPU    | 4, 8    | ONNX Runtime's MatMulNBits: activations int8 per block of K             |
| `dense`             | any    | any     | the dequantized HQQ weight in bf16, `F.linear`: the backbone's speed    |
| `tinygemm_cuda`     | CUDA   | 2, 3, 4 | `aten._weight_int4pack_mm` (untested here: no GPU on the CI boxes)      |
| `gemlite_int8_cuda` | CUDA   | 8       | gemlite's int8 Triton GEMV + the rank-1 zero-point correction (gemlite) |
| `gemlite_int4_cuda` | CUDA   | 2, 4    | gemlite's Triton GEMV on HQQ's grouped layout (gemlite)                 |
| `hqq`               | any    | any     | dequantizes the whole weight on every call: the slow reference          |

`w8a8_cpu` (river_hf.kernels.fbgemm_w8a8) and `matmulnbits_cpu` (river_hf.kernels.matmulnbits: int8 per block of K)
are the kernels that are not weight-only. `w8a8_cpu` rounds each token's activations to 8 bits (7 without
AVX512-VNNI) before an integer GEMM, so it costs fidelity the others do not, and a river uses it only when asked
(`RiverQuantConfig(activations="int8")`). It is there because on AVX2-only CPUs, where bf16 GEMVs and the int4
kernel are slow, its u8 x s8 GEMM is 2.2-2.3x a bf16 GEMV at Llama-3.2-1B's sizes, and slower at 576-wide ones
(docs/activations.md).

`dense` is the floor a measured choice can fall back to where no packed kernel beats a bf16 GEMV (e.g. the 8-bit
kernel on some AVX2 CPUs at small shapes): the twin then costs what the backbone layer costs, never more.
"""

from __future__ import annotations

from functools import partial
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

from . import fbgemm_w8a8, gemlite_kernels
from . import matmulnbits as ort_kernel

SUPPORTED_NBITS = (2, 3, 4, 8)
# Group sizes the int4 kernels accept; a per-row (None) grouping is run as the largest of these that divides K.
_INT4_KERNEL_GROUPS = (256, 128, 64, 32)
# tinygemm dequantizes (W_q - 8) * scale + Z: codes are stored around the middle of the 4-bit range.
_INT4_MID = 8
# The int8 kernel takes signed codes: HQQ's 8-bit codes 0..255 are shifted by 128.
_INT8_MID = 128


def dequantize(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """HQQ's dequantization W = (W_q - zero) * scale. codes: [N, K]; scale, zero: [N, G] -> float32 [N, K]."""
    rows, cols = codes.shape
    grouped = codes.float().reshape(rows, scale.shape[1], -1)  # [N, G, K // G]
    return ((grouped - zero.float()[..., None]) * scale.float()[..., None]).reshape(rows, cols)


def requantize(weight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """The codes of a dequantized weight [N, K] (exact for a bf16 copy: its rounding error is far below half a
    step). Inverse of `dequantize` -> uint8 [N, K]."""
    rows, cols = weight.shape
    grouped = weight.float().reshape(rows, scale.shape[1], -1)
    return (grouped / scale.float()[..., None] + zero.float()[..., None]).round().reshape(rows, cols).to(torch.uint8)


def int4_kernel_group(in_features: int, group_size: int | None) -> int | None:
    if group_size is not None:
        return group_size
    return next((g for g in _INT4_KERNEL_GROUPS if in_features % g == 0), None)


def _int4_shift(nbits: int) -> int:
    """Added to 2/3-bit codes so they sit around the kernel's midpoint 8 (0 for 4-bit, 4 for 3-bit, 6 for 2-bit)."""
    # Centering keeps |W_q - 8| and |Z| small, so the bf16 rounding of scale and Z stays small relative to the weight.
    return _INT4_MID - 2 ** (nbits - 1)


def _int4_scales_and_zeros(scale, zero, nbits: int, in_features: int, kernel_group: int) -> torch.Tensor:
    """HQQ scale, zero [N, G] -> the kernel's bf16 [K / kernel_group, N, 2] of (scale, Z)."""
    # Kernel: (W_q + shift - 8) * s + Z. With Z = s * (2^(nbits-1) - zero) that is (W_q - zero) * s, HQQ's weight
    # (for 4 bits this is torchao's hqq_tinygemm_linear.py mapping, Z = s * 8 - zero * s).
    repeat = in_features // kernel_group // scale.shape[1]  # > 1 only for per-row (group_size=None) quantization
    scale, zero = scale.repeat_interleave(repeat, dim=1), zero.repeat_interleave(repeat, dim=1)
    pairs = torch.stack([scale, scale * (2 ** (nbits - 1) - zero)], dim=-1)  # [N, K / kernel_group, 2]
    # bf16, not fp32: the CPU kernel's fp32 path is ~50x slower.
    return pairs.transpose(0, 1).contiguous().to(torch.bfloat16)


def _pack_int4(convert, codes, scale, zero, group_size, nbits):
    """`convert`: centered int32 codes [N, K] -> the kernel's packed weight."""
    kernel_group = int4_kernel_group(codes.shape[1], group_size)
    # Codes 0..15 read as int8 widen to int32 ~3x faster than uint8 do on CPU (a saved river's load packs hundreds)
    centered = (codes.view(torch.int8) if codes.dtype == torch.uint8 else codes).to(torch.int32, copy=True)
    if _int4_shift(nbits):
        centered += _int4_shift(nbits)  # [N, K] in 0..15
    return {"qweight": convert(centered.contiguous()),
            "scales_and_zeros": _int4_scales_and_zeros(scale, zero, nbits, codes.shape[1], kernel_group)}


def _convert_int4_cpu(codes):  # [N, K] int32 -> opaque uint8 [N, K / 2], blocked for this CPU's ISA (not portable)
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 8)  # inner_k_tiles: ignored on CPU


def _convert_tinygemm_cuda(codes):  # [N, K] int32 -> opaque int4 tiles
    inner_k_tiles = next(t for t in (8, 4, 2) if codes.shape[1] % (16 * t) == 0)
    # The CUDA converter takes two codes per byte, even column in the high nibble (as hqq's torchao backend does).
    nibbles = (codes[:, ::2] << 4 | codes[:, 1::2]).to(torch.uint8).contiguous()  # [N, K / 2]
    return torch.ops.aten._convert_weight_to_int4pack(nibbles, inner_k_tiles)


def _pack_int8_cpu(codes, scale, zero, group_size, nbits):
    # Per-row only: y = s * (x @ (W_q - 128)^T) + s * (128 - zero) * sum(x), exactly HQQ's (W_q - zero) * s.
    # bf16 scales: the kernel wants them with bf16 input, and a bf16 correction saves two ops per call (~15 µs).
    # uint8 code c -> int8 c - 128 is flipping the top bit and reading the byte as signed: one pass, not three.
    # Always a new tensor, never the codes flipped in place: the kernel segfaults on a weight that is not 16-byte
    # aligned when x has more than one row (torch 2.13), and a saved river's stored codes lie in the mapped file
    # at 8-byte offsets.
    return {"qweight": (codes.to(torch.uint8) ^ _INT8_MID).view(torch.int8),  # [N, K]
            "kernel_scale": scale[:, 0].to(torch.bfloat16),  # [N]
            "zero_shift": (scale[:, 0] * (_INT8_MID - zero[:, 0])).to(torch.bfloat16)}  # [N]


def _pack_int8_fp32_cpu(codes, scale, zero, group_size, nbits):
    packed = _pack_int8_cpu(codes, scale, zero, group_size, nbits)
    return {name: tensor.float() if tensor.is_floating_point() else tensor for name, tensor in packed.items()}


def _pack_dense(codes, scale, zero, group_size, nbits):
    return {"qweight": dequantize(codes, scale, zero).to(torch.bfloat16)}  # [N, K]


def _pack_hqq(codes, scale, zero, group_size, nbits):
    return {"qweight": codes}  # [N, K] uint8, dequantized on every call


# Every op costs microseconds at batch-1 decoding (a GEMV here takes ~20-40 µs), so the hot path skips no-op casts:
# `_cast` instead of `.to()`. The buffer casts only matter after a model-wide `.to(dtype)` has touched them.
def cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if t.dtype == dtype else t.to(dtype)


# The matmuls take the module's buffers as a dict (`module._buffers`): a buffer read through nn.Module.__getattr__
# costs microseconds, and a decode step runs ~7 of these per layer. `group` is the int4 kernels' group size.
def _matmul_int4_cpu(buffers, group, x):  # x: [M, K] bf16 -> [M, N] bf16
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, buffers["qweight"], group,
                                                      cast(buffers["scales_and_zeros"], torch.bfloat16))


def _matmul_tinygemm_cuda(buffers, group, x):  # x: [M, K] bf16 -> [M, N] bf16
    return torch.ops.aten._weight_int4pack_mm(x, buffers["qweight"], group,
                                              cast(buffers["scales_and_zeros"], torch.bfloat16))


def _matmul_int8(dtype, buffers, group, x):  # x: [M, K] `dtype` -> [M, N] `dtype`
    y = torch.ops.aten._weight_int8pack_mm(x, buffers["qweight"], cast(buffers["kernel_scale"], dtype))
    # Rank-1 zero-point correction: the kernel is symmetric, HQQ's 8-bit grid is not (addcmul accumulates in fp32).
    return torch.addcmul(y, x.sum(dim=-1, keepdim=True), cast(buffers["zero_shift"], dtype))


def _matmul_dense(buffers, group, x):  # x: [M, K] bf16 -> [M, N] bf16
    return F.linear(x, cast(buffers["qweight"], torch.bfloat16))


def _matmul_hqq(buffers, group, x):  # x: [M, K] any float dtype -> [M, N] same dtype
    weight = dequantize(buffers["qweight"], buffers["scale"], buffers["zero"])
    return F.linear(x, weight.to(x.dtype))


def _codes_via_int4_kernel(module) -> torch.Tensor:
    """Read the [N, K] codes back from the opaque int4 layout: with scale 1 and Z = 8 the kernel's weight is the
    stored (centered) code."""
    mm = {"int4pack_cpu": torch.ops.aten._weight_int4pack_mm_for_cpu,
          "tinygemm_cuda": torch.ops.aten._weight_int4pack_mm}[module.backend]
    unit = torch.empty_like(module.scales_and_zeros, dtype=torch.bfloat16)  # [K / group, N, 2]
    unit[..., 0], unit[..., 1] = 1.0, _INT4_MID
    k, rows = module.in_features, []
    for start in range(0, k, 1024):  # the identity matrix [K, K] in row chunks: bounded memory for wide layers
        eye = torch.zeros(min(1024, k - start), k, dtype=torch.bfloat16, device=module.qweight.device)
        eye.diagonal(start).fill_(1)  # [chunk, K]: rows start.. of the identity
        rows.append(mm(eye, module.qweight, module.kernel_group_size, unit))  # [chunk, N]: codes, exact in bf16
    return (torch.cat(rows).t().float().round() - _int4_shift(module.nbits)).to(torch.uint8)


def _codes_int8(module) -> torch.Tensor:
    return module.qweight.to(torch.int16) + _INT8_MID


def _codes_dense(module) -> torch.Tensor:
    return requantize(module.qweight, module.scale, module.zero)


def _codes_hqq(module) -> torch.Tensor:
    return module.qweight


class Kernel(NamedTuple):
    device_type: str | None  # None: runs on any device
    nbits: tuple[int, ...]
    ops: tuple[str, ...]  # ops it needs (older torch builds lack some): aten's by name, others as "namespace::name"
    pack: Callable  # (codes, scale, zero, group_size, nbits) -> {buffer name: tensor}
    matmul: Callable  # (buffers: {name: tensor}, int4 group size, x [M, K]) -> [M, N]
    codes: Callable  # module -> HQQ's codes [N, K]
    activation_dtype: torch.dtype | None  # what the kernel takes (None: the input's own dtype)
    prepack: Callable | None = None  # (buffers, nbits) -> what `matmul` reads, when that is not the buffers themselves
    quantizes_activations: bool = False  # rounds the activations too (a fidelity cost): used only when asked
    per_row: bool = False  # reads one (scale, zero) per output row: a group size is not used
    engines: tuple[str, ...] = ()  # the torch.backends.quantized.engine values it runs under (empty: any)
    available: Callable[[], bool] = lambda: True  # whether the packages it needs are installed
    requires: tuple[str, str] | None = None  # (packages, river-hf extra) it needs, for the error when they are missing
    # Whether backend="auto" may take it without measuring (it is faster than the weight-only kernels at any shape)
    unmeasured_pick: bool = True


KERNELS = {
    "int4pack_cpu": Kernel(
        device_type="cpu", nbits=(2, 3, 4), ops=("_weight_int4pack_mm_for_cpu", "_convert_weight_to_int4pack_for_cpu"),
        pack=partial(_pack_int4, _convert_int4_cpu), matmul=_matmul_int4_cpu, codes=_codes_via_int4_kernel,
        activation_dtype=torch.bfloat16),
    "int8pack_cpu": Kernel(
        device_type="cpu", nbits=(8,), ops=("_weight_int8pack_mm",),
        pack=_pack_int8_cpu, matmul=partial(_matmul_int8, torch.bfloat16), codes=_codes_int8,
        activation_dtype=torch.bfloat16, per_row=True),
    "int8pack_fp32_cpu": Kernel(
        device_type="cpu", nbits=(8,), ops=("_weight_int8pack_mm",),
        pack=_pack_int8_fp32_cpu, matmul=partial(_matmul_int8, torch.float32), codes=_codes_int8,
        activation_dtype=torch.float32, per_row=True),
    "w8a8_cpu": Kernel(
        device_type="cpu", nbits=(8,), ops=("quantized::linear_dynamic", "quantized::linear_prepack"),
        pack=_pack_int8_fp32_cpu, matmul=fbgemm_w8a8.matmul, codes=_codes_int8, activation_dtype=torch.float32,
        prepack=fbgemm_w8a8.prepack, quantizes_activations=True, per_row=True, engines=("x86", "fbgemm")),
    "matmulnbits_cpu": Kernel(
        device_type="cpu", nbits=(4, 8), ops=(), pack=ort_kernel.pack,
        matmul=lambda matmulnbits, group, x: matmulnbits(x), codes=ort_kernel.codes, activation_dtype=None,
        prepack=ort_kernel.prepack, quantizes_activations=True, available=ort_kernel.available,
        requires=("onnxruntime and onnx", "ort"),
        unmeasured_pick=False),  # its per-call overhead makes it slower than torch's kernels at small shapes
    "dense": Kernel(
        device_type=None, nbits=SUPPORTED_NBITS, ops=(),
        pack=_pack_dense, matmul=_matmul_dense, codes=_codes_dense, activation_dtype=torch.bfloat16),
    "tinygemm_cuda": Kernel(
        device_type="cuda", nbits=(2, 3, 4), ops=("_weight_int4pack_mm", "_convert_weight_to_int4pack"),
        pack=partial(_pack_int4, _convert_tinygemm_cuda), matmul=_matmul_tinygemm_cuda, codes=_codes_via_int4_kernel,
        activation_dtype=torch.bfloat16),
    # gemlite (river_hf.kernels.gemlite_kernels): `pip install river-hf[cuda]`
    "gemlite_int8_cuda": Kernel(
        device_type="cuda", nbits=(8,), ops=(), pack=gemlite_kernels.pack_int8, matmul=gemlite_kernels.matmul,
        codes=gemlite_kernels.codes_int8, activation_dtype=gemlite_kernels.ACTIVATION_DTYPE,
        prepack=gemlite_kernels.prepack,
        per_row=True, available=gemlite_kernels.available, requires=("gemlite", "cuda")),
    "gemlite_int4_cuda": Kernel(
        device_type="cuda", nbits=(2, 4), ops=(), pack=gemlite_kernels.pack_int4, matmul=gemlite_kernels.matmul,
        codes=gemlite_kernels.codes_int4, activation_dtype=gemlite_kernels.ACTIVATION_DTYPE,
        prepack=gemlite_kernels.prepack,
        available=gemlite_kernels.available, requires=("gemlite", "cuda")),
    "hqq": Kernel(
        device_type=None, nbits=SUPPORTED_NBITS, ops=(),
        pack=_pack_hqq, matmul=_matmul_hqq, codes=_codes_hqq, activation_dtype=None),
}
# The device's preferred kernel per width ('auto' takes the first that runs); 'fastest' measures these and `dense`.
PREFERRED_BACKENDS = ("int4pack_cpu", "int8pack_cpu", "tinygemm_cuda", "gemlite_int8_cuda")


def _has_op(qualified: str) -> bool:
    namespace, _, name = qualified.rpartition("::")
    try:
        return hasattr(getattr(torch.ops, namespace or "aten"), name)
    except (AttributeError, RuntimeError):
        return False


def runs(backend: str, nbits: int, device: torch.device) -> bool:
    kernel = KERNELS[backend]
    return (nbits in kernel.nbits and kernel.device_type in (None, device.type)
            and all(_has_op(op) for op in kernel.ops)
            and (not kernel.engines or torch.backends.quantized.engine in kernel.engines) and kernel.available())


def shape_problem(backend: str, out_features: int, in_features: int, group_size: int | None) -> str | None:
    """Why `backend` cannot run a [out_features, in_features] weight (the kernels crash or refuse), or None."""
    if backend in ("int4pack_cpu", "tinygemm_cuda"):
        row_block = 16 if backend == "int4pack_cpu" else 8
        if out_features % row_block:
            return f"`out_features`={out_features} is not a multiple of {row_block}"
        if int4_kernel_group(in_features, group_size) is None:
            return f"`in_features`={in_features} is not a multiple of 32"
    if backend == "matmulnbits_cpu":
        return ort_kernel.shape_problem(out_features, in_features, group_size)
    if backend in ("gemlite_int8_cuda", "gemlite_int4_cuda"):
        return gemlite_kernels.shape_problem(out_features, in_features, group_size)
    if backend in ("int8pack_cpu", "int8pack_fp32_cpu") and in_features % 16:
        return f"`in_features`={in_features} is not a multiple of 16"  # the kernel segfaults otherwise (torch 2.13)
    return None


