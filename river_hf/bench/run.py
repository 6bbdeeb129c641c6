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
from transformers import GenerationConfig

from ..generation import RiverConfig
from ..router import RiverSettings
from .fidelity import Fidelity, backbone_references, measure_fidelity
from .speed import Timing, interleaved, median_rate
from .systems import (
    BACKBONE,
    FULL_QUANT,
    STATIC_FULL_QUANT,
    river_name,
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


def run_bench(model, prompt_inputs: list[dict], settings: BenchSettings, taus: list[float]) -> dict:
    """Measure every system; `prompt_inputs` are chat inputs ({input_ids, attention_mask}, [1, T] each) for
    max(settings.prompts, settings.fidelity_prompts) prompts. Returns {"settings", "twins", "systems", "memory"}."""
    rss_built = peak_rss_bytes()  # the river is built; nothing measured yet
    static, taus = static_full_quant(model), river_taus(taus)
    speed_prompts = prompt_inputs[:settings.prompts]
    timings = measure_speed(model, static, system_configs(settings, taus), speed_prompts, settings.rounds)
    fidelity = measure_all_fidelity(model, static, prompt_inputs[:settings.fidelity_prompts],
                                    settings.fidelity_tokens, taus)
    twins = twin_description(model)
    return {"settings": {**asdict(settings), "taus": taus, "batch_size": 1, "warmup_passes": 1},
            "twins": twins, "systems": system_records(timings, fidelity, twins, taus, len(speed_prompts)),
            "memory": memory_report(model, rss_built)}


def measure_speed(model, static, configs: dict, prompts: list[dict], rounds: int) -> dict[str, list[Timing]]:
    with tqdm(total=len(configs) * len(prompts) * rounds, desc="speed (interleaved)", file=sys.stderr) as bar:
        return interleaved(model, configs, prompts, rounds, progress=bar.update, models={STATIC_FULL_QUANT: static})


def measure_all_fidelity(model, static, prompts: list[dict], tokens: int, taus: list[float]) -> dict[str, Fidelity]:
    """Teacher-forced fidelity of every system but the backbone, against backbone references computed once."""
    references = [backbone_references(model, [inputs["input_ids"]], tokens)[0]
                  for inputs in tqdm(prompts, desc="backbone references", file=sys.stderr)]
    systems = {FULL_QUANT: (model, RiverSettings(tau=-1.0)), STATIC_FULL_QUANT: (static, None),
               **{river_name(tau): (model, RiverSettings(tau=tau)) for tau in taus}}
    return {name: measure_fidelity(system, references, settings)
            for name, (system, settings) in tqdm(systems.items(), desc="fidelity (teacher-forced)", file=sys.stderr)}


def river_taus(taus: list[float]) -> list[float]:
    """The grid without duplicates and without tau <= -1 (that is full-quant, measured anyway)."""
    return sorted({float(tau) for tau in taus if tau > -1.0})


def system_configs(settings: BenchSettings, taus: list[float]) -> dict:
    """name -> generation config, in the order the systems run. All generate exactly max_new_tokens, greedily."""
    fixed = dict(max_new_tokens=settings.max_new_tokens, min_new_tokens=settings.max_new_tokens, do_sample=False)
    return {BACKBONE: GenerationConfig(**fixed), FULL_QUANT: RiverConfig(tau=-1.0, **fixed),
            STATIC_FULL_QUANT: GenerationConfig(**fixed),
            **{river_name(tau): RiverConfig(tau=tau, **fixed) for tau in river_taus(taus)}}


# ---- the record -------------------------------------------------------------------------------------------------
def system_records(timings: dict[str, list[Timing]], fidelity: dict[str, Fidelity], twins: dict,
                   taus: list[float], num_prompts: int) -> list[dict]:
    base, static = median_rate(timings[BACKBONE]), median_rate(timings[STATIC_FULL_QUANT])
    kinds = {BACKBONE: ("backbone", None), FULL_QUANT: ("full-quant", -1.0),
             STATIC_FULL_QUANT: ("static-full-quant", None), **{river_name(t): ("river", t) for t in taus}}
    records = []
    for name, runs in timings.items():
        kind, tau = kinds[name]
        summary = speed_summary(runs, base, static)
        summary.update(depth_summary(runs, kind, twins))
        fid = fidelity.get(name)
        records.append({"name": name, "kind": kind, "tau": tau, "summary": summary,
                        "fidelity": _fidelity_record(fid),
                        "runs": [run_record(run, idx, num_prompts) for idx, run in enumerate(runs)]})
    return records


def speed_summary(runs: list[Timing], base_rate: float, static_rate: float) -> dict:
    rate = median_rate(runs)
    peaks = [run.cuda_peak_bytes for run in runs if run.cuda_peak_bytes is not None]
    return {"decode_tokens_per_s": rate, "speed_ratio": rate / base_rate, "ratio_vs_static_full_quant":
            rate / static_rate, "prefill_ms": 1000 * statistics.median(run.prefill_s for run in runs),
            "cuda_peak_bytes": max(peaks) if peaks else None}


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
            "prefill_s": run.prefill_s, "decode_s": run.decode_s, "decode_tokens_per_s": run.decode_tokens_per_s, "token_times_s": run.token_times,
            "token_ids": run.token_ids, "exit_depths": run.exit_depths, "mean_exit_depth": run.mean_exit_depth,
            "cuda_peak_bytes": run.cuda_peak_bytes}


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
            **record, "target": full_quant_target(record["systems"])}


def full_quant_target(systems: list[dict]) -> dict:
    by_name = {system["name"]: system for system in systems}
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
    """The twin configuration and the settings, then one row per system."""
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
        lines.append(f"| {system_label(system)} | {sm['decode_tokens_per_s']:.1f} | {sm['speed_ratio']:.2f}x | "
                     f"{sm['ratio_vs_static_full_quant']:.2f}x | {sm['prefill_ms']:.0f} | {depth} | "
                     f"{fid['match']:.1%} | {fid['kl']:.4f} |")
    target = record["target"]
    lines += ["", f"full-quant (river, tau=-1) runs at {target['full_quant_vs_static_full_quant']:.2f}x the static "
                  f"full-quant model (target >= {target['target']}x: {'met' if target['met'] else 'NOT met'})"]
    return "\n".join(lines)


SYSTEM_LABELS = {"backbone": "backbone", "full-quant": "full-quant (river tau=-1)",
                 "static-full-quant": "static full-quant (no router)"}


def system_label(system: dict) -> str:
    return SYSTEM_LABELS.get(system["kind"]) or f"river tau={system['tau']:g}"
