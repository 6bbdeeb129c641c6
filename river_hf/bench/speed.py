"""Decode speed of one generate call, timed per token (prefill apart), and interleaved comparisons."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
from transformers.generation.streamers import BaseStreamer


class TokenClock(BaseStreamer):
    """A streamer that only timestamps: `generate` calls `put` with the prompt, then once per new token."""

    def __init__(self):
        self.start: float | None = None
        self.token_times: list[float] = []

    def put(self, value):
        now = time.perf_counter()
        if self.start is None:
            self.start = now
        else:
            self.token_times.append(now)

    def end(self):
        pass


@dataclass
class Timing:
    decode_tokens_per_s: float  # (n - 1) tokens over the time from the first new token to the last
    prefill_s: float            # from the call to the first new token
    new_tokens: int
    mean_exit_depth: float      # over decoded positions; nan for a plain backbone run


@torch.no_grad()
def time_generate(model, inputs: dict, generation_config) -> Timing:
    clock = TokenClock()
    out = model.generate(**inputs, generation_config=generation_config, streamer=clock, return_dict_in_generate=True)
    times = clock.token_times
    decode_s = times[-1] - times[0] if len(times) > 1 else float("nan")
    depth = out.cache.mean_exit_depth() if hasattr(out.cache, "mean_exit_depth") else float("nan")
    return Timing((len(times) - 1) / decode_s, times[0] - clock.start, len(times), depth)


def interleaved(model, systems: dict, prompts: list[dict], rounds: int = 2, progress=None) -> dict[str, list[Timing]]:
    """Time every system (name -> generation config) on every prompt, after one warm-up pass, in the order
    A B C A B C ...: drifting machine load then hits all systems alike. `progress(n)` is called after each run."""
    for config in systems.values():  # warm-up: first calls pay for allocation and kernel selection
        time_generate(model, prompts[0], config)
    timings: dict[str, list[Timing]] = {name: [] for name in systems}
    for _ in range(rounds):
        for inputs in prompts:
            for name, config in systems.items():
                timings[name].append(time_generate(model, inputs, config))
                if progress is not None:
                    progress(1)
    return timings


def median_rate(timings: list[Timing]) -> float:
    return statistics.median(t.decode_tokens_per_s for t in timings)
