"""The gemlite kernels' own arithmetic, without a GPU: reading codes back from gemlite's layouts, the int8 kernel's
zero-point correction, and what `prepack` hands gemlite. gemlite itself needs CUDA to import, so its layouts are
built here as its pack functions lay them out (gemlite 0.6's `pack_weights_over_cols`, `A16W8.from_weights`);
tests/test_cuda_kernels.py runs the real kernels against HQQ's weight on a GPU."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from river_hf.kernels import gemlite_kernels
from river_hf.kernels.registry import KERNELS, dequantize, runs

N, K = 48, 128


def gemlite_words(codes: torch.Tensor, nbits: int) -> torch.Tensor:
    """gemlite's packing over K: code k of a row at bits (k % per_word) * nbits of int32 word k // per_word, stored
    transposed and contiguous [K / per_word, N]."""
    per_word = 32 // nbits
    grouped = codes.to(torch.int64).reshape(codes.shape[0], -1, per_word)
    words = (grouped << (torch.arange(per_word) * nbits)).sum(-1)  # disjoint bits: the sum is the OR
    return words.to(torch.uint32).view(torch.int32).t().contiguous()


@pytest.mark.parametrize("nbits", [2, 4])
def test_int4_codes_read_back_from_gemlite_words(nbits):
    codes = torch.randint(0, 2 ** nbits, (N, K), dtype=torch.uint8)
    codes[0, -1] = 2 ** nbits - 1  # the top bits of a word: the sign bit of the int32
    layer = SimpleNamespace(nbits=nbits, qweight=gemlite_words(codes, nbits))
    assert torch.equal(gemlite_kernels.codes_int4(layer).to(torch.uint8), codes)


def int8_layer(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> dict:
    """The buffers `pack_int8` keeps, in gemlite's A16W8 layout: int8 codes - 128 as a transposed view, fp32 scales."""
    signed = (codes ^ 128).view(torch.int8)
    return {"qweight": signed.t(), "kernel_scale": scale[:, :1].float().t(),
            "zero_shift": (scale[:, 0] * (128 - zero[:, 0])).to(torch.bfloat16),
            "kernel_meta": torch.tensor([0, 8, K, 255, 1, 1, 1, 1, 0, 0, 2, 0], dtype=torch.int32)}


def fake_gemlite_int8(x, bias, tensor_args, meta_args, matmul_type):
    """gemlite's symmetric int8 GEMV with per-row scales (its W_group_mode 2): x @ (W_q * scale)."""
    weight, scale = tensor_args[:2]  # [K, N] int8, [1, N] fp32
    return (x.float() @ (weight.float() * scale.float())).to(x.dtype)


def test_int8_correction_gives_hqqs_weight(monkeypatch):
    """The symmetric kernel on codes - 128 plus s * (128 - zero) * sum(x) is HQQ's (W_q - zero) * s."""
    codes = torch.randint(0, 256, (N, K), dtype=torch.uint8)
    scale, zero = torch.rand(N, 1) * 0.01 + 1e-3, torch.rand(N, 1) * 40 + 100  # float zeros, as HQQ's optimizer makes
    buffers = int8_layer(codes, scale, zero)
    monkeypatch.setattr(torch.ops, "gemlite", SimpleNamespace(forward_functional=fake_gemlite_int8), raising=False)
    x = torch.randn(3, K, dtype=torch.bfloat16)
    y = gemlite_kernels.matmul(gemlite_kernels.prepack(buffers, 8), None, x)
    reference = x.float() @ dequantize(codes, scale, zero).t()
    assert (y.float() - reference).abs().max() < 0.02 * reference.abs().max()
    assert torch.equal(gemlite_kernels.codes_int8(SimpleNamespace(qweight=buffers["qweight"])).to(torch.uint8), codes)


def test_prepack_gives_gemlite_its_packed_dtypes():
    """A model-wide `.to(dtype)` casts float buffers; gemlite still gets what it was packed with (its meta_args say
    fp32 scales for the int8 layer, bf16 for the HQQ one) and plain ints for its settings."""
    codes = torch.randint(0, 256, (N, K), dtype=torch.uint8)
    buffers = int8_layer(codes, torch.rand(N, 1), torch.rand(N, 1))
    cast = {name: t.half() if t.is_floating_point() else t for name, t in buffers.items()}
    inputs = gemlite_kernels.prepack(cast, 8)
    weight, scale, zeros, meta_scale = inputs["tensor_args"]
    assert weight is cast["qweight"] and scale.dtype == torch.float32 and inputs["zero_shift"].dtype == torch.bfloat16
    assert zeros.numel() == 0 and meta_scale.dtype == torch.float32
    assert inputs["meta_args"] == buffers["kernel_meta"].tolist() and all(type(v) is int for v in inputs["meta_args"])
    grouped = {"qweight": gemlite_words(codes // 16, 4), "kernel_scale": torch.rand(2, N).half(),
               "kernel_zero": torch.rand(2, N).half(), "kernel_meta": buffers["kernel_meta"]}
    inputs = gemlite_kernels.prepack(grouped, 4)
    assert [t.dtype for t in inputs["tensor_args"][1:3]] == [torch.bfloat16, torch.bfloat16]
    assert inputs["zero_shift"] is None


def test_gemlite_kernels_run_only_on_cuda_with_gemlite(monkeypatch):
    assert not runs("gemlite_int8_cuda", 8, torch.device("cpu"))
    monkeypatch.setitem(KERNELS, "gemlite_int8_cuda", KERNELS["gemlite_int8_cuda"]._replace(available=lambda: True))
    assert runs("gemlite_int8_cuda", 8, torch.device("cuda")) and not runs("gemlite_int8_cuda", 4, torch.device("cuda"))
    assert gemlite_kernels.shape_problem(64, 80, None) == "`in_features`=80 is not a multiple of 32"
    assert gemlite_kernels.shape_problem(64, 128, 64) is None
