"""Task accuracy of a river against its own backbone: GSM8K here, HumanEval in `humaneval.py`, and the loop both use.

One river model serves every system compared: the generation config chooses per call what runs (a plain
`GenerationConfig` is the untouched backbone, `RiverConfig(tau=-1)` the paper's full quantization, `RiverConfig(tau=t)`
the river). Each example runs on every system in turn, so drifting machine load hits all systems alike, and each call
is timed by `speed.time_generate` (decode tokens/s, prefill apart; mean exit depth from the call's `RiverCache`).

GSM8K: k-shot (the first k train questions, in order) greedy answers, scored by exact numeric match of the extracted
final number. Exemplar answers keep their reasoning and `#### <number>` line but drop GSM8K's calculator annotations
(`<<48/2=24>>`): they are tool-call markup for the original paper's calculator, not text a model should imitate.
"""

from __future__ import annotations

import copy
import json
import math
import os
import re
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch
from tqdm.auto import tqdm
from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList

from ..generation import RiverConfig
from .systems import twin_label
from .speed import Timing, time_generate

BACKBONE = "backbone"
FULL_QUANT = "full-quant (tau=-1)"


# ---- systems ----------------------------------------------------------------------------------------------------
def eval_systems(taus: list[float], river: bool = True, **generation_kwargs) -> dict[str, GenerationConfig]:
    """name -> generation config: the backbone, then (with `river`) full quantization and the river at each tau
    (repeated taus once; tau -1 is full quantization already)."""
    systems = {BACKBONE: GenerationConfig(**generation_kwargs)}
    if river:
        systems[FULL_QUANT] = RiverConfig(tau=-1, **generation_kwargs)
        for tau in dict.fromkeys(tau for tau in taus if tau != -1):
            systems[f"river tau={tau:g}"] = RiverConfig(tau=tau, **generation_kwargs)
    return systems


# ---- running every system on every example ---------------------------------------------------------------------
@dataclass
class Example:
    id: str
    prompt: str | list[dict]   # plain text (completed as is), or chat messages (through the chat template)
    gold: str | None = None    # the reference answer, when the task has one to show
    problem: dict | None = None  # task data the scorer needs (HumanEval's tests)


@dataclass
class Scored:
    prediction: str | None
    correct: bool
    detail: str | None = None  # e.g. HumanEval's "passed" / "failed: ..." / "timed out"


class StopOnText(StoppingCriteria):
    """Stops once the generated text contains a stop string. HF's own `stop_strings` needs a tokenizer whose tokens
    it can map back to text piece by piece, which not every tokenizer allows; decoding the tail works for any."""

    def __init__(self, tokenizer, stops, prompt_length: int):
        self.tokenizer, self.stops, self.prompt_length = tokenizer, tuple(stops), prompt_length
        self.tail = max(len(stop) for stop in self.stops) + 1  # tokens: each carries at least one character

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:  # input_ids: [B, T]
        start = max(self.prompt_length, input_ids.shape[1] - self.tail)
        texts = self.tokenizer.batch_decode(input_ids[:, start:], skip_special_tokens=True)
        return torch.tensor([any(stop in text for stop in self.stops) for text in texts], device=input_ids.device)


class _RecordingModel:
    """Hands `time_generate` the model and keeps the output of its `generate` call (the timer returns timings
    only); adds this call's extra `generate` arguments."""

    def __init__(self, model, **extra):
        self.model, self.extra, self.output = model, extra, None

    def generate(self, **kwargs):
        self.output = self.model.generate(**kwargs, **self.extra)
        return self.output


def encode_prompt(tokenizer, prompt: str | list[dict], device) -> dict[str, torch.Tensor]:
    """{"input_ids", "attention_mask"}, each [1, T]: chat messages through the template, plain text as is."""
    if isinstance(prompt, str):
        encoded = tokenizer(prompt, return_tensors="pt")
    else:
        encoded = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, return_dict=True,
                                                return_tensors="pt")
    input_ids = encoded["input_ids"]
    attention_mask = encoded.get("attention_mask")
    attention_mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
    return {"input_ids": input_ids.to(device), "attention_mask": attention_mask.to(device)}


def truncate_at(text: str, stops) -> str:
    """`text` up to the first occurrence of any stop string (generation stops *after* producing one)."""
    cut = min((index for index in (text.find(stop) for stop in stops) if index >= 0), default=len(text))
    return text[:cut]


def generate_text(model, tokenizer, inputs: dict, config: GenerationConfig, stops=()) -> tuple[str, Timing]:
    """The new text (cut before the first stop string) and the call's timing. Batch 1."""
    prompt_length = inputs["input_ids"].shape[1]
    extra = {"stopping_criteria": StoppingCriteriaList([StopOnText(tokenizer, stops, prompt_length)])} if stops else {}
    recorder = _RecordingModel(model, **extra)
    timing = time_generate(recorder, inputs, config)
    text = tokenizer.decode(recorder.output.sequences[0, prompt_length:], skip_special_tokens=True)
    return truncate_at(text, stops), timing


@dataclass
class EvalResult:
    records: list[dict] = field(default_factory=list)  # one per example: id, gold, systems -> name -> record
    timings: dict[str, list[Timing]] = field(default_factory=dict)

    def summaries(self, num_layers: int) -> dict[str, dict]:
        return {name: summarize(name, self.records, runs, num_layers) for name, runs in self.timings.items()}


def run_eval(model, tokenizer, examples: list[Example], systems: dict[str, GenerationConfig],
             score: Callable[[Example, str], Scored], stops=(), progress: bool = True) -> EvalResult:
    """Every system on every example (A B C, A B C, ...), after a short warm-up call per system. Generation stops
    at any of `stops` (the answer is cut before it)."""
    device = model.device
    warm_up(model, tokenizer, encode_prompt(tokenizer, examples[0].prompt, device), systems)
    result = EvalResult(timings={name: [] for name in systems})
    with tqdm(total=len(examples) * len(systems), desc="eval", disable=not progress) as bar:
        for example in examples:
            inputs = encode_prompt(tokenizer, example.prompt, device)
            record = {"id": example.id, "gold": example.gold, "systems": {}}
            for name, config in systems.items():
                text, timing = generate_text(model, tokenizer, inputs, config, stops)
                scored = score(example, text)
                result.timings[name].append(timing)
                record["systems"][name] = {**asdict(scored), "new_tokens": timing.new_tokens,
                                           "decode_tokens_per_s": timing.decode_tokens_per_s,
                                           "mean_exit_depth": timing.mean_exit_depth, "output": text}
                bar.update(1)
            result.records.append(record)
    return result


def warm_up(model, tokenizer, inputs: dict, systems: dict[str, GenerationConfig], tokens: int = 4) -> None:
    """First calls pay for allocation and kernel selection: one short call per system keeps that out of the rates."""
    for config in systems.values():
        short = copy.deepcopy(config)
        short.max_new_tokens = tokens
        generate_text(model, tokenizer, inputs, short)


def summarize(name: str, records: list[dict], timings: list[Timing], num_layers: int) -> dict:
    """Accuracy, median decode tok/s, and mean exit depth weighted by decoded positions (all layers: the backbone)."""
    correct = sum(record["systems"][name]["correct"] for record in records)
    rates = [t.decode_tokens_per_s for t in timings if not math.isnan(t.decode_tokens_per_s)]
    weighted = [(t.mean_exit_depth, t.new_tokens - 1) for t in timings
                if t.new_tokens > 1 and not math.isnan(t.mean_exit_depth)]
    positions = sum(n for _, n in weighted)
    depth = sum(d * n for d, n in weighted) / positions if positions else float("nan")
    return {"accuracy": correct / len(records), "correct": correct, "total": len(records),
            "mean_exit_depth": num_layers if name == BACKBONE else depth,
            "decode_tokens_per_s": statistics.median(rates) if rates else float("nan")}


# ---- reporting --------------------------------------------------------------------------------------------------
def markdown_table(summaries: dict[str, dict], num_layers: int, metric: str = "accuracy") -> str:
    base_rate = summaries.get(BACKBONE, {}).get("decode_tokens_per_s", float("nan"))
    lines = [f"| system | {metric} | correct | decode tok/s | vs backbone | mean exit depth (of {num_layers}) |",
             "|---|---:|---:|---:|---:|---:|"]
    for name, s in summaries.items():
        lines.append(f"| {name} | {s['accuracy']:.1%} | {s['correct']}/{s['total']} | "
                     f"{s['decode_tokens_per_s']:.1f} | {s['decode_tokens_per_s'] / base_rate:.2f}x | "
                     f"{s['mean_exit_depth']:.1f} |")
    return "\n".join(lines)


def twin_line(twins: dict | None) -> str:
    if twins is None:
        return "twins: none (--no-river: the backbone only)"
    return twin_label(twins)


def build_report(task: str, settings: dict, twins: dict | None, result: EvalResult, num_layers: int) -> dict:
    """What the JSON file holds: the run's settings, the twins as built, a summary per system, every answer."""
    return {"task": task, "created": time.strftime("%Y-%m-%dT%H:%M:%S"), "settings": settings, "twins": twins,
            "num_layers": num_layers, "systems": result.summaries(num_layers), "records": result.records}


def default_output_path(task: str) -> str:
    return os.path.join("runs", f"eval-{task}-{time.strftime('%Y%m%d-%H%M%S')}.json")


def write_json(path: str, payload: dict) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as file:
        json.dump(_finite(payload), file, indent=1)


def _finite(value):
    """NaN (no decoded tokens, no rate) becomes null: strict JSON has no NaN."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    return value


# ---- GSM8K ------------------------------------------------------------------------------------------------------
GSM8K_STOP = ("Question:",)
DATA_ENV = "RIVER_HF_DATA"
_NUMBER = r"-?\$?-?\d[\d,]*(?:\.\d+)?"
_ANSWER_PATTERNS = (re.compile(r"####\s*(" + _NUMBER + ")"),
                    re.compile(r"[Tt]he answer is\s*:?\s*(" + _NUMBER + ")"))


def extract_answer(text: str) -> str | None:
    """The final number of a GSM8K answer or model output, normalised ("1,234" -> "1234", "$18" -> "18"): the number
    after '####' if any, else after 'The answer is', else the last number in the text; None without a number."""
    for pattern in _ANSWER_PATTERNS:
        match = pattern.search(text)
        if match:
            return _normalise(match.group(1))
    numbers = re.findall(_NUMBER, text)
    return _normalise(numbers[-1]) if numbers else None


def _normalise(number: str) -> str:
    return number.replace(",", "").replace("$", "").rstrip(".")


def numbers_equal(prediction: str | None, gold: str) -> bool:
    if prediction is None:
        return False
    try:
        return math.isclose(float(prediction), float(gold), rel_tol=1e-9, abs_tol=1e-9)
    except ValueError:  # e.g. "--5"
        return False


def score_gsm8k(example: Example, output: str) -> Scored:
    prediction = extract_answer(output)
    return Scored(prediction=prediction, correct=numbers_equal(prediction, example.gold))


def clean_exemplar_answer(answer: str) -> str:
    """A train answer without GSM8K's calculator annotations: "48/2 = <<48/2=24>>24" -> "48/2 = 24"."""
    return re.sub(r"<<[^>]*>>", "", answer)


def gsm8k_prompt(exemplars: list[dict], question: str, chat: bool) -> str | list[dict]:
    """k-shot prompt: each exemplar as a prior user/assistant turn (chat) or a "Question: ...\\nAnswer: ..." block
    (plain); the test question last."""
    if chat:
        messages = []
        for shot in exemplars:
            messages += [{"role": "user", "content": f"Question: {shot['question']}"},
                         {"role": "assistant", "content": clean_exemplar_answer(shot["answer"])}]
        return messages + [{"role": "user", "content": f"Question: {question}"}]
    blocks = [f"Question: {shot['question']}\nAnswer: {clean_exemplar_answer(shot['answer'])}" for shot in exemplars]
    return "\n\n".join(blocks + [f"Question: {question}\nAnswer:"])


def gsm8k_examples(train: list[dict] | None, test: list[dict], shots: int, chat: bool,
                   limit: int | None = None) -> list[Example]:
    """The first `limit` test questions, each with the first `shots` train questions as exemplars, in file order."""
    check_shots(train, shots)
    exemplars = train[:shots] if shots else []
    return [Example(id=f"test-{idx}", prompt=gsm8k_prompt(exemplars, row["question"], chat),
                    gold=extract_answer(row["answer"]))
            for idx, row in enumerate(test[:limit])]


def check_shots(train: list[dict] | None, shots: int) -> None:
    if shots and (train is None or len(train) < shots):
        have = 0 if train is None else len(train)
        raise ValueError(f"`--shots` {shots} needs {shots} train examples but {have} were found; give `--data` a "
                         f"folder with train.jsonl and test.jsonl, or pass `--shots 0`.")


def read_jsonl(path: str | Path) -> list[dict]:
    with open(path) as file:
        return [json.loads(line) for line in file if line.strip()]


def default_data_root() -> Path:
    """$RIVER_HF_DATA, else ../shared/data beside the repository (where this workplace keeps the GSM8K files)."""
    if os.environ.get(DATA_ENV):
        return Path(os.environ[DATA_ENV])
    return Path(__file__).resolve().parents[3] / "shared" / "data"


def load_gsm8k(data: str | None = None, dataset: str | None = None) -> tuple[list[dict] | None, list[dict], str]:
    """(train rows or None, test rows, where they came from). Rows hold "question" and "answer".

    `data`: a folder with train.jsonl and test.jsonl, or one JSONL file of test questions (exemplars then come from a
    train.jsonl beside it, if there is one). `dataset`: a hub dataset id such as "openai/gsm8k" (needs `datasets`).
    Neither: the folder gsm8k/ under `default_data_root()`.
    """
    if data is not None and dataset is not None:
        raise ValueError("give either `--data` (local files) or `--dataset` (a hub dataset), not both.")
    if dataset is not None:
        return _load_hub_gsm8k(dataset)
    path = Path(data).expanduser() if data is not None else default_data_root() / "gsm8k"
    test_file = path if path.is_file() else path / "test.jsonl"
    if not test_file.is_file():
        where = f"`--data` {data!r}" if data is not None else f"the default data folder {str(path)!r}"
        raise ValueError(f"no GSM8K test.jsonl found at {where}. Pass `--data` a folder holding train.jsonl and "
                         f"test.jsonl (or a test JSONL file), set ${DATA_ENV} to a folder holding gsm8k/, or use "
                         f"`--dataset openai/gsm8k` with the `datasets` package installed.")
    test = read_jsonl(test_file)
    if not test:
        raise ValueError(f"`--data`: {str(test_file)!r} holds no questions.")
    train_file = test_file.with_name("train.jsonl")
    train = read_jsonl(train_file) if train_file.is_file() and train_file != test_file else None
    return train, test, str(path)


def _load_hub_gsm8k(dataset: str) -> tuple[list[dict], list[dict], str]:
    try:
        import datasets
    except ModuleNotFoundError:
        raise ValueError(f"`--dataset` {dataset!r} needs the `datasets` package (`pip install datasets`); or pass "
                         f"`--data` a local folder with train.jsonl and test.jsonl.") from None
    splits = datasets.load_dataset(dataset, "main")
    return [dict(row) for row in splits["train"]], [dict(row) for row in splits["test"]], dataset
