"""The JSON records that bench, eval and calibrate write: one writer, one naming rule, one early output check.

Records are strict JSON (NaN and infinities become null) so that any reader can load them. An output path is
checked before any model loads (`resolve_output`): a folder gets the default file name inside it, and a path whose
folder cannot be created or written fails at once, naming the flag.
"""

from __future__ import annotations

import json
import math
import os
from datetime import datetime
from pathlib import Path

RUNS_DIR = Path("runs")


def json_safe(value):
    """`value` with every NaN/inf float written as None (strict JSON has neither), through dicts, lists and tuples."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(item) for item in value]
    return value


def write_record(record: dict, path: str | Path) -> Path:
    """Write `record` as indented strict JSON (creating its folder); returns the path written."""
    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(json_safe(record), indent=1) + "\n")
    return path


def default_name(kind: str, suffix: str = ".json", now: datetime | None = None) -> str:
    """`<kind>-<timestamp><suffix>`, e.g. bench-20250101-120000.json or eval-gsm8k-20250101-120000.json."""
    return f"{kind}-{(now or datetime.now()).strftime('%Y%m%d-%H%M%S')}{suffix}"


def resolve_output(path: str | Path | None, name: str, flag: str = "--output") -> Path:
    """Where a record goes: `runs/<name>` when `path` is None, `<path>/<name>` when `path` is a folder (existing, or
    written with a trailing slash), else `path`. Raises ValueError naming `flag` when the file could not be written
    there (its folder is a file, or neither it nor the nearest existing folder above it is writable), so that a run
    fails before it measures anything rather than after."""
    if path is None:
        target = RUNS_DIR / name
    else:
        text = os.fspath(path)
        target = Path(text).expanduser()
        if target.is_dir() or text.endswith(("/", os.sep)):
            target = target / name
    if target.is_dir():
        raise ValueError(f"`{flag}` {str(target)!r} is a folder; give a file name.")
    _check_writable_folder(target.parent, flag)
    return target


def _check_writable_folder(folder: Path, flag: str) -> None:
    existing = folder
    while not existing.exists() and existing != existing.parent:  # the nearest folder that exists, to create below
        existing = existing.parent
    if not existing.is_dir():
        raise ValueError(f"`{flag}`: cannot create the folder {str(folder)!r}: {str(existing)!r} is a file.")
    if not os.access(existing, os.W_OK | os.X_OK):
        what = "write into" if existing == folder else "create the folder " + repr(str(folder)) + " in"
        raise ValueError(f"`{flag}`: cannot {what} {str(existing)!r} (permission denied); give a path you can write.")
