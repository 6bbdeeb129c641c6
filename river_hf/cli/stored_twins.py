"""The command line's twins, kept between runs: `river-hf generate` builds the packaged model's river once.

Building twins runs HQQ's optimizer on every twin linear: most of a `river-hf` start (about a minute for SmolLM2 on
a 2-core CPU). `build_river_cached` keeps what it built as a saved river's twins file (`river_hf.saving.twin_files`:
portable codes, checked against fingerprints of the backbone's weights) under `twins/` in the user's cache folder
(`river_hf.cache_folder`), keyed by the model's name or path, its dtype and the twin settings; the next run packs the
twins from that file without HQQ. The kernels are chosen at load as always (`backend`).

Never silently wrong: a model whose weights changed under the same name has its mismatching twins rebuilt with a
`TwinsMismatchWarning` (then the file is written again); an unreadable file is removed and rebuilt, with a warning.
`RIVER_HF_CACHE=off` turns it off.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings

from ..core.config import RiverQuantConfig
from ..core.build import build_river
from ..saving.twin_files import (FORMAT_VERSION, TWINS_FILE, StoredTwinsError, TwinsMismatchWarning, save_twins,
                                 twin_settings)
from ..saving.twin_loading import StoredTwins
from ..cache_folder import CACHE_ENV, cache_root


def twins_folder(model, quant_config: RiverQuantConfig) -> str | None:
    """Where the twins of `model` under `quant_config` are kept, or None (cache off, or a model with no name)."""
    root = cache_root()
    name = getattr(model.config, "_name_or_path", None)
    if root is None or not name:
        return None
    name = os.path.abspath(name) if os.path.exists(name) else name
    identity = {"model": name, "dtype": str(model.dtype), "format": FORMAT_VERSION,
                "twins": twin_settings(quant_config)}
    key = hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:16]
    stem = os.path.basename(name.rstrip("/")) or "model"
    return os.path.join(root, "twins", f"{stem}-{key}")


def has_kept_twins(model, quant_config: RiverQuantConfig) -> bool:
    folder = twins_folder(model, quant_config)
    return folder is not None and os.path.isfile(os.path.join(folder, TWINS_FILE))


def build_river_cached(model, quant_config: RiverQuantConfig, progress: bool = True):
    """`build_river`, reading the twins kept for this model and config when there are some, and keeping them
    when they had to be built. Returns the model."""
    folder = twins_folder(model, quant_config)
    stored = _read(folder, quant_config)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", TwinsMismatchWarning)
        build_river(model, quant_config, progress=progress, stored_twins=stored)
    rebuilt = False
    for warning in caught:  # pass every warning on; a mismatch means the kept file is stale
        rebuilt |= issubclass(warning.category, TwinsMismatchWarning)
        warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
    if folder is not None and (stored is None or rebuilt):
        _keep(model, folder)
    return model


def _read(folder: str | None, quant_config: RiverQuantConfig) -> StoredTwins | None:
    if folder is None or not os.path.isdir(folder):
        return None
    try:
        return StoredTwins.read(folder, quant_config)
    except StoredTwinsError as error:
        warnings.warn(f"river_hf: the kept twins in {folder!r} are unusable ({error}); they are built again.",
                      stacklevel=3)
        return None


def _keep(model, folder: str) -> None:
    try:
        os.makedirs(folder, exist_ok=True)
        save_twins(model, folder)
    except (OSError, ValueError, RuntimeError) as error:  # keeping is an optimisation: the river built is good
        warnings.warn(f"river_hf: could not keep the twins in {folder!r} ({error}); the next run builds them "
                      f"again. Set {CACHE_ENV} to a writable folder, or {CACHE_ENV}=off.", stacklevel=3)
