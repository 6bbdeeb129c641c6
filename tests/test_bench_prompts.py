"""Where `river-hf bench` and calibration find their prompts (river_hf.bench.data): a JSONL file, GSM8K through
$RIVER_HF_DATA or packaged with river_hf, a hub dataset; and the errors that name what is missing or malformed."""

from __future__ import annotations

import sys

import pytest

from river_hf.bench import data as bench_data

from conftest import write_questions


def test_prompts_from_a_jsonl_with_question_or_prompt(tmp_path):
    path = write_questions(tmp_path / "p.jsonl", ["a", "b", "c"], field="prompt")
    assert bench_data.load_prompts(2, data=path).prompts == ["a", "b"]


def test_gsm8k_is_found_through_the_environment(tmp_path, monkeypatch):
    (tmp_path / "gsm8k").mkdir()
    write_questions(tmp_path / "gsm8k" / "train.jsonl", ["q1", "q2"])
    monkeypatch.setenv(bench_data.DATA_ENV, str(tmp_path))
    found = bench_data.load_prompts(5, split="train")
    assert found.prompts == ["q1", "q2"] and found.source == str(tmp_path / "gsm8k" / "train.jsonl")


def test_the_packaged_gsm8k_needs_nothing_beside_the_package(monkeypatch):
    monkeypatch.delenv(bench_data.DATA_ENV, raising=False)
    test, train = bench_data.load_prompts(3), bench_data.load_prompts(3, split="train")
    assert test.source == str(bench_data.PACKAGED_DATA / "gsm8k" / "test.jsonl") and len(test.prompts) == 3
    assert train.prompts[0] != test.prompts[0]  # calibration's split is not the bench's
    assert (bench_data.PACKAGED_DATA / "gsm8k" / "LICENSE").read_text().startswith("MIT License")


def test_missing_gsm8k_says_where_it_looked(tmp_path, monkeypatch):
    monkeypatch.setenv(bench_data.DATA_ENV, str(tmp_path))
    monkeypatch.setattr(bench_data, "PACKAGED_DATA", tmp_path / "package")
    with pytest.raises(ValueError, match="RIVER_HF_DATA.*`--data`"):
        bench_data.load_prompts(2)


def test_hub_dataset_without_datasets_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets -> ModuleNotFoundError
    with pytest.raises(ValueError, match="needs datasets, which is not installed here"):
        bench_data.load_prompts(2, dataset="openai/gsm8k:main")


@pytest.mark.parametrize("lines, message", [
    (['{"answer": 3}'], "has no string field 'question' or 'prompt'"),
    (["not json"], "is not JSON"),
    (["[1, 2]"], "is not a JSON object"),
])
def test_bad_prompt_files(tmp_path, lines, message):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=message):
        bench_data.load_prompts(2, data=str(path))
