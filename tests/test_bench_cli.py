"""`river-hf bench`: one small run on a tiny random Llama saved to disk, then its record, table and plots checked."""

from __future__ import annotations

import contextlib
import io
import json
import statistics
from pathlib import Path
from xml.etree import ElementTree

import pytest
import torch

import river_hf
from river_hf.bench.plots import pareto_front
from river_hf.bench.report import versus_random
from river_hf.bench.run import FULL, QUICK, SCHEMA, BenchSettings
from river_hf.bench.systems import SMOLLM2_TAUS, default_taus, river_taus, static_full_quant, weight_bytes
from river_hf.cli import build_parser, main
from river_hf.loading.models import build_chat_inputs, load_model_and_tokenizer

from conftest import QUESTIONS, save_tiny_model, tiny_model, write_questions

NUM_LAYERS = 4
PROMPTS, ROUNDS, TOKENS = 2, 1, 6
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    """(record, stdout, output path): backbone, full-quant, static full-quant and taus 0.8 and 1.5."""
    root = tmp_path_factory.mktemp("bench")
    model_dir = save_tiny_model(root / "tiny-llama", num_layers=NUM_LAYERS)
    data = write_questions(root / "questions.jsonl")
    output = root / "out" / "run.json"
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):  # (capsys is function-scoped)
        code = main(["bench", "--model", model_dir, "--data", data, "--taus", "-1", "0.8", "1.5", "--prompts",
                     str(PROMPTS), "--rounds", str(ROUNDS), "--max-new-tokens", str(TOKENS), "--fidelity-prompts",
                     "2", "--fidelity-tokens", "5", "--exit-rates", "0.5", "--signals", "update_norm",
                     "--signal-taus", "0.5", "--backend", "auto", "--nbits", "4", "--no-quantize-lm-head",
                     "--output", str(output)])
    assert code == 0
    return json.loads(output.read_text()), stdout.getvalue(), output


@pytest.fixture(scope="module")
def strategy_run(tmp_path_factory):
    """(record, stdout, output path) of `river-hf bench --strategies all` on a tiny Llama."""
    root = tmp_path_factory.mktemp("strategies")
    model_dir = save_tiny_model(root / "tiny-llama", num_layers=NUM_LAYERS)
    output = root / "strategies.json"
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        code = main(["bench", "--model", model_dir, "--data", write_questions(root / "q.jsonl"), "--strategies", "all",
                     "--strategy-taus", "0.5", "-1", "--prompts", "1", "--rounds", "1", "--max-new-tokens", str(TOKENS),
                     "--fidelity-prompts", "1", "--fidelity-tokens", "5", "--output", str(output)])
    assert code == 0
    return json.loads(output.read_text()), stdout.getvalue(), output


def systems_by_name(record):
    return {system["name"]: system for system in record["systems"]}


# ---- the record -------------------------------------------------------------------------------------------------
def test_record_schema(bench_run):
    record, _, _ = bench_run
    assert record["schema"] == SCHEMA
    assert {"created", "arguments", "model", "prompts", "environment", "settings", "twins", "systems", "memory",
            "target"} <= set(record)
    assert record["twins"] == {"nbits": 4, "group_size": 64, "start_layer": 1, "quantize_lm_head": False,
                               "lm_head_nbits": 4, "skip_modules": [], "backend": "auto", "kernels": ["int4pack_cpu"],
                               "num_layers": NUM_LAYERS}
    assert record["settings"]["taus"] == [0.8, 1.5]  # -1 is full-quant, measured anyway
    assert record["prompts"]["texts"] == QUESTIONS[:2]
    assert record["model"]["dtype"] == "bfloat16"  # $RIVER_HF_DTYPE, pinned by conftest
    env = record["environment"]
    assert env["torch"] == torch.__version__ and env["transformers"] and env["torch_threads"] >= 1
    memory = record["memory"]
    assert memory["backbone_weight_bytes"] > memory["twin_weight_bytes"] > 0
    assert memory["process_peak_rss_bytes"] >= memory["process_peak_rss_after_build_bytes"] > 0
    names = [system["name"] for system in record["systems"]]
    assert names[3].startswith("defaults (")  # tau 'auto', resolved by this machine's measured ExitGain
    assert names[:3] + names[4:] == ["backbone", "full-quant", "static-full-quant", "tau=0.8", "tau=1.5",
                                     "update_norm tau=0.5", "random p=0.5"]
    assert record["exit_gain"]["backbone_ms"] > 0 and isinstance(record["exit_gain"]["pays"], bool)


def test_every_run_is_recorded_raw(bench_run):
    record, _, _ = bench_run
    for system in record["systems"]:
        runs = system["runs"]
        assert [(run["round"], run["prompt"]) for run in runs] == [(r, p) for r in range(ROUNDS)
                                                                   for p in range(PROMPTS)]
        for run in runs:
            assert run["new_tokens"] == TOKENS == len(run["token_times_s"]) == len(run["token_ids"])
            assert run["token_times_s"] == sorted(run["token_times_s"])
        # the defaults system is a river only where this machine's measured ExitGain said exiting pays
        river = system["kind"] in ("full-quant", "river", "random") or (
            system["kind"] == "defaults" and system["tau"] is not None)
        assert (system["summary"]["exit_depth_histogram"] is not None) == river
        if river:  # one depth per decoded position: every new token but the last passed through the model
            histogram = system["summary"]["exit_depth_histogram"]
            assert sum(histogram.values()) == PROMPTS * ROUNDS * (TOKENS - 1)
            assert all(len(run["exit_depths"]) == TOKENS - 1 for run in runs)


def test_speed_ratios_follow_from_the_raw_token_times(bench_run):
    record, _, _ = bench_run

    def median_rate(system):
        return statistics.median((len(t) - 1) / (t[-1] - t[0]) for t in (r["token_times_s"] for r in system["runs"]))

    systems = systems_by_name(record)
    base, static = median_rate(systems["backbone"]), median_rate(systems["static-full-quant"])
    for system in record["systems"]:
        summary = system["summary"]
        assert summary["decode_tokens_per_s"] == pytest.approx(median_rate(system))
        assert summary["speed_ratio"] == pytest.approx(median_rate(system) / base)
        assert summary["ratio_vs_static_full_quant"] == pytest.approx(median_rate(system) / static)
        prefill = statistics.median(run["token_times_s"][0] for run in system["runs"])
        assert summary["prefill_ms"] == pytest.approx(1000 * prefill)
    target = record["target"]
    assert target["full_quant_vs_static_full_quant"] == systems["full-quant"]["summary"]["ratio_vs_static_full_quant"]
    assert target["met"] == (target["full_quant_vs_static_full_quant"] >= target["target"])


def test_tau_above_one_is_the_backbone(bench_run):
    record, _, _ = bench_run
    systems = systems_by_name(record)
    never = systems["tau=1.5"]
    assert never["fidelity"]["match"] == 1.0 and never["fidelity"]["kl"] == pytest.approx(0.0, abs=1e-6)
    assert never["summary"]["exit_depth_histogram"] == {str(NUM_LAYERS): PROMPTS * ROUNDS * (TOKENS - 1)}
    assert [r["token_ids"] for r in never["runs"]] == [r["token_ids"] for r in systems["backbone"]["runs"]]


def test_static_reference_computes_what_full_quant_computes(bench_run):
    record, _, _ = bench_run
    systems = systems_by_name(record)
    full, static = systems["full-quant"], systems["static-full-quant"]
    assert [r["token_ids"] for r in full["runs"]] == [r["token_ids"] for r in static["runs"]]
    assert full["summary"]["exit_depth_histogram"] == {"1": PROMPTS * ROUNDS * (TOKENS - 1)}
    assert full["fidelity"]["match"] == pytest.approx(static["fidelity"]["match"])
    assert full["fidelity"]["kl"] == pytest.approx(static["fidelity"]["kl"], rel=1e-4, abs=1e-7)


def test_table_names_the_twins_and_every_system(bench_run):
    _, out, _ = bench_run
    assert f"twins: 4-bit HQQ, group 64, from layer 1 of {NUM_LAYERS}, kernel int4pack_cpu" in out
    for label in ("| backbone |", "| full-quant (river tau=-1) |", "| static full-quant (no router) |",
                  "| river tau=0.8 |", "| river tau=1.5 |"):
        assert label in out
    assert "runs at" in out and "the static full-quant model" in out
    assert "| random routing p=0.5 |" in out and "| river tau=0.5 (update_norm) |" in out
    assert "against random routing at equal speed" in out and "- cosine:" in out and "- update_norm:" in out


def test_random_routing_exits_and_is_compared(bench_run):
    record, _, _ = bench_run
    random_system = systems_by_name(record)["random p=0.5"]
    histogram = random_system["summary"]["exit_depth_histogram"]
    exited = sum(n for depth, n in histogram.items() if int(depth) < NUM_LAYERS)
    assert 0 < exited < sum(histogram.values())  # some tokens exit, some do not
    assert set(record["versus_random"]) == {"cosine", "update_norm"}
    cosine = record["versus_random"]["cosine"]
    assert cosine["points"] + cosine["out_of_range"] == 2


def test_versus_random_interpolates_the_random_curve_at_equal_speed_or_depth():
    def system(kind, speed, match, depth, signal="cosine"):
        return {"kind": kind, "signal": signal, "strategy": None,
                "summary": {"speed_ratio": speed, "mean_exit_depth": depth}, "fidelity": {"match": match}}

    systems = [system("backbone", 1.0, 1.0, 30, None), system("random", 1.5, 0.80, 20, "random"),
               system("random", 2.0, 0.60, 10, "random"),
               system("river", 1.25, 0.95, 26), system("river", 1.75, 0.60, 14), system("river", 3.0, 0.70, 5)]
    comparison = versus_random(systems, "speed")["cosine"]
    # the curve runs (1.0, 100%) -> (1.5, 80%) -> (2.0, 60%); beyond its fastest point there is nothing to compare
    assert comparison["delta"][:2] == pytest.approx([0.95 - 0.90, 0.60 - 0.70]) and comparison["delta"][2] is None
    assert comparison["beats"] == 1 and comparison["points"] == 2 and comparison["out_of_range"] == 1
    assert comparison["mean_delta"] == pytest.approx((0.05 - 0.10) / 2)
    # the point past the curve (3.0x) is more faithful than the curve's fastest point (2.0x, 60%): it dominates it
    assert comparison["dominates_fastest_random"] == pytest.approx([0.70 - 0.60])
    # by depth: (30, 100%) -> (20, 80%) -> (10, 60%)
    by_depth = versus_random(systems, "depth")["cosine"]
    assert by_depth["delta"][:2] == pytest.approx([0.95 - 0.92, 0.60 - 0.68]) and by_depth["delta"][2] is None
    assert versus_random([system("river", 1.2, 0.9, 20)]) == {}  # no random systems: nothing to compare with


def test_strategy_bench_reports_every_strategy_at_two_taus(strategy_run):
    record, out, output = strategy_run
    names = [system["name"] for system in record["systems"]]
    strategies = ["river", "recompute", "state_propagation", "mask", "mono_decreasing"]
    assert names == ["backbone"] + [f"{s} tau={t:g}" for s in strategies for t in (0.5, -1)]
    for system in record["systems"][1:]:
        summary = system["summary"]
        assert summary["backbone_ms_per_token"] > 0 and summary["skipped_ms_per_token"] >= 0
        assert summary["backbone_ms_per_token"] + summary["skipped_ms_per_token"] < summary["ms_per_token"]
        assert system["fidelity"]["measured"]
    systems = systems_by_name(record)
    # tau=-1 exits as early as each strategy allows: at the start layer, or half the layers for mask
    assert systems["river tau=-1"]["summary"]["mean_exit_depth"] == 1
    assert systems["mask tau=-1"]["summary"]["mean_exit_depth"] == NUM_LAYERS // 2
    assert "| strategy | tau | mean exit depth" in out and "| recompute | -1 |" in out
    path = output.with_name(output.stem + "-strategies.svg")
    assert "skipped layers" in svg_text(path) and str(path) in out


def svg_text(path: Path) -> str:
    """The text of an SVG figure's labels, after checking it is a drawn SVG of a readable size."""
    root = ElementTree.parse(path).getroot()
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    assert float(root.get("width").removesuffix("pt")) > 100 and float(root.get("height").removesuffix("pt")) > 100
    assert len(root.findall(".//{http://www.w3.org/2000/svg}path")) > 10
    return " ".join("".join(node.itertext()) for node in root.iter("{http://www.w3.org/2000/svg}text"))


def test_plots_are_svg_figures_with_their_labels(bench_run):
    _, out, output = bench_run
    for suffix, label in (("-pareto.svg", "decode speed / backbone"), ("-exit-depths.svg", "exit depth")):
        path = output.with_name(output.stem + suffix)
        assert label in svg_text(path) and str(path) in out


def test_a_figure_is_the_same_bytes_each_time(bench_run, tmp_path):
    """No date, fixed ids: regenerating docs/ figures from the same record changes nothing in git."""
    from river_hf.bench.plots import pareto_figure, save

    record, _, _ = bench_run
    first, second = tmp_path / "a.svg", tmp_path / "b.svg"
    save(pareto_figure(record), first)
    save(pareto_figure(record), second)
    assert first.read_bytes() == second.read_bytes()


def test_plot_overlays_several_records(bench_run, tmp_path, capsys):
    _, _, output = bench_run
    png = tmp_path / "precisions.png"  # a .png path still gets a PNG
    assert main(["plot", str(output), str(output), "--output", str(png)]) == 0
    assert png.read_bytes().startswith(PNG_SIGNATURE) and str(png) in capsys.readouterr().out
    svg = tmp_path / "precisions.svg"
    assert main(["plot", str(output), str(output), "--output", str(svg)]) == 0
    assert "per twin precision" in svg_text(svg)


def test_plot_of_a_missing_record_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        main(["plot", str(tmp_path / "none.json"), "--output", str(tmp_path / "x.png")])
    assert info.value.code == 2 and "could not read bench record" in capsys.readouterr().err


# ---- the pieces -------------------------------------------------------------------------------------------------
def test_static_full_quant_shares_every_tensor_and_leaves_the_river_alone():
    # the backbone's own LM head: the static copy has no quantized one (the bench's "+head" systems add it), and
    # which 8-bit head kernel 'fastest' picks, hence which near-tie argmax flips, depends on this machine's timing
    model = river_hf.build_river(tiny_model(), river_hf.RiverQuantConfig(quantize_lm_head=False), progress=False)
    ids = torch.randint(3, 256, (1, 5))
    static = static_full_quant(model)
    river_tensors = {t.data_ptr() for t in (*model.parameters(), *model.buffers())}
    assert all(t.data_ptr() in river_tensors for t in (*static.parameters(), *static.buffers()))
    assert not river_hf.is_river(static)
    assert all(isinstance(layer, river_hf.RiverLayer)
               for layer in river_hf.core.architectures.find_decoder_layers(model))
    # prefill_exit="sequence": the prompt on the twins too, as the static copy runs it ("auto" follows this machine's
    # measured prompt-shaped timing, which made the test pass or fail by machine and test order)
    expected = model.generate(ids, max_new_tokens=5, do_sample=False, tau=-1, exit_signal="cosine",
                              prefill_exit="sequence")
    assert torch.equal(static.generate(ids, max_new_tokens=5, do_sample=False), expected)


def test_weight_bytes_counts_shared_norms_once():
    plain = tiny_model()
    backbone = sum(t.numel() * t.element_size() for t in (*plain.parameters(), *plain.buffers()))
    sizes = weight_bytes(river_hf.build_river(plain, progress=False))
    assert sizes["backbone"] == backbone and 0 < sizes["twins"] < backbone


def test_default_taus(saved_tiny_model):
    model, tokenizer = load_model_and_tokenizer(str(saved_tiny_model))
    river_hf.build_river(model, progress=False)
    inputs = build_chat_inputs(tokenizer, "w5 w9 w33 w40 w7")
    assert default_taus(model, inputs, packaged=True, quick=False) == list(SMOLLM2_TAUS)
    taus = default_taus(model, inputs, packaged=False, quick=True)
    assert 1 <= len(taus) <= 3 and taus == sorted(taus) and all(-1 <= tau <= 1 for tau in taus)


def test_river_taus_drop_full_quant_and_duplicates():
    assert river_taus([0.99, -1, 0.97, 0.99, -2]) == [0.97, 0.99]


def test_twin_schedule_and_quantized_head_options():
    from river_hf.cli.commands.common import twin_config

    args = build_parser().parse_args(["bench", "--nbits", "8*2,4*3", "--quantize-lm-head", "--lm-head-nbits", "4",
                                      "--lm-head-exact-top-k", "0"])
    config = twin_config(args)
    assert config.nbits == [8, 8, 4, 4, 4] and config.quantize_lm_head and config.lm_head_nbits == 4
    assert (config.lm_head_exact_top_k == 0
            and twin_config(build_parser().parse_args(["bench"])).lm_head_exact_top_k == 64)
    assert twin_config(build_parser().parse_args(["bench"])).lm_head_nbits == "auto"
    assert twin_config(build_parser().parse_args(["bench", "--lm-head-nbits", "AUTO"])).lm_head_nbits == "auto"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "--lm-head-nbits", "four"])


@pytest.mark.parametrize("flags, twins, head", [([], None, None), (["--activations", "int8"], "int8", "int8"),
                                                 (["--lm-head-activations", "int8"], None, "int8"),
                                                 (["--activations", "int8", "--lm-head-activations", "none"],
                                                  "int8", None)])
def test_activation_flags_reach_the_twins_and_the_head(flags, twins, head):
    from river_hf.cli.commands.common import twin_config

    config = twin_config(build_parser().parse_args(["bench", *flags]))
    assert (config.activations, config.head_activations) == (twins, head)


def test_quick_preset_and_overrides():
    args = build_parser().parse_args(["bench", "--quick", "--max-new-tokens", "16"])
    settings = (QUICK if args.quick else FULL).with_overrides(**vars(args))
    assert settings == BenchSettings(prompts=2, rounds=1, max_new_tokens=16, fidelity_prompts=3, fidelity_tokens=32)
    assert FULL.max_new_tokens == 128


def test_pareto_front_keeps_the_undominated_points():
    points = [(1.0, 1.0), (0.8, 1.8), (0.9, 1.4), (0.85, 1.2), (0.9, 1.3)]
    assert pareto_front(points) == [(0.8, 1.8), (0.9, 1.4), (1.0, 1.0)]


# ---- bad arguments are usage errors, before any model loads ------------------------------------------------------
@pytest.mark.parametrize("args, message", [
    (["--data", "/no/such/file.jsonl"], "`--data`: file '/no/such/file.jsonl' not found"),
    (["--taus", "nan"], "--taus must be real numbers"),
    (["--nbits", "5"], "`nbits`=5 is not supported"),
    (["--prompts", "0"], "--prompts: must be >= 1"),
    (["--data", "x.jsonl", "--dataset", "openai/gsm8k"], "either `--data`"),
    (["--strategies", "skip"], "invalid choice: 'skip'"),
    (["--exit-rates", "1.5"], "must be a probability between 0 and 1"),
    (["--signals", "random"], "invalid choice: 'random'"),
    (["--nbits", "8*x"], "expected bits (e.g. 4) or a schedule"),
    (["--nbits", "8*2,5"], "`nbits`[2]=5 is not supported"),
    (["--compiled", "--strategies", "all"], "--strategies, --lossless and --offload cannot run on a static cache"),
    (["--compiled", "--lossless", "4"], "leave out --compiled"),
])
def test_bad_bench_arguments(args, message, capsys):
    with pytest.raises(SystemExit) as info:
        main(["bench", "--model", "/no/such/model", *args])
    assert info.value.code == 2
    assert message in capsys.readouterr().err
