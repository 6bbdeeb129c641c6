"""`tau="auto"`, the default: the default signal's measured threshold, on a machine where exiting pays.

A river is only worth running where a step on the twins is faster than a step on the backbone. That depends on the
machine as much as on the model: on an AVX2-only CPU the twins' kernels gain 1.3-1.5x per matmul, and at 135M
parameters the matmuls are only ~40% of a step, so a fully exited step of SmolLM2 is no faster than a backbone step
(benchmarks/README.md, "AVX2"); on an AVX-512-BF16 CPU it is 1.5x faster. So the first `generate` that leaves tau to
its default measures, once per river, a decode step that exits as early as allowed against a backbone step
(interleaved, in this process, on this machine): the `ExitGain`. Where the exited step is at least `MIN_GAIN` faster,
tau="auto" is the signal's `DEFAULT_TAUS` entry; where it is not, tau="auto" exits nothing, `generate` runs the plain
backbone (never slower than it, by construction) and a warning says so once. An explicit tau is always obeyed.
In lossless mode tau="auto" is LOSSLESS_AUTO_TAU (-1: every draft leaves at the start layer), unmeasured: the
backbone verifies every draft, and the lossless fallback (river_hf.lossless.draft_control)
judges whether drafting pays here.
"""

from __future__ import annotations

import dataclasses
import inspect
import statistics
import time
import warnings
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from .kv_cache import RiverCache
from .river import River

from .settings import DEFAULT_TAUS, LOSSLESS_AUTO_TAU, RiverSettings
from .signals import reads_tau

MIN_GAIN = 0.05  # an exited step must be this much faster than a backbone step: below it, router costs eat the gain
NEVER_EXITS = 2.0  # a tau above every score: nothing exits
FULL_EXIT = RiverSettings(tau=-1.0, exit_signal="cosine", prefill_exit="none")  # the measurement's exited steps
_PROMPT_TOKENS = 16  # the measurement's prompt: long enough that attention reads a real cache
_MIN_STEPS, _MAX_STEPS = 3, 8  # timed decode steps per system (after one warm-up step each)
_MAX_SECONDS = 3.0  # stop adding steps once the measurement took this long (large models on CPU)


@dataclass(frozen=True)
class ExitGain:
    """One river's measured decode step: on the backbone, and exited as early as allowed (milliseconds)."""

    backbone_ms: float
    exited_ms: float
    steps: int
    device: str

    @property
    def speedup(self) -> float:
        return self.backbone_ms / self.exited_ms

    @property
    def pays(self) -> bool:
        return self.exited_ms <= self.backbone_ms * (1.0 - MIN_GAIN)

    def describe(self) -> str:
        return (f"a decode step exited at the river's start took {self.exited_ms:.1f} ms against the backbone's "
                f"{self.backbone_ms:.1f} ms ({self.speedup:.2f}x, median of {self.steps} interleaved steps on "
                f"{self.device})")


def auto_settings(settings: RiverSettings, river: River, measure) -> RiverSettings | None:
    """For tau="auto": `settings` with the signal's default tau where this river's exits pay on this machine, else
    None (run the plain backbone; warns once per river). `measure()` -> ExitGain runs once per river. Lossless
    settings get LOSSLESS_AUTO_TAU, unmeasured."""
    if not reads_tau(settings.exit_signal):  # random routing, a scripted signal: asked for as is, never guarded
        return dataclasses.replace(settings, tau=NEVER_EXITS)
    if settings.lossless:  # drafts leave at once; the fallback, not an exit-gain timing, judges this machine
        return dataclasses.replace(settings, tau=LOSSLESS_AUTO_TAU)
    gain = exit_gain(river, measure)
    if not gain.pays:
        _warn_once(river, gain)
        return None
    return dataclasses.replace(settings, tau=default_tau(settings.exit_signal))


def default_tau(exit_signal: str) -> float:
    if exit_signal not in DEFAULT_TAUS:
        raise ValueError(f"`tau`='auto' has no measured default for `exit_signal`={exit_signal!r} (defaults exist "
                         f"for {sorted(DEFAULT_TAUS)}); give `tau` a number.")
    return DEFAULT_TAUS[exit_signal]


def exit_gain(river: River, measure) -> ExitGain:
    """This river's ExitGain, measured on first use (`measure()`) and kept in its `River`: how the river runs on this
    machine belongs with how it was built, and a rebuilt river measures again."""
    if river.exit_gain is None:
        river.exit_gain = measure()
    return river.exit_gain


@torch.no_grad()
def measure_exit_gain(model, exited: RiverCache, clock=time.perf_counter) -> ExitGain:
    """Decode steps of `model` (a river) on the backbone and, through `exited` (a fresh RiverCache whose router exits
    as early as allowed: `FULL_EXIT`), on the twins, interleaved: the medians.

    Both systems prefill the same short prompt into their own cache, then decode one token per step; every round
    times one step of each, so a noisy neighbour slows both alike. `clock` is injectable for tests.
    """
    device = next(model.parameters()).device
    vocab = model.config.get_text_config(decoder=True).vocab_size
    prompt = (torch.arange(_PROMPT_TOKENS, device=device) % vocab).unsqueeze(0)  # [1, T]
    token = prompt[:, -1:]  # [1, 1]: the decoded token (its value does not change the cost)
    caches = {"backbone": DynamicCache(config=model.config), "exited": exited}
    # transformers 5.24 renamed forward's `past_key_values` to `cache` (the old name warns)
    cache_kwarg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    for cache in caches.values():  # prefill, then one untimed warm-up step each
        model(input_ids=prompt, use_cache=True, **{cache_kwarg: cache})
        model(input_ids=token, use_cache=True, **{cache_kwarg: cache})
    times: dict[str, list[float]] = {name: [] for name in caches}
    started = clock()
    while len(times["exited"]) < _MAX_STEPS and (len(times["exited"]) < _MIN_STEPS or clock() - started < _MAX_SECONDS):
        for name, cache in caches.items():
            times[name].append(_timed_step(model, {"input_ids": token, cache_kwarg: cache}, device, clock))
    return ExitGain(backbone_ms=statistics.median(times["backbone"]) * 1e3,
                    exited_ms=statistics.median(times["exited"]) * 1e3, steps=len(times["exited"]),
                    device=str(device))


def _timed_step(model, inputs: dict, device, clock) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    begin = clock()
    model(use_cache=True, **inputs)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return clock() - begin


def _warn_once(river: River, gain: ExitGain) -> None:
    if river.exit_gain_warned:
        return
    river.exit_gain_warned = True
    warnings.warn(f"river_hf: on this machine {gain.describe()}, so exiting does not pay: with tau='auto' nothing "
                  f"exits and generate runs the plain backbone. Pass a number as `tau` (e.g. tau=0.3 with the "
                  f"confidence signal) to exit anyway.", stacklevel=4)
