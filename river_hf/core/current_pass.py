"""Which river pass is running now, for the parts of a river model that live outside the decoder layers.

Decoder layers get the pass's `RiverCache` (and so its router) as an argument. The LM head does not: it only sees
hidden states. Two hooks on the top-level model bridge that gap: before a forward pass, `begin_pass` notes the pass's
`RiverCache` in a context variable; after it, `end_pass` hands the logits to the exit signal when it asks for them
(the "confidence" signal) and clears the note. A context variable is per thread (and per asyncio task), so two threads
generating on one model at once each see their own pass; nothing about a call is stored on the model.
"""

from __future__ import annotations

from contextvars import ContextVar

import torch
from torch import nn

from .kv_cache import ExitRecord

_ACTIVE_CACHE: ContextVar[ExitRecord | None] = ContextVar("river_hf_active_cache", default=None)


def cache_of(kwargs: dict):
    """The cache a forward call was given (transformers 5 names it `cache`; older code `past_key_values`)."""
    cache = kwargs.get("cache")
    return kwargs.get("past_key_values") if cache is None else cache


def river_cache_of(kwargs: dict) -> ExitRecord | None:
    """The call's river cache when it is a river pass (a RiverCache or RiverStaticCache with a router), else None."""
    cache = cache_of(kwargs)
    return cache if isinstance(cache, ExitRecord) and cache.router is not None else None


def active_router():
    """The router of the river pass running in this thread, or None during a plain pass."""
    cache = _ACTIVE_CACHE.get()
    return None if cache is None else cache.router


def begin_pass(module, args, kwargs) -> None:
    # a captured step: river_hf.core.captured_decode does this pass's bookkeeping outside the graph
    if torch.compiler.is_compiling():
        return
    _ACTIVE_CACHE.set(river_cache_of(kwargs))


def end_pass(module, args, kwargs, output) -> None:
    if torch.compiler.is_compiling():
        return
    cache = _ACTIVE_CACHE.get()
    _ACTIVE_CACHE.set(None)
    logits = getattr(output, "logits", None)
    if cache is not None and cache.router.signal.needs_logits and logits is not None:
        cache.router.signal.observe_logits(logits)


def hook_passes(model: nn.Module) -> list:
    """Install the two hooks on `model`; returns their handles (for remove_river)."""
    return [model.register_forward_pre_hook(begin_pass, with_kwargs=True),
            model.register_forward_hook(end_pass, with_kwargs=True, always_call=True)]
