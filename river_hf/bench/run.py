"""`river-hf bench`: speed, exit depth, memory and fidelity of the backbone, full quantization, a static
full-quantization reference and the river at a grid of taus, in one process, on the same prompts.

Speed runs are interleaved after a warm-up (`speed.interleaved`); fidelity is teacher-forced against the backbone's
own greedy continuations, computed once (`fidelity.backbone_references`). The result is one JSON-ready record
(every raw token time included, so each ratio can be recomputed from it) and a markdown table.
"""

from __future__ import annotations

import json
import math
import os
import platform
import resource
import statistics
import sys
from collections import Counter
from dataclasses import asdict, dataclass, fields, replace
from datetime import datetime, timezone
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch
import transformers
from tqdm.auto import tqdm

from .fidelity import Fidelity, backbone_references, measure_fidelity
from .speed import Timing, interleaved, median_rate
from .systems import (
    BACKBONE,
    FULL_QUANT,
    STATIC_FULL_QUANT,
    System,
    fixed_length,
    random_systems,
    reference_systems,
    signal_systems,
    static_full_quant,
    twin_description,
    twin_label,
    weight_bytes,
)

SCHEMA = "river-hf-bench/1"
# The paper's premise: full quantization through the river should run close to a model that simply is quantized.
FULL_QUANT_TARGET = 0.9


@dataclass
class BenchSettings:
    prompts: int = 3                 # speed prompts (batch 1)
    rounds: int = 2
    max_new_tokens: int = 128        # every speed run generates exactly this many tokens
    fidelity_prompts: int = 6
    fidelity_tokens: int = 64        # length of the backbone continuations fidelity is measured along

    def with_overrides(self, **values) -> BenchSettings:
        """These settings with every value that is not None replaced (unknown names are ignored)."""
        known = {f.name for f in fields(self)}
        return replace(self, **{k: v for k, v in values.items() if v is not None and k in known})


FULL = BenchSettings()
QUICK = BenchSettings(prompts=2, rounds=1, max_new_tokens=64, fidelity_prompts=3, fidelity_tokens=32)


def run_bench(model, prompt_inputs: list[dict], settings: BenchSettings, systems: list[System]) -> dict:
    """Measure every system; `prompt_inputs` are chat inputs ({input_ids, attention_mask}, [1, T] each) for
    max(settings.prompts, settings.fidelity_prompts) prompts. Returns {"settings", "twins", "systems", "memory"}."""
    rss_built = peak_rss_bytes()  # the river is built; nothing measured yet
    speed_prompts = prompt_inputs[:settings.prompts]
    timings = measure_speed(model, systems, speed_prompts, settings.rounds)
    fidelity = measure_all_fidelity(model, systems, prompt_inputs[:settings.fidelity_prompts], settings.fidelity_tokens)
    twins = twin_description(model)
    taus = [system.tau for system in systems if system.kind == "river" and system.signal == "cosine"]
    return {"settings": {**asdict(settings), "taus": taus, "batch_size": 1, "warmup_passes": 1},
            "twins": twins, "systems": system_records(systems, timings, fidelity, twins, len(speed_prompts)),
            "memory": memory_report(model, rss_built)}


def sweep_systems(model, settings: BenchSettings, taus: list[float], signals: dict[str, list[float]] | None = None,
                  exit_rates: list[float] = (), seed: int = 0, signal_layer: int | None = None) -> list[System]:
    """The default bench: backbone, full-quant, static full-quant, the cosine river at each tau; then any other
    signal's taus and the random-routing baseline at each exit rate."""
    fixed = fixed_length(settings.max_new_tokens)
    systems = reference_systems(static_full_quant(model), fixed) + signal_systems("cosine", river_taus(taus), fixed)
    for signal, signal_taus in (signals or {}).items():
        systems += signal_systems(signal, river_taus(signal_taus), fixed, signal_layer)
    return systems + random_systems(list(exit_rates), seed, fixed)


def measure_speed(model, systems: list[System], prompts: list[dict], rounds: int) -> dict[str, list[Timing]]:
    configs = {system.name: system.config for system in systems}
    models = {system.name: system.model for system in systems if system.model is not None}
    with tqdm(total=len(configs) * len(prompts) * rounds, desc="speed (interleaved)", file=sys.stderr) as bar:
        return interleaved(model, configs, prompts, rounds, progress=bar.update, models=models, profile=True)


def measure_all_fidelity(model, systems: list[System], prompts: list[dict], tokens: int) -> dict[str, Fidelity]:
    """Teacher-forced fidelity of every system but the backbone, against backbone references computed once."""
    references = [backbone_references(model, [inputs["input_ids"]], tokens)[0]
                  for inputs in tqdm(prompts, desc="backbone references", file=sys.stderr)]
    measured = [system for system in systems if system.kind != "backbone"]
    return {system.name: measure_fidelity(system.model or model, references, system.river_settings)
            for system in tqdm(measured, desc="fidelity (teacher-forced)", file=sys.stderr)}


def river_taus(taus: list[float]) -> list[float]:
    """The grid without duplicates and without tau <= -1 (that is full-quant, measured anyway)."""
    return sorted({float(tau) for tau in taus if tau > -1.0})


# ---- the record -------------------------------------------------------------------------------------------------
def system_records(systems: list[System], timings: dict[str, list[Timing]], fidelity: dict[str, Fidelity],
                   twins: dict, num_prompts: int) -> list[dict]:
    base = median_rate(timings[BACKBONE])
    static = median_rate(timings[STATIC_FULL_QUANT]) if STATIC_FULL_QUANT in timings else None
    records = []
    for system in systems:
        runs = timings[system.name]
        summary = speed_summary(runs, base, static)
        summary.update(depth_summary(runs, system.kind, twins))
        records.append({**system.describe(), "summary": summary,
                        "fidelity": _fidelity_record(fidelity.get(system.name)),
                        "runs": [run_record(run, idx, num_prompts) for idx, run in enumerate(runs)]})
    return records


def speed_summary(runs: list[Timing], base_rate: float, static_rate: float | None) -> dict:
    rate = median_rate(runs)
    peaks = [run.cuda_peak_bytes for run in runs if run.cuda_peak_bytes is not None]
    return {"decode_tokens_per_s": rate, "speed_ratio": rate / base_rate,
            "ratio_vs_static_full_quant": rate / static_rate if static_rate else None,
            "ms_per_token": 1000 / rate, "backbone_ms_per_token": _median_ms(runs, "backbone"),
            "skipped_ms_per_token": _median_ms(runs, "skipped"),
            "prefill_ms": 1000 * statistics.median(run.prefill_s for run in runs),
            "cuda_peak_bytes": max(peaks) if peaks else None}


def _median_ms(runs: list[Timing], part: str) -> float | None:
    """Median over runs of one part's decode-step layer time per token; None for plain systems (not profiled)."""
    values = [run.ms_per_token(part) for run in runs if run.layer_seconds is not None]
    return statistics.median(values) if values else None


def depth_summary(runs: list[Timing], kind: str, twins: dict) -> dict:
    """Mean exit depth and the histogram {depth: decoded positions} from the runs' exit records. Plain systems
    keep no record: their depth is the backbone's full depth, or start_layer for the static reference."""
    if runs[0].exit_depths is None:
        depth = twins["num_layers"] if kind == "backbone" else twins["start_layer"]
        return {"mean_exit_depth": float(depth), "exit_depth_histogram": None, "exit_depth_measured": False}
    counts = Counter(depth for run in runs for depth in run.exit_depths)
    total = sum(counts.values())
    mean = sum(depth * n for depth, n in counts.items()) / total if total else math.nan
    return {"mean_exit_depth": mean, "exit_depth_histogram": {str(d): counts[d] for d in sorted(counts)},
            "exit_depth_measured": True}


def _fidelity_record(fidelity: Fidelity | None) -> dict:
    if fidelity is None:  # the backbone against itself
        return {"match": 1.0, "kl": 0.0, "mean_exit_depth": None, "positions": None, "measured": False}
    return {**asdict(fidelity), "measured": True}


def run_record(run: Timing, index: int, num_prompts: int) -> dict:
    """One timed generate call; runs go prompt by prompt, round after round."""
    return {"round": index // num_prompts, "prompt": index % num_prompts, "new_tokens": run.new_tokens,
            "prefill_s": run.prefill_s, "decode_s": run.decode_s, "decode_tokens_per_s": run.decode_tokens_per_s,
            "token_times_s": run.token_times,
            "token_ids": run.token_ids, "exit_depths": run.exit_depths, "mean_exit_depth": run.mean_exit_depth,
            "cuda_peak_bytes": run.cuda_peak_bytes, "layer_seconds": run.layer_seconds}


def memory_report(model, rss_built: int) -> dict:
    """Weights by owner, and the process's peak RSS once the river was built and at the end (all systems share one
    process, so RSS is not per system; on CUDA each system's summary has its own `cuda_peak_bytes`)."""
    sizes = weight_bytes(model)
    return {"backbone_weight_bytes": sizes["backbone"], "twin_weight_bytes": sizes["twins"],
            "process_peak_rss_after_build_bytes": rss_built, "process_peak_rss_bytes": peak_rss_bytes(),
            "cuda_max_allocated_bytes": torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None}


def peak_rss_bytes() -> int:
    """The process's peak resident set so far (one process runs every system, so it is not per system)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux


def environment() -> dict:
    try:
        river_version = version("river-hf")
    except PackageNotFoundError:
        river_version = None
    return {"python": platform.python_version(), "platform": platform.platform(), "torch": torch.__version__,
            "transformers": transformers.__version__, "river_hf": river_version,
            "torch_threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
            "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None}


def finish_record(record: dict, model_id: str, device: str, prompt_source: str, prompts: list[str],
                  arguments: dict | None, started: dict) -> dict:
    """Add what the numbers depend on: the model, the prompts, versions, threads, machine load before and after."""
    settings = record["settings"]
    used = max(settings["prompts"], settings["fidelity_prompts"])
    return {"schema": SCHEMA, "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "arguments": arguments, "model": {"id": model_id, "device": device, "dtype": "bfloat16"},
            "prompts": {"source": prompt_source, "texts": prompts[:used], "speed": settings["prompts"],
                        "fidelity": settings["fidelity_prompts"]},
            "environment": {**started, "load_average_after": environment()["load_average"]},
            **record, "target": full_quant_target(record["systems"]),
            "versus_random": versus_random(record["systems"], "speed"),
            "versus_random_at_equal_depth": versus_random(record["systems"], "depth")}


def full_quant_target(systems: list[dict]) -> dict | None:
    by_name = {system["name"]: system for system in systems}
    if FULL_QUANT not in by_name or STATIC_FULL_QUANT not in by_name:
        return None
    ratio = by_name[FULL_QUANT]["summary"]["ratio_vs_static_full_quant"]
    return {"full_quant_vs_static_full_quant": ratio, "target": FULL_QUANT_TARGET, "met": ratio >= FULL_QUANT_TARGET}


def write_record(record: dict, path: str | Path) -> Path:
    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_json_safe(record), indent=1) + "\n")
    return path


def default_output(now: datetime | None = None) -> Path:
    return Path("runs") / f"bench-{(now or datetime.now()).strftime('%Y%m%d-%H%M%S')}.json"


def _json_safe(value):
    """NaN/inf are not JSON: write them as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(item) for item in value]
    return value


# ---- the table --------------------------------------------------------------------------------------------------
def markdown_table(record: dict) -> str:
    """The twin configuration and the settings, then one row per system (and the comparisons that apply)."""
    s, twins = record["settings"], record["twins"]
    lines = [twin_label(twins) + f" · model {record['model']['id']} on {record['model']['device']}",
             f"speed: {s['prompts']} prompts x {s['rounds']} rounds, {s['max_new_tokens']} new tokens, batch 1, "
             f"interleaved after warm-up, median; fidelity: teacher-forced, {s['fidelity_prompts']} prompts x "
             f"{s['fidelity_tokens']} backbone tokens; {record['environment']['torch_threads']} threads", "",
             f"| system | decode tok/s | vs backbone | vs static full-quant | prefill ms | mean exit depth "
             f"(of {twins['num_layers']}) | next-token match | KL |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for system in record["systems"]:
        sm, fid = system["summary"], system["fidelity"]
        depth = f"{sm['mean_exit_depth']:.1f}" + ("" if sm["exit_depth_measured"] else " (fixed)")
        vs_static = _ratio(sm["ratio_vs_static_full_quant"])
        lines.append(f"| {system_label(system)} | {sm['decode_tokens_per_s']:.1f} | {sm['speed_ratio']:.2f}x | "
                     f"{vs_static} | {sm['prefill_ms']:.0f} | {depth} | {fid['match']:.1%} | {fid['kl']:.4f} |")
    target = record.get("target")
    if target:
        met = "met" if target["met"] else "NOT met"
        lines += ["", f"full-quant (river, tau=-1) runs at {target['full_quant_vs_static_full_quant']:.2f}x the "
                      f"static full-quant model (target >= {target['target']}x: {met})"]
    for key, what in (("versus_random", "speed"), ("versus_random_at_equal_depth", "mean exit depth")):
        lines += _versus_random_lines(record.get(key), what)
    return "\n".join(lines)


def _versus_random_lines(comparison: dict | None, what: str) -> list[str]:
    if not comparison:
        return []
    lines = ["", f"against random routing at equal {what} (match of the system minus the random curve's, "
                 f"interpolated at the system's {what}):"]
    lines += [f"- {name}: {_points(entry['delta'])} ({entry['beats']} of {entry['points']} comparable points "
              f"above the curve" + ("" if entry["mean_delta"] is None else f"; mean {_points(entry['mean_delta'])}")
              + _dominance(entry.get("dominates_fastest_random")) + ")" for name, entry in comparison.items()]
    return lines


def _dominance(margins: list[float] | None) -> str:
    if not margins:
        return ""
    return (f"; {len(margins)} point(s) beyond the curve are also more faithful than its fastest point, by "
            + ", ".join(f"{m * 100:+.1f} pp" for m in margins))


def strategy_table(record: dict) -> str:
    """The paper's Fig. 3 as a table: per KV strategy and tau, where the decode time goes, and what it costs."""
    twins = record["twins"]
    lines = [f"| strategy | tau | mean exit depth (of {twins['num_layers']}) | backbone ms/token | skipped-layer "
             f"ms/token | total ms/token | vs backbone | next-token match | KL |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for system in record["systems"]:
        sm, fid = system["summary"], system["fidelity"]
        strategy = system["strategy"] or system["kind"]
        tau = "" if system["tau"] is None else f"{system['tau']:g}"
        lines.append(f"| {strategy} | {tau} | {sm['mean_exit_depth']:.1f} | {_ms(sm['backbone_ms_per_token'])} | "
                     f"{_ms(sm['skipped_ms_per_token'])} | {sm['ms_per_token']:.1f} | {sm['speed_ratio']:.2f}x | "
                     f"{fid['match']:.1%} | {fid['kl']:.4f} |")
    return "\n".join(lines)


def versus_random(systems: list[dict], axis: str = "speed") -> dict[str, dict]:
    """Per exit signal: how much more faithful than random routing it is at the same speed (axis="speed"), or at the
    same mean exit depth (axis="depth": the same share of backbone layers, router overhead aside).

    The random curve is (x, match) of the random-routing systems plus the backbone (1.0x / full depth, 100%),
    linearly interpolated. A system beyond the curve's fast end has no random system to compare with (random routing
    exits at a uniformly drawn depth, so even p=1 keeps about half the layers on the backbone): its delta is None
    and it is counted as `out_of_range`, not guessed."""
    def x_of(system):  # oriented so that the backbone is the curve's slow end (smallest x)
        return system["summary"]["speed_ratio"] if axis == "speed" else -system["summary"]["mean_exit_depth"]

    backbone = next((s for s in systems if s["kind"] == "backbone"), None)
    curve = sorted([(x_of(s), s["fidelity"]["match"]) for s in systems if s["kind"] == "random"]
                   + ([(x_of(backbone), 1.0)] if backbone is not None else []))
    if len(curve) < 2:
        return {}
    by_signal: dict[str, list[float | None]] = {}
    dominating: dict[str, list[float]] = {}
    for system in systems:
        if system["kind"] in ("river", "strategy") and system.get("signal"):
            x, match = x_of(system), system["fidelity"]["match"]
            random_match = _interpolate(curve, x)
            delta = None if random_match is None else match - random_match
            system["fidelity"][f"match_minus_random_at_equal_{axis}"] = delta
            label = system["signal"] if system["kind"] == "river" else f"{system['strategy']} ({system['signal']})"
            by_signal.setdefault(label, []).append(delta)
            if random_match is None and match > curve[-1][1]:  # beyond the curve AND more faithful than its end
                dominating.setdefault(label, []).append(match - curve[-1][1])
    return {label: {**_comparison(deltas), "dominates_fastest_random": dominating.get(label, [])}
            for label, deltas in by_signal.items()}


def _comparison(deltas: list[float | None]) -> dict:
    compared = [d for d in deltas if d is not None]
    return {"delta": deltas, "points": len(compared), "beats": sum(d > 0 for d in compared),
            "out_of_range": len(deltas) - len(compared),
            "mean_delta": sum(compared) / len(compared) if compared else None}


def _interpolate(curve: list[tuple[float, float]], x: float) -> float | None:
    """The curve's match at speed x; below its slowest point, its slowest point's; None beyond its fastest."""
    if x <= curve[0][0]:
        return curve[0][1]
    for (x0, y0), (x1, y1) in zip(curve, curve[1:]):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0) if x1 > x0 else max(y0, y1)
    return None


def _points(values) -> str:
    if isinstance(values, list):
        return ", ".join(_points(v) for v in values)
    return "faster than any random point" if values is None else f"{values * 100:+.1f} pp"


def _ratio(value) -> str:
    return "" if value is None else f"{value:.2f}x"


def _ms(value) -> str:
    return "" if value is None else f"{value:.1f}"


SYSTEM_LABELS = {"backbone": "backbone", "full-quant": "full-quant (river tau=-1)",
                 "static-full-quant": "static full-quant (no router)"}


def system_label(system: dict) -> str:
    if system["kind"] in SYSTEM_LABELS:
        return SYSTEM_LABELS[system["kind"]]
    if system["kind"] == "random":
        return f"random routing p={system['exit_rate']:g}"
    if system["kind"] == "strategy":
        return f"{system['strategy']} tau={system['tau']:g}"
    signal = "" if system.get("signal") in (None, "cosine") else f" ({system['signal']})"
    return f"river tau={system['tau']:g}{signal}"
