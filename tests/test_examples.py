"""The examples run as written (on a tiny local model, so that they take seconds)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def load_example(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_quickstart(saved_tiny_model, capsys):
    out = load_example("quickstart").main(["--model", str(saved_tiny_model), "--prompt", "w5 w9 w33",
                                           "--tau", "-1", "--max-new-tokens", "5"])
    assert out.sequences.shape == (1, 3 + 5)
    assert "mean exit depth 1.00 of 6 layers, 100% of generated tokens exited early" in capsys.readouterr().out


def test_pipeline_example(saved_tiny_model):
    result = load_example("pipeline_example").main(["--model", str(saved_tiny_model), "--max-new-tokens", "4"])
    assert result[0]["generated_text"].startswith("Three words")
