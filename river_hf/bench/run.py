"""`river-hf bench`: speed, exit depth, memory and fidelity of the backbone, full quantization, a static
full-quantization reference and the river at a grid of taus, in one process, on the same prompts.

Speed runs are interleaved after a warm-up (`speed.interleaved`); fidelity is teacher-forced against the backbone's
own greedy continuations, computed once (`fidelity.backbone_references`). The result is one JSON-ready record
(every raw token time included, so each ratio can be recomputed from it); `report.py` turns it into tables.

    record = bench(river_model, tokenizer, prompts, QUICK, Sweep(taus=[0.97, 0.98]))
    print(markdown_table(record)); write_record(record, "runs/bench.json")
"""

from __future__ import annotations

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

import torch
import transformers
from tqdm.auto import tqdm

from ..kernels import choice as kernel_choice, machine, matmulnbits as ort_kernel
from ..loading.models import build_chat_inputs
from ..core.twins import get_river
from ..core.build import is_river
from .bytes import add_byte_limits
from .fidelity import Fidelity, backbone_references
from .report import full_quant_target, versus_random
from .speed import Timing, interleaved, median_rate
from .step_split import step_split
from .systems import (
    BACKBONE,
    COMPILED_BACKBONE,
    STATIC_FULL_QUANT,
    Sweep,
    System,
    is_compiled,
    twin_description,
    weight_bytes,
)

SCHEMA = "river-hf-bench/1"


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

    @property
    def prompts_used(self) -> int:
        return max(self.prompts, self.fidelity_prompts)


FULL = BenchSettings()
QUICK = BenchSettings(prompts=2, rounds=1, max_new_tokens=64, fidelity_prompts=3, fidelity_tokens=32)


def bench(model, tokenizer, prompts: list[str], settings: BenchSettings = FULL, sweep: Sweep | None = None,
          systems: list[System] | None = None, *, model_id: str | None = None, prompt_source: str = "prompts",
          arguments: dict | None = None, started: dict | None = None) -> dict:
    """The whole bench on a river model: the systems of `sweep` (default: `Sweep()`), or `systems` as given,
    measured on `prompts` (user messages, through the chat template; at least `settings.prompts_used` of them), as
    one JSON-ready record. `model_id`, `prompt_source` and `arguments` are recorded as given; `started`: the
    `environment()` taken before the model loaded (default: now)."""
    started = started or environment()
    if not is_river(model):
        raise ValueError("`model` has no river: build it first with `river_hf.build_river(model, RiverQuantConfig())`.")
    if not prompts:
        raise ValueError("`prompts` is empty: the bench needs at least one prompt.")
    inputs = [build_chat_inputs(tokenizer, prompt, model.device) for prompt in prompts[:settings.prompts_used]]
    if systems is None:
        systems = (sweep or Sweep()).systems(model, inputs[0], settings.max_new_tokens)
    record = run_bench(model, inputs, settings, systems)
    model_id = model_id or getattr(model.config, "_name_or_path", "") or type(model).__name__
    return finish_record(record, model_id, str(model.device), dtype_name(model), prompt_source, prompts, arguments,
                         started)


def run_bench(model, prompt_inputs: list[dict], settings: BenchSettings, systems: list[System],
              fidelity: bool = True) -> dict:
    """Measure every system; `prompt_inputs` are chat inputs ({input_ids, attention_mask}, [1, T] each) for
    max(settings.prompts, settings.fidelity_prompts) prompts. `fidelity=False` (random weights): speed and memory
    only, every fidelity field None. Returns {"settings", "twins", "systems", "memory"}."""
    rss_built = peak_rss_bytes()  # the river is built; nothing measured yet
    speed_prompts = prompt_inputs[:settings.prompts]
    timings = measure_speed(model, systems, speed_prompts, settings.rounds)
    fidelities = measure_all_fidelity(model, systems, prompt_inputs[:settings.fidelity_prompts],
                                      settings.fidelity_tokens) if fidelity else None
    twins = twin_description(model)
    taus = [system.tau for system in systems if system.kind == "river" and system.signal == "cosine"]
    records = system_records(systems, timings, fidelities, twins, len(speed_prompts))
    add_byte_limits(records, [system.model or model for system in systems])
    for record, split in zip(records, measure_step_splits(model, systems, speed_prompts[0])):
        record["summary"]["step_split_ms_per_token"] = split
    gain = get_river(model).exit_gain  # measured when the defaults system was made
    return {"settings": {**asdict(settings), "taus": taus, "batch_size": 1, "warmup_passes": 1},
            "twins": twins, "systems": records, "memory": memory_report(model, rss_built),
            "exit_gain": None if gain is None else {**asdict(gain), "speedup": gain.speedup, "pays": gain.pays}}


def measure_speed(model, systems: list[System], prompts: list[dict], rounds: int) -> dict[str, list[Timing]]:
    configs = {system.name: system.config for system in systems}
    models = {system.name: system.model for system in systems if system.model is not None}
    with tqdm(total=len(configs) * len(prompts) * rounds, desc="speed (interleaved)", file=sys.stderr) as bar:
        return interleaved(model, configs, prompts, rounds, progress=bar.update, models=models, profile=True)


def measure_step_splits(model, systems: list[System], inputs: dict) -> list[dict]:
    """Per system, where a decode step's time goes (`step_split`): one extra, hooked generate call each; None for
    compiled systems (a hook inside a captured graph would time nothing, or break the graph it times)."""
    return [None if is_compiled(system.config) else step_split(system.model or model, inputs, system.config)
            for system in tqdm(systems, desc="step split (hooked)", file=sys.stderr)]


def measure_all_fidelity(model, systems: list[System], prompts: list[dict], tokens: int) -> dict[str, Fidelity]:
    """Teacher-forced fidelity of every system but the backbone, against backbone references computed once."""
    references = backbone_references(model, [inputs["input_ids"] for inputs in prompts], tokens, progress=True)
    measured = [system for system in systems if system.kind != "backbone"]
    return {system.name: system.fidelity(model, references)
            for system in tqdm(measured, desc="fidelity (teacher-forced)", file=sys.stderr)}


# ---- the record -------------------------------------------------------------------------------------------------
def system_records(systems: list[System], timings: dict[str, list[Timing]],
                   fidelity: dict[str, Fidelity] | None, twins: dict, num_prompts: int) -> list[dict]:
    """One record per system; `fidelity` None: not measured (every fidelity field None)."""
    base = median_rate(timings[BACKBONE])
    static = median_rate(timings[STATIC_FULL_QUANT]) if STATIC_FULL_QUANT in timings else None
    compiled = median_rate(timings[COMPILED_BACKBONE]) if COMPILED_BACKBONE in timings else None
    records = []
    for system in systems:
        runs = timings[system.name]
        summary = speed_summary(runs, base, static, compiled)
        summary.update(depth_summary(runs, system.kind, twins))
        records.append({**system.describe(), "summary": summary,
                        "fidelity": _fidelity_record(fidelity.get(system.name)) if fidelity is not None
                        else dict(UNMEASURED_FIDELITY),
                        "runs": [run_record(run, idx, num_prompts) for idx, run in enumerate(runs)]})
    return records


def speed_summary(runs: list[Timing], base_rate: float, static_rate: float | None,
                  compiled_rate: float | None = None) -> dict:
    rate = median_rate(runs)
    peaks = [run.cuda_peak_bytes for run in runs if run.cuda_peak_bytes is not None]
    return {"decode_tokens_per_s": rate, "speed_ratio": rate / base_rate,
            "ratio_vs_static_full_quant": rate / static_rate if static_rate else None,
            "ratio_vs_compiled_backbone": rate / compiled_rate if compiled_rate else None,
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
        depth = twins["start_layer"] if kind == STATIC_FULL_QUANT else twins["num_layers"]
        return {"mean_exit_depth": float(depth), "exit_depth_histogram": None, "exit_depth_measured": False}
    counts = Counter(depth for run in runs for depth in run.exit_depths)
    total = sum(counts.values())
    mean = sum(depth * n for depth, n in counts.items()) / total if total else math.nan
    return {"mean_exit_depth": mean, "exit_depth_histogram": {str(d): counts[d] for d in sorted(counts)},
            "exit_depth_measured": True}


UNMEASURED_FIDELITY = {"match": None, "kl": None, "mean_exit_depth": None, "positions": None, "measured": False}


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


# OpenMP settings read once at process start: how torch's threads wait between parallel regions changes what the
# `matmulnbits_cpu` kernel (its own threads) measures (docs/activations.md)
OPENMP_VARIABLES = ("OMP_NUM_THREADS", *ort_kernel.OPENMP_WAIT_VARIABLES)


def environment() -> dict:
    """The machine and the libraries: CPU model, torch's CPU capability (AVX2 / AVX512 / AVX512_BF16 / AMX ...),
    threads, CPU count, versions, the OpenMP variables set, load average."""
    return {"python": platform.python_version(), "platform": platform.platform(), "torch": torch.__version__,
            "transformers": transformers.__version__, "hqq": _version("hqq"), "river_hf": _version("river-hf"),
            "onnxruntime": _version("onnxruntime"),
            "openmp": {name: os.environ[name] for name in OPENMP_VARIABLES if name in os.environ},
            **machine.cpu_description(),
            "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None}


def _version(package: str) -> str | None:
    try:
        return version(package)
    except PackageNotFoundError:
        return None


def dtype_name(model) -> str:
    """The backbone's dtype as records write it ("bfloat16")."""
    return str(model.dtype).removeprefix("torch.")


def finish_record(record: dict, model_id: str, device: str, dtype: str, prompt_source: str, prompts: list[str],
                  arguments: dict | None, started: dict) -> dict:
    """Add what the numbers depend on: the model, the prompts, versions, threads, machine load before and after."""
    settings = record["settings"]
    used = max(settings["prompts"], settings["fidelity_prompts"])
    return {"schema": SCHEMA, "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "arguments": arguments, "model": {"id": model_id, "device": device, "dtype": dtype},
            "prompts": {"source": prompt_source, "texts": prompts[:used], "speed": settings["prompts"],
                        "fidelity": settings["fidelity_prompts"]},
            "environment": {**started, "load_average_after": environment()["load_average"]},
            # the twin kernels this process measured (backend="fastest"), with every candidate's time
            "kernel_choices": [asdict(choice) for choice in kernel_choice.measured_choices()],
            **record, **comparisons(record["systems"])}


def comparisons(systems: list[dict]) -> dict:
    """The full-quant target and the comparisons with random routing (those need fidelity: skipped without)."""
    measured = any(system["fidelity"]["match"] is not None for system in systems)
    return {"target": full_quant_target(systems),
            "versus_random": versus_random(systems, "speed") if measured else {},
            "versus_random_at_equal_depth": versus_random(systems, "depth") if measured else {}}
