"""The backbone's dtype, chosen by measurement on this machine: `fastest_dtype(model)`.

Why measure: a decode step is batch-1 GEMVs, which read every weight once. bf16 halves fp32's bytes, and on the CPUs
where this project compared them it decodes faster (SmolLM2 on a 2-core AVX2 EPYC: 1.44-1.59x, benchmarks/README.md,
"The backbone's dtype"; on AVX-512-BF16 CPUs 1.2-2x, benchmarks/zen4.md and shared FACTS.md), but only where the CPU
converts bf16 fast enough to stay memory-bound, which a CPU without AVX2 need not. So the two candidates (bf16,
fp32) are timed on a batch-1 GEMV at the model's MLP shape ([intermediate, hidden], its largest layer matmul),
cache-cold and interleaved as the twins' kernels are (`kernel_choice`), and bf16 keeps its place (half the memory)
unless fp32 is faster by `kernel_choice.TIE_MARGIN`. The choice is remembered per machine in the kernel choices'
file. Prompts are not what this picks for: on AVX2 a bf16 GEMM (a prompt) is 5-7x slower than fp32, which a river
recovers by prefilling on its twins (`prefill_exit="auto"`).

On CUDA nothing is timed: bf16 where the GPU supports it, else fp16 (not measured: no GPU run yet).
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass

import torch
from torch import nn
from transformers import AutoConfig, PretrainedConfig

from . import choice as kernel_choice

CANDIDATES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
PREFERRED = "bfloat16"
_CHOICES: dict[tuple, "DtypeChoice"] = {}  # one measurement per process and key


@dataclass(frozen=True)
class DtypeChoice:
    """The backbone dtype chosen for one MLP shape, and each candidate's µs per batch-1 GEMV."""

    dtype: str
    out_features: int
    in_features: int
    microseconds: dict[str, float]
    remembered: bool = False

    @property
    def torch_dtype(self) -> torch.dtype:
        return CANDIDATES[self.dtype]

    def describe(self) -> str:
        timings = ", ".join(f"{name} {us:.0f}" for name, us in sorted(self.microseconds.items(), key=lambda x: x[1]))
        when = ", measured earlier on this machine" if self.remembered else ""
        return f"{self.dtype} (µs per GEMV at {self.in_features}x{self.out_features}: {timings}{when})"


def fastest_dtype(model: str | os.PathLike | PretrainedConfig | nn.Module, device: str | torch.device = "cpu",
                  **config_kwargs) -> torch.dtype:
    """The dtype to load `model` in for the fastest decoding on `device`: `from_pretrained(..., dtype=
    fastest_dtype(model_id))`. `model`: a hub id or local folder (its config is read; `config_kwargs` go to
    `AutoConfig.from_pretrained`, e.g. `gguf_file`), a config, or a loaded model."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return choose(mlp_shape(_config(model, config_kwargs)), device).torch_dtype


def choose(shape: tuple[int, int], device: torch.device = torch.device("cpu")) -> DtypeChoice:
    """The measured choice for an [out_features, in_features] weight (memo, then this machine's file, then timing)."""
    key = (*shape, torch.get_num_threads())
    if key not in _CHOICES:
        choice = _remembered(key, device)
        if choice is None:
            choice = _measure(shape, device)
            kernel_choice.remember_entry(_entry_key(key), {k: v for k, v in asdict(choice).items()
                                                           if k != "remembered"}, device)
        _CHOICES[key] = choice
    return _CHOICES[key]


def forget() -> None:
    """Drop this process's dtype choices (what a new process starts with); the machine's remembered ones stay, in
    `kernels.choice`'s store (`choice.forget()` drops those)."""
    _CHOICES.clear()


def measured_choices() -> list[DtypeChoice]:
    return list(_CHOICES.values())


def mlp_shape(config: PretrainedConfig) -> tuple[int, int]:
    """[intermediate, hidden]: the shape of the MLP's up projection, a decoder layer's largest matmul."""
    text = config.get_text_config(decoder=True)
    hidden = getattr(text, "hidden_size", None)
    if not isinstance(hidden, int) or hidden <= 0:
        raise ValueError(f"the model's config ({type(text).__name__}) has no `hidden_size`, so its dtype cannot be "
                         f"timed: choose it yourself (torch.bfloat16 decoded fastest wherever it was measured).")
    intermediate = getattr(text, "intermediate_size", None)
    return (intermediate if isinstance(intermediate, int) and intermediate > 0 else 4 * hidden), hidden


def _config(model, config_kwargs: dict) -> PretrainedConfig:
    if isinstance(model, nn.Module):
        model = getattr(model, "config", None)
    if isinstance(model, PretrainedConfig):
        return model
    if isinstance(model, (str, os.PathLike)):
        return AutoConfig.from_pretrained(model, **config_kwargs)
    raise TypeError(f"fastest_dtype: `model` must be a hub id or folder, a transformers config or a loaded model; got "
                    f"{type(model).__name__}.")


def _entry_key(key: tuple) -> str:
    out_features, in_features, threads = key
    return f"backbone dtype/{out_features}x{in_features}/{threads} threads"


def _remembered(key: tuple, device: torch.device) -> DtypeChoice | None:
    entry = kernel_choice.remembered_entry(_entry_key(key), device) or {}
    try:
        choice = DtypeChoice(**entry, remembered=True)
    except TypeError:
        return None
    return choice if choice.dtype in CANDIDATES and set(choice.microseconds) == set(CANDIDATES) else None


@torch.inference_mode()
def _measure(shape: tuple[int, int], device: torch.device) -> DtypeChoice:
    out_features, in_features = shape
    timings = kernel_choice.interleaved_medians(
        {name: _round_timer(out_features, in_features, dtype, device) for name, dtype in CANDIDATES.items()})
    fastest = min(timings, key=timings.get)
    chosen = PREFERRED if timings[PREFERRED] <= timings[fastest] * kernel_choice.TIE_MARGIN else fastest
    return DtypeChoice(chosen, out_features, in_features, timings)


def _round_timer(out_features: int, in_features: int, dtype: torch.dtype, device: torch.device):
    """A function timing one round: x [1, K] times each of enough weight copies to overflow the last-level cache
    twice (a decode step reads its weights from memory), µs per GEMV."""
    count = kernel_choice.cache_cold_copies(out_features * in_features * torch.finfo(dtype).bits // 8, device)
    weights = [torch.randn(out_features, in_features, device=device).to(dtype) for _ in range(count)]
    x = torch.randn(1, in_features, device=device).to(dtype)

    def timed_round() -> float:
        start = time.perf_counter()
        for weight in weights:
            torch.nn.functional.linear(x, weight)
        return (time.perf_counter() - start) / len(weights) * 1e6

    return timed_round
