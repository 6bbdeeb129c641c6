"""Decode speed of one generate call, timed per token (prefill apart), and interleaved comparisons."""

from __future__ import annotations

import copy
import statistics
import time
from dataclasses import dataclass, field

import torch
from transformers.generation.streamers import BaseStreamer

from ..core.kv_cache import RiverCache
from ..core.generation import RiverConfig


class TokenClock(BaseStreamer):
    """A streamer that timestamps every token: `generate` calls `put` with the prompt (before prefill), then once per
    new token, so `token_times` holds one time per generated token. `then` (e.g. a `TextStreamer`) gets every call
    after the clock has read the time: the one token-timing path of bench, eval and `river-hf generate`."""

    def __init__(self, then: BaseStreamer | None = None):
        self.start: float | None = None
        self.token_times: list[float] = []
        self.then = then

    def put(self, value):
        if value.is_cuda:  # kernels run asynchronously: a token exists once its step has finished
            torch.cuda.synchronize(value.device)
        now = time.perf_counter()
        if self.start is None:
            self.start = now
        else:
            self.token_times.append(now)
        if self.then is not None:
            self.then.put(value)

    def end(self):
        if self.then is not None:
            self.then.end()


@dataclass
class Timing:
    decode_tokens_per_s: float  # (n - 1) tokens over the time from the first new token to the last
    prefill_s: float            # from the call to the first new token
    new_tokens: int
    mean_exit_depth: float      # over decoded positions; nan for a plain backbone run
    token_times: list[float] = field(default_factory=list)  # seconds from the call to each new token (the raw data)
    token_ids: list[int] = field(default_factory=list)      # the new tokens (row 0)
    exit_depths: list[int] | None = None  # backbone layers each decoded position ran (row 0); None without a river
    cuda_peak_bytes: int | None = None    # torch.cuda.max_memory_allocated during the call; None on CPU
    layer_seconds: dict[str, float] | None = None  # decode steps' layer time: "backbone" / "skipped" (river only)

    def ms_per_token(self, part: str) -> float:
        """Milliseconds per decoded token of one part of the decoder layers' time (nan without a river)."""
        if self.layer_seconds is None or self.new_tokens < 2:
            return float("nan")
        return 1000 * self.layer_seconds.get(part, 0.0) / (self.new_tokens - 1)

    @property
    def decode_s(self) -> float:
        return self.token_times[-1] - self.token_times[0] if len(self.token_times) > 1 else float("nan")


@torch.no_grad()
def time_generate(model, inputs: dict, generation_config, profile: bool = False) -> Timing:
    """One timed generate call. `profile=True` (river configs only) also splits the decode steps' layer time into
    backbone and skipped layers (`Timing.layer_seconds`), at two clock reads per layer call."""
    device = inputs["input_ids"].device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    clock = TokenClock()
    generation_config = copy.deepcopy(generation_config)  # the caller's config stays as it was
    generation_config.return_dict_in_generate = True  # for the cache and its exit record
    extra = {}
    # generate gives the profiled cache its router and strategy; a static cache's steps are captured, not profiled
    if profile and isinstance(generation_config, RiverConfig) and generation_config.cache_implementation is None:
        extra["cache"] = RiverCache(config=model.config.get_text_config(decoder=True), profile=True)
    out = model.generate(**inputs, generation_config=generation_config, streamer=clock, **extra)
    times = [t - clock.start for t in clock.token_times]
    decode_s = times[-1] - times[0] if len(times) > 1 else float("nan")
    cache = out.cache
    river = hasattr(cache, "mean_exit_depth")
    return Timing(
        decode_tokens_per_s=(len(times) - 1) / decode_s, prefill_s=times[0], new_tokens=len(times),
        mean_exit_depth=cache.mean_exit_depth() if river else float("nan"), token_times=times,
        token_ids=out.sequences[0, inputs["input_ids"].shape[1]:].tolist(),
        exit_depths=cache.exit_depth[0, cache.prompt_length:].tolist() if river else None,
        cuda_peak_bytes=torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
        layer_seconds=dict(cache.seconds) if river else None)


def longest_prompt(prompts: list[dict]) -> dict:
    """The prompt to warm up on: a static cache sized for the longest call serves every shorter one, so compiled
    systems compile there and not inside a timed run (transformers keeps the longest length a model's static cache
    has had, and a longer one recompiles every captured graph)."""
    return max(prompts, key=lambda inputs: inputs["input_ids"].shape[-1])


def interleaved(model, systems: dict, prompts: list[dict], rounds: int = 2, progress=None,
                models: dict | None = None, profile: bool = False) -> dict[str, list[Timing]]:
    """Time every system (name -> generation config) on every prompt, after one warm-up pass, in the order
    A B C A B C ...: drifting machine load then hits all systems alike. `progress(n)` is called after each run.

    `models` (name -> model) runs a system on a model of its own (e.g. a static full-quantization reference that
    shares the weights); the others run on `model`. Runs are listed prompt by prompt, round after round."""
    models = models or {}
    warm_up = longest_prompt(prompts)
    for name, config in systems.items():  # warm-up: first calls pay for allocation and kernel selection
        time_generate(models.get(name, model), warm_up, config, profile)
    timings: dict[str, list[Timing]] = {name: [] for name in systems}
    for _ in range(rounds):
        for inputs in prompts:
            for name, config in systems.items():
                timings[name].append(time_generate(models.get(name, model), inputs, config, profile))
                if progress is not None:
                    progress(1)
    return timings


def median_rate(timings: list[Timing]) -> float:
    return statistics.median(t.decode_tokens_per_s for t in timings)
