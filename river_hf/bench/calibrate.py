"""`river-hf calibrate`: the fastest tau whose *measured* teacher-forced match meets a target, and where it is kept.

The search: teacher-forced match against the backbone is (near-)monotone in tau, so bisect tau between a failing
`lo` and a passing `hi` on measured match. Cosines crowd just below 1, so the bisection halves log(1 - tau), not
tau. Among every probe that met the target, the one with the lowest mean exit depth wins: depth orders taus by
speed (fewer backbone layers, more twin layers), but only measured match decides which taus qualify.

Calibrations are kept in one JSON file, `~/.cache/river_hf/calibration.json` (or `$RIVER_HF_CACHE/...`), keyed by
model and twin configuration; `river-hf generate --tau auto` reads them back.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

from ..core.config import RiverQuantConfig
from ..loading.models import DEFAULT_GGUF_FILE, build_chat_inputs, resolve_model_path
from ..cache_folder import data_root
from .fidelity import Reference, backbone_references
from .systems import river_system, twin_description

SIGNAL = "cosine"  # what `river-hf calibrate` searches the tau of (and `--tau auto` reads back for)
DEFAULT_TAU_RANGE = (-1.0, 0.999)  # tau > 1 is the backbone itself: 0.999 is the most faithful tau that may exit
DEFAULT_TOLERANCE = 0.002
DEFAULT_MAX_STEPS = 8
CALIBRATION_FILE = "calibration.json"


@dataclass
class Probe:
    tau: float
    match: float
    kl: float
    mean_exit_depth: float


class CalibrationError(ValueError):
    """The target cannot be met; `best` is the most faithful probe measured."""

    def __init__(self, message: str, best: Probe):
        super().__init__(message)
        self.best = best


def search_tau(measure: Callable[[float], Probe], target: float, lo: float = DEFAULT_TAU_RANGE[0],
               hi: float = DEFAULT_TAU_RANGE[1], tolerance: float = DEFAULT_TOLERANCE,
               max_steps: int = DEFAULT_MAX_STEPS, progress=None) -> tuple[Probe, list[Probe]]:
    """(chosen probe, every probe in the order measured). `measure(tau)` runs the teacher-forced measurement."""
    probes = []

    def probe(tau: float) -> Probe:
        probes.append(measure(tau))
        if progress is not None:
            progress(probes[-1])
        return probes[-1]

    if probe(hi).match < target:
        best = max(probes, key=lambda p: p.match)
        raise CalibrationError(
            f"`--target-match` {target:g} is out of reach: even tau={hi:g} (nearly every token on the backbone) "
            f"measures match {best.match:.4f} (KL {best.kl:.4f}, mean exit depth {best.mean_exit_depth:.1f}). "
            f"Lower the target, or build more faithful twins (e.g. `--nbits 8`, or a later `--start-layer`).", best)
    if probe(lo).match < target:
        for _ in range(max_steps):
            if hi - lo <= tolerance:
                break
            mid = 1.0 - math.sqrt((1.0 - lo) * (1.0 - hi))  # geometric midpoint of the distances to 1
            if probe(mid).match >= target:
                hi = mid
            else:
                lo = mid
    passing = [p for p in probes if p.match >= target]
    return min(passing, key=lambda p: (p.mean_exit_depth, p.tau)), probes


def teacher_forced_probe(model, references: list[Reference], **river) -> Callable[[float], Probe]:
    """measure(tau): the river at tau (and any other river settings: `exit_signal`, `kv_strategy`, ...) measured as
    the bench measures a system's fidelity."""
    def measure(tau: float) -> Probe:
        fidelity = river_system(tau, **river).fidelity(model, references)
        return Probe(tau=tau, match=fidelity.match, kl=fidelity.kl, mean_exit_depth=fidelity.mean_exit_depth)

    return measure


@dataclass
class Calibration:
    """What `calibrate` found: the chosen probe, every probe measured, and what they were measured on."""

    chosen: Probe
    probes: list[Probe]
    target_match: float
    twins: dict     # `systems.twin_description` of the river measured
    prompts: dict   # source, count, tokens, positions

    def entry(self) -> dict:
        """The calibration file's entry (see `save_calibration`)."""
        return calibration_entry(self.chosen, self.probes, self.target_match, self.twins, self.prompts)


def calibrate(model, tokenizer, prompts: list[str], target_match: float, tokens: int = 64,
              tau_range: tuple[float, float] = DEFAULT_TAU_RANGE, tolerance: float = DEFAULT_TOLERANCE,
              max_steps: int = DEFAULT_MAX_STEPS, source: str = "prompts", progress=None, **river) -> Calibration:
    """The fastest tau of a river model whose teacher-forced next-token match against its backbone, along the
    backbone's own `tokens`-token greedy continuations of `prompts` (user messages, through the chat template),
    meets `target_match`. `progress(probe)` is called after each measurement; `river` fixes the other river settings.
    Raises `CalibrationError` (a ValueError) when even the most faithful tau misses the target."""
    check_target(target_match)
    check_tau_range(*tau_range)
    inputs = [build_chat_inputs(tokenizer, prompt, model.device)["input_ids"] for prompt in prompts]
    references = backbone_references(model, inputs, tokens, progress=True)
    chosen, probes = search_tau(teacher_forced_probe(model, references, **river), target_match, *tau_range,
                                tolerance=tolerance, max_steps=max_steps, progress=progress)
    measured = {"source": source, "count": len(references), "tokens": tokens,
                "positions": sum(len(ref.continuation) for ref in references)}
    return Calibration(chosen, probes, target_match, twin_description(model), measured)


def check_target(target: float) -> None:
    if not (isinstance(target, (int, float)) and 0.0 < target <= 1.0):
        raise ValueError(f"`--target-match` must be a share of positions in (0, 1], e.g. 0.98; got {target!r}.")


def check_tau_range(lo: float, hi: float) -> None:
    if not (-1.0 <= lo < hi < 1.0):
        raise ValueError(f"`--tau-range` must satisfy -1 <= LO < HI < 1 (tau >= 1 never exits); got {lo:g} {hi:g}.")


# ---- the calibration file ---------------------------------------------------------------------------------------
def calibration_path() -> Path:
    return Path(data_root()).expanduser() / CALIBRATION_FILE


def model_id(model: str | None, gguf_file: str | None = None) -> str:
    """A stable name for the model: the packaged default, a hub id, or an absolute local path (GGUF file appended)."""
    if model is None and gguf_file is None:
        return f"packaged:{DEFAULT_GGUF_FILE}"
    path, gguf = resolve_model_path(model, gguf_file)
    path = os.path.abspath(path) if os.path.exists(path) else path
    return f"{path}/{gguf}" if gguf else path


def calibration_key(model: str, quant_config: RiverQuantConfig, device: str) -> str:
    """Model + everything that changes the twins' numerics (the kernel follows from backend and device)."""
    skip = ",".join(quant_config.skip_modules) or "-"
    device_type = str(device).split(":")[0]  # cuda:0 and cuda:1 run the same kernels
    head = f" lm_head={quant_config.head_nbits}" if quant_config.quantize_lm_head else ""
    return (f"{model} | nbits={quant_config.nbits} group_size={quant_config.group_size} "
            f"start_layer={quant_config.start_layer} skip={skip} backend={quant_config.backend}{head} | {device_type}")


def load_calibrations(path: Path | None = None) -> dict:
    path = path or calibration_path()
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text()).get("entries", {})
    except (json.JSONDecodeError, AttributeError) as error:
        raise ValueError(f"The calibration file {str(path)!r} is not valid JSON ({error}); delete it and run "
                         f"`river-hf calibrate` again.") from error


def save_calibration(key: str, entry: dict, path: Path | None = None) -> Path:
    """Add or replace one entry; the file is rewritten atomically."""
    path = path or calibration_path()
    entries = {**load_calibrations(path), key: entry}
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(".json.tmp")
    temporary.write_text(json.dumps({"version": 1, "entries": entries}, indent=1) + "\n")
    os.replace(temporary, path)
    return path


def lookup_calibration(key: str, path: Path | None = None) -> dict | None:
    return load_calibrations(path).get(key)


def calibration_entry(chosen: Probe, probes: list[Probe], target: float, twins: dict, prompts: dict) -> dict:
    return {"tau": chosen.tau, "match": chosen.match, "kl": chosen.kl, "mean_exit_depth": chosen.mean_exit_depth,
            "target_match": target, "twins": twins, "prompts": prompts, "probes": [asdict(p) for p in probes],
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds")}
