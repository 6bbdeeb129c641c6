"""The user's river_hf cache folder: where work that is slow to redo and safe to reuse is kept between processes.

What lives there (each in its own subfolder or file, each keyed so that a stale entry is never used):
- `gguf/`: local GGUF files converted to safetensors (`river_hf.loading.gguf`);
- `kernel_choices/`: the kernels `backend="fastest"` measured, per machine (`river_hf.kernels.choice`);
- `twins/`: the twins the command line built, per model and twin settings (`river_hf.cli.stored_twins`);
- `packed_twins/`: saved rivers' twins in this machine's kernel layout, the 4 most recently loaded
  (`river_hf.saving.packed_cache`);
- `calibrations.json`: `river-hf calibrate`'s taus; `offload/`: offloaded layers' files (default folder).

Where: `$RIVER_HF_CACHE`, else `$XDG_CACHE_HOME/river_hf`, else `~/.cache/river_hf`. `RIVER_HF_CACHE=off` turns
every reuse off (each start then redoes the work); the calibration file and offload folder, which are not
optimisations, fall back to the default folder.
"""

from __future__ import annotations

import json
import os
import tempfile

CACHE_ENV = "RIVER_HF_CACHE"
_OFF = ("off", "0", "none", "")


def cache_root() -> str | None:
    """The cache folder, or None when `RIVER_HF_CACHE=off`."""
    configured = os.environ.get(CACHE_ENV)
    if configured is not None and configured.strip().lower() in _OFF:
        return None
    if configured:
        return os.path.expanduser(configured)
    return default_root()


def default_root() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "river_hf")


def data_root() -> str:
    """Where files that are not optimisations (calibrations, offloaded layers) go: the cache folder even when
    reuse is off."""
    return cache_root() or default_root()


def write_json_atomically(path: str, content) -> None:
    """Write JSON to `path` through a temporary file and a rename: a reader never sees half a file. Raises OSError."""
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    handle, partial = tempfile.mkstemp(prefix=".partial-", suffix=".json", dir=folder)
    try:
        with os.fdopen(handle, "w") as file:
            json.dump(content, file, indent=1, sort_keys=True)
        os.replace(partial, path)
    finally:
        if os.path.exists(partial):
            os.remove(partial)
