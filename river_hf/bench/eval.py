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
import math
import re
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
from tqdm.auto import tqdm
from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList

from ..loading.models import build_chat_inputs
from ..core.build import is_river
from .speed import Timing, time_generate
from .systems import BACKBONE, System, twin_description, twin_label


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


def run_eval(model, tokenizer, examples: list[Example], systems: list[System],
             score: Callable[[Example, str], Scored], stops=(), progress: bool = True) -> EvalResult:
    """Every system on every example (A B C, A B C, ...), after a short warm-up call per system. Generation stops
    at any of `stops` (the answer is cut before it). A string prompt is completed as is (`chat=False`)."""
    device = model.device
    warm_up(model, tokenizer, build_chat_inputs(tokenizer, examples[0].prompt, device, chat=False), systems)
    result = EvalResult(timings={system.name: [] for system in systems})
    with tqdm(total=len(examples) * len(systems), desc="eval", disable=not progress) as bar:
        for example in examples:
            inputs = build_chat_inputs(tokenizer, example.prompt, device, chat=False)
            record = {"id": example.id, "gold": example.gold, "systems": {}}
            for system in systems:
                text, timing = generate_text(system.model or model, tokenizer, inputs, system.config, stops)
                scored = score(example, text)
                result.timings[system.name].append(timing)
                record["systems"][system.name] = {**asdict(scored), "new_tokens": timing.new_tokens,
                                                  "decode_tokens_per_s": timing.decode_tokens_per_s,
                                                  "mean_exit_depth": timing.mean_exit_depth, "output": text}
                bar.update(1)
            result.records.append(record)
    return result


def warm_up(model, tokenizer, inputs: dict, systems: list[System], tokens: int = 4) -> None:
    """First calls pay for allocation and kernel selection: one short call per system keeps that out of the rates."""
    for system in systems:
        short = copy.deepcopy(system.config)
        short.max_new_tokens = tokens
        generate_text(system.model or model, tokenizer, inputs, short)


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


# ---- one call for a notebook ------------------------------------------------------------------------------------
@dataclass
class Task:
    """A task as `evaluate` runs it: its examples, how an answer is scored, where generation stops."""

    name: str
    examples: list[Example]
    score: Callable[[Example, str], Scored]
    stops: tuple[str, ...] = ()
    metric: str = "accuracy"
    settings: dict = field(default_factory=dict)  # what the report records about how the task was set up


def evaluate(model, tokenizer, task: Task, systems: list[System], settings: dict | None = None,
             progress: bool = True) -> dict:
    """Every system (e.g. `systems.eval_systems([0.97])`) on every example of `task`, on one model (a river model,
    or a plain one for backbone-only systems). Returns the report `write_record` writes and `report_table` prints;
    `settings` (e.g. the model's name) go into it before the task's own."""
    if not task.examples:
        raise ValueError(f"task {task.name!r} has no examples.")
    twins = twin_description(model) if is_river(model) else None
    result = run_eval(model, tokenizer, task.examples, systems, task.score, task.stops, progress)
    num_layers = model.config.get_text_config(decoder=True).num_hidden_layers
    settings = {**(settings or {}), "stop_strings": list(task.stops), **task.settings}
    return {**build_report(task.name, settings, twins, result, num_layers), "metric": task.metric}


def report_table(report: dict) -> str:
    """The twins, then the markdown table of a report from `evaluate`."""
    return twin_line(report["twins"]) + "\n" + markdown_table(report["systems"], report["num_layers"],
                                                               report.get("metric", "accuracy"))


# ---- GSM8K ------------------------------------------------------------------------------------------------------
GSM8K_STOP = ("Question:",)
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


def gsm8k_task(train: list[dict] | None, test: list[dict], shots: int = 5, chat: bool = True,
               limit: int | None = None, source: str = "") -> Task:
    """GSM8K k-shot (rows from `data.load_gsm8k`): chat turns or plain "Question: ... Answer:" text."""
    return Task("gsm8k", gsm8k_examples(train, test, shots, chat, limit), score_gsm8k, GSM8K_STOP,
                settings={"shots": shots, "prompt": "chat template" if chat else "plain text", "data": source})
