"""Twin linears that read one input run as one GEMV on the CPU kernels (river_hf.kernels.shared_inputs: stacked
siblings): attention's q/k/v and the MLP's gate/up.

Invariants: a member computes its own rows bit for bit whatever the call order or input (the stack is a speed-up,
never a change of output); its buffers are views of the stack's (nothing stored twice, deep copies included); a river
generates the same tokens and logits stacked or not, eagerly and captured, where a captured step holds one matmul
per stack; stacking declines where the members cannot share a kernel, or, with `backend="fastest"`, where the
stacked shape did not time faster.
"""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from torch import nn

import river_hf
from river_hf import RiverQuantConfig
from river_hf.kernels import choice as kernel_choice
from river_hf.kernels.quantize import RiverQuantLinear
from river_hf.kernels.shared_inputs import StackedSiblings, stack_siblings, unstack

from conftest import generate, river_of, tiny_model
from test_static_cache import GraphCounter, cpu_compile, fresh_dynamo  # noqa: F401 (fresh_dynamo: a fixture)

NAMES = ("q_proj", "k_proj", "v_proj")
SIZES = (128, 64, 64)


def attention(nbits=8, group_size=None, backend="int8pack_cpu", bias=False, backends=None) -> nn.Module:
    """A module holding three twin linears named like HF attention's projections, reading 128 features."""
    torch.manual_seed(0)
    module = nn.Module()
    for name, size, kernel in zip(NAMES, SIZES, backends or [backend] * 3):
        linear = RiverQuantLinear.from_linear(nn.Linear(128, size, bias=bias), nbits=nbits, group_size=group_size,
                                              backend=kernel)
        setattr(module, name, linear)
    return module


@pytest.mark.parametrize("nbits, group_size, backend, bias", [(8, None, "int8pack_cpu", False),
                                                              (8, None, "int8pack_fp32_cpu", True),
                                                              (4, 64, "int4pack_cpu", True), (4, 32, "dense", False)])
def test_members_compute_their_own_rows_bit_for_bit_in_any_order(nbits, group_size, backend, bias):
    stacked, alone = attention(nbits, group_size, backend, bias), attention(nbits, group_size, backend, bias)
    assert stack_siblings(stacked, RiverQuantConfig(backend="auto")) == 1
    members = [getattr(stacked, name) for name in NAMES]
    assert all(isinstance(member.siblings, StackedSiblings) for member in members)
    x, other = torch.randn(2, 5, 128, dtype=torch.bfloat16), torch.randn(2, 5, 128, dtype=torch.bfloat16)
    for order in (NAMES, ("v_proj", "q_proj", "k_proj"), ("k_proj", "k_proj", "q_proj", "v_proj")):
        for name in order:
            assert torch.equal(getattr(stacked, name)(x), getattr(alone, name)(x)), (order, name)
    assert torch.equal(stacked.k_proj(other), alone.k_proj(other)) and torch.equal(stacked.q_proj(x), alone.q_proj(x))
    x.add_(1.0)  # written in place since: the parts kept for it are stale, so they are not used
    assert torch.equal(stacked.v_proj(x), alone.v_proj(x))
    assert all(torch.equal(member.compute(x), getattr(alone, name)(x)) for name, member in zip(NAMES, members))
    assert all(torch.equal(member.codes(), getattr(alone, name).codes()) for name, member in zip(NAMES, members))


def test_threads_calling_the_members_at_once_get_their_own_rows():
    stacked, alone = attention(4, 64, "int4pack_cpu"), attention(4, 64, "int4pack_cpu")
    stack_siblings(stacked, RiverQuantConfig(backend="auto"))
    inputs = [torch.randn(1, 1, 128, dtype=torch.bfloat16) for _ in range(4)]
    expected = [[getattr(alone, name)(x) for name in NAMES] for x in inputs]
    results = {}

    def decode(index):
        results[index] = [[getattr(stacked, name)(inputs[index]) for name in NAMES] for _ in range(100)]

    threads = [threading.Thread(target=decode, args=(index,)) for index in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(results) == [0, 1, 2, 3]
    for index, runs in results.items():
        assert all(torch.equal(got, want) for run in runs for got, want in zip(run, expected[index]))


def test_members_are_views_of_the_stack_and_a_deep_copy_keeps_them_so():
    module = attention()
    stack_siblings(module, RiverQuantConfig(backend="auto"))
    for copied in (module, copy.deepcopy(module)):
        stack = copied.q_proj.siblings.stacked
        assert all(getattr(copied, name).siblings is copied.q_proj.siblings for name in NAMES)
        assert all(getattr(copied, name).qweight.untyped_storage().data_ptr() == stack.qweight.untyped_storage()
                   .data_ptr() for name in NAMES)
    assert copy.deepcopy(module).q_proj.siblings is not module.q_proj.siblings


def test_a_member_moved_or_cast_onto_new_buffers_runs_alone():
    stacked, alone = attention(4, 32, "dense"), attention(4, 32, "dense")
    stack_siblings(stacked, RiverQuantConfig(backend="auto"))
    stacked.to("cpu")  # nothing changes: still stacked
    assert all(getattr(stacked, name).siblings is not None for name in NAMES)
    stacked.float()  # the dense bf16 weights become new float32 tensors; the stack keeps the old ones
    x = torch.randn(1, 3, 128, dtype=torch.bfloat16)
    assert all(getattr(stacked, name).siblings is None for name in NAMES)
    assert all(torch.equal(getattr(stacked, name)(x), getattr(alone, name)(x)) for name in NAMES)


@pytest.mark.parametrize("case", ["different kernels, not timed", "a bias on some members", "the hqq kernel"])
def test_stacking_declines_where_members_cannot_share_a_kernel(case):
    module = {"different kernels, not timed": lambda: attention(backends=["int8pack_cpu", "dense", "dense"]),
              "the hqq kernel": lambda: attention(4, 64, "hqq"),
              "a bias on some members": lambda: attention()}[case]()
    if case == "a bias on some members":
        module.k_proj.bias = torch.zeros(64)
    assert stack_siblings(module, RiverQuantConfig(backend="auto")) == 0
    assert all(getattr(module, name).siblings is None for name in NAMES)


@pytest.mark.parametrize("stacked_us, stacks", [(150.0, True), (290.0, False)])
def test_fastest_stacks_where_the_stacked_shape_timed_faster(monkeypatch, stacked_us, stacks):
    """q on int8pack (100 µs), k and v on dense (50 µs each): one int8pack call for all three rows pays when it
    beats their 200 µs by the tie margin; k and v then move onto int8pack, with the same codes."""
    module = attention(backends=["int8pack_cpu", "dense", "dense"])
    codes = module.k_proj.codes()

    def timed(nbits, group_size, out_features, in_features, device, activations):
        microseconds = ({"int8pack_cpu": stacked_us, "dense": 400.0} if out_features == sum(SIZES) else
                        {"int8pack_cpu": 100.0, "dense": 50.0 if out_features == 64 else 300.0})
        backend = min(microseconds, key=microseconds.get)
        return kernel_choice.KernelChoice(out_features, in_features, nbits, group_size, "cpu", backend, microseconds,
                                          {backend: 1.0})

    monkeypatch.setattr("river_hf.kernels.shared_inputs.fastest_backend", timed)
    assert stack_siblings(module, RiverQuantConfig(backend="fastest")) == int(stacks)
    assert (module.k_proj.backend == "int8pack_cpu") is stacks and torch.equal(module.k_proj.codes(), codes)


def test_members_on_one_kernel_stack_without_a_timing(monkeypatch):
    monkeypatch.setattr("river_hf.kernels.shared_inputs.fastest_backend", lambda *a: pytest.fail("timed"))
    module = attention(4, 64, "int4pack_cpu")
    assert stack_siblings(module, RiverQuantConfig(backend="fastest")) == 1


def test_a_river_generates_the_same_stacked_or_not(prompt_ids):
    """A default CPU river stacks q/k/v and gate/up in every twin; unstacked, the same members give the same tokens,
    logits and exits, and every layer's cache holds every position."""
    model = river_of(tiny_model("llama"))
    twins = [layer.twin for layer in river_hf.river_layers(model) if layer.twin is not None]
    assert all(isinstance(twin.self_attn.q_proj.siblings, StackedSiblings) for twin in twins)
    assert all(twin.mlp.up_proj.siblings is twin.mlp.gate_proj.siblings is not None for twin in twins)
    stacked = {tau: generate(model, prompt_ids, tau=tau, output_logits=True) for tau in (-1, 0.5)}
    assert sum(unstack(twin) for twin in twins) == 5 * len(twins)
    for tau, out in stacked.items():
        alone = generate(model, prompt_ids, tau=tau, output_logits=True)
        assert torch.equal(out.sequences, alone.sequences) and torch.equal(out.cache.exit_depth, alone.cache.exit_depth)
        assert all(torch.equal(a, b) for a, b in zip(out.logits, alone.logits))
        out.cache.check_kv_integrity()


def test_a_captured_step_runs_one_matmul_per_stack(prompt_ids, fresh_dynamo):
    """Captured (static cache, dynamo), the exited step's graph calls the int4 kernel once for q/k/v and once for
    gate/up in each twin: three calls fewer per twin than unstacked, with the same tokens."""
    model = river_of(tiny_model("llama"))
    twins = [layer.twin for layer in river_hf.river_layers(model) if layer.twin is not None]

    def captured():
        counter = GraphCounter()
        out = generate(model, prompt_ids, tau=-1, exit_signal="confidence", cache_implementation="static",
                       compile_config=cpu_compile(counter.backend))
        calls = sum(1 for graph in counter.graphs for node in graph.graph.nodes
                    if "int4pack" in str(node.target))
        return out, calls

    stacked, stacked_calls = captured()
    for twin in twins:
        unstack(twin)
    torch._dynamo.reset()
    alone, alone_calls = captured()
    assert torch.equal(stacked.sequences, alone.sequences)
    assert stacked_calls and alone_calls - stacked_calls == 3 * len(twins)
    assert all(twin.self_attn.q_proj.siblings is None for twin in twins)
