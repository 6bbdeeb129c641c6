"""Kernels that dynamo cannot trace (fbgemm's packed weight for `w8a8_cpu`, ONNX Runtime's session for
`matmulnbits_cpu`, a shared-input group) reach a captured step through one custom op (river_hf.kernels.opaque_calls):
no graph break, the eager result, a copy or a re-packed module calls its own kernel, and a freed module frees it."""

from __future__ import annotations

import copy
import gc

import pytest
import torch
from torch import nn

from river_hf.kernels import matmulnbits as ort_kernel
from river_hf.kernels.opaque_calls import OPAQUE_CALLS
from river_hf.kernels.quantize import RiverQuantLinear
from river_hf.kernels.registry import runs

from conftest import generate, river_of, tiny_model
from test_static_cache import GraphCounter, cpu_compile, fresh_dynamo, same_run  # noqa: F401 (a fixture)

IN, OUT = 256, 96
W8A8 = pytest.param(dict(nbits=8, group_size=None, backend="w8a8_cpu"), id="w8a8_cpu", marks=pytest.mark.skipif(
    not runs("w8a8_cpu", 8, torch.device("cpu")), reason="no fbgemm/x86 quantized engine in this torch"))
MATMULNBITS = pytest.param(dict(nbits=4, group_size=32, backend="matmulnbits_cpu"), id="matmulnbits_cpu",
                           marks=pytest.mark.skipif(not ort_kernel.available(), reason="onnxruntime not installed"))
pytestmark = pytest.mark.usefixtures("one_thread")


def twin(kernel: dict, seed: int = 0) -> RiverQuantLinear:
    torch.manual_seed(seed)
    return RiverQuantLinear.from_linear(nn.Linear(IN, OUT), activations="int8", **kernel)


def opaque_call(module: RiverQuantLinear):
    inputs = module.kernel_inputs
    return inputs["linear"] if isinstance(inputs, dict) else inputs


@pytest.mark.parametrize("kernel", [W8A8, MATMULNBITS])
def test_a_compiled_call_is_one_graph_and_computes_the_eager_result(kernel, fresh_dynamo):
    quantized = twin(kernel)
    decode, prompt = torch.randn(1, IN), torch.randn(5, IN)
    explanation = torch._dynamo.explain(quantized)(decode)
    assert (explanation.graph_count, explanation.graph_break_count) == (1, 0)
    compiled = torch.compile(quantized, backend="eager", fullgraph=True)
    for x in (decode, prompt):
        assert torch.equal(compiled(x), quantized(x))
    other = twin(kernel, seed=3)
    quantized.load_state_dict(other.state_dict())  # packed again: a new handle, which the graph's guard sees
    assert torch.equal(compiled(decode), other(decode))


@pytest.mark.parametrize("kernel", [W8A8, MATMULNBITS])
def test_a_copy_calls_its_own_kernel_and_a_freed_module_frees_it(kernel, fresh_dynamo):
    quantized = twin(kernel)
    clone = copy.deepcopy(quantized)
    assert opaque_call(clone).handle != opaque_call(quantized).handle
    x = torch.randn(1, IN)
    expected = quantized(x)
    compiled = torch.compile(clone, backend="eager", fullgraph=True)
    handle = opaque_call(quantized).handle
    del quantized
    gc.collect()
    assert handle not in OPAQUE_CALLS
    assert torch.equal(compiled(x), expected)  # the copy's own kernel, alive without the original


@pytest.mark.parametrize("kernel", [W8A8, MATMULNBITS])
def test_a_captured_river_on_these_kernels_is_one_graph_per_depth(kernel, prompt_ids, fresh_dynamo):
    """Exited steps run every twin (and, for w8a8, the head) on the kernel; a break would add frames. For
    matmulnbits the q/k/v and gate/up twins are shared-input groups, each member its own call."""
    model = tiny_model("llama")
    backbone = GraphCounter()
    generate(model, prompt_ids, cache_implementation="static", compile_config=cpu_compile(backbone.backend))
    torch._dynamo.reset()
    river_of(model, activations="int8", quantize_lm_head=kernel["backend"] == "w8a8_cpu", **kernel)
    counter = GraphCounter()
    for tau in (1.5, -1):
        out = generate(model, prompt_ids, tau=tau, exit_signal="confidence", cache_implementation="static",
                       compile_config=cpu_compile(counter.backend))
        same_run(out, generate(model, prompt_ids, tau=tau, exit_signal="confidence"))
    assert counter.frame_count == backbone.frame_count + 1
