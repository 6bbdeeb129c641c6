"""`river-hf bench --lossless K ...`: the lossless mode against the backbone, in one process, interleaved.

Per system: decode speed as a ratio to the backbone's, greedy match (the share of generated tokens equal to the
backbone's own greedy tokens on the same prompt: must be 100%), acceptance rate, tokens per backbone pass, how many
runs fell back to plain decoding and after how many tokens, and where the decode time went (drafting, verification,
of it the drafts that were thrown away, plain steps). Each lossless setting runs three times: as users get it (with
the fallback), with `draft_fallback=False`, whose speed says what drafting alone achieves on this machine, and the
same with `exact_verify=False` (one multi-row verification pass: what bit-exactness costs here).
"""

from __future__ import annotations

import copy
import statistics
import sys
from datetime import datetime, timezone

import torch
from tqdm.auto import tqdm
from transformers import GenerationConfig

from ..core.generation import RiverConfig
from ..loading.models import build_chat_inputs
from .speed import TokenClock
from .systems import BACKBONE, fixed_length, twin_description

SCHEMA = "river-hf-bench-lossless/1"
# (name suffix, draft_fallback, exact_verify): as users get it; drafting alone; drafting alone with one multi-row
# verification pass instead of the row-exact one (what exactness costs on this machine)
VARIANTS = (("", True, True), (" (no fallback)", False, True), (" (no fallback, batched verify)", False, False))


def lossless_systems(draft_lengths: list, signal_taus: list[tuple[str, float]], max_new_tokens: int) -> dict:
    """name -> generation config: the backbone, then per draft length and (signal, tau) the lossless mode with and
    without its fallback."""
    fixed = fixed_length(max_new_tokens)
    systems = {BACKBONE: GenerationConfig(**fixed)}
    for k in draft_lengths:
        for signal, tau in signal_taus:
            name = f"lossless k={k} {signal} tau={tau:g}"
            for suffix, fallback, exact in VARIANTS:
                systems[name + suffix] = RiverConfig(tau=tau, exit_signal=signal, lossless=True, num_draft_tokens=k,
                                                     draft_fallback=fallback, exact_verify=exact, **fixed)
    return systems


@torch.no_grad()
def timed_run(model, inputs: dict, config) -> dict:
    """One generate call timed per token (TokenClock); its tokens and, for lossless, its draft record's summary."""
    clock = TokenClock()
    config = copy.deepcopy(config)
    config.return_dict_in_generate = True
    out = model.generate(**inputs, generation_config=config, streamer=clock)
    times = [t - clock.start for t in clock.token_times]
    record = getattr(out.cache, "drafts", None)
    return {"new_tokens": len(times), "prefill_s": times[0], "decode_s": times[-1] - times[0],
            "decode_tokens_per_s": (len(times) - 1) / (times[-1] - times[0]),
            "token_ids": out.sequences[0, inputs["input_ids"].shape[1]:].tolist(),
            "drafts": record.summary() if record is not None else None}


def bench_lossless(model, tokenizer, prompts: list[str], systems: dict, rounds: int = 2) -> dict:
    """Every system on every prompt (batch 1), after one warm-up call each, interleaved A B C A B C ... -> record."""
    inputs = [build_chat_inputs(tokenizer, prompt, model.device) for prompt in prompts]
    for config in systems.values():
        timed_run(model, inputs[0], config)
    runs: dict[str, list[dict]] = {name: [] for name in systems}
    with tqdm(total=len(systems) * len(inputs) * rounds, desc="lossless (interleaved)", file=sys.stderr) as bar:
        for _ in range(rounds):
            for index, prompt_inputs in enumerate(inputs):
                for name, config in systems.items():
                    runs[name].append({"prompt": index, **timed_run(model, prompt_inputs, config)})
                    bar.update(1)
    base = statistics.median(run["decode_tokens_per_s"] for run in runs[BACKBONE])
    references = {run["prompt"]: run["token_ids"] for run in runs[BACKBONE]}
    return {"schema": SCHEMA, "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "settings": {"prompts": len(inputs), "rounds": rounds, "batch_size": 1, "warmup_passes": 1,
                         "max_new_tokens": systems[BACKBONE].max_new_tokens},
            "twins": twin_description(model),
            "systems": [{"name": name, "summary": system_summary(runs[name], base, references), "runs": runs[name]}
                        for name in systems]}


def system_summary(runs: list[dict], base_rate: float, references: dict[int, list[int]]) -> dict:
    """Speed ratio (median decode tok/s over the backbone's), match against the backbone's tokens, and the drafts."""
    rate = statistics.median(run["decode_tokens_per_s"] for run in runs)
    same = sum(a == b for run in runs for a, b in zip(run["token_ids"], references[run["prompt"]]))
    total = sum(len(references[run["prompt"]]) for run in runs)
    agreeing = [agreeing_prefix(run["token_ids"], references[run["prompt"]]) for run in runs]
    summary = {"decode_tokens_per_s": rate, "speed_ratio": rate / base_rate, "match": same / total,
               "identical_runs": sum(n == len(references[run["prompt"]]) for n, run in zip(agreeing, runs)),
               "first_divergence": [None if n == len(references[run["prompt"]]) else n
                                    for n, run in zip(agreeing, runs)]}
    drafts = [run["drafts"] for run in runs if run["drafts"] is not None]
    if drafts:
        summary.update(draft_summary(drafts))
    return summary


def agreeing_prefix(tokens: list[int], reference: list[int]) -> int:
    """How many leading tokens equal the reference's."""
    return next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), min(len(tokens), len(reference)))


def draft_summary(drafts: list[dict]) -> dict:
    """Pooled over runs: acceptance, tokens per backbone pass, fallbacks, and ms per generated token by part."""
    tokens = sum(d["new_tokens"] for d in drafts)
    drafted = sum(d["drafted"] for d in drafts)
    remembered = sum(bool(d.get("fallback_remembered")) for d in drafts)  # earlier calls' verdict: no probing
    fell_back = [d["fell_back_at"] for d in drafts
                 if d["fell_back_at"] is not None and not d.get("fallback_remembered")]
    per_token = {f"{part}_ms_per_token": 1000 * sum(d[f"{part}_seconds"] for d in drafts) / tokens
                 for part in ("draft", "verify", "rejected_draft", "plain")}
    return {"acceptance_rate": sum(d["accepted"] for d in drafts) / drafted if drafted else None,
            "tokens_per_backbone_pass": tokens / sum(d["backbone_passes"] for d in drafts),
            "runs_fell_back": len(fell_back), "runs_fallback_remembered": remembered, "runs": len(drafts),
            "median_fell_back_at": statistics.median(fell_back) if fell_back else None, **per_token}


def markdown_table(record: dict) -> str:
    """One row per system."""
    header = ("| system | decode tok/s | speed ratio | match | acceptance | tokens/backbone pass | fell back | "
              "draft / verify / rejected / plain ms per token |")
    lines = [header, "|---|---|---|---|---|---|---|---|"]
    for system in record["systems"]:
        s = system["summary"]
        if "acceptance_rate" in s:
            acceptance = "n/a" if s["acceptance_rate"] is None else f"{s['acceptance_rate']:.1%}"
            remembered = f" (+{s['runs_fallback_remembered']} remembered)" if s.get("runs_fallback_remembered") else ""
            drafts = (f"{acceptance} | {s['tokens_per_backbone_pass']:.2f} | "
                      f"{s['runs_fell_back']}/{s['runs']}{remembered} | "
                      f"{s['draft_ms_per_token']:.1f} / {s['verify_ms_per_token']:.1f} / "
                      f"{s['rejected_draft_ms_per_token']:.1f} / {s['plain_ms_per_token']:.1f}")
        else:
            drafts = "- | 1.00 | - | -"
        match = f"{s['match']:.1%} ({s['identical_runs']}/{len(system['runs'])} runs identical)"
        lines.append(f"| {system['name']} | {s['decode_tokens_per_s']:.1f} | {s['speed_ratio']:.3f}x | "
                     f"{match} | {drafts} |")
    return "\n".join(lines)
