"""The pieces a twins file is made of (river_hf.saving.twin_files, river_hf.kernels.quantize): the weight digest, and
twin linears read back into HQQ's portable codes and packed again, on every backend, to the same buffers."""

from __future__ import annotations

import warnings

import pytest
import torch

from river_hf.kernels import quantize
from river_hf.kernels.registry import KERNELS
from river_hf.saving.twin_files import digest


def test_digest_changes_with_any_element_a_row_swap_or_the_dtype():
    torch.manual_seed(0)
    weight = torch.randn(64, 96, dtype=torch.bfloat16)
    changed, swapped = weight.clone(), weight.clone()
    changed[40, 17] = changed[40, 17] + 1
    swapped[[3, 4]] = weight[[4, 3]]
    digests = {digest(weight), digest(changed), digest(swapped), digest(weight.float())}
    assert len(digests) == 4 and digest(weight.clone()) == digest(weight)


@pytest.mark.parametrize("nbits, group_size", [(4, 64), (3, 32), (2, None)])
def test_codes_read_from_the_int4_layout_equal_the_kernels_own(nbits, group_size):
    torch.manual_seed(nbits)
    linear = quantize.RiverQuantLinear.from_linear(torch.nn.Linear(256, 96), nbits=nbits, group_size=group_size,
                                                   backend="int4pack_cpu")
    codes = linear.codes()
    assert torch.equal(codes, KERNELS["int4pack_cpu"].codes(linear))  # the K-row matmul through the kernel
    again = quantize.RiverQuantLinear.from_codes(codes, linear.scale, linear.zero, linear.bias, nbits=nbits,
                                                 group_size=group_size, backend="int4pack_cpu")
    assert all(torch.equal(again._buffers[k], linear._buffers[k]) for k in linear._buffers)


@pytest.mark.parametrize("backend, nbits, group_size", [
    ("int8pack_cpu", 8, None), ("int8pack_fp32_cpu", 8, None), ("dense", 8, None), ("dense", 4, 64), ("hqq", 3, 32)])
def test_codes_give_back_the_same_packed_twin_on_every_backend(backend, nbits, group_size):
    torch.manual_seed(0)
    linear = torch.nn.Linear(256, 96)
    with torch.no_grad():  # rows far from zero: HQQ's zero point far from the middle, where bf16 rounding bites
        linear.weight.add_(torch.rand(96, 1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # 'hqq' warns that it is slow
        twin = quantize.RiverQuantLinear.from_linear(linear, nbits=nbits, group_size=group_size, backend=backend)
        again = quantize.RiverQuantLinear.from_codes(twin.codes(), twin.scale, twin.zero, twin.bias, nbits=nbits,
                                                     group_size=group_size, backend=backend)
    assert all(torch.equal(again._buffers[k], twin._buffers[k]) for k in twin._buffers if twin._buffers[k] is not None)


def test_from_codes_checks_its_input_and_the_grouping_a_kernel_can_read():
    codes = torch.randint(0, 256, (32, 128), dtype=torch.uint8)
    scale, zero = torch.rand(32, 2) + 0.1, torch.full((32, 2), 128.0)
    grouped = quantize.RiverQuantLinear.from_codes(codes, scale, zero, nbits=8, group_size=64, backend="auto")
    assert grouped.backend == "dense"  # the int8 kernels read one group per row
    with pytest.raises(ValueError, match="`backend`='int8pack_cpu' cannot run these stored 8-bit codes"):
        quantize.RiverQuantLinear.from_codes(codes, scale, zero, nbits=8, group_size=64, backend="int8pack_cpu")
    with pytest.raises(ValueError, match="`codes` must be uint8"):
        quantize.RiverQuantLinear.from_codes(codes, scale[:, :1], zero, nbits=8, group_size=64)
