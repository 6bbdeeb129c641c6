"""A local GGUF file, converted once: its dequantized weights, config and tokenizer cached as a safetensors folder.

Loading a GGUF parses its metadata three times (tokenizer, config, weights) and dequantizes every tensor; for the
packaged SmolLM2-135M that is most of a start. The first load of a GGUF file at a dtype writes what it produced with
transformers' own `save_pretrained` into the cache; later loads read that folder, which holds exactly the same
tensors (same dtype, no second rounding), so a start is fast and gives the same model bit for bit.

Where: `gguf/` in the user's cache folder (`river_hf.cache_folder`). The folder's name holds a key
of the file's absolute path, size and modification time, the dtype and transformers' version, so a changed file or
an upgrade converts again. `RIVER_HF_CACHE=off` turns the cache off. Hub GGUFs (no local file) are not cached.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import warnings

import torch
import transformers

from ..cache_folder import CACHE_ENV, cache_root

COMPLETE_MARKER = "river_hf_gguf_complete"  # written last: a folder without it is an interrupted conversion


def cached_folder(gguf_path: str, dtype: torch.dtype) -> str | None:
    """Where the conversion of `gguf_path` at `dtype` lives (whether or not it exists yet); None: no caching."""
    root = cache_root()
    if root is None or not os.path.isfile(gguf_path):
        return None
    path = os.path.abspath(gguf_path)
    stat = os.stat(path)
    identity = f"{path}|{stat.st_size}|{stat.st_mtime_ns}|{dtype}|transformers {transformers.__version__}"
    key = hashlib.sha256(identity.encode()).hexdigest()[:16]
    stem = os.path.splitext(os.path.basename(path))[0]
    return os.path.join(root, "gguf", f"{stem}-{str(dtype).removeprefix('torch.')}-{key}")


def is_complete(folder: str | None) -> bool:
    return folder is not None and os.path.isfile(os.path.join(folder, COMPLETE_MARKER))


def store(folder: str, model, tokenizer) -> bool:
    """Write `model` and `tokenizer` to `folder` atomically (a temporary folder renamed into place). A failure
    (read-only or full disk) warns and leaves no partial folder behind; the caller goes on with what it loaded."""
    parent = os.path.dirname(folder)
    staging = None
    try:
        os.makedirs(parent, exist_ok=True)
        staging = tempfile.mkdtemp(prefix=".converting-", dir=parent)
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        open(os.path.join(staging, COMPLETE_MARKER), "w").close()
        if is_complete(folder):  # another process converted the same file meanwhile: keep theirs
            shutil.rmtree(staging)
        else:
            shutil.rmtree(folder, ignore_errors=True)  # an interrupted conversion's leftovers
            os.replace(staging, folder)
        return True
    except Exception as error:  # the cache is an optimisation: whatever fails, the loaded model is still good
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        warnings.warn(f"river_hf: could not cache the converted GGUF in {parent!r} ({error}); the next start "
                      f"converts it again. Set {CACHE_ENV} to a writable folder, or {CACHE_ENV}=off.", stacklevel=2)
        return False
