"""The examples run as written (on a tiny local model, so that they take seconds)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import load_module

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def load_example(name: str):
    return load_module(EXAMPLES / f"{name}.py")


def test_quickstart(saved_tiny_model, capsys):
    out = load_example("quickstart").main(["--model", str(saved_tiny_model), "--prompt", "w5 w9 w33",
                                           "--tau", "-1", "--max-new-tokens", "5"])
    assert out.sequences.shape == (1, 3 + 5)
    assert "mean exit depth 1.00 of 6 layers, 100% of generated tokens exited early" in capsys.readouterr().out


def test_pipeline_example(saved_tiny_model):
    result = load_example("pipeline_example").main(["--model", str(saved_tiny_model), "--max-new-tokens", "4"])
    assert result[0]["generated_text"].startswith("Three words")


def test_saved_river_example_loads_the_same_river(saved_tiny_model, tmp_path, capsys):
    before, after = load_example("saved_river").main(["--model", str(saved_tiny_model), "--folder",
                                                      str(tmp_path / "river"), "--max-new-tokens", "4"])
    assert torch.equal(before, after) and (tmp_path / "river" / "river_twins.safetensors").is_file()
    assert "same tokens as the river that was saved: True" in capsys.readouterr().out


def test_lossless_example_gives_the_backbone_output(saved_tiny_model, capsys):
    out, plain = load_example("lossless").main(["--model", str(saved_tiny_model), "--max-new-tokens", "6",
                                                "--draft-tokens", "3"])
    assert torch.equal(out.sequences, plain)
    assert "identical to the backbone's greedy output: True" in capsys.readouterr().out


def test_streaming_example_streams_what_it_returns(saved_tiny_model, capsys):
    out = load_example("streaming").main(["--model", str(saved_tiny_model), "--max-new-tokens", "5"])
    printed = capsys.readouterr().out
    assert out.sequences.shape[1] > 5 and "of the streamed tokens exited early" in printed


def test_offloading_example_keeps_the_tokens(saved_tiny_model, capsys):
    resident, offloaded = load_example("offloading").main(["--model", str(saved_tiny_model), "--layers", "3", "4",
                                                           "--max-new-tokens", "5"])
    assert torch.equal(resident, offloaded)
    assert "offloaded backbone layers: [3, 4]" in capsys.readouterr().out


def test_lora_example_tau_above_one_is_the_adapted_model(saved_tiny_model, capsys):
    pytest.importorskip("peft")
    river, plain = load_example("lora_river").main(["--model", str(saved_tiny_model), "--max-new-tokens", "4"])
    assert torch.equal(river, plain)
    assert "tau > 1 gives the adapted model's tokens: True" in capsys.readouterr().out


def test_calibrate_example_finds_a_tau(saved_tiny_model, capsys):
    found = load_example("calibrate").main(["--model", str(saved_tiny_model), "--target-match", "0.5",
                                            "--prompts", "w5 w9", "--tokens", "6"])
    assert found.chosen.match >= 0.5
    assert f"tau {found.chosen.tau:.4f}: match" in capsys.readouterr().out


def test_static_cache_example_runs_the_captured_river(saved_tiny_model, capsys):
    out = load_example("static_cache").main(["--model", str(saved_tiny_model), "--backend", "eager",
                                             "--max-new-tokens", "5"])
    assert type(out.cache).__name__ == "RiverStaticCache"
    assert "RiverStaticCache:" in capsys.readouterr().out
