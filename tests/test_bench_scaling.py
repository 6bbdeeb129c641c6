"""`river-hf bench --random-model` (river_hf.bench.shapes, scaling) and `river-hf plot --scaling`, on the tiny shape."""

import contextlib
import io
import json
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from river_hf.bench.shapes import SHAPES, random_model, random_prompts, shape_config
from river_hf.cli import main

SYSTEMS = ["backbone", "full-quant 4-bit+head (river)", "static 4-bit", "static 4-bit+head", "static 8-bit",
           "static 8-bit+head", "random p=0.5", "random p=0.9"]


@pytest.mark.parametrize("name, parameters", [("smollm2-135m", 134_515_008), ("llama-3.2-1b", 1_235_814_400),
                                              ("llama-3.2-3b", 3_212_749_824), ("llama-3.1-8b", 8_030_261_248)])
def test_shapes_have_the_public_checkpoints_parameter_counts(name, parameters):
    with torch.device("meta"):  # no memory, no init
        model = AutoModelForCausalLM.from_config(shape_config(name))
    assert model.num_parameters() == parameters and model.config.tie_word_embeddings == (name != "llama-3.1-8b")


def test_random_model_is_bf16_seeded_and_prompts_are_fixed_length():
    first, second = random_model("tiny-test"), random_model("tiny-test")
    assert first.dtype == torch.bfloat16 and first.config.hidden_size == SHAPES["tiny-test"]["hidden_size"]
    assert torch.equal(first.model.embed_tokens.weight, second.model.embed_tokens.weight)
    assert random_model("tiny-test", dtype=torch.float32).dtype == torch.float32
    prompts = random_prompts(256, 2, length=8)
    assert [p["input_ids"].shape for p in prompts] == [torch.Size([1, 8])] * 2
    assert int(prompts[0]["input_ids"].max()) < 256


def test_unknown_shape_names_the_field():
    with pytest.raises(ValueError, match="`random_model`='nope'"):
        shape_config("nope")


def run_cli(args):
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        code = main(args)
    return code, stdout.getvalue()


@pytest.fixture(scope="module")
def scaling_run(tmp_path_factory):
    output = tmp_path_factory.mktemp("scaling") / "tiny.json"
    code, stdout = run_cli(["bench", "--random-model", "tiny-test", "--quick", "--prompts", "1", "--rounds", "1",
                            "--max-new-tokens", "4", "--prompt-length", "8", "--start-layer", "1",
                            "--backend", "auto", "--output", str(output)])  # packed kernels: fewer bytes by design
    assert code == 0
    return json.loads(output.read_text()), stdout, output


def test_random_model_record_has_speed_memory_bytes_and_no_fidelity(scaling_run):
    record, _, _ = scaling_run
    assert record["fidelity"] == "not measured: random weights"
    assert [system["name"] for system in record["systems"]] == SYSTEMS
    assert record["random_model"]["parameters"] == random_model("tiny-test").num_parameters()
    assert set(record["random_model"]["peak_rss_after_bytes"]) == {"backbone", "8-bit twins", "4-bit twins + head"}
    assert record["memory"]["process_peak_rss_bytes"] > 0
    by_name = {system["name"]: system for system in record["systems"]}
    for system in record["systems"]:
        assert system["fidelity"]["match"] is None and not system["fidelity"]["measured"]
        sm = system["summary"]
        assert sm["weight_bytes_per_token"] > 0
        assert sm["share_of_byte_limit"] == pytest.approx(sm["speed_ratio"] / sm["byte_ratio"])
    bytes_of = {name: by_name[name]["summary"]["weight_bytes_per_token"] for name in SYSTEMS}
    assert bytes_of["static 4-bit+head"] < bytes_of["static 4-bit"] < bytes_of["static 8-bit"] < bytes_of["backbone"]
    assert bytes_of["full-quant 4-bit+head (river)"] == bytes_of["static 4-bit+head"]  # every token exits at 1
    assert by_name["backbone"]["summary"]["byte_ratio"] == 1.0
    assert record["twins"]["nbits"] == 4 and record["twins"]["quantize_lm_head"]
    assert record["random_model"]["twin_builds"]["8-bit"]["nbits"] == 8
    assert record["random_model"]["hqq_optimizer"] is False  # plain rounding: speed and bytes only


def test_every_record_names_the_machine(scaling_run):
    record, stdout, _ = scaling_run
    env = record["environment"]
    assert env["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert {"cpu_model", "torch_threads", "cpu_count", "torch", "transformers", "hqq", "river_hf"} <= set(env)
    assert isinstance(record["kernel_choices"], list)
    header = stdout.splitlines()[0]
    assert f"{env['cpu_capability']} CPU capability, {env['torch_threads']} threads" in header
    assert "| byte limit | share of limit |" in stdout and "| n/a | n/a |" in stdout
    assert "how far from the byte limit" in stdout and "- static 8-bit: " in stdout


def test_scaling_plots(scaling_run, tmp_path):
    record, stdout, output = scaling_run
    scaling_figure = output.with_name("tiny-scaling.svg")
    assert "byte limit" in scaling_figure.read_text() and f"plot: {scaling_figure}" in stdout
    other = dict(record, environment={**record["environment"], "cpu_capability": "AVX512"},
                 random_model={**record["random_model"], "parameters": 10 * record["random_model"]["parameters"]})
    second = tmp_path / "other.json"
    second.write_text(json.dumps(other))
    code, _ = run_cli(["plot", "--scaling", str(output), str(second), "--output", str(tmp_path / "s.png")])
    assert code == 0 and (tmp_path / "s.png").read_bytes()[:4] == b"\x89PNG"


def test_random_model_refuses_a_model(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--random-model", "tiny-test", "--model", "x", "--output", str(tmp_path / "r.json")])
    assert exit_info.value.code == 2 and "--random-model replaces --model" in capsys.readouterr().err


def test_one_build_only_runs_its_own_systems(tmp_path):
    output = tmp_path / "four.json"
    code, _ = run_cli(["bench", "--random-model", "tiny-test", "--quick", "--prompts", "1", "--rounds", "1",
                       "--max-new-tokens", "3", "--prompt-length", "8", "--start-layer", "1", "--backend", "auto",
                       "--twin-bits", "4", "--exit-rates", "0.5", "--no-plots", "--dtype", "float32",
                       "--output", str(output)])
    record = json.loads(output.read_text())
    assert code == 0 and list(record["random_model"]["twin_builds"]) == ["4-bit"]
    assert record["model"]["dtype"] == "float32"  # --dtype reaches the random shape
    assert [system["name"] for system in record["systems"]] == [
        "backbone", "full-quant 4-bit+head (river)", "static 4-bit", "static 4-bit+head", "random p=0.5"]
    assert set(record["random_model"]["peak_rss_after_bytes"]) == {"backbone", "4-bit twins + head"}


def test_the_4_bit_build_quantizes_the_head_to_lm_head_nbits(scaling_run, tmp_path):
    """Without --lm-head-nbits the scaling builds keep the 8-bit head their records define full quantization with;
    given one ('auto': the river's default, 4 bits here), the head takes it and the names say so."""
    eight_bit_head, _, _ = scaling_run
    assert eight_bit_head["random_model"]["twin_builds"]["4-bit"]["lm_head_nbits"] == 8
    output = tmp_path / "head4.json"
    code, _ = run_cli(["bench", "--random-model", "tiny-test", "--quick", "--prompts", "1", "--rounds", "1",
                       "--max-new-tokens", "4", "--prompt-length", "8", "--start-layer", "1", "--backend", "auto",
                       "--twin-bits", "4", "--lm-head-nbits", "auto", "--exit-rates", "--no-plots",
                       "--output", str(output)])
    record = json.loads(output.read_text())
    assert code == 0 and record["random_model"]["twin_builds"]["4-bit"]["lm_head_nbits"] == 4
    assert [system["name"] for system in record["systems"]] == [
        "backbone", "full-quant 4-bit+4-bit head (river)", "static 4-bit", "static 4-bit+4-bit head"]
    bytes_of = {system["name"]: system["summary"]["weight_bytes_per_token"]
                for run in (record, eight_bit_head) for system in run["systems"]}
    assert bytes_of["static 4-bit+4-bit head"] < bytes_of["static 4-bit+head"] < bytes_of["static 4-bit"]


def test_unknown_twin_bits_name_the_field():
    from river_hf.bench.scaling import twin_configs
    from river_hf.core.config import RiverQuantConfig

    with pytest.raises(ValueError, match="`twin_bits`=\\(3,\\)"):
        twin_configs(RiverQuantConfig(), (3,))


def test_w8a8_build_alone_carries_the_head_and_its_own_name(tmp_path):
    output = tmp_path / "w8a8.json"
    code, _ = run_cli(["bench", "--random-model", "tiny-test", "--quick", "--prompts", "1", "--rounds", "1",
                       "--max-new-tokens", "3", "--prompt-length", "8", "--start-layer", "1", "--backend", "auto",
                       "--twin-bits", "8", "--activations", "int8", "--exit-rates", "0.5", "--no-plots",
                       "--output", str(output)])
    record = json.loads(output.read_text())
    assert code == 0 and list(record["random_model"]["twin_builds"]) == ["8-bit W8A8"]
    assert record["random_model"]["twin_builds"]["8-bit W8A8"]["activations"] == "int8"
    assert [system["name"] for system in record["systems"]] == [
        "backbone", "full-quant 8-bit W8A8+head (river)", "static 8-bit W8A8", "static 8-bit W8A8+head",
        "random p=0.5"]


def test_scaling_plot_keeps_random_routing_of_each_twin_build_apart():
    from river_hf.bench.plots import plot_line

    record = {"random_model": {"twin_builds": {"8-bit": {}, "4-bit": {}}}}
    w8a8 = {"random_model": {"twin_builds": {"8-bit W8A8": {}}}}
    random_system = {"name": "random p=0.5", "kind": "random"}
    assert plot_line(record, random_system) == "random p=0.5 (4-bit twins)"
    assert plot_line(w8a8, random_system) == "random p=0.5 (8-bit W8A8 twins)"
    assert plot_line(w8a8, {"name": "static 8-bit W8A8", "kind": "static-full-quant"}) == "static 8-bit W8A8"


def test_scaling_panels_tell_amx_from_no_amx(scaling_run):
    """Two Xeons share model name and torch dispatch ("AVX512") but not kernel speed: the CPU's AMX flag splits them
    into panels; a record that lists no flags (older records) keeps the name-and-dispatch panel."""
    from river_hf.bench.plots import scaling_figure

    record = scaling_run[0]

    def on(features):
        env = {**record["environment"], "cpu_model": "Intel(R) Xeon(R) Processor", "cpu_capability": "AVX512",
               "cpu_features": features}
        return dict(record, environment=env)

    figure = scaling_figure([on(["avx512f", "avx512_bf16", "amx_tile", "amx_bf16"]), on(["avx512f", "avx512_bf16"]),
                             on(None)])
    threads = record["environment"]["torch_threads"]
    assert {ax.get_title() for ax in figure.axes} == {
        f"Intel(R) Xeon(R) Processor: AVX512, AMX, {threads} threads",
        f"Intel(R) Xeon(R) Processor: AVX512, no AMX, {threads} threads",
        f"Intel(R) Xeon(R) Processor: AVX512, {threads} threads"}


def test_compiled_systems_are_measured_against_the_compiled_backbone(tmp_path):
    """--compiled adds transformers' compiled static-cache backbone and the river's captured systems (inductor on
    CPU), with their ratio to the compiled backbone in the record and the table."""
    output = tmp_path / "compiled.json"
    code, stdout = run_cli(["bench", "--random-model", "tiny-test", "--quick", "--prompts", "1", "--rounds", "1",
                            "--max-new-tokens", "4", "--prompt-length", "8", "--start-layer", "1", "--twin-bits", "4",
                            "--exit-rates", "0.9", "--backend", "auto", "--compiled", "--no-plots",
                            "--output", str(output)])
    assert code == 0
    systems = {system["name"]: system for system in json.loads(output.read_text())["systems"]}
    assert {"backbone (compiled)", "full-quant (captured)", "random p=0.9 (captured)"} <= systems.keys()
    assert systems["backbone (compiled)"]["summary"]["ratio_vs_compiled_backbone"] == 1.0
    captured = systems["full-quant (captured)"]
    assert set(captured["runs"][0]["exit_depths"]) == {1}  # every decoded token on the twins
    assert captured["summary"]["step_split_ms_per_token"] is None
    assert "vs compiled backbone" in stdout and "| full-quant (captured) |" in stdout


def test_without_matplotlib_the_record_stays_and_the_extra_is_named(tmp_path, monkeypatch, capsys):
    import river_hf.bench

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ModuleNotFoundError
    monkeypatch.delitem(sys.modules, "river_hf.bench.plots", raising=False)
    monkeypatch.delattr(river_hf.bench, "plots", raising=False)
    output = tmp_path / "no-plots.json"
    code, _ = run_cli(["bench", "--random-model", "tiny-test", "--quick", "--prompts", "1", "--rounds", "1",
                       "--max-new-tokens", "2", "--prompt-length", "4", "--start-layer", "1", "--twin-bits", "4",
                       "--backend", "auto", "--output", str(output)])
    assert code == 0 and json.loads(output.read_text())["systems"]
    assert ("plots skipped: drawing them needs matplotlib, which is not installed here: "
            "`pip install river-hf[bench]`" in capsys.readouterr().err)
    with pytest.raises(SystemExit):
        run_cli(["plot", str(output), "--output", str(tmp_path / "p.svg")])
    assert ("`river-hf plot` needs matplotlib, which is not installed here: `pip install river-hf[bench]`"
            in capsys.readouterr().err)
