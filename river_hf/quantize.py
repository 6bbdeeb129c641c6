"""Quantize an `nn.Linear` with HQQ and run it on a fast weight-only kernel: the building block of a twin layer.

Two steps, as in gpt-fast: HQQ turns the weight into integer codes W_q with a (scale, zero) per group, so that
W ≈ (W_q - zero) * scale; then one kernel packs those three tensors into its own layout and runs the matmul.

| backend         | device | nbits   | kernel                                                             |
|-----------------|--------|---------|--------------------------------------------------------------------|
| `int4pack_cpu`  | CPU    | 2, 3, 4 | `aten._weight_int4pack_mm_for_cpu` (bf16 activations, bf16 scales) |
| `int8pack_cpu`  | CPU    | 8       | `aten._weight_int8pack_mm` + a rank-1 zero-point correction        |
| `tinygemm_cuda` | CUDA   | 2, 3, 4 | `aten._weight_int4pack_mm` (untested here: no GPU on the CI boxes) |
| `hqq`           | any    | any     | dequantizes the whole weight on every call: the slow reference     |

The backend is resolved per linear layer, so a model whose twins mix widths (a `RiverQuantConfig` bit schedule) runs
each layer on its own kernel: on CPU, int8pack for the 8-bit layers and int4pack for the others. The int8 kernel
reads one (scale, zero) per output row: given a group size, a single `from_linear` call warns once and ignores it,
while a schedule's 8-bit layers are quantized per row to begin with (no warning).

Batch-1 GEMV on a 2-core CPU (examples/bench_kernels.py): at 576x1536 the int4 kernel is 2.5-6x faster than a bf16
`nn.Linear` (depending on the machine and its neighbours) and int8 1.5-6x, while the 'hqq' path is 5-30x slower.
"""

from __future__ import annotations

import warnings
from functools import partial
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from hqq.core.quantize import Quantizer
from torch import nn

from .checks import check_choice

SUPPORTED_NBITS = (2, 3, 4, 8)
SUPPORTED_GROUP_SIZES = (32, 64, 128, 256, None)  # None = one group per output channel (whole row)
BACKENDS = ("auto", "int4pack_cpu", "int8pack_cpu", "tinygemm_cuda", "hqq")

# Group sizes the int4 kernels accept; a per-row (None) grouping is run as the largest of these that divides K.
_INT4_KERNEL_GROUPS = (256, 128, 64, 32)
# tinygemm dequantizes (W_q - 8) * scale + Z: codes are stored around the middle of the 4-bit range.
_INT4_MID = 8
# The int8 kernel takes signed codes: HQQ's 8-bit codes 0..255 are shifted by 128.
_INT8_MID = 128


# ---------------------------------------------------------------- HQQ quantization (step 1: codes + scale/zero)


@torch.no_grad()
def _hqq_quantize(weight: torch.Tensor, nbits: int, group_size: int | None):
    """weight: [N, K] -> codes uint8 [N, K] in 0..2^nbits-1, scale and zero float32 [N, G] (G = K // group_size)."""
    # bitpack=False keeps one code per element; axis=1 makes the groups consecutive runs inside a row, the layout
    # every kernel here expects.
    w_q, meta = Quantizer.quantize(weight.detach().float(), nbits=nbits, group_size=group_size, optimize=True,
                                   axis=1, bitpack=False, compute_dtype=torch.float32, device=weight.device)
    rows = weight.shape[0]
    codes = w_q.reshape(weight.shape).to(torch.uint8)
    # clone(): HQQ's optimizer runs under inference_mode, and inference tensors make awkward buffers.
    scale = meta["scale"].reshape(rows, -1).float().clone()
    zero = meta["zero"].reshape(rows, -1).float().clone()
    return codes, scale, zero


def _dequantize(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """HQQ's dequantization W = (W_q - zero) * scale. codes: [N, K]; scale, zero: [N, G] -> float32 [N, K]."""
    rows, cols = codes.shape
    grouped = codes.float().reshape(rows, scale.shape[1], -1)  # [N, G, K // G]
    return ((grouped - zero.float()[..., None]) * scale.float()[..., None]).reshape(rows, cols)


# ---------------------------------------------------------------- kernels (step 2: pack, matmul, unpack)


def _int4_kernel_group(in_features: int, group_size: int | None) -> int | None:
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
    kernel_group = _int4_kernel_group(codes.shape[1], group_size)
    centered = codes.to(torch.int32) + _int4_shift(nbits)  # [N, K] in 0..15
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
    return {"qweight": (codes.to(torch.int16) - _INT8_MID).to(torch.int8),  # [N, K]
            "kernel_scale": scale[:, 0].to(torch.bfloat16),  # [N]
            "zero_shift": (scale[:, 0] * (_INT8_MID - zero[:, 0])).to(torch.bfloat16)}  # [N]


def _pack_hqq(codes, scale, zero, group_size, nbits):
    return {"qweight": codes}  # [N, K] uint8, dequantized on every call


# Every op costs microseconds at batch-1 decoding (a GEMV here takes ~20-40 µs), so the hot path skips no-op casts:
# `_cast` instead of `.to()`. The buffer casts only matter after a model-wide `.to(dtype)` has touched them.
def _cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if t.dtype == dtype else t.to(dtype)


def _matmul_int4_cpu(module, x):  # x: [M, K] bf16 -> [M, N] bf16
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, module.qweight, module.kernel_group_size,
                                                      _cast(module.scales_and_zeros, torch.bfloat16))


def _matmul_tinygemm_cuda(module, x):  # x: [M, K] bf16 -> [M, N] bf16
    return torch.ops.aten._weight_int4pack_mm(x, module.qweight, module.kernel_group_size,
                                              _cast(module.scales_and_zeros, torch.bfloat16))


def _matmul_int8_cpu(module, x):  # x: [M, K] bf16 -> [M, N] bf16
    y = torch.ops.aten._weight_int8pack_mm(x, module.qweight, _cast(module.kernel_scale, torch.bfloat16))
    # Rank-1 zero-point correction: the kernel is symmetric, HQQ's 8-bit grid is not (addcmul accumulates in fp32).
    return torch.addcmul(y, x.sum(dim=-1, keepdim=True), _cast(module.zero_shift, torch.bfloat16))


def _matmul_hqq(module, x):  # x: [M, K] any float dtype -> [M, N] same dtype
    return F.linear(x, module.dequantized_weight().to(x.dtype))


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


def _codes_hqq(module) -> torch.Tensor:
    return module.qweight


class _Kernel(NamedTuple):
    device_type: str | None  # None: runs on any device
    nbits: tuple[int, ...]
    ops: tuple[str, ...]  # aten ops it needs (older torch builds lack some)
    pack: Callable  # (codes, scale, zero, group_size, nbits) -> {buffer name: tensor}
    matmul: Callable  # (module, x [M, K]) -> [M, N]
    codes: Callable  # module -> HQQ's codes [N, K]
    bf16_input: bool


_KERNELS = {
    "int4pack_cpu": _Kernel(
        device_type="cpu", nbits=(2, 3, 4), ops=("_weight_int4pack_mm_for_cpu", "_convert_weight_to_int4pack_for_cpu"),
        pack=partial(_pack_int4, _convert_int4_cpu), matmul=_matmul_int4_cpu, codes=_codes_via_int4_kernel,
        bf16_input=True),
    "int8pack_cpu": _Kernel(
        device_type="cpu", nbits=(8,), ops=("_weight_int8pack_mm",),
        pack=_pack_int8_cpu, matmul=_matmul_int8_cpu, codes=_codes_int8, bf16_input=True),
    "tinygemm_cuda": _Kernel(
        device_type="cuda", nbits=(2, 3, 4), ops=("_weight_int4pack_mm", "_convert_weight_to_int4pack"),
        pack=partial(_pack_int4, _convert_tinygemm_cuda), matmul=_matmul_tinygemm_cuda, codes=_codes_via_int4_kernel,
        bf16_input=True),
    "hqq": _Kernel(
        device_type=None, nbits=SUPPORTED_NBITS, ops=(),
        pack=_pack_hqq, matmul=_matmul_hqq, codes=_codes_hqq, bf16_input=False),
}
_FAST_BACKENDS = ("int4pack_cpu", "int8pack_cpu", "tinygemm_cuda")  # 'auto' takes the first that runs


# ---------------------------------------------------------------- choosing a backend


def _runs(backend: str, nbits: int, device: torch.device) -> bool:
    kernel = _KERNELS[backend]
    return (nbits in kernel.nbits and kernel.device_type in (None, device.type)
            and all(hasattr(torch.ops.aten, op) for op in kernel.ops))


def backend_nbits(backend: str) -> tuple[int, ...]:
    """The bit widths `backend` can run (on its device); 'auto' and 'hqq': all of SUPPORTED_NBITS."""
    check_choice("backend", backend, BACKENDS)
    return SUPPORTED_NBITS if backend == "auto" else _KERNELS[backend].nbits


def _fast_backend(nbits: int, device: torch.device) -> str | None:
    return next((name for name in _FAST_BACKENDS if _runs(name, nbits, device)), None)


def _warn_slow(nbits: int, device: torch.device, reason: str) -> None:
    # The message holds no layer shape, so Python's warning filter shows it once, not once per linear layer.
    warnings.warn(f"RiverQuantLinear: {reason}; using backend 'hqq', which dequantizes the whole weight on every "
                  f"call and is slower than the full-precision layer ({nbits}-bit on {device.type}).", stacklevel=2)


def resolve_backend(backend: str, nbits: int, device: torch.device) -> str:
    """The kernel a twin linear will run on. 'auto' -> the fastest one that runs `nbits` on `device`:
    CPU: 2/3/4 bits -> 'int4pack_cpu', 8 -> 'int8pack_cpu'; CUDA: 2/3/4 -> 'tinygemm_cuda'; otherwise 'hqq' (slow,
    with a warning). An explicit backend is returned as is if it can run there, else ValueError."""
    check_choice("nbits", nbits, SUPPORTED_NBITS)
    check_choice("backend", backend, BACKENDS)
    device = torch.device(device)
    if backend == "auto":
        fast = _fast_backend(nbits, device)
        if fast is None:
            _warn_slow(nbits, device, f"no fast kernel for {nbits}-bit weights on {device.type}")
        return fast or "hqq"
    if not _runs(backend, nbits, device):
        usable = tuple(name for name in _KERNELS if _runs(name, nbits, device))
        raise ValueError(f"`backend`={backend!r} cannot run {nbits}-bit weights on {device.type}; "
                         f"choose one of {('auto',) + usable}.")
    return backend


def _shape_problem(backend: str, out_features: int, in_features: int, group_size: int | None) -> str | None:
    """Why `backend` cannot run a [out_features, in_features] weight (the kernels crash or refuse), or None."""
    if backend in ("int4pack_cpu", "tinygemm_cuda"):
        row_block = 16 if backend == "int4pack_cpu" else 8
        if out_features % row_block:
            return f"`out_features`={out_features} is not a multiple of {row_block}"
        if _int4_kernel_group(in_features, group_size) is None:
            return f"`in_features`={in_features} is not a multiple of 32"
    if backend == "int8pack_cpu" and in_features % 16:
        return f"`in_features`={in_features} is not a multiple of 16"  # the kernel segfaults otherwise (torch 2.13)
    return None


def _fit_layer(requested: str, nbits: int, group_size: int | None, weight: torch.Tensor) -> tuple[str, int | None]:
    """The (backend, group_size) one layer's weight [N, K] will use; warns when that is not what was asked."""
    backend = resolve_backend(requested, nbits, weight.device)
    problem = _shape_problem(backend, *weight.shape, group_size)
    if problem and requested != "auto":
        raise ValueError(f"`backend`={requested!r} cannot run this layer: {problem}.")
    if problem:
        _warn_slow(nbits, weight.device, f"{backend!r} cannot run some layers ({problem})")
        backend = "hqq"
    elif requested == "hqq":
        fast = _fast_backend(nbits, weight.device)
        _warn_slow(nbits, weight.device, f"backend 'hqq' was asked for ({fast or 'no kernel'} is the fast one here)")
    if backend == "int8pack_cpu" and group_size is not None:
        warnings.warn(f"RiverQuantLinear: 'int8pack_cpu' runs 8-bit weights with one group per output row; "
                      f"`group_size`={group_size} is ignored.", stacklevel=2)
        group_size = None
    return backend, group_size


def _check_layer(linear: nn.Module, nbits, group_size, axis) -> None:
    if not isinstance(linear, nn.Linear):
        raise ValueError(f"`linear` must be an nn.Linear; got {type(linear).__name__}.")
    check_choice("nbits", nbits, SUPPORTED_NBITS)
    check_choice("group_size", group_size, SUPPORTED_GROUP_SIZES)
    # The kernels group along the input dimension; HQQ's axis=0 groups strided columns no kernel here can read.
    check_choice("axis", axis, (1,))
    if group_size is not None and linear.in_features % group_size:
        raise ValueError(f"`group_size`={group_size} does not divide `in_features`={linear.in_features}.")


# ---------------------------------------------------------------- the module


class RiverQuantLinear(nn.Module):
    """Drop-in for `nn.Linear` with HQQ-quantized weights: forward(x [..., in_features]) -> [..., out_features], in
    x's dtype. Build it with `RiverQuantLinear.from_linear(linear, nbits, group_size, backend=...)`.

    Buffers (not Parameters: nothing here trains): `scale`, `zero` float32 [N, G] are HQQ's per-group meta
    (G = in_features // group_size, 1 when group_size is None); `qweight` is the kernel's weight; `bias` is
    the original bias or None. Extra per backend: `scales_and_zeros` (int4 kernels), `kernel_scale` and
    `zero_shift` (int8 kernel).

    Device moves: the packed weight is laid out for the device type (and, for `int4pack_cpu`, the CPU ISA) it was
    built on. `.to(dtype)` is harmless; moving between CPU and CUDA is not supported (forward raises): build the
    twin on the target device instead. Only the 'hqq' backend runs anywhere.
    """

    def __init__(self, in_features: int, out_features: int, nbits: int, group_size: int | None, backend: str,
                 buffers: dict[str, torch.Tensor], bias: torch.Tensor | None = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.nbits, self.group_size, self.backend = nbits, group_size, backend
        for name, tensor in buffers.items():
            self.register_buffer(name, tensor)
        self.register_buffer("bias", bias)
        # int4 kernels read per-row scales as groups they accept (see _int4_kernel_group).
        sz = buffers.get("scales_and_zeros")
        self.kernel_group_size = None if sz is None else in_features // sz.shape[0]

    @classmethod
    @torch.no_grad()
    def from_linear(cls, linear: nn.Linear, nbits: int = 4, group_size: int | None = 64, axis: int = 1,
                    backend: str = "auto") -> "RiverQuantLinear":
        """Quantize `linear` (its weight [N, K] stays untouched) on its own device, packed for `backend`."""
        _check_layer(linear, nbits, group_size, axis)
        backend, group_size = _fit_layer(backend, nbits, group_size, linear.weight)
        codes, scale, zero = _hqq_quantize(linear.weight, nbits, group_size)
        buffers = {"scale": scale, "zero": zero, **_KERNELS[backend].pack(codes, scale, zero, group_size, nbits)}
        bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls(linear.in_features, linear.out_features, nbits, group_size, backend, buffers, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., K] -> [..., N]
        kernel = _KERNELS[self.backend]
        if kernel.device_type not in (None, x.device.type):
            raise RuntimeError(f"RiverQuantLinear was packed for {kernel.device_type} ({self.backend!r}) but got "
                               f"input on {x.device.type}; rebuild it with from_linear on that device.")
        x2d = x.reshape(-1, self.in_features)  # [M, K]
        if kernel.bf16_input:
            x2d = _cast(x2d, torch.bfloat16).contiguous()  # the fast kernels are bf16-only
        y = _cast(kernel.matmul(self, x2d), x.dtype)  # [M, N]
        if self.bias is not None:
            y = y + _cast(self.bias, x.dtype)
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], self.out_features)

    @torch.no_grad()
    def dequantized_weight(self) -> torch.Tensor:
        """[N, K] float32: the weight HQQ's (W_q, scale, zero) represent, exactly; the reference the kernels are
        tested against. The int4 backends read their codes back by running the kernel on an identity matrix."""
        return _dequantize(_KERNELS[self.backend].codes(self), self.scale, self.zero)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, nbits={self.nbits}, "
                f"group_size={self.group_size}, backend={self.backend}")
