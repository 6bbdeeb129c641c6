"""The `matmulnbits_cpu` twin kernel (ONNX Runtime's MatMulNBits, river_hf.kernels.matmulnbits): what it computes (HQQ's
weight, float zero points included, times activations rounded to int8 per block), that it is used only when asked
(`activations="int8"`) and only where measured, and the river invariants with it."""

from __future__ import annotations

import copy
import threading
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import river_hf
from river_hf import RiverQuantConfig
from river_hf.kernels import matmulnbits as ort_kernel
from river_hf.kernels.choice import candidates
from river_hf.kernels.machine import machine_identity
from river_hf.kernels.registry import dequantize, runs
from river_hf.kernels.backends import resolve_backend
from river_hf.kernels.quantize import RiverQuantLinear

from conftest import assert_full_quantization_is_exact, generate, river_of, tiny_model

CPU = torch.device("cpu")
IN, OUT, GROUP = 256, 96, 64
pytestmark = pytest.mark.skipif(not ort_kernel.available(), reason="onnxruntime / onnx not installed")


def twin(nbits: int, seed: int = 0, bias: bool = True) -> tuple[nn.Linear, RiverQuantLinear]:
    torch.manual_seed(seed)
    linear = nn.Linear(IN, OUT, bias=bias)
    return linear, RiverQuantLinear.from_linear(linear, nbits, GROUP, backend="matmulnbits_cpu", activations="int8")


def rel_error(actual, expected) -> float:
    return ((actual.float() - expected.float()).norm() / expected.float().norm()).item()


# ---------------------------------------------------------------- what it computes


@pytest.mark.parametrize("nbits", [4, 8])
@pytest.mark.parametrize("rows", [1, 5])
def test_it_computes_the_hqq_weight_float_zeros_included(nbits, rows):
    linear, quantized = twin(nbits)
    fractional = (quantized.zero - quantized.zero.round()).abs()
    assert fractional.max() > 0.1  # HQQ's zeros are not integers: the kernel's integer zero points alone would miss
    torch.manual_seed(1)
    x = torch.randn(rows, IN)
    exact = F.linear(x, quantized.dequantized_weight(), linear.bias)
    rounded_zero = F.linear(x, dequantize(quantized.codes(), quantized.scale, quantized.zero.round()), linear.bias)
    error = rel_error(quantized(x), exact)
    assert 1e-4 < error < 2e-2  # int8 activations: a real, small cost
    if nbits == 4:  # an 8-bit step is too fine for the zeros' rounding to show above the activations' rounding
        assert error < 0.5 * rel_error(rounded_zero, exact)


def test_dtypes_shapes_and_rows_alone():
    _, quantized = twin(4, bias=False)
    x = torch.randn(2, 3, IN, dtype=torch.bfloat16)
    y = quantized(x)
    assert y.dtype == torch.bfloat16 and y.shape == (2, 3, OUT)
    # Each row is rounded on its own grid: a prompt's rows are what the same tokens give decoded one at a time
    alone = torch.cat([quantized(row[None]) for row in x.reshape(-1, IN)])
    assert rel_error(y.reshape(-1, OUT), alone) < 1e-2
    # The decode path reuses one bound buffer: earlier outputs must not change under later calls
    first = quantized(x[0, :1])
    kept = first.clone()
    quantized(x[1, :1])
    assert torch.equal(first, kept)


def test_threads_decoding_at_once_get_their_own_rows():
    _, quantized = twin(4, bias=False)
    inputs = [torch.randn(1, IN) for _ in range(4)]
    expected = [quantized(x) for x in inputs]
    results = {}

    def decode(index):
        results[index] = [quantized(inputs[index]) for _ in range(200)]

    threads = [threading.Thread(target=decode, args=(index,)) for index in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(torch.equal(y, expected[index]) for index, ys in results.items() for y in ys)


def test_a_first_call_under_inference_mode_leaves_later_calls_working():
    """The decode row's bound buffers are made on the first call; made as inference tensors, a later call outside
    inference mode could not write to them (this failed in a bench whose first step ran under inference_mode)."""
    _, quantized = twin(4, bias=False)
    x = torch.randn(1, IN)
    with torch.inference_mode():
        first = quantized(x)
    with torch.no_grad():
        assert torch.equal(quantized(x), first)


def test_copies_loaded_state_and_stored_codes_compute_the_same():
    _, quantized = twin(4, seed=0)
    _, other = twin(4, seed=3)
    x = torch.randn(2, IN)
    assert torch.equal(copy.deepcopy(quantized)(x), quantized(x))
    rebuilt = RiverQuantLinear.from_codes(quantized.codes(), quantized.scale, quantized.zero, quantized.bias, nbits=4,
                                          group_size=GROUP, backend="matmulnbits_cpu", activations="int8")
    assert torch.equal(rebuilt(x), quantized(x))
    other.load_state_dict(quantized.state_dict())  # in-place copies: the session must follow
    assert torch.equal(other(x), quantized(x))


# ---------------------------------------------------------------- used only when asked, and where measured


def test_offered_only_with_int8_activations_and_a_group_size():
    assert "matmulnbits_cpu" not in candidates(4, GROUP, OUT, IN, CPU)
    assert "matmulnbits_cpu" in candidates(4, GROUP, OUT, IN, CPU, activations="int8")
    assert "matmulnbits_cpu" in candidates(8, GROUP, OUT, IN, CPU, activations="int8")
    assert "matmulnbits_cpu" not in candidates(8, None, OUT, IN, CPU, activations="int8")  # per-row codes
    assert "matmulnbits_cpu" not in candidates(3, GROUP, OUT, IN, CPU, activations="int8")
    # 'auto' does not measure, and at small shapes the kernel is slower than torch's: it never picks it
    assert resolve_backend("auto", 4, CPU, activations="int8") == "int4pack_cpu"


def test_not_offered_without_onnxruntime(monkeypatch):
    with_it = machine_identity(CPU)
    monkeypatch.setattr(ort_kernel.importlib.util, "find_spec", lambda name: None)
    assert not runs("matmulnbits_cpu", 4, CPU)
    assert "matmulnbits_cpu" not in candidates(4, GROUP, OUT, IN, CPU, activations="int8")
    # kernel choices remembered without it are not reused once it is installed (another machine identity)
    assert "matmulnbits_cpu" in with_it["kernels"] and "matmulnbits_cpu" not in machine_identity(CPU)["kernels"]


def test_bad_settings_name_the_field():
    with pytest.raises(ValueError, match="`backend`='matmulnbits_cpu'.*activations='int8'"):
        RiverQuantConfig(backend="matmulnbits_cpu", quantize_lm_head=False)
    with pytest.raises(ValueError, match="`backend`='matmulnbits_cpu' cannot run this layer: per-row codes"):
        RiverQuantLinear.from_linear(nn.Linear(IN, OUT), 8, None, backend="matmulnbits_cpu", activations="int8")
    # Per-row codes (an 8-bit head, a schedule's 8-bit layers, no group size) are refused by the config, naming the
    # field
    ort = dict(backend="matmulnbits_cpu", activations="int8")
    with pytest.raises(ValueError, match="`lm_head_nbits`=8 quantizes the LM head with one scale per row"):
        RiverQuantConfig(nbits=4, lm_head_nbits=8, **ort)
    assert RiverQuantConfig(nbits=4, **ort).head_nbits == 4  # 'auto': a W4A8 backend gets a grouped 4-bit head
    with pytest.raises(ValueError, match="`nbits`='auto' gives some twins 8 bits with one scale per row"):
        RiverQuantConfig(quantize_lm_head=False, **ort)
    with pytest.raises(ValueError, match="`group_size` is None"):
        RiverQuantConfig(nbits=4, group_size=None, quantize_lm_head=False, **ort)
    assert RiverQuantConfig(nbits=4, lm_head_nbits=4, **ort).backend == "matmulnbits_cpu"
    assert "`group_size`=48" in ort_kernel.shape_problem(OUT, 96, 48)  # not a power of two
    assert ort_kernel.shape_problem(OUT, 96, 32) is None


# ---------------------------------------------------------------- the river with MatMulNBits twins


def test_river_invariants_with_matmulnbits_twins_and_head(prompt_ids):
    model = tiny_model("llama")
    plain = generate(model, prompt_ids).sequences
    river = river_of(model, nbits=4, group_size=GROUP, quantize_lm_head=True, lm_head_nbits=4,
                     activations="int8", backend="matmulnbits_cpu")
    backends = {m.backend for m in river.modules() if isinstance(m, RiverQuantLinear)}
    assert backends == {"matmulnbits_cpu"}
    assert_full_quantization_is_exact(river, prompt_ids, plain)
    river_hf.remove_river(river)
    assert torch.equal(generate(model, prompt_ids).sequences, plain)


def test_bench_records_name_the_openmp_settings_and_onnxruntime(monkeypatch):
    """How torch's threads wait (read at process start) changes this kernel's speed: a record must say."""
    from river_hf.bench.run import environment
    monkeypatch.setenv("GOMP_SPINCOUNT", "10000")
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    env = environment()
    assert env["openmp"].get("GOMP_SPINCOUNT") == "10000" and "OMP_WAIT_POLICY" not in env["openmp"]
    assert env["onnxruntime"]


@pytest.mark.parametrize("variable", [None, "GOMP_SPINCOUNT", "OMP_WAIT_POLICY"])
def test_a_build_on_it_says_how_to_stop_openmp_spinning_unless_set(monkeypatch, variable):
    for name in ort_kernel.OPENMP_WAIT_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    if variable is not None:
        monkeypatch.setenv(variable, "10000" if variable == "GOMP_SPINCOUNT" else "PASSIVE")
    monkeypatch.setattr(ort_kernel, "torch_threads", lambda: 2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        river_of(tiny_model("llama"), nbits=4, group_size=GROUP, quantize_lm_head=False, activations="int8",
                 backend="matmulnbits_cpu")
        river_of(tiny_model("llama"), nbits=4, group_size=GROUP, quantize_lm_head=False)  # int4pack: never
    spinning = [w for w in caught if "GOMP_SPINCOUNT=10000" in str(w.message)]
    assert len(spinning) == (1 if variable is None else 0)


def test_a_saved_river_with_matmulnbits_twins_loads_without_hqq_and_generates_the_same(tmp_path):
    from test_saved_river import assert_same_river, saved_river, without_hqq
    from transformers import AutoModelForCausalLM

    model, folder = saved_river(tmp_path, backend="matmulnbits_cpu", activations="int8")
    assert {m.backend for m in model.modules() if isinstance(m, RiverQuantLinear)} == {"matmulnbits_cpu"}
    loaded = without_hqq(AutoModelForCausalLM.from_pretrained, folder)
    assert {m.backend for m in loaded.modules() if isinstance(m, RiverQuantLinear)} == {"matmulnbits_cpu"}
    assert_same_river(loaded, model)
