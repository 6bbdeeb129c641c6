"""`river-hf generate`: on a tiny random Llama saved to disk (fast), and once on the packaged SmolLM2 (slow)."""

import re
import types

import pytest
import torch

from river_hf.cli import build_parser, main
from river_hf.cli.display import (EXIT_COLORS, FULL_DEPTH_COLOR, GenerationStats, depth_bucket, exit_legend,
    token_exit_depths, token_pieces)
from conftest import make_tiny_tokenizer, save_tiny_model

NUM_LAYERS = 4
ANSI = "\x1b["


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny-llama"), num_layers=NUM_LAYERS)


def generate(model_dir, *extra, tokens=4):
    return main(["generate", "what is two plus three?", "--model", model_dir, "--max-new-tokens", str(tokens),
                 *extra])


def summary_line(out: str) -> str:
    lines = [line for line in out.splitlines() if line.startswith("[river-hf]")]
    assert len(lines) == 1, out
    return lines[0]


# ---- generate, end to end ---------------------------------------------------------------------------------------
def test_generate_no_river_prints_one_summary_line(tiny_model_dir, capsys):
    assert generate(tiny_model_dir, "--no-river") == 0
    line = summary_line(capsys.readouterr().out)
    assert re.search(r"4 new tokens · decode \d+\.\d tok/s · prefill \d+\.\d\d s", line)
    assert f"river off: every token ran all {NUM_LAYERS} layers" in line


def test_river_exiting_as_early_as_allowed(tiny_model_dir, capsys):
    assert generate(tiny_model_dir, "--tau", "-1", "--start-layer", "1") == 0
    captured = capsys.readouterr()
    line = summary_line(captured.out)
    assert f"mean exit depth 1.0 of {NUM_LAYERS} layers" in line
    assert "100% of tokens exited early (confidence tau -1, 8x3-bit twins, group 64, from layer 1)" in line
    assert re.search(r"building river: (quantizing|reading the twins an earlier run kept for) 3 layers", captured.err)


def test_river_that_never_exits(tiny_model_dir, capsys):
    assert generate(tiny_model_dir, "--tau", "2") == 0
    line = summary_line(capsys.readouterr().out)
    assert f"mean exit depth {NUM_LAYERS:.1f} of {NUM_LAYERS} layers" in line
    assert "0% of tokens exited early" in line


def test_generate_with_another_signal_and_kv_strategy(tiny_model_dir, capsys):
    assert generate(tiny_model_dir, "--tau", "-1", "--exit-signal", "confidence", "--kv-strategy", "mask") == 0
    line = summary_line(capsys.readouterr().out)
    # tau=-1: every decode step exits at the mask strategy's minimum exit layer, half the layers
    assert f"mean exit depth {NUM_LAYERS // 2:.1f} of {NUM_LAYERS} layers" in line


def test_generate_compile_captures_the_decode_steps(tiny_model_dir, capsys, monkeypatch):
    from transformers import CompileConfig

    from river_hf.cli.commands import generate as generate_command
    from river_hf.core.captured_decode import compile_config_for

    assert compile_config_for("cpu")._compile_all_devices  # what --compile asks on a CPU, where HF compiles nothing
    traced = CompileConfig(backend="eager", mode="default")  # dynamo's graphs without inductor's minutes on 2 cores
    traced._compile_all_devices = True
    monkeypatch.setattr(generate_command, "compile_config_for", lambda device: traced)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    assert generate(tiny_model_dir, "--compile", "--tau", "-1", "--start-layer", "1", tokens=5) == 0
    captured = capsys.readouterr()
    line = summary_line(captured.out)
    assert f"mean exit depth 1.0 of {NUM_LAYERS} layers" in line  # the static cache's record
    assert "(without the 1 step that compiled first: " in line  # tau -1: one exit depth, one graph
    assert "river: capturing the decode step exiting after 1 backbone layers" in captured.err
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1
    # the compiled backbone with --no-river
    assert generate(tiny_model_dir, "--compile", "--no-river", tokens=3) == 0
    assert f"every token ran all {NUM_LAYERS} layers" in summary_line(capsys.readouterr().out)


def test_show_exits_colours_each_token(tiny_model_dir, capsys, monkeypatch):
    monkeypatch.delenv("NO_COLOR", raising=False)
    assert generate(tiny_model_dir, "--tau", "-1", "--start-layer", "2", "--show-exits", tokens=6) == 0
    out = capsys.readouterr().out
    after_summary = out[out.index("[river-hf]"):]
    assert after_summary.count(EXIT_COLORS[0]) >= 2  # answer tokens at depth 2 plus the legend
    assert "exit depth (backbone layers run):" in after_summary


def test_show_exits_respects_no_color(tiny_model_dir, capsys, monkeypatch):
    monkeypatch.setenv("NO_COLOR", "1")
    assert generate(tiny_model_dir, "--tau", "-1", "--start-layer", "2", "--show-exits", tokens=6) == 0
    out = capsys.readouterr().out
    assert ANSI not in out
    assert "[2]" in out


def test_sampling_with_a_seed_is_reproducible(tiny_model_dir, capsys):
    runs = []
    for _ in range(2):
        generate(tiny_model_dir, "--no-river", "--sample", "--seed", "3", tokens=8)
        runs.append(capsys.readouterr().out.split("[river-hf]")[0])
    assert runs[0] == runs[1]


# ---- argument validation (fails before any model loads) ---------------------------------------------------------
@pytest.mark.parametrize("args, message", [
    (["--tau", "abc"], "--tau: invalid float value: 'abc'"),
    (["--max-new-tokens", "0"], "--max-new-tokens: must be >= 1, got 0"),
    (["--max-new-tokens", "x"], "--max-new-tokens: 'x' is not an integer"),
    (["--group-size", "-64"], "--group-size: must be >= 1"),
    (["--nbits", "5"], "`nbits`=5 is not supported"),
    (["--tau", "nan"], "`tau` must be a real number"),
    (["--no-river", "--show-exits"], "--show-exits needs the river"),
    (["--compile", "--lossless"], "--compile: `cache_implementation`='static' with `lossless`=True"),
    (["--compile", "--kv-strategy", "mask"], "--compile: `cache_implementation`='static' needs `kv_strategy`='river'"),
])
def test_bad_arguments_are_usage_errors(args, message, capsys):
    with pytest.raises(SystemExit) as info:
        main(["generate", "hi", "--model", "/no/such/model", *args])
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_missing_model_folder_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        main(["generate", "hi", "--no-river", "--model", str(tmp_path / "missing")])
    assert info.value.code == 2
    assert str(tmp_path / "missing") in capsys.readouterr().err


def test_start_layer_beyond_the_model_is_a_usage_error(tiny_model_dir, capsys):
    with pytest.raises(SystemExit):
        generate(tiny_model_dir, "--start-layer", str(NUM_LAYERS))
    assert "`start_layer`" in capsys.readouterr().err


def test_a_subcommand_is_required(capsys):
    with pytest.raises(SystemExit):
        main([])
    assert "COMMAND" in capsys.readouterr().err


def test_defaults():
    args = build_parser().parse_args(["generate", "hi"])
    assert (args.tau, args.exit_signal, args.nbits, args.group_size, args.start_layer, args.max_new_tokens) == (
        "auto", "confidence", "auto", 64, 1, 128)
    assert args.quantize_lm_head and not build_parser().parse_args(["generate", "hi", "--no-quantize-lm-head"]
                                                                    ).quantize_lm_head
    assert args.model is None and not args.no_river


# ---- the pieces -------------------------------------------------------------------------------------------------
def test_decode_rate_counts_tokens_after_the_first():
    streamer = types.SimpleNamespace(start=0.0, token_times=[0.5, 1.0, 1.5, 2.5])
    stats = GenerationStats.collect(streamer, num_layers=30)
    assert stats.new_tokens == 4
    assert stats.prefill_s == 0.5
    assert stats.decode_tokens_per_s == pytest.approx(3 / 2.0)
    assert stats.mean_exit_depth is None


def test_decode_rate_leaves_out_the_steps_that_compiled():
    # tokens 1 and 3 came from steps that compiled their graphs (10 s and 5 s); tokens 2 and 4 took 0.1 s each
    streamer = types.SimpleNamespace(start=0.0, token_times=[0.5, 10.5, 10.6, 15.6, 15.7])
    stats = GenerationStats.collect(streamer, num_layers=30, compiling_steps=[3, 1, 9])  # 9: past the last token
    assert stats.decode_tokens_per_s == pytest.approx(2 / 0.2)
    assert (stats.compiling_steps, stats.compiling_s) == (2, pytest.approx(15.0))
    assert "decode 10.0 tok/s (without the 2 steps that compiled first: 15.0 s)" in stats.summary_line()
    assert "compiled" not in GenerationStats.collect(streamer, num_layers=30).summary_line()


def test_exit_stats_skip_the_prefill_token():
    streamer = types.SimpleNamespace(start=0.0, token_times=[0.1, 0.2, 0.3, 0.4])
    stats = GenerationStats.collect(streamer, num_layers=30, depths=[1, 10, 30, 20])  # depths[0]: the prefill's
    assert stats.mean_exit_depth == pytest.approx(20.0)
    assert stats.exit_share == pytest.approx(2 / 3)


def test_one_token_has_no_decode_rate():
    stats = GenerationStats.collect(types.SimpleNamespace(start=0.0, token_times=[0.3]), num_layers=30)
    assert "decode nan tok/s" in stats.summary_line()


def test_token_exit_depths_align_each_token_with_the_pass_that_chose_it():
    # prompt of 3 positions (depths 7, 7, 7), then decode steps at depths 1, 2; the 3rd new token is never fed back.
    cache = types.SimpleNamespace(exit_depth=torch.tensor([[7, 7, 7, 1, 2]]))
    assert token_exit_depths(cache, prompt_length=3, num_new_tokens=3) == [7, 1, 2]


def test_depth_buckets_cover_the_range_and_single_out_full_depth():
    buckets = [depth_bucket(d, start_layer=1, num_layers=30) for d in range(1, 31)]
    assert buckets[0] == 0 and buckets[-2] == len(EXIT_COLORS) - 1 and buckets[-1] == len(EXIT_COLORS)
    assert buckets == sorted(buckets)


def test_legend_names_every_colour():
    legend = exit_legend(start_layer=1, num_layers=30)
    assert all(color in legend for color in EXIT_COLORS + (FULL_DEPTH_COLOR,))
    assert "1-8" in legend and "30 (never exited)" in legend


def test_token_pieces_keep_multibyte_characters_whole():
    tokenizer = make_tiny_tokenizer()
    ids = tokenizer("héllo wörld")["input_ids"]
    pieces = token_pieces(tokenizer, ids)
    assert "".join(text for text, _ in pieces) == "héllo wörld"
    assert all("\ufffd" not in text for text, _ in pieces)
    assert pieces[-1][1] == len(ids) - 1


# ---- the real model ---------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_generate_on_the_packaged_smollm2(capsys):
    # --start-layer 28: a river of 2 twins, so quantizing takes seconds rather than minutes.
    assert main(["generate", "What is 2+3?", "--max-new-tokens", "8", "--start-layer", "28"]) == 0
    line = summary_line(capsys.readouterr().out)
    assert re.search(r"[1-8] new tokens · decode \d+\.\d tok/s", line)
    assert "30 layers" in line  # "of 30" where it exits; "all 30" where tau auto ran the backbone
