"""Handing freed memory back to the operating system right after the river drops large tensors.

glibc's allocator keeps freed heap memory in its arenas for reuse, so a process that drops hundreds of MB of weights
(`offload_backbone` moving backbone layers to disk, `remove_river` dropping the twins) keeps its private memory
(RssAnon) until `malloc_trim` asks glibc to return its free pages. Tried as a user would on SmolLM2 (issue 33): after
offloading layers 2-29, RssAnon did not fall at all until `malloc_trim(0)` was called; tests/test_offload.py checks
that it now falls right after the call.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc


def release_freed_memory() -> bool:
    """Collect garbage, then ask the C library to return free heap pages (glibc's `malloc_trim(0)`). Returns False
    where the C library has no `malloc_trim` (macOS, musl): there nothing more can be done from Python."""
    gc.collect()
    libc = _libc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True


@functools.cache
def _libc():
    """The process's C library when it offers malloc_trim (glibc), else None."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "malloc_trim") else None
