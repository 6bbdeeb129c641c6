"""Measurement helpers: teacher-forced fidelity and interleaved timing, on a tiny model."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import GenerationConfig

from river_hf import RiverConfig
from river_hf.bench.fidelity import backbone_references, compare, measure_fidelity, teacher_forced_logits
from river_hf.bench.speed import interleaved, median_rate
from river_hf import RiverSettings

from conftest import plain_copy_with_twins, river_of, tiny_model


@pytest.fixture(scope="module")
def river_model():
    return river_of(tiny_model(), start_layer=1)


@pytest.fixture(scope="module")
def references(river_model):
    torch.manual_seed(3)
    return backbone_references(river_model, [torch.randint(3, 256, (1, 6)) for _ in range(2)], max_new_tokens=10)


def test_tau_above_one_is_perfectly_faithful(river_model, references):
    fidelity = measure_fidelity(river_model, references, RiverSettings(tau=1.5))
    assert fidelity.match == 1.0 and fidelity.kl == pytest.approx(0.0, abs=1e-6)
    assert fidelity.mean_exit_depth == 6 and fidelity.positions == 20


def test_full_quantization_fidelity_is_measured_against_the_twin_model(river_model, references):
    fidelity = measure_fidelity(river_model, references, RiverSettings(tau=-1, exit_signal="cosine"))
    assert fidelity.mean_exit_depth == 1
    full_quant = plain_copy_with_twins(river_model)
    pooled = [compare(ref.logits, teacher_forced_logits(full_quant, ref.prompt_ids, ref.continuation, None)[0])
              for ref in references]
    assert fidelity.match == pytest.approx(sum(m for m, _ in pooled) / 2)
    assert fidelity.kl == pytest.approx(sum(k for _, k in pooled) / 2, rel=1e-4)
    assert fidelity.kl > 0


def test_compare_counts_argmax_agreement_and_kl():
    reference = torch.tensor([[2.0, 0.0], [0.0, 2.0]])
    system = torch.tensor([[2.0, 0.0], [2.0, 0.0]])
    match, kl = compare(reference, system)
    p = torch.softmax(torch.tensor([0.0, 2.0]), -1)
    expected_kl = (p * (p.log() - p.flip(0).log())).sum().item() / 2
    assert match == 0.5 and kl == pytest.approx(expected_kl)


def test_interleaved_timing_runs_every_system_on_every_prompt(river_model):
    prompts = [{"input_ids": torch.randint(3, 256, (1, 5))} for _ in range(2)]
    fixed = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False)
    systems = {"backbone": GenerationConfig(**fixed), "river": RiverConfig(tau=-1, exit_signal="cosine", **fixed)}
    timings = interleaved(river_model, systems, prompts, rounds=2)
    assert {name: len(runs) for name, runs in timings.items()} == {"backbone": 4, "river": 4}
    assert all(t.new_tokens == 4 and t.decode_tokens_per_s > 0 for runs in timings.values() for t in runs)
    assert all(t.mean_exit_depth == 1 for t in timings["river"])
    assert all(math.isnan(t.mean_exit_depth) for t in timings["backbone"])
    assert median_rate(timings["river"]) > 0


# ---- --compiled on a model: the compiled backbone and the captured rivers -----------------------------------------
@pytest.fixture
def defaults_exit(monkeypatch):
    """The defaults system exits (confidence 0.3) whatever the tiny model's measured exit gain: tau 'auto' pinned."""
    import dataclasses

    from river_hf.bench import systems

    monkeypatch.setattr(systems, "resolve_auto_tau", lambda model, settings: dataclasses.replace(settings, tau=0.3))


def test_a_compiled_sweep_adds_the_compiled_backbone_and_captured_rivers(river_model, defaults_exit):
    from river_hf.bench.systems import CAPTURED, COMPILED_BACKBONE, FULL_QUANT, Sweep

    inputs = {"input_ids": torch.tensor([[5, 9, 33]]), "attention_mask": torch.ones(1, 3, dtype=torch.long)}
    by_name = {s.name: s for s in Sweep(taus=[1.5], exit_rates=[0.5], compiled=True).systems(river_model, inputs, 4)}
    defaults = next(name for name, s in by_name.items() if s.kind == "defaults" and not name.endswith(CAPTURED))
    captured = {COMPILED_BACKBONE, FULL_QUANT + CAPTURED, defaults + CAPTURED}
    assert captured <= set(by_name)
    assert not [name for name in by_name if name.endswith(CAPTURED) and name not in captured]  # random stays eager
    config = by_name[defaults + CAPTURED].config
    assert (config.tau, config.exit_signal, config.cache_implementation) == (0.3, "confidence", "static")
    assert config.compile_config._compile_all_devices  # a CPU compiles only when told
    for compiled in (False, None):  # None: on CUDA only
        names = [s.name for s in Sweep(taus=[1.5], exit_rates=[0.5], compiled=compiled).systems(river_model, inputs, 4)]
        assert COMPILED_BACKBONE not in names and not [name for name in names if name.endswith(CAPTURED)]


def test_bench_compiled_times_the_captured_defaults_against_the_compiled_backbone(tmp_path, defaults_exit,
                                                                                monkeypatch):
    import json

    from transformers import CompileConfig

    from river_hf.bench import systems
    from river_hf.cli import main
    from conftest import save_tiny_model

    traced = CompileConfig(backend="eager", mode=None)  # dynamo's graphs, run as traced: no minutes of inductor
    traced._compile_all_devices = True
    monkeypatch.setattr(systems, "compile_config_for", lambda device: traced)
    data = tmp_path / "q.jsonl"
    data.write_text('{"question": "what is two plus three?"}\n')
    output = tmp_path / "run.json"
    assert main(["bench", "--model", save_tiny_model(tmp_path / "tiny"), "--data", str(data), "--compiled",
                 "--taus", "1.5", "--exit-rates", "0.5", "--prompts", "1", "--rounds", "1", "--max-new-tokens", "4",
                 "--fidelity-prompts", "1", "--fidelity-tokens", "4", "--backend", "auto", "--no-plots",
                 "--output", str(output)]) == 0
    records = {s["name"]: s for s in json.loads(output.read_text())["systems"]}
    captured = next(s for name, s in records.items() if s["kind"] == "defaults" and name.endswith(systems.CAPTURED))
    assert captured["summary"]["ratio_vs_compiled_backbone"] > 0
    assert captured["fidelity"]["match"] is not None  # its settings' teacher-forced match, as the eager defaults'
    assert records[systems.COMPILED_BACKBONE]["summary"]["ratio_vs_compiled_backbone"] == pytest.approx(1.0)


def test_interleaved_warms_up_at_the_longest_prompt_so_no_timed_run_compiles():
    """A compiled static-cache system compiles again when a longer prompt grows the cache: the warm-up runs the
    longest prompt, so the timed runs (a short prompt first) find every graph made."""
    from test_static_cache import GraphCounter, cpu_compile

    torch._dynamo.reset()
    model = river_of(tiny_model(), start_layer=1)
    counter = GraphCounter()
    prompts = [{"input_ids": torch.randint(3, 256, (1, n))} for n in (4, 12)]
    fixed = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False, cache_implementation="static",
                 compile_config=cpu_compile(counter.backend))
    systems = {"backbone": GenerationConfig(**fixed), "river": RiverConfig(tau=-1, exit_signal="confidence", **fixed)}
    warmed = {}

    def after_each_run(_):
        warmed.setdefault("graphs", counter.frame_count)

    interleaved(model, systems, prompts, rounds=1, progress=after_each_run)
    torch._dynamo.reset()
    assert counter.frame_count == warmed["graphs"] > 0  # nothing compiled after the first timed run
