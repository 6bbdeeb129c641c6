"""Reading a packed twin linear's HQQ codes back without running its kernel (what saving a river needs): the int4
kernels' packed layout is located by packing index images, a 'dense' weight is rounded back to its codes. Each
returns None where it cannot be sure, and the caller then reads the codes through the kernel (`Kernel.codes`).
"""

from __future__ import annotations

import torch

from .registry import KERNELS, dequantize


def nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Any packed tensor's bytes as 4-bit values, low nibble first -> uint8 [2 * bytes]."""
    data = packed.contiguous().view(torch.uint8).reshape(-1)
    return torch.stack([data & 15, data >> 4], dim=-1).reshape(-1)


def int4_codes_by_layout(module: "RiverQuantLinear") -> torch.Tensor | None:
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
        source |= nibbles(pack(image, module.scale, module.zero, module.group_size, 4)["qweight"]).long() << (4 * digit)
    centered = torch.empty(rows * cols, dtype=torch.int16, device=index.device)
    centered[source] = nibbles(module.qweight).to(torch.int16)
    codes = centered.reshape(rows, cols) - (8 - 2 ** (nbits - 1))  # 2/3-bit codes sit around the midpoint 8
    if codes.min() < 0 or codes.max() >= 2 ** nbits:
        return None
    codes = codes.to(torch.uint8)
    repacked = pack(codes, module.scale, module.zero, module.group_size, nbits)["qweight"]
    return codes if torch.equal(repacked, module.qweight) else None


def dense_codes(module: "RiverQuantLinear") -> torch.Tensor | None:
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
