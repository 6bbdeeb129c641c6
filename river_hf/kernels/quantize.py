"""Quantize an `nn.Linear` with HQQ and run it on a weight-only kernel: the building block of a twin layer.

Two steps, as in gpt-fast: HQQ turns the weight into integer codes W_q with a (scale, zero) per group, so that
W ≈ (W_q - zero) * scale; then one kernel (`river_hf.kernels.registry`) packs those three tensors into its own
layout and runs the matmul.

The backend is resolved per linear layer (`kernels.backends`), so a model whose twins mix widths (a `RiverQuantConfig`
bit schedule) runs each layer on its own kernel. The int8 kernels read one (scale, zero) per output
row: given a group size, a single `from_linear` call warns once and ignores it, while a schedule's 8-bit layers are
quantized per row to begin with (no warning).
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar

import torch
from hqq.core.quantize import Quantizer
from torch import nn

from ..checks import check_choice
from .backends import ACTIVATIONS, backend_for_codes, fit_layer
from .codes_from_layout import dense_codes, int4_codes_by_layout
from .registry import KERNELS, SUPPORTED_NBITS, cast, dequantize

SUPPORTED_GROUP_SIZES = (32, 64, 128, 256, None)  # None = one group per output channel (whole row)


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
    `river_hf.saving.twin_files.fingerprint` of the linear it quantized: its whole and sampled digests), so a saved
    river can tell stale twins apart.

    Device moves: the packed weight is laid out for the device type (and, for `int4pack_cpu`, the CPU ISA) it was
    built on. `.to(dtype)` is harmless; moving between CPU and CUDA is not supported (forward raises): build the
    twin on the target device instead. Only the 'hqq' backend runs anywhere.
    """

    source_fingerprint = None  # a twin_files.SourceFingerprint; see the class docstring
    # Set on the members of a sibling stack (river_hf.kernels.shared_inputs.StackedSiblings): their calls go through
    # it, one GEMV for every member's rows; their own buffers are views of the stack's and still run alone.
    siblings = None
    sibling_index = 0

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
        if self.siblings is not None and not self._views_of(self.siblings.stacked):
            self.siblings = None  # moved or cast onto new buffers: the stack (not a submodule) stayed; run alone
        return module

    def _views_of(self, stack: "RiverQuantLinear") -> bool:
        return all(self._buffers[name].untyped_storage().data_ptr() == stack._buffers[name].untyped_storage()
                   .data_ptr() for name in ("qweight", "scale"))

    @classmethod
    @torch.no_grad()
    def from_linear(cls, linear: nn.Linear, nbits: int = 4, group_size: int | None = 64, axis: int = 1,
                    backend: str = "auto", activations: str | None = None) -> "RiverQuantLinear":
        """Quantize `linear` (its weight [N, K] stays untouched) on its own device, packed for `backend`
        (`activations`: see ACTIVATIONS)."""
        _check_layer(linear, nbits, group_size, axis)
        check_choice("activations", activations, ACTIVATIONS)
        backend, group_size = fit_layer(backend, nbits, group_size, linear.weight, activations)
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
                             f"{codes.dtype} {tuple(codes.shape)}, scale {tuple(scale.shape)}, "
                             f"zero {tuple(zero.shape)} "
                             f"for `group_size`={group_size}.")
        device = torch.device(device) if device is not None else codes.device
        backend = backend_for_codes(backend, nbits, group_size, out_features, in_features, device, activations)
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
            codes = int4_codes_by_layout(self)
        elif self.backend == "dense":
            codes = dense_codes(self)
        if codes is None:
            codes = KERNELS[self.backend].codes(self).to(torch.uint8)
        packed = KERNELS[self.backend].pack(codes, self.scale, self.zero, self.group_size, self.nbits)
        if not all(torch.equal(tensor, self._buffers[name]) for name, tensor in packed.items()):
            raise RuntimeError(f"RiverQuantLinear ({self.backend!r}, {self.nbits}-bit, [{self.out_features}, "
                               f"{self.in_features}]): its packed buffers are not what its codes pack to (were they "
                               f"cast after the river was built?); build the river again before saving its twins.")
        return codes

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., K] -> [..., N]
        if self.siblings is not None:
            return self.siblings.output(self.sibling_index, x)
        return self.compute(x)

    def compute(self, x: torch.Tensor) -> torch.Tensor:
        """This linear's own matmul, whether or not it is a member of a sibling stack."""
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
