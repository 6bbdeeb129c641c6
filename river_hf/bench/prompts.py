"""Where benchmark and calibration prompts come from: GSM8K questions by default, a local JSONL, or a hub dataset.

GSM8K is looked up, in order, under `$RIVER_HF_DATA/gsm8k/{split}.jsonl` and `<repo>/../shared/data/gsm8k/` (the
project's checkout keeps a copy there). Benchmarks use the test split, calibration the train split, so a tau is
never chosen on the prompts it is then measured on.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

DATA_ENV = "RIVER_HF_DATA"
PROMPT_FIELDS = ("question", "prompt")  # the first one a record has is the user message
REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass
class PromptSet:
    source: str           # the file or hub dataset the prompts came from
    prompts: list[str]


def data_roots() -> list[Path]:
    """Folders that may hold `gsm8k/`, in the order they are tried."""
    roots = [Path(os.environ[DATA_ENV]).expanduser()] if os.environ.get(DATA_ENV) else []
    return roots + [REPO_ROOT.parent / "shared" / "data"]


def gsm8k_path(split: str) -> Path:
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


def read_jsonl_prompts(path: str | Path, count: int) -> list[str]:
    """The first `count` prompts of a JSONL file, each line an object with a 'question' or 'prompt' field."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise ValueError(f"`--data`: file {str(path)!r} not found; give a JSONL file with a 'question' or 'prompt' "
                         f"field per line.")
    prompts = []
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if len(prompts) == count:
                break
            if line.strip():
                prompts.append(_prompt_of(_parse_line(line, path, number), f"{path}:{number}"))
    return prompts


def _parse_line(line: str, path: Path, number: int) -> dict:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(f"`--data`: line {number} of {str(path)!r} is not JSON ({error.msg}).") from None
    if not isinstance(record, dict):
        raise ValueError(f"`--data`: line {number} of {str(path)!r} is not a JSON object.")
    return record


def _prompt_of(record: dict, where: str) -> str:
    for name in PROMPT_FIELDS:
        if isinstance(record.get(name), str):
            return record[name]
    raise ValueError(f"`--data`: {where} has no string field {' or '.join(map(repr, PROMPT_FIELDS))}.")


def hub_prompts(dataset: str, split: str, count: int) -> list[str]:
    """`dataset` is a hub id, optionally with a config after a colon (`openai/gsm8k:main`); needs `datasets`."""
    try:
        import datasets
    except ModuleNotFoundError:
        raise ValueError(f"`--dataset`={dataset!r} needs the `datasets` package (`pip install datasets`); or pass "
                         f"`--data` with a local JSONL file.") from None
    name, _, config = dataset.partition(":")
    try:
        rows = datasets.load_dataset(name, config or None, split=split)
    except Exception as error:  # the hub raises many types (offline, missing split, gated); all mean "cannot load"
        raise ValueError(f"`--dataset`: could not load {dataset!r} split {split!r}: {error}") from error
    return [_prompt_of(rows[idx], f"{dataset}[{idx}]") for idx in range(min(count, len(rows)))]


def load_prompts(count: int, data: str | None = None, dataset: str | None = None, split: str = "test") -> PromptSet:
    """`count` user prompts: from `data` (local JSONL), else `dataset` (hub), else GSM8K's `split`."""
    if data is not None and dataset is not None:
        raise ValueError("Pass either `--data` (a local JSONL file) or `--dataset` (a hub id), not both.")
    if dataset is not None:
        prompts, source = hub_prompts(dataset, split, count), f"{dataset} ({split})"
    else:
        path = Path(data).expanduser() if data is not None else gsm8k_path(split)
        prompts, source = read_jsonl_prompts(path, count), str(path)
    if not prompts:
        raise ValueError(f"No prompts in {source}.")
    return PromptSet(source=source, prompts=prompts)
