"""backend='fastest': each twin linear's kernel is chosen by timing the candidates on this machine, the choice is
recorded, every candidate computes HQQ's weight, and prefill_exit='auto' follows the measured prompt-shaped timing."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
from torch import nn

import river_hf
from river_hf import RiverConfig, RiverQuantConfig
from river_hf.kernels import choice as kernel_choice, machine
from river_hf.core.generation import new_river_cache
from river_hf.core.twins import twin_linears, twins_prefill_faster
from river_hf.kernels.quantize import RiverQuantLinear

from conftest import tiny_model


@pytest.mark.parametrize("nbits, group_size", [(4, 64), (8, None), (2, 32), (8, 64)])
def test_every_candidate_computes_the_hqq_weight(nbits, group_size):
    torch.manual_seed(0)
    linear = nn.Linear(256, 128)
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    names = kernel_choice.candidates(nbits, group_size, 128, 256, torch.device("cpu"))
    assert "dense" in names and "hqq" not in names
    for name in names:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # int8 kernels warn that they ignore a group size
            twin = RiverQuantLinear.from_linear(linear, nbits=nbits, group_size=group_size, backend=name)
        expected = x.float() @ twin.dequantized_weight().t() + linear.bias.detach()
        torch.testing.assert_close(twin(x).float(), expected, atol=0.05, rtol=0.02)


def test_fastest_records_what_it_measured_and_keeps_the_preferred_kernel_on_close_calls():
    choice = kernel_choice.fastest_backend(4, 64, 128, 256, "cpu")
    assert choice is kernel_choice.fastest_backend(4, 64, 128, 256, "cpu")  # measured once per process
    assert choice in kernel_choice.measured_choices()
    assert set(choice.microseconds) == {"int4pack_cpu", "dense"}
    assert all(us > 0 for us in choice.microseconds.values())
    fastest = min(choice.microseconds, key=choice.microseconds.get)
    if choice.backend != fastest:  # only the preferred kernel may win without being the fastest, and only by a hair
        assert choice.backend == "int4pack_cpu"
        assert choice.microseconds["int4pack_cpu"] <= choice.microseconds[fastest] * kernel_choice.TIE_MARGIN
    assert {choice.backend, "dense"} <= set(choice.prefill_microseconds)
    assert "256x128 4-bit: " + choice.backend in choice.describe()


def test_a_river_built_with_fastest_runs_the_recorded_kernels():
    model = river_hf.build_river(tiny_model(),
                                 RiverQuantConfig(nbits=4, start_layer=1, group_size=32, backend="fastest"),
                                 progress=False)
    for layer in river_hf.river_layers(model)[1:]:
        for linear in twin_linears(layer.twin):
            choice = kernel_choice.lookup(linear.out_features, linear.in_features, 4, linear.backend, "cpu")
            assert choice is not None and choice.backend == linear.backend


def test_prefill_exit_auto_follows_the_measured_prompt_timing(prompt_ids):
    model = river_hf.build_river(tiny_model(),
                                 RiverQuantConfig(nbits=4, start_layer=1, group_size=32, backend="fastest"),
                                 progress=False)
    layers = river_hf.river_layers(model)
    expected = "sequence" if twins_prefill_faster(layers) else "none"
    cache = new_river_cache(model, RiverConfig(tau=-1, exit_signal="cosine").river_settings())
    assert cache.router.settings.prefill_exit == expected
    out = model.generate(prompt_ids, attention_mask=torch.ones_like(prompt_ids), max_new_tokens=3, do_sample=False,
                         tau=-1, exit_signal="cosine", return_dict_in_generate=True)
    prompt_depth = out.cache.exit_depth[:, :prompt_ids.shape[1]]
    assert (prompt_depth == (1 if expected == "sequence" else 6)).all()


def test_an_explicit_backend_keeps_the_papers_sequence_level_prompt_exit():
    model = river_hf.build_river(tiny_model(), RiverQuantConfig(start_layer=1, group_size=32, backend="auto"),
                                 progress=False)
    assert twins_prefill_faster(river_hf.river_layers(model))
    assert (new_river_cache(model, RiverConfig(tau=-1, exit_signal="cosine").river_settings())
            .router.settings.prefill_exit == "sequence")


def test_the_avx2_dispatch_builds_and_runs_a_correct_river():
    """ATEN_CPU_CAPABILITY=avx2 makes an AVX-512 machine dispatch like an AVX2-only one: every candidate kernel must
    still compute HQQ's weight there, and the choice is made and recorded under that capability."""
    script = textwrap.dedent("""
        import torch, warnings
        from torch import nn
        from river_hf.kernels import choice as kernel_choice, machine
        from river_hf.kernels.quantize import RiverQuantLinear
        assert torch.backends.cpu.get_cpu_capability() in ("AVX2", "DEFAULT"), torch.backends.cpu.get_cpu_capability()
        torch.manual_seed(0)
        linear, x = nn.Linear(256, 128), torch.randn(2, 256, dtype=torch.bfloat16)
        for nbits, group in ((4, 64), (8, None)):
            for name in kernel_choice.candidates(nbits, group, 128, 256, torch.device("cpu")) + ["fastest"]:
                twin = RiverQuantLinear.from_linear(linear, nbits=nbits, group_size=group, backend=name)
                expected = x.float() @ twin.dequantized_weight().t() + linear.bias.detach()
                torch.testing.assert_close(twin(x).float(), expected, atol=0.05, rtol=0.02)
        print("ok", machine.cpu_description()["cpu_capability"], len(kernel_choice.measured_choices()))
    """)
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split()[:2] == ["ok", "AVX2"] and int(result.stdout.split()[2]) == 2


def test_records_name_the_cpus_instruction_sets_apart_from_torchs_dispatch():
    """torch reports "AVX512" on an AMX CPU: the description lists the CPU's own flags that kernels turn on."""
    cpuinfo = ("processor\t: 0\nmodel name\t: Some CPU\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 amx_tile "
               "amx_bf16 amx_int8 avx512_vnni\n")
    assert machine.cpu_features(cpuinfo) == ["avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile",
                                                   "amx_bf16", "amx_int8"]
    assert machine.cpu_features("flags\t: fpu sse2 avx2 fma\n") == ["avx2"]
    assert machine.cpu_features("no flags line here\n") == []
    described = machine.cpu_description()
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as file:
            flags = next(line for line in file if line.startswith("flags")).split()
        assert described["cpu_features"] == [f for f in machine.ISA_FEATURES if f in flags]


@pytest.fixture
def forgotten_choices():
    """Choices a test sets up (`kernel_choice.keep`) must not outlive it: this process's memo is emptied before and
    after (later builds measure again, or read the machine's store)."""
    kernel_choice.forget(machine=False)
    yield
    kernel_choice.forget(machine=False)


def test_a_river_built_with_an_explicit_backend_ignores_other_rivers_prompt_timings(forgotten_choices):
    """This process measured (for a 'fastest' river) that the twins run prompts slower at these shapes, as bf16 GEMMs
    on AMX do: a river built with backend="auto" measured nothing, so its prompts still exit (the paper's default),
    whatever ran before it. Where 'fastest' built the river, that measurement decides."""
    auto = river_hf.build_river(tiny_model(), RiverQuantConfig(nbits=4, start_layer=1, group_size=32, backend="auto"),
                                progress=False)
    for layer in river_hf.river_layers(auto)[1:]:
        for linear in twin_linears(layer.twin):
            kernel_choice.keep(kernel_choice.KernelChoice(
                linear.out_features, linear.in_features, 4, 32, "cpu", linear.backend,
                {linear.backend: 1.0, "dense": 2.0}, {linear.backend: 9.0, "dense": 1.0}))
    assert twins_prefill_faster(river_hf.river_layers(auto))
    assert new_river_cache(auto, RiverConfig(tau=-1).river_settings()).router.settings.prefill_exit == "sequence"
    fastest = river_hf.build_river(tiny_model(), RiverQuantConfig(nbits=4, start_layer=1, group_size=32,
                                                                  backend="fastest"), progress=False)
    assert not twins_prefill_faster(river_hf.river_layers(fastest))  # the injected timings, read by 'fastest'
    assert new_river_cache(fastest, RiverConfig(tau=-1).river_settings()).router.settings.prefill_exit == "none"


def failing_kernel(requires):
    from river_hf.kernels.registry import KERNELS

    def matmul(buffers, group, x):
        raise RuntimeError("no such instruction here")

    return KERNELS["dense"]._replace(device_type="cpu", matmul=matmul, requires=requires)


def test_an_optional_kernel_that_fails_is_left_out_of_the_choice(monkeypatch):
    """A kernel from an optional package (gemlite, ONNX Runtime) that fails at its first call is dropped from the
    timing with a warning naming it, and the build goes on with the others; a built-in kernel's failure is a bug:
    it raises."""
    from river_hf.kernels.registry import KERNELS

    monkeypatch.setitem(KERNELS, "broken_optional", failing_kernel(("somepkg", "extra")))
    monkeypatch.setenv("RIVER_HF_CACHE", "off")
    kernel_choice.forget(machine=False)
    with pytest.warns(UserWarning, match=r"'broken_optional' kernel failed on a 128x256 4-bit layer \(RuntimeError: "
                                         r"no such instruction here\); it is left out"):
        made = kernel_choice.fastest_backend(4, 64, 128, 256, torch.device("cpu"))
    assert "broken_optional" not in made.microseconds and made.backend in ("int4pack_cpu", "dense")
    kernel_choice.forget(machine=False)
    monkeypatch.setitem(KERNELS, "broken_optional", failing_kernel(None))
    with pytest.raises(RuntimeError, match="no such instruction"):
        kernel_choice.fastest_backend(4, 64, 128, 256, torch.device("cpu"))
    kernel_choice.forget(machine=False)
