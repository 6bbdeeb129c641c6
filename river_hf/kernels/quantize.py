"""Quantize an `nn.Linear` with HQQ and run it on a weight-only kernel: the building block of a twin layer.

Two steps, as in gpt-fast: HQQ turns the weight into integer codes W_q with a (scale, zero) per group, so that
W ≈ (W_q - zero) * scale; then one kernel (`river_hf.kernels.registry`) packs those three tensors into its own layout and runs
the matmul.

The backend is resolved per linear layer, so a model whose twins mix widths (a `RiverQuantConfig` bit schedule) runs
each layer on its own kernel. `backend="auto"` takes the device's preferred kernel for the width (CPU: int4pack for
2-4 bits, int8pack for 8; CUDA: tinygemm); `backend="fastest"` measures the candidates on this machine for this
layer's shape (`river_hf.kernels.choice`) and takes the fastest. The int8 kernels read one (scale, zero) per output
row: given a group size, a single `from_linear` call warns once and ignores it, while a schedule's 8-bit layers are
quantized per row to begin with (no warning).
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from contextvars import ContextVar

import torch
from hqq.core.quantize import Quantizer
from torch import nn

from ..checks import check_choice, install_hint
from .choice import fastest_backend
from .registry import KERNELS, PREFERRED_BACKENDS, SUPPORTED_NBITS, cast, dequantize, runs, shape_problem

SUPPORTED_GROUP_SIZES = (32, 64, 128, 256, None)  # None = one group per output channel (whole row)
BACKENDS = ("auto", "fastest", *KERNELS)
# What 'auto' and 'fastest' may do to activations: None keeps the kernels weight-only; "int8" also lets 8-bit twins
# run on kernels that round each token's activations to int8 (KERNELS[...].quantizes_activations), a fidelity cost
ACTIVATIONS = (None, "int8")


# ---------------------------------------------------------------- HQQ quantization (step 1: codes + scale/zero)


# False inside `plain_rounding()`: HQQ skips its optimizer (per thread, like every per-call state in river_hf)
_HQQ_OPTIMIZE: ContextVar[bool] = ContextVar("river_hf_hqq_optimize", default=True)


@contextmanager
def plain_rounding():
    """Inside the block, twins are quantized without HQQ's optimizer: min-max rounding per group. The kernels, the
    packed layouts and the bytes are exactly those of optimized twins, only the codes' values differ, and a build
    takes seconds instead of half an hour at the 3B shape on 2 CPU cores. For speed and memory measurements on
    random weights (`bench --random-model`), where fidelity means nothing; never for a river that is used."""
    token = _HQQ_OPTIMIZE.set(False)
    try:
        yield
    finally:
        _HQQ_OPTIMIZE.reset(token)


@torch.no_grad()
def hqq_quantize(weight: torch.Tensor, nbits: int, group_size: int | None):
    """weight: [N, K] -> codes uint8 [N, K] in 0..2^nbits-1, scale and zero float32 [N, G] (G = K // group_size)."""
    # bitpack=False keeps one code per element; axis=1 makes the groups consecutive runs inside a row, the layout
    # every kernel here expects.
    w_q, meta = Quantizer.quantize(weight.detach().float(), nbits=nbits, group_size=group_size,
                                   optimize=_HQQ_OPTIMIZE.get(),
                                   axis=1, bitpack=False, compute_dtype=torch.float32, device=weight.device)
    rows = weight.shape[0]
    codes = w_q.reshape(weight.shape).to(torch.uint8)
    # clone(): HQQ's optimizer runs under inference_mode, and inference tensors make awkward buffers.
    scale = meta["scale"].reshape(rows, -1).float().clone()
    zero = meta["zero"].reshape(rows, -1).float().clone()
    return codes, scale, zero


# ---------------------------------------------------------------- choosing a backend


def backend_nbits(backend: str) -> tuple[int, ...]:
    """The bit widths `backend` can run (on its device); 'auto', 'fastest', 'dense' and 'hqq': all of them."""
    check_choice("backend", backend, BACKENDS)
    return SUPPORTED_NBITS if backend in ("auto", "fastest") else KERNELS[backend].nbits


def _fast_backend(nbits: int, device: torch.device, activations: str | None = None) -> str | None:
    quantizing = tuple(name for name, kernel in KERNELS.items()
                       if kernel.quantizes_activations and kernel.unmeasured_pick)
    preferred = (quantizing if activations == "int8" else ()) + PREFERRED_BACKENDS
    return next((name for name in preferred if runs(name, nbits, device)), None)


def _warn_slow(nbits: int, device: torch.device, reason: str) -> None:
    # The message holds no layer shape, so Python's warning filter shows it once, not once per linear layer.
    warnings.warn(f"RiverQuantLinear: {reason}; using backend 'hqq', which dequantizes the whole weight on every "
                  f"call and is slower than the full-precision layer ({nbits}-bit on {device.type}).", stacklevel=2)


def resolve_backend(backend: str, nbits: int, device: torch.device, activations: str | None = None) -> str:
    """The kernel a twin linear will run on. 'auto' -> the fastest one that runs `nbits` on `device`:
    CPU: 2/3/4 bits -> 'int4pack_cpu', 8 -> 'int8pack_cpu' ('w8a8_cpu' with activations="int8"); CUDA: 2/3/4 ->
    'tinygemm_cuda'; otherwise 'hqq' (slow, with a warning). An explicit backend is returned as is if it can run
    there, else ValueError."""
    check_choice("nbits", nbits, SUPPORTED_NBITS)
    check_choice("backend", backend, BACKENDS)
    check_choice("activations", activations, ACTIVATIONS)
    device = torch.device(device)
    if backend in ("auto", "fastest"):  # 'fastest' needs the layer's shape: `_fit_layer` measures it
        fast = _fast_backend(nbits, device, activations)
        if fast is None:
            _warn_slow(nbits, device, f"no fast kernel for {nbits}-bit weights on {device.type}")
        return fast or "hqq"
    kernel = KERNELS[backend]
    if kernel.requires and not kernel.available():
        raise ValueError(f"`backend`={backend!r} {install_hint(*kernel.requires)}; or choose another backend.")
    if not runs(backend, nbits, device):
        usable = tuple(name for name in KERNELS if runs(name, nbits, device))
        raise ValueError(f"`backend`={backend!r} cannot run {nbits}-bit weights on {device.type}; "
                         f"choose one of {('auto', 'fastest') + usable}.")
    return backend


def _fit_layer(requested: str, nbits: int, group_size: int | None, weight: torch.Tensor,
               activations: str | None) -> tuple[str, int | None]:
    """The (backend, group_size) one layer's weight [N, K] will use; warns when that is not what was asked."""
    if requested == "fastest" and weight.device.type == "cpu":  # on CUDA (one kernel per width) 'auto' decides
        backend = fastest_backend(nbits, group_size, *weight.shape, weight.device, activations).backend
        return backend, None if KERNELS[backend].per_row else group_size
    backend = resolve_backend(requested, nbits, weight.device, activations)
    problem = shape_problem(backend, *weight.shape, group_size)
    if problem and requested not in ("auto", "fastest"):
        raise ValueError(f"`backend`={requested!r} cannot run this layer: {problem}.")
    if problem:
        _warn_slow(nbits, weight.device, f"{backend!r} cannot run some layers ({problem})")
        backend = "hqq"
    elif requested == "hqq":
        fast = _fast_backend(nbits, weight.device)
        _warn_slow(nbits, weight.device, f"backend 'hqq' was asked for ({fast or 'no kernel'} is the fast one here)")
    if KERNELS[backend].per_row and group_size is not None:
        warnings.warn(f"RiverQuantLinear: {backend!r} runs 8-bit weights with one group per output row; "
                      f"`group_size`={group_size} is ignored.", stacklevel=2)
        group_size = None
    return backend, group_size


def _readable(backend: str, nbits: int, group_size: int | None, out_features: int, in_features: int) -> bool:
    """Whether `backend` can run codes already grouped by `group_size` (stored codes cannot be regrouped: the int8
    kernels read one (scale, zero) per row)."""
    if KERNELS[backend].per_row and group_size is not None:
        return False
    return shape_problem(backend, out_features, in_features, group_size) is None


def _backend_for_codes(requested: str, nbits: int, group_size: int | None, out_features: int, in_features: int,
                       device: torch.device, activations: str | None) -> str:
    """The kernel for stored codes: chosen as for a fresh layer ('fastest' measures, 'auto' takes the preferred one),
    among the kernels that can read the codes' grouping; 'dense' (any grouping, the backbone's speed) otherwise."""
    if requested == "fastest" and device.type == "cpu":
        choice = fastest_backend(nbits, group_size, out_features, in_features, device, activations)
        if _readable(choice.backend, nbits, group_size, out_features, in_features):
            return choice.backend  # what a fresh build picks (the preferred kernel wins close calls)
        usable = [name for name in choice.microseconds if _readable(name, nbits, group_size, out_features,
                                                                    in_features)]
        return min(usable, key=choice.microseconds.get) if usable else "hqq"
    backend = resolve_backend(requested, nbits, device, activations)
    if _readable(backend, nbits, group_size, out_features, in_features):
        return backend
    if requested not in ("auto", "fastest"):
        raise ValueError(f"`backend`={requested!r} cannot run these stored {nbits}-bit codes of a "
                         f"[{out_features}, {in_features}] weight grouped by `group_size`={group_size}; use "
                         f"backend='auto' or 'dense'.")
    return "dense"


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Any packed tensor's bytes as 4-bit values, low nibble first -> uint8 [2 * bytes]."""
    data = packed.contiguous().view(torch.uint8).reshape(-1)
    return torch.stack([data & 15, data >> 4], dim=-1).reshape(-1)


def _int4_codes_by_layout(module: "RiverQuantLinear") -> torch.Tensor | None:
    """The codes [N, K] of an int4-kernel layer, from its packed weight without running the kernel.

    The packed weight is a data-independent shuffle of 4-bit values (blocked for the CPU's ISA: opaque, but fixed),
    so packing images whose values are the base-16 digits of each element's index shows where every code went: a
    few packs, where reading the codes through the kernel (an identity-matrix matmul, `Kernel.codes`) costs K GEMVs
    per layer, hours for an 8B model on CPU. Checked by packing the decoded codes again: None when the bytes
    differ (the caller then reads them through the kernel)."""
    rows, cols, nbits = module.out_features, module.in_features, module.nbits
    pack = KERNELS[module.backend].pack
    index = torch.arange(rows * cols, device=module.qweight.device)
    source = torch.zeros_like(index)
    for digit in range(((rows * cols - 1).bit_length() + 3) // 4):
        image = ((index >> (4 * digit)) & 15).reshape(rows, cols).to(torch.int32)  # packed as 4-bit: no shift
        source |= _nibbles(pack(image, module.scale, module.zero, module.group_size, 4)["qweight"]).long() << (4 * digit)
    centered = torch.empty(rows * cols, dtype=torch.int16, device=index.device)
    centered[source] = _nibbles(module.qweight).to(torch.int16)
    codes = centered.reshape(rows, cols) - (8 - 2 ** (nbits - 1))  # 2/3-bit codes sit around the midpoint 8
    if codes.min() < 0 or codes.max() >= 2 ** nbits:
        return None
    codes = codes.to(torch.uint8)
    repacked = pack(codes, module.scale, module.zero, module.group_size, nbits)["qweight"]
    return codes if torch.equal(repacked, module.qweight) else None


def _dense_codes(module: "RiverQuantLinear") -> torch.Tensor | None:
    """The codes [N, K] of a 'dense' layer, whose weight is the bf16 rounding of (W_q - zero) * scale. Rounding back
    to the nearest code can miss by one where |W_q - zero| is large (bf16 keeps 8 significant bits), so of each
    nearest code and its two neighbours, the one whose bf16 weight is the stored one is taken. None when some
    element has none (not a 'dense' weight made by this code)."""
    weight, scale, zero = module.qweight, module.scale.float(), module.zero.float()
    rows, cols = weight.shape
    grouped = weight.float().reshape(rows, scale.shape[1], -1) / scale[..., None] + zero[..., None]
    nearest = grouped.round().reshape(rows, cols).to(torch.int16)
    codes = torch.zeros_like(nearest)
    found = torch.zeros_like(nearest, dtype=torch.bool)
    for shift in (0, -1, 1):
        candidate = (nearest + shift).clamp(0, 2 ** module.nbits - 1)
        match = ~found & (dequantize(candidate, scale, zero).to(weight.dtype) == weight)
        codes, found = torch.where(match, candidate, codes), found | match
    return codes.to(torch.uint8) if bool(found.all()) else None


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
    `zero_shift` (int8 kernel). `source_fingerprint`: what the twin was made from (set by build_river,
    `river_hf.saving.twin_files.fingerprint` of the linear it quantized), so a saved river can tell stale twins apart.

    Device moves: the packed weight is laid out for the device type (and, for `int4pack_cpu`, the CPU ISA) it was
    built on. `.to(dtype)` is harmless; moving between CPU and CUDA is not supported (forward raises): build the
    twin on the target device instead. Only the 'hqq' backend runs anywhere.
    """

    source_fingerprint: str | None = None  # see the class docstring

    def __init__(self, in_features: int, out_features: int, nbits: int, group_size: int | None, backend: str,
                 buffers: dict[str, torch.Tensor], bias: torch.Tensor | None = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.nbits, self.group_size, self.backend = nbits, group_size, backend
        for name, tensor in buffers.items():
            self.register_buffer(name, tensor)
        self.register_buffer("bias", bias)
        # Plain attributes, read on every call: a buffer lookup goes through nn.Module.__getattr__ (~1 µs), and a
        # decode step makes ~7 calls per layer, so the hot path reads as few as it can.
        self.kernel = KERNELS[backend]
        self.has_bias = bias is not None
        # int4 kernels read per-row scales as groups they accept (see _int4_kernel_group).
        sz = buffers.get("scales_and_zeros")
        self.kernel_group_size = None if sz is None else in_features // sz.shape[0]
        self._prepack()
        # Loading a state dict copies into the buffers in place: an fbgemm weight packed before would be stale.
        self.register_load_state_dict_post_hook(lambda module, _keys: module._prepack())

    def _prepack(self) -> None:
        """`kernel_inputs`: what the kernel's matmul reads; the buffers themselves unless the kernel packs them into
        an object of its own (fbgemm's weight for 'w8a8_cpu', an ONNX Runtime session for 'matmulnbits_cpu'; remade
        whenever the buffers change)."""
        prepack = self.kernel.prepack
        self.kernel_inputs = self._buffers if prepack is None else prepack(self._buffers, self.nbits)

    def _apply(self, fn, recurse=True):
        module = super()._apply(fn, recurse)
        self._prepack()
        return module

    @classmethod
    @torch.no_grad()
    def from_linear(cls, linear: nn.Linear, nbits: int = 4, group_size: int | None = 64, axis: int = 1,
                    backend: str = "auto", activations: str | None = None) -> "RiverQuantLinear":
        """Quantize `linear` (its weight [N, K] stays untouched) on its own device, packed for `backend`
        (`activations`: see ACTIVATIONS)."""
        _check_layer(linear, nbits, group_size, axis)
        check_choice("activations", activations, ACTIVATIONS)
        backend, group_size = _fit_layer(backend, nbits, group_size, linear.weight, activations)
        codes, scale, zero = hqq_quantize(linear.weight, nbits, group_size)
        buffers = {"scale": scale, "zero": zero, **KERNELS[backend].pack(codes, scale, zero, group_size, nbits)}
        bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls(linear.in_features, linear.out_features, nbits, group_size, backend, buffers, bias)

    @classmethod
    @torch.no_grad()
    def from_codes(cls, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bias: torch.Tensor | None = None,
                   nbits: int = 4, group_size: int | None = 64, backend: str = "auto",
                   device: torch.device | str | None = None, activations: str | None = None) -> "RiverQuantLinear":
        """A twin linear from HQQ codes made before (a saved river, river_hf.saving.twin_files): codes uint8 [N, K] in
        0..2^nbits-1, scale and zero [N, G]; packed for `backend` on `device` (default: the codes' device), no HQQ.
        'fastest' measures the kernels for this shape as `from_linear` does, among those that can read the codes'
        grouping (8-bit codes grouped by `group_size` cannot run on the per-row int8 kernels: they run on 'dense')."""
        check_choice("nbits", nbits, SUPPORTED_NBITS)
        check_choice("group_size", group_size, SUPPORTED_GROUP_SIZES)
        out_features, in_features = codes.shape
        groups = 1 if group_size is None else in_features // group_size
        if codes.dtype != torch.uint8 or scale.shape != (out_features, groups) or zero.shape != scale.shape:
            raise ValueError(f"`codes` must be uint8 [N, K] and `scale`, `zero` [N, K // group_size]; got codes "
                             f"{codes.dtype} {tuple(codes.shape)}, scale {tuple(scale.shape)}, zero {tuple(zero.shape)} "
                             f"for `group_size`={group_size}.")
        device = torch.device(device) if device is not None else codes.device
        backend = _backend_for_codes(backend, nbits, group_size, out_features, in_features, device, activations)
        codes, scale, zero = codes.to(device), scale.to(device).float(), zero.to(device).float()
        buffers = {"scale": scale, "zero": zero, **KERNELS[backend].pack(codes, scale, zero, group_size, nbits)}
        bias = None if bias is None else bias.to(device)
        return cls(in_features, out_features, nbits, group_size, backend, buffers, bias)

    @torch.no_grad()
    def codes(self) -> torch.Tensor:
        """HQQ's codes [N, K] uint8, read back from the kernel's layout: the portable form a saved river stores.
        Checked: packing them again gives this module's buffers exactly (so a twin made `from_codes` computes what
        this one does); a RuntimeError otherwise."""
        codes = None
        if "scales_and_zeros" in self._buffers:  # the int4 kernels' opaque layouts
            codes = _int4_codes_by_layout(self)
        elif self.backend == "dense":
            codes = _dense_codes(self)
        if codes is None:
            codes = KERNELS[self.backend].codes(self).to(torch.uint8)
        packed = KERNELS[self.backend].pack(codes, self.scale, self.zero, self.group_size, self.nbits)
        if not all(torch.equal(tensor, self._buffers[name]) for name, tensor in packed.items()):
            raise RuntimeError(f"RiverQuantLinear ({self.backend!r}, {self.nbits}-bit, [{self.out_features}, "
                               f"{self.in_features}]): its packed buffers are not what its codes pack to (were they "
                               f"cast after the river was built?); build the river again before saving its twins.")
        return codes

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., K] -> [..., N]
        kernel = self.kernel
        if kernel.device_type is not None and kernel.device_type != x.device.type:
            raise RuntimeError(f"RiverQuantLinear was packed for {kernel.device_type} ({self.backend!r}) but got "
                               f"input on {x.device.type}; rebuild it with from_linear on that device.")
        x2d = x.reshape(-1, self.in_features)  # [M, K]
        if kernel.activation_dtype is not None:
            x2d = cast(x2d, kernel.activation_dtype).contiguous()  # the packed kernels take one dtype
        y = cast(kernel.matmul(self.kernel_inputs, self.kernel_group_size, x2d), x.dtype)  # [M, N]
        if self.has_bias:
            y = y + cast(self.bias, x.dtype)
        return y.view(*x.shape[:-1], self.out_features)

    @torch.no_grad()
    def dequantized_weight(self) -> torch.Tensor:
        """[N, K] float32: the weight HQQ's (W_q, scale, zero) represent, exactly; the reference the kernels are
        tested against. The int4 backends read their codes back by running the kernel on an identity matrix."""
        return dequantize(KERNELS[self.backend].codes(self), self.scale, self.zero)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, nbits={self.nbits}, "
                f"group_size={self.group_size}, backend={self.backend}")
