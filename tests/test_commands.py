"""river_hf.cli.commands and the library under them: river flags derived from RiverSettings, --output given a folder or
an unwritable place (checked before any model loads), the one record writer, the one token clock, and the library
entry points a notebook calls (evaluate, calibrate) on a tiny saved model."""

from __future__ import annotations

import json
import math
import os
from dataclasses import fields

import pytest

import river_hf
from river_hf.bench.calibrate import calibrate
from river_hf.bench.eval import Example, Scored, Task, evaluate, report_table
from river_hf.bench.records import json_safe, resolve_output, write_record
from river_hf.bench.speed import TokenClock
from river_hf.bench.systems import eval_systems
from river_hf.cli import build_parser, main
from river_hf.cli.commands.common import river_settings
from river_hf.loading.models import build_chat_inputs, load_model_and_tokenizer
from river_hf.core.settings import RiverSettings, river_field_help
from river_hf.core.signals import signal_names
from river_hf.core.kv_strategies import strategy_names

from conftest import make_tiny_tokenizer, save_tiny_model

QUESTIONS = ["what is two plus three?", "hello world"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def questions(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "questions.jsonl"
    path.write_text("".join(json.dumps({"question": q}) + "\n" for q in QUESTIONS))
    return str(path)


# ---- river flags come from RiverSettings ------------------------------------------------------------------------
def river_action(parser, dest):
    generate = parser._subparsers._group_actions[0].choices["generate"]
    return next(action for action in generate._actions if action.dest == dest)


def test_river_flags_take_default_help_and_choices_from_the_settings():
    parser = build_parser()
    defaults = {f.name: f.default for f in fields(RiverSettings)}
    for name in ("tau", "exit_signal", "kv_strategy", "prefill_exit", "min_exit_layer", "signal_layer"):
        action = river_action(parser, name)
        assert action.default == defaults[name]
        assert action.help.startswith(river_field_help(name).replace("%", "%%")[:40])
    assert list(river_action(parser, "exit_signal").choices) == [n for n in signal_names() if n != "random"]
    assert list(river_action(parser, "kv_strategy").choices) == list(strategy_names())


def test_generate_seed_is_the_sampling_seed_not_the_random_signal_seed():
    args = build_parser().parse_args(["generate", "hi", "--seed", "7", "--min-exit-layer", "2"])
    settings = river_settings(args)
    assert args.seed == 7 and "seed" not in settings
    assert settings["min_exit_layer"] == 2 and settings["exit_signal"] == "confidence"


def test_min_exit_layer_reaches_the_river(tiny_dir, capsys):
    assert main(["generate", "hello world", "--model", tiny_dir, "--max-new-tokens", "4", "--tau", "-1",
                 "--min-exit-layer", "2"]) == 0
    assert "mean exit depth 2.0 of 4 layers" in capsys.readouterr().out


@pytest.mark.parametrize("args, message", [
    (["--prefill-exit", "0"], "--prefill-exit: expected one of"),
    (["--min-exit-layer", "0"], "--min-exit-layer: must be >= 1"),
    (["--exit-signal", "random"], "invalid choice: 'random'"),
])
def test_bad_river_flags_are_usage_errors(args, message, capsys):
    with pytest.raises(SystemExit) as info:
        main(["generate", "hi", "--model", "/no/such/model", *args])
    assert info.value.code == 2 and message in capsys.readouterr().err


# ---- --output ---------------------------------------------------------------------------------------------------
def test_resolve_output_puts_a_record_inside_a_folder(tmp_path):
    assert resolve_output(None, "bench-x.json") == resolve_output("runs/", "bench-x.json")
    assert resolve_output(str(tmp_path), "bench-x.json") == tmp_path / "bench-x.json"
    assert resolve_output(str(tmp_path / "new") + os.sep, "b.json") == tmp_path / "new" / "b.json"
    assert resolve_output(str(tmp_path / "a" / "b.json"), "x.json") == tmp_path / "a" / "b.json"
    assert not (tmp_path / "a").exists()  # checked, not created


def test_resolve_output_fails_where_it_cannot_write(tmp_path):
    (tmp_path / "file.txt").write_text("")
    with pytest.raises(ValueError, match=r"`--output`: cannot create the folder .* is a file"):
        resolve_output(str(tmp_path / "file.txt" / "sub" / "out.json"), "x.json")
    if os.geteuid() != 0:  # root may write anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(ValueError, match="permission denied"):
            resolve_output(str(locked / "out.json"), "x.json")


@pytest.mark.parametrize("command", [
    ["bench", "--data", "{data}"],
    ["eval", "gsm8k", "--data", "{data}"],
    ["plot", "{data}"],
])
def test_an_unwritable_output_fails_before_the_model_loads(command, tmp_path, questions, capsys):
    (tmp_path / "file.txt").write_text("")
    argv = [part.replace("{data}", questions) for part in command]
    if command[0] != "plot":
        argv += ["--model", "/no/such/model"]  # loading it would fail with another message
    with pytest.raises(SystemExit) as info:
        main(argv + ["--output", str(tmp_path / "file.txt" / "out.json")])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "`--output`" in err and "could not load the model" not in err


def test_bench_eval_and_plot_write_inside_an_output_folder(tiny_dir, questions, tmp_path, capsys):
    out = tmp_path / "records"
    out.mkdir()
    assert main(["bench", "--model", tiny_dir, "--data", questions, "--taus", "1.5", "--prompts", "1", "--rounds",
                 "1", "--max-new-tokens", "3", "--fidelity-prompts", "1", "--fidelity-tokens", "3",
                 "--exit-rates", "--no-plots", "--dtype", "float32", "--output", str(out)]) == 0
    [record] = out.glob("bench-*.json")
    written = json.loads(record.read_text())
    assert written["schema"] == "river-hf-bench/1" and written["model"]["dtype"] == "float32"  # the model's, as loaded
    gsm8k = tmp_path / "gsm8k.jsonl"
    gsm8k.write_text(json.dumps({"question": "two plus three?", "answer": "#### 5"}) + "\n")
    assert main(["eval", "gsm8k", "--model", tiny_dir, "--data", str(gsm8k), "--shots", "0", "--max-new-tokens",
                 "2", "--taus", "1.5", "--output", str(out)]) == 0
    [report] = out.glob("eval-gsm8k-*.json")
    assert set(json.loads(report.read_text())["systems"]) == {"backbone", "full-quant (tau=-1)",
                                                              "river confidence tau=1.5"}
    assert main(["plot", str(record), "--output", str(out)]) == 0
    [figure] = out.glob("plot-*.svg")
    assert str(figure) in capsys.readouterr().out


# ---- the pieces -------------------------------------------------------------------------------------------------
def test_records_are_strict_json(tmp_path):
    assert json_safe({"a": [math.nan, 1.0, (math.inf, 2)], "b": -math.inf}) == {"a": [None, 1.0, [None, 2]],
                                                                                 "b": None}
    path = write_record({"x": math.nan}, tmp_path / "deep" / "r.json")
    assert json.loads(path.read_text()) == {"x": None}


def test_token_clock_times_each_token_and_passes_it_on():
    import torch

    class Recorder:
        def __init__(self):
            self.calls = []

        def put(self, value):
            self.calls.append(value.tolist())

        def end(self):
            self.calls.append("end")

    recorder = Recorder()
    clock = TokenClock(then=recorder)
    for value in ([[1, 2, 3]], [4], [5]):  # the prompt, then one call per new token
        clock.put(torch.tensor(value))
    clock.end()
    assert recorder.calls == [[[1, 2, 3]], [4], [5], "end"]
    assert clock.start is not None and len(clock.token_times) == 2 and clock.token_times == sorted(clock.token_times)


def test_build_chat_inputs_completes_plain_text_or_templates_messages():
    tokenizer = make_tiny_tokenizer()

    def text(inputs):
        return tokenizer.decode(inputs["input_ids"][0])

    assert text(build_chat_inputs(tokenizer, "hello world", chat=False)) == "hello world"
    assert text(build_chat_inputs(tokenizer, "hello world")).startswith("<|im_start|>user\nhello world")
    messages = [{"role": "user", "content": "hello world"}]
    assert text(build_chat_inputs(tokenizer, messages, chat=False)) == text(build_chat_inputs(tokenizer, "hello world"))


# ---- the library, called as a notebook would --------------------------------------------------------------------
@pytest.fixture(scope="module")
def river(tiny_dir):
    model, tokenizer = load_model_and_tokenizer(tiny_dir)
    return river_hf.build_river(model, river_hf.RiverQuantConfig(nbits=4), progress=False), tokenizer


def test_evaluate_runs_every_system_on_a_task_of_plain_values(river):
    model, tokenizer = river
    task = Task("echo", [Example(id="0", prompt="hello world", gold="x")],
                score=lambda example, output: Scored(prediction=output, correct=True))
    systems = eval_systems([1.5], generation={"max_new_tokens": 2, "do_sample": False})
    report = evaluate(model, tokenizer, task, systems, progress=False)
    assert list(report["systems"]) == ["backbone", "full-quant (tau=-1)", "river tau=1.5"]
    assert report["systems"]["full-quant (tau=-1)"]["mean_exit_depth"] == 1
    assert report["twins"]["nbits"] == 4 and "| river tau=1.5 |" in report_table(report)


def test_calibrate_returns_the_chosen_tau_and_its_entry(river):
    model, tokenizer = river
    found = calibrate(model, tokenizer, QUESTIONS, target_match=0.01, tokens=4)  # full quantization meets it
    assert found.chosen.tau == -1.0 and [p.tau for p in found.probes] == [0.999, -1.0]
    assert found.prompts["count"] == 2 and found.prompts["positions"] == 8 and found.twins["num_layers"] == 4
    entry = found.entry()
    assert entry["tau"] == -1.0 and entry["target_match"] == 0.01 and len(entry["probes"]) == 2
