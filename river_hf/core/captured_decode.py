"""The river on HF's static cache, with its decode steps captured: one compiled graph per exit depth.

How a user asks for it is transformers' own switch: `generate(..., cache_implementation="static")` (or in a
`RiverConfig`, or the model's `generation_config`). transformers then sizes a static cache and asks the model for it
(`_prepare_static_cache`); a river model answers with a `RiverStaticCache` holding the call's router
(`static_river_cache`). Where transformers compiles the decode step (a compileable cache on CUDA and the like; on CPU
when `compile_config._compile_all_devices` is set), it asks the model for `get_compiled_call(compile_config)`, its
`torch.compile(model.__call__)`; a river model wraps that call in a `CapturedDecode`.

Before each decode step `CapturedDecode` asks the router for the step's exit depth. A signal that knows it before
the step runs (`ExitSignal.planned_depth`: confidence and random always, the similarity signals at tau > 1 and
tau <= -1, where they read no score) fixes it, and the compiled call runs with the depth as a constant of the graph
(`planned_depth` on the cache, read by the RiverLayers; `RiverLMHead.captured_exit` for a quantized head): dynamo
keeps one graph per depth seen (confidence: two, the backbone and the exit at the first eligible depth; under
`mode="reduce-overhead"` each is a CUDA graph). The exit record and the signal's view of the logits are kept here,
outside the graph.

A similarity signal between the extremes (cosine, update_norm, cosine_first) reads the step's hidden states after
each eligible layer: such steps run eagerly, layer by layer, over the static cache. A compiled step would break its
graph at every decision, into one graph per layer (attention indexes the cache with `layer_idx`, so each layer's is
its own), and `benchmarks/scripts/compile_twins.py --parts layer --whole-step` measured layers compiled one by one as
slower than eager ones on a CPU (0.76-0.94x; the whole step compiled: 1.20-1.26x; benchmarks/zen5.md).
"""

from __future__ import annotations

import os
import sys
import threading
import time
import warnings
import weakref
from contextlib import contextmanager, nullcontext
from contextvars import ContextVar

import torch
from tqdm.auto import tqdm
from transformers import CompileConfig

from .kv_cache import RiverStaticCache
from .lm_head import river_lm_head
from .current_pass import river_cache_of

STATIC_IMPLEMENTATIONS = ("static", "offloaded_static")
# Steps that use a quantized LM head take turns: the traced head reads one flag of the (shared) RiverLMHead.
_QUANTIZED_HEAD_STEPS = threading.Lock()
# The river settings of this thread's `generate` call while transformers makes its static cache (contextvars: two
# threads generating on one model each see their own).
_PENDING_SETTINGS: ContextVar = ContextVar("river_hf_static_settings", default=None)
# compiled call -> the exit depths it has run: the first step at a depth compiles its graph (a progress line shows it)
_CAPTURED_DEPTHS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def requested_setting(name: str, generation_config, kwargs: dict, model_default):
    """A generation setting as transformers will read it: a keyword of `generate`, else the config passed, else the
    model's own `generation_config` (None when none sets it)."""
    for source in (kwargs, generation_config, model_default):
        value = source.get(name) if isinstance(source, dict) else getattr(source, name, None)
        if value is not None:
            return value
    return None


def compile_config_for(device) -> CompileConfig:
    """transformers' CompileConfig for captured decode steps on `device`: its defaults (inductor, CUDA graphs) on
    CUDA; elsewhere inductor's default mode, with the flag without which transformers compiles nothing there."""
    if torch.device(device).type == "cuda":
        return CompileConfig()
    config = CompileConfig(mode="default")
    config._compile_all_devices = True  # transformers' own switch; it compiles on CUDA-like devices only by default
    return config


def warn_shared_inductor_cache(device) -> None:
    """Warn when CPU steps compile under an `ATEN_CPU_CAPABILITY` override into inductor's default on-disk cache.
    torch 2.13 picks inductor's vector ISA from that variable but does not key its FX graph cache on it, so a graph
    generated for AVX-512 and found there by an AVX2-dispatch run is built with AVX2 flags: wrong values or a crash
    (benchmarks/icelake.md). A cache folder of the run's own (TORCHINDUCTOR_CACHE_DIR) avoids it."""
    capability = os.environ.get("ATEN_CPU_CAPABILITY")
    if torch.device(device).type != "cpu" or not capability or os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        return
    warnings.warn(f"river: ATEN_CPU_CAPABILITY={capability} is set and the compiled steps use inductor's default "
                  f"cache folder, which torch does not key on that variable: a graph cached by a run under another "
                  f"capability can compute wrong values or crash here. Set TORCHINDUCTOR_CACHE_DIR to a folder of "
                  f"this capability's own.", RuntimeWarning, stacklevel=3)


def check_static_river(model, settings, implementation: str | None) -> None:
    """Refuse, before anything runs, what a static river cache cannot hold (a ValueError naming the setting)."""
    if implementation not in STATIC_IMPLEMENTATIONS:
        return
    check_static_settings(settings, implementation)
    fix = "or drop `cache_implementation` (the default dynamic cache supports it)"
    if not getattr(model, "_can_compile_fullgraph", False):
        raise ValueError(f"`cache_implementation`={implementation!r}: transformers does not support a static cache "
                         f"for {type(model).__name__}; drop `cache_implementation`.")
    if any(getattr(module, "_hf_hook", None) is not None for module in model.modules()):
        raise ValueError(f"`cache_implementation`={implementation!r} on a model with accelerate hooks (an offloaded "
                         f"backbone, a device_map dispatch): they page weights in from Python on every call, which a "
                         f"captured step cannot hold; call `river_hf.reload_backbone(model)` first, {fix}.")


def check_static_settings(settings, implementation: str = "static") -> None:
    """The river settings a static river cache cannot run (a ValueError naming the setting); needs no model."""
    fix = "or drop `cache_implementation` (the default dynamic cache supports it)"
    if settings.lossless:
        raise ValueError(f"`cache_implementation`={implementation!r} with `lossless`=True: "
                         f"lossless mode crops the cache "
                         f"after each verification, which a static river cache does not support; set `lossless=False` "
                         f"{fix}.")
    if settings.kv_strategy != "river":
        raise ValueError(f"`cache_implementation`={implementation!r} needs `kv_strategy`='river' (got "
                         f"{settings.kv_strategy!r}): the other strategies leave some layers' slots unwritten for a "
                         f"while, and a static layer writes each new position at its own running count; use "
                         f"kv_strategy='river' {fix}.")


@contextmanager
def static_cache_settings(settings):
    """For the length of one `generate` call: the river settings `static_river_cache` builds its cache with."""
    token = _PENDING_SETTINGS.set(settings)
    try:
        yield
    finally:
        _PENDING_SETTINGS.reset(token)


def static_river_cache(model, plain_cache, model_kwargs: dict, new_river_cache):
    """The cache transformers made for a static generate (`plain_cache`), as a RiverStaticCache of the same length
    when this thread's call is a river call; `plain_cache` as it is otherwise (a plain static generate)."""
    settings = _PENDING_SETTINGS.get()
    if settings is None:
        return plain_cache
    # transformers' own sizing (the call's max length, or a longer one an earlier call used: no recompilation)
    river_cache = RiverStaticCache(config=model.config.get_text_config(decoder=True),
                                   max_cache_len=model._previous_max_cache_length,
                                   offloading=getattr(plain_cache, "offloading", False))
    return new_river_cache(model, settings, model_kwargs.get("attention_mask"), cache=river_cache)


def check_passed_static_cache(cache, input_length: int, max_new_tokens: int | None, batch_size: int | None = None,
                              dtype=None) -> None:
    """A RiverStaticCache the caller passed must have room for the prompt and every new token, and, once its tensors
    exist (a cache used before), hold this call's batch (`batch_size`: rows after generate's expansion for beams and
    return sequences) in the model's dtype: a ValueError naming `cache` before anything runs, where the static
    layers' index_copy_ would fail mid-step."""
    if not isinstance(cache, RiverStaticCache):
        return
    # the input holds the cached positions too when a call continues from a cache (transformers skips them)
    needed = max(cache.recorded_length, input_length) + (max_new_tokens or 0)
    if max_new_tokens is not None and needed > cache.max_cache_len:
        raise ValueError(f"`cache`: this RiverStaticCache holds {cache.max_cache_len} positions, and this call needs "
                         f"{needed} ({max(cache.recorded_length, input_length)} in the input + {max_new_tokens} new); "
                         f"make it with a larger `max_cache_len`, or lower `max_new_tokens`.")
    made = next((layer for layer in cache.layers if getattr(layer, "is_initialized", False)), None)
    if made is None:  # its tensors are made by the first update, at this call's batch and dtype
        return
    fresh = "make a new RiverStaticCache for this call (or pass none: river_hf makes one)"
    if batch_size is not None and made.keys.shape[0] != batch_size:
        raise ValueError(f"`cache`: this RiverStaticCache holds a batch of {made.keys.shape[0]} sequences, and this "
                         f"call runs {batch_size}; {fresh}.")
    if dtype is not None and made.keys.dtype != dtype:
        raise ValueError(f"`cache`: this RiverStaticCache holds {made.keys.dtype} keys and values, and the model "
                         f"computes in {dtype}; {fresh}.")


class CapturedDecode:
    """transformers' compiled decode call, steering each river step onto the graph of its planned exit depth."""

    def __init__(self, model, compiled_call):
        self.model = model
        self.compiled_call = compiled_call  # torch.compile(model.__call__), kept by transformers between calls

    def __call__(self, *args, **kwargs):
        cache = river_cache_of(kwargs)
        if cache is None:  # a plain pass (the backbone's own static generate): transformers' compiled call
            return self.compiled_call(*args, **kwargs)
        num_tokens = _new_tokens(kwargs)
        if not self._captures(cache, num_tokens):  # decided inside the step: layer by layer, eagerly
            return self.model(*args, **kwargs)
        router = cache.router
        depth = router.plan_step(num_tokens, is_first_step=False)
        with self._head_for(exited=depth < router.num_layers):
            cache.planned_depth = depth
            try:
                output = self._run(cache, depth, router.num_layers, args, kwargs)
            finally:
                cache.planned_depth = None
        logits = output.logits  # [B, T, V]
        cache.record_step(depth, logits.shape[0], num_tokens, logits.device)
        if router.signal.needs_logits:
            router.signal.observe_logits(logits)
        return output

    def _run(self, cache, depth: int, num_layers: int, args, kwargs):
        """The compiled call; the first time at `depth` it compiles (seconds to minutes), shown as a progress line
        and noted in the cache's `compiling_steps`."""
        seen = _CAPTURED_DEPTHS.setdefault(self.compiled_call, set())
        if depth in seen:
            return self.compiled_call(*args, **kwargs)
        path = "on the backbone" if depth >= num_layers else f"exiting after {depth} backbone layers"
        started = time.perf_counter()
        _end_streamed_line()
        with tqdm(total=1, desc=f"river: capturing the decode step {path} (once per exit depth)",
                  file=sys.stderr) as bar:
            output = self.compiled_call(*args, **kwargs)
            bar.update(1)
        cache.compiling_steps[cache.recorded_length] = time.perf_counter() - started
        seen.add(depth)
        return output

    @staticmethod
    def _captures(cache, num_tokens: int) -> bool:
        """A decode step of a planning signal, on a static river cache, without per-layer profiling."""
        return (isinstance(cache, RiverStaticCache) and num_tokens == 1 and cache.recorded_length > 0
                and cache.router.signal.plans_decode_steps and not cache.profile)

    def _head_for(self, exited: bool):
        head = river_lm_head(self.model)
        return nullcontext() if head is None else _captured_head(head, exited)


def _end_streamed_line() -> None:
    """On a terminal, start the capture's progress line on a line of its own. A capture happens mid-generate, after a
    streamer may have printed part of a line (the first token at least), and tqdm draws its bar from the line's start
    ('\r'), over that text: `river-hf generate --compile` showed "15 + 27" as "5 + 27". Elsewhere (logs, pipes)
    nothing is drawn over, so nothing is added."""
    if sys.stderr.isatty():
        sys.stdout.flush()
        sys.stderr.write("\n")


@contextmanager
def _captured_head(head, exited: bool):
    with _QUANTIZED_HEAD_STEPS:
        head.captured_exit = exited
        try:
            yield
        finally:
            head.captured_exit = False


def _new_tokens(kwargs: dict) -> int:
    """Positions this forward call adds (input_ids or inputs_embeds: [B, T, ...])."""
    inputs = kwargs.get("input_ids")
    inputs = kwargs.get("inputs_embeds") if inputs is None else inputs
    return inputs.shape[1]

