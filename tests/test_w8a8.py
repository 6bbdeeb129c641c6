"""The W8A8 twin kernel (`w8a8_cpu`, fbgemm's dynamic int8 linear): what it computes, that it is used only when
asked (`activations="int8"`), and the river invariants with it."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import river_hf
from river_hf import RiverQuantConfig
from river_hf.kernels.choice import candidates
from river_hf.kernels import fbgemm_w8a8
from river_hf.kernels.fbgemm_w8a8 import w8a8_reduce_range
from river_hf.kernels.registry import runs
from river_hf.kernels.backends import resolve_backend
from river_hf.kernels.quantize import RiverQuantLinear

from conftest import assert_full_quantization_is_exact, generate, river_of, tiny_model

CPU = torch.device("cpu")
IN, OUT = 256, 128
pytestmark = [pytest.mark.skipif(not runs("w8a8_cpu", 8, CPU), reason="no fbgemm/x86 quantized engine in this torch"),
              pytest.mark.usefixtures("one_thread")]


def twin(seed: int = 0, bias: bool = True) -> tuple[nn.Linear, RiverQuantLinear]:
    torch.manual_seed(seed)
    linear = nn.Linear(IN, OUT, bias=bias)
    return linear, RiverQuantLinear.from_linear(linear, 8, None, backend="w8a8_cpu", activations="int8")


def rounded_per_token(x: torch.Tensor, reduce_range: bool = fbgemm_w8a8.W8A8_REDUCE_RANGE) -> torch.Tensor:
    """An independent model of the kernel's activations: each row rounded on its own asymmetric grid, as torch's own
    dynamic quantization rounds one tensor (7 bits with reduce_range, the setting for this CPU: 8 with AVX512-VNNI)."""
    return torch.cat([torch.quantize_per_tensor_dynamic(row[None], torch.quint8, reduce_range).dequantize()
                      for row in x])


def rel_error(actual, expected) -> float:
    return ((actual.float() - expected.float()).norm() / expected.float().norm()).item()


# ---------------------------------------------------------------- what it computes


def test_a_decode_step_is_the_hqq_weight_times_the_rounded_token():
    linear, quantized = twin()
    torch.manual_seed(1)
    x = torch.randn(1, IN)
    rounded = F.linear(rounded_per_token(x), quantized.dequantized_weight(), linear.bias)
    exact = F.linear(x, quantized.dequantized_weight(), linear.bias)
    # The activations' rounding is a real, bounded cost, and it is the rounding modelled here: what is left against
    # the model is the zero-point correction, which reads the unrounded activations' sum.
    assert 1e-3 < rel_error(quantized(x), exact) < 3e-2
    assert rel_error(quantized(x), rounded) < 0.3 * rel_error(quantized(x), exact)


def test_activations_keep_8_bits_only_where_fbgemm_sums_in_int32():
    """AVX512-VNNI (fbgemm's vpdpbusd) sums u8 x s8 products in int32; without it pairs are summed in int16, which
    saturates at 8 bits. Whatever this CPU is, the setting the kernel passes computes a saturating input exactly."""
    assert w8a8_reduce_range(["avx2", "avx512f", "avx512_vnni", "amx_int8"]) is False
    assert w8a8_reduce_range(["avx2", "avx_vnni", "avx512f"]) is True   # fbgemm has no AVX-VNNI kernels
    assert w8a8_reduce_range(None) is True                              # unknown CPU: the safe grid
    # All activations at the top code (255, or 127 on the 7-bit grid) against weights at -128: a pair of products
    # sums to -65280 at 8 bits, beyond int16.
    rows, cols = 4, 256
    weight = torch._make_per_channel_quantized_tensor(torch.full((rows, cols), -128, dtype=torch.int8),
                                                      torch.full((rows,), 1 / 128, dtype=torch.double),
                                                      torch.zeros(rows, dtype=torch.long), 0)
    packed = torch.ops.quantized.linear_prepack(weight, None)
    y = torch.ops.quantized.linear_dynamic(torch.ones(1, cols), packed, fbgemm_w8a8.W8A8_REDUCE_RANGE)
    torch.testing.assert_close(y, torch.full((1, rows), -float(cols)))


def test_8_bit_activations_round_finer_than_7():
    if fbgemm_w8a8.W8A8_REDUCE_RANGE:
        pytest.skip("this CPU has no AVX512-VNNI: the kernel rounds activations to 7 bits")
    linear, quantized = twin(bias=False)
    torch.manual_seed(4)
    x = torch.randn(1, IN)
    exact = F.linear(x, quantized.dequantized_weight())
    at_7_bits = F.linear(rounded_per_token(x, reduce_range=True), quantized.dequantized_weight())
    assert rel_error(quantized(x), exact) < 0.7 * rel_error(at_7_bits, exact)


def test_each_prompt_token_keeps_its_own_activation_range():
    """fbgemm takes one activation scale per tensor; a quiet token next to a loud one must not lose its precision."""
    linear, quantized = twin(bias=False)
    torch.manual_seed(2)
    x = torch.randn(3, IN) * torch.tensor([[1e-3], [1.0], [50.0]])
    y = quantized(x)
    exact = F.linear(x, quantized.dequantized_weight())
    for row in range(3):
        assert rel_error(y[row], exact[row]) < 3e-2, row


def test_bf16_inputs_come_back_in_bf16():
    _, quantized = twin()
    x = torch.randn(2, 3, IN, dtype=torch.bfloat16)
    y = quantized(x)
    assert y.dtype == torch.bfloat16 and y.shape == (2, 3, OUT)


def test_copies_loaded_state_and_stored_codes_compute_the_same():
    _, quantized = twin(seed=0)
    _, other = twin(seed=3)
    x = torch.randn(2, IN)
    assert torch.equal(copy.deepcopy(quantized)(x), quantized(x))
    rebuilt = RiverQuantLinear.from_codes(quantized.codes(), quantized.scale, quantized.zero, quantized.bias, nbits=8,
                                          group_size=None, backend="w8a8_cpu", activations="int8")
    assert torch.equal(rebuilt(x), quantized(x))
    other.load_state_dict(quantized.state_dict())  # in-place copies: fbgemm's packed weight must follow
    assert torch.equal(other(x), quantized(x))


# ---------------------------------------------------------------- used only when asked


def test_weight_only_unless_activations_int8():
    assert resolve_backend("auto", 8, CPU) == "int8pack_cpu"
    assert resolve_backend("auto", 8, CPU, activations="int8") == "w8a8_cpu"
    assert resolve_backend("auto", 4, CPU, activations="int8") == "int4pack_cpu"  # 4-bit twins stay weight-only
    assert "w8a8_cpu" not in candidates(8, None, OUT, IN, CPU)
    assert "w8a8_cpu" in candidates(8, None, OUT, IN, CPU, activations="int8")
    assert "w8a8_cpu" not in candidates(4, 64, OUT, IN, CPU, activations="int8")


def test_bad_settings_name_the_field():
    with pytest.raises(ValueError, match="`activations`='int4'"):
        RiverQuantConfig(activations="int4")
    with pytest.raises(ValueError, match="`backend`='w8a8_cpu'.*activations='int8'"):
        RiverQuantConfig(nbits=8, quantize_lm_head=False, backend="w8a8_cpu")
    with pytest.raises(ValueError, match="`activations`='fp8'"):
        RiverQuantLinear.from_linear(nn.Linear(IN, OUT), 8, None, activations="fp8")
    RiverQuantConfig(nbits=8, backend="w8a8_cpu", activations="int8")  # said explicitly: fine
    assert RiverQuantConfig.from_dict(RiverQuantConfig(activations="int8").to_dict()).activations == "int8"


# ---------------------------------------------------------------- the river with W8A8 twins


def test_river_invariants_with_w8a8_twins_and_head(prompt_ids):
    model = tiny_model("llama")
    plain = generate(model, prompt_ids).sequences
    river = river_of(model, nbits=8, group_size=None, quantize_lm_head=True, activations="int8")
    backends = {m.backend for m in river.modules() if isinstance(m, RiverQuantLinear)}
    assert backends == {"w8a8_cpu"}
    assert_full_quantization_is_exact(river, prompt_ids, plain)
    river_hf.remove_river(river)
    assert torch.equal(generate(model, prompt_ids).sequences, plain)

