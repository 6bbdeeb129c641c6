"""Twin linears sharing an input run as one `matmulnbits_cpu` call (river_hf.kernels.shared_inputs): which are grouped,
that every member computes exactly what it computed alone in any call order or input, one run per group and step,
threads, copies, when `backend="fastest"` fuses, and the river invariants with groups."""

from __future__ import annotations

import copy
import threading

import pytest
import torch

from river_hf import RiverQuantConfig, remove_river
from river_hf.kernels import choice as kernel_choice, matmulnbits as ort_kernel
from river_hf.core.twins import river_layers
from river_hf.kernels.quantize import RiverQuantLinear
from river_hf.kernels.shared_inputs import GroupMember, fuse_shared_inputs, unfuse

from conftest import assert_full_quantization_is_exact, generate, river_of, tiny_model

pytestmark = pytest.mark.skipif(not ort_kernel.available(), reason="onnxruntime / onnx not installed")
MATMULNBITS = dict(nbits=4, group_size=32, activations="int8", quantize_lm_head=False)


def grouped_river(backend="matmulnbits_cpu", **quant):
    return river_of(tiny_model("llama"), backend=backend, **{**MATMULNBITS, **quant})


def twins(model):
    return [layer.twin for layer in river_layers(model) if layer.twin is not None]


def outputs(modules, x):
    return [module(x) for module in modules]


def test_q_k_v_and_gate_up_are_grouped_the_others_run_alone():
    for twin in twins(grouped_river()):
        attention, mlp = twin.self_attn, twin.mlp
        q, k, v = (attention.q_proj.kernel_inputs, attention.k_proj.kernel_inputs, attention.v_proj.kernel_inputs)
        assert all(isinstance(member, GroupMember) for member in (q, k, v))
        assert q.group is k.group is v.group and [q.index, k.index, v.index] == [0, 1, 2]
        gate, up = mlp.gate_proj.kernel_inputs, mlp.up_proj.kernel_inputs
        assert gate.group is up.group and gate.group is not q.group
        assert not isinstance(attention.o_proj.kernel_inputs, GroupMember)
        assert not isinstance(mlp.down_proj.kernel_inputs, GroupMember)


@pytest.mark.parametrize("rows", [1, 5])
def test_members_compute_what_they_computed_alone_in_any_order(rows):
    twin = twins(grouped_river())[0]
    attention = twin.self_attn
    projections = [attention.q_proj, attention.k_proj, attention.v_proj]
    torch.manual_seed(0)
    x = torch.randn(1, rows, attention.q_proj.in_features, dtype=torch.bfloat16)
    in_order = outputs(projections, x)
    reversed_order = outputs(projections[::-1], x)[::-1]
    twice = outputs(projections + projections, x)
    unfuse(twin)
    alone = outputs(projections, x)
    for result in (in_order, reversed_order, twice[:3], twice[3:]):
        assert all(torch.equal(got, expected) for got, expected in zip(result, alone))


def test_an_input_written_between_calls_is_not_served_stale_parts():
    twin = twins(grouped_river())[0]
    attention = twin.self_attn
    x = torch.randn(1, 1, attention.q_proj.in_features)
    attention.q_proj(x)
    x.mul_(-2.0)  # same storage, new values: k must see them
    other = torch.randn_like(x)
    k_after_write, v_on_other = attention.k_proj(x), attention.v_proj(other)
    unfuse(twin)
    assert torch.equal(k_after_write, attention.k_proj(x))
    assert torch.equal(v_on_other, attention.v_proj(other))


def test_one_run_per_group_when_members_share_the_input():
    twin = twins(grouped_river())[0]
    attention = twin.self_attn
    group = attention.q_proj.kernel_inputs.group
    runs = []
    session = group.session
    group.session = lambda x: runs.append(x.shape) or session(x)
    x = torch.randn(1, 1, attention.q_proj.in_features)
    outputs([attention.q_proj, attention.k_proj, attention.v_proj], x)
    assert len(runs) == 1
    outputs([attention.q_proj, attention.k_proj, attention.v_proj], torch.randn_like(x))
    assert len(runs) == 2
    for projection in (attention.q_proj, attention.k_proj, attention.v_proj):
        projection(torch.randn_like(x))  # each on its own input: each runs the group
    assert len(runs) == 5


def test_threads_decoding_at_once_get_their_own_parts():
    twin = twins(grouped_river())[0]
    attention = twin.self_attn
    projections = [attention.q_proj, attention.k_proj, attention.v_proj]
    inputs = [torch.randn(1, 1, attention.q_proj.in_features) for _ in range(4)]
    expected = [outputs(projections, x) for x in inputs]
    results = {}

    def decode(index):
        results[index] = [outputs(projections, inputs[index]) for _ in range(100)]

    threads = [threading.Thread(target=decode, args=(index,)) for index in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for index, runs in results.items():
        assert all(torch.equal(got, want) for run in runs for got, want in zip(run, expected[index]))


def test_deep_copies_keep_one_group_per_copy_and_compute_the_same():
    twin = twins(grouped_river())[0]
    x = torch.randn(1, 3, twin.mlp.gate_proj.in_features)
    expected = outputs([twin.mlp.gate_proj, twin.mlp.up_proj], x)
    for clone in (copy.deepcopy(twin), copy.deepcopy(twin)):
        gate, up = clone.mlp.gate_proj.kernel_inputs, clone.mlp.up_proj.kernel_inputs
        assert gate.group is up.group and gate.group is not twin.mlp.gate_proj.kernel_inputs.group
        assert all(torch.equal(got, want) for got, want in zip(outputs([clone.mlp.gate_proj, clone.mlp.up_proj], x),
                                                               expected))


def test_a_moved_member_gets_its_own_session_and_stays_exact():
    twin = twins(grouped_river())[0]
    x = torch.randn(1, 1, twin.mlp.gate_proj.in_features)
    expected = twin.mlp.up_proj(x)
    twin.mlp.up_proj.to(torch.float32)  # _apply: prepacked again, alone
    assert not isinstance(twin.mlp.up_proj.kernel_inputs, GroupMember)
    assert torch.equal(twin.mlp.up_proj(x), expected)


def test_river_invariants_with_grouped_twins(prompt_ids):
    model = tiny_model("llama")
    plain = generate(model, prompt_ids).sequences
    river = river_of(model, **{**MATMULNBITS, "quantize_lm_head": True, "lm_head_nbits": 4},
                     backend="matmulnbits_cpu")
    assert all(isinstance(twin.self_attn.q_proj.kernel_inputs, GroupMember) for twin in twins(river))
    assert_full_quantization_is_exact(river, prompt_ids, plain)
    remove_river(river)
    assert torch.equal(generate(model, prompt_ids).sequences, plain)


def test_not_grouped_without_int8_activations_or_with_backend_auto():
    assert fuse_shared_inputs(twins(grouped_river())[0], RiverQuantConfig(nbits=4, group_size=32)) == 0
    auto = grouped_river(backend="auto")
    assert not any(isinstance(m.kernel_inputs, GroupMember) for m in auto.modules() if isinstance(m, RiverQuantLinear))


def _choice(out_features, in_features, microseconds):
    backend = min(microseconds, key=microseconds.get)
    return kernel_choice.KernelChoice(out_features, in_features, 4, 32, "cpu", backend, microseconds,
                                      {backend: 1.0, "dense": 2.0})


@pytest.mark.parametrize("stacked_us, fused", [(100.0, True), (290.0, False)])
def test_fastest_groups_where_the_stacked_shape_timed_faster(monkeypatch, stacked_us, fused):
    """Members on int4pack (each timed 100 µs) are repacked onto matmulnbits only when the stacked call beats 300 µs
    by the tie margin; the repacked members compute with the same codes."""
    model = grouped_river(backend="auto")  # int4pack twins, not grouped
    twin = twins(model)[0]
    attention = twin.self_attn
    widths = {attention.q_proj.out_features, attention.k_proj.out_features}
    total = attention.q_proj.out_features + 2 * attention.k_proj.out_features
    codes = attention.k_proj.codes()

    def timed(nbits, group_size, out_features, in_features, device, activations):
        if out_features == total:
            return _choice(out_features, in_features, {"int4pack_cpu": 400.0, "matmulnbits_cpu": stacked_us})
        assert out_features in widths | {twin.mlp.gate_proj.out_features * 2, twin.mlp.gate_proj.out_features}
        return _choice(out_features, in_features, {"int4pack_cpu": 100.0, "matmulnbits_cpu": 150.0})

    monkeypatch.setattr("river_hf.kernels.shared_inputs.fastest_backend", timed)
    groups = fuse_shared_inputs(twin, RiverQuantConfig(backend="fastest", **MATMULNBITS))
    assert isinstance(attention.q_proj.kernel_inputs, GroupMember) is fused
    if fused:
        assert attention.k_proj.backend == "matmulnbits_cpu" and torch.equal(attention.k_proj.codes(), codes)
        assert groups >= 1
    else:
        assert attention.k_proj.backend == "int4pack_cpu"
