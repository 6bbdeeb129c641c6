"""The twin kernels on CUDA (skipped without a GPU; gemlite's without the gemlite package): each computes HQQ's
weight, gives back the codes it was packed from, runs the same inside a CUDA graph, and `backend="fastest"` times
them there; a river whose twins and head take the measured kernels keeps the backbone's tokens at tau > 1 and every
KV slot when every step exits."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch import nn

from river_hf.kernels import choice
from river_hf.kernels.quantize import RiverQuantLinear, hqq_quantize
from river_hf.kernels.registry import dequantize

from conftest import generate, river_of, tiny_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
HAS_GEMLITE = importlib.util.find_spec("gemlite") is not None
CUDA = torch.device("cuda")
K, N = 512, 1024
# (backend, bits, group size) as a river builds them: 2-4-bit twins grouped, 8-bit ones per row
KERNELS_ON_CUDA = [("tinygemm_cuda", 4, 64), ("gemlite_int4_cuda", 4, 64), ("gemlite_int4_cuda", 2, 64),
                   ("gemlite_int8_cuda", 8, None), ("dense", 8, None), ("dense", 4, 64)]


def needs_package(backend: str) -> None:
    if backend.startswith("gemlite") and not HAS_GEMLITE:
        pytest.skip("needs gemlite (pip install river-hf[cuda])")


def linear_on_cuda(seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(K, N, bias=False, device=CUDA, dtype=torch.bfloat16)


@pytest.mark.parametrize("backend, nbits, group_size", KERNELS_ON_CUDA)
def test_cuda_kernel_computes_hqqs_weight(backend, nbits, group_size):
    needs_package(backend)
    linear = linear_on_cuda()
    twin = RiverQuantLinear.from_linear(linear, nbits, group_size, backend=backend)
    assert twin.backend == backend
    codes, scale, zero = hqq_quantize(linear.weight, nbits, group_size)
    weight = dequantize(codes, scale, zero)  # [N, K] float32: HQQ's weight
    for rows in (1, 5):  # a decode step, a short prompt
        x = torch.randn(rows, K, device=CUDA, dtype=torch.bfloat16)
        reference = x.float() @ weight.t()
        error = (twin(x).float() - reference).abs().max() / reference.abs().max()
        assert error < 0.02, f"{backend} {nbits}-bit, {rows} rows: {error:.4f} of the output's range"
    assert torch.equal(twin.codes(), codes)  # what a saved river stores, read back from the kernel's layout


@pytest.mark.parametrize("backend, nbits, group_size", KERNELS_ON_CUDA)
def test_cuda_kernel_runs_in_a_cuda_graph(backend, nbits, group_size):
    """Captured (torch.compile's CUDA graphs, as a static river's decode step) it computes what it does eagerly."""
    needs_package(backend)
    twin = RiverQuantLinear.from_linear(linear_on_cuda(1), nbits, group_size, backend=backend)
    x = torch.randn(1, K, device=CUDA, dtype=torch.bfloat16)
    eager = twin(x)
    captured = torch.compile(twin, mode="reduce-overhead", fullgraph=True)
    for _ in range(3):  # warm-up, record, replay
        out = captured(x).clone()
    torch.testing.assert_close(out, eager, atol=2e-2 * eager.abs().max().item(), rtol=0)


def test_fastest_times_the_cuda_kernels():
    """`backend="fastest"` on CUDA times every kernel that runs the width (dense, the backbone's GEMV, among them)
    and takes one of them."""
    choice.forget(machine=False)
    for nbits, group_size in ((4, 64), (8, None)):
        made = choice.fastest_backend(nbits, group_size, 2048, 2048, CUDA)
        expected = {"dense"} | ({"tinygemm_cuda"} if nbits == 4 else set())
        if HAS_GEMLITE:
            expected |= {"gemlite_int4_cuda" if nbits == 4 else "gemlite_int8_cuda"}
        assert set(made.microseconds) == expected and made.backend in expected
        assert all(us > 0 for us in made.microseconds.values())


def test_river_on_measured_cuda_kernels():
    """The default build (`backend="fastest"`, an 8-bit head) on CUDA: tau > 1 is the backbone, and with every step
    exiting every layer's cache holds every position."""
    model = tiny_model().to(CUDA)
    ids = torch.randint(3, 256, (1, 10), device=CUDA)
    backbone = generate(model, ids).sequences
    river_of(model, backend="fastest", quantize_lm_head=True)
    assert torch.equal(generate(model, ids, tau=1.5).sequences, backbone)
    out = generate(model, ids, tau=-1)
    out.cache.check_kv_integrity()
