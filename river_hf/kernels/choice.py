"""`backend="fastest"`: pick each twin linear's kernel by timing the candidates on this machine, at this layer's shape.

Kernel speed does not travel: on an AVX-512-BF16 CPU the int4 kernel is ~2.5x a bf16 GEMV at SmolLM2's sizes, on an
AVX2-only CPU ~1.4x, and the 8-bit kernel can be slower than the bf16 GEMV it replaces (FACTS.md). So when a river
is built, every distinct (shape, bits, group size) is timed once per process on a batch-1 GEMV, as in decoding:
- the candidates are the kernels that can run those bits on this device (`kernels.KERNELS`), plus `dense` (the
  dequantized weight in bf16: the backbone's own speed, the floor);
- each candidate gets enough copies of a random weight to overflow the last-level cache (a decode step reads every
  layer's weights from memory, not from cache), and the candidates take turns, round after round, so a noisy
  neighbour slows all of them alike; the median time per call counts, activation casts included;
- on CUDA a candidate's round of calls is captured once as a CUDA graph and the replays are timed: a static
  river's decode step runs as a captured graph, where a kernel costs its GPU time, while an eager launch adds
  Python and driver time that can exceed a batch-1 GEMV on a GPU (and differs between a Triton kernel and
  cuBLAS): timed eagerly, launch costs would decide the choice;
- the device's preferred kernel keeps its place unless another is faster by `TIE_MARGIN`, so close calls do not
  flip from one build to the next.
Every choice made is kept (`measured_choices()`) for the bench record and the CLI's build message, and remembered
on disk per machine (`kernel_choices/` in the user's cache folder, `river_hf.cache_folder`): a later process on the
same machine (same CPU model and capability, or GPU name; torch version; kernel set; thread count) reads the choice
instead of timing again, which was ~11 s of every SmolLM2 build or saved-river load on a 2-core CPU. A remembered
choice says so (`remembered`, and "measured earlier" in `describe()`); `forget()` or `RIVER_HF_CACHE=off` times
again.

Prompts are another matter: a prefill multiplies [T, K] by the weight, compute-bound, where the packed kernels can be
slower than the backbone's bf16 GEMM. So each choice also times the chosen kernel against `dense` at
`PREFILL_TOKENS` rows; `prefill_exit="auto"` lets a prompt exit onto the twins only where that measured faster.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import time
import warnings
from dataclasses import asdict, dataclass, fields
from typing import Callable

import torch

from .registry import KERNELS, PREFERRED_BACKENDS, cast, int4_kernel_group, runs, shape_problem
from ..cache_folder import CACHE_ENV, cache_root, write_json_atomically
from .machine import last_level_cache_bytes, machine_identity

TIE_MARGIN = 1.10  # another kernel must be this much faster than the preferred one to replace it
ROUNDS, WARMUP_ROUNDS, MIN_ROUNDS = 15, 2, 3
SECONDS_PER_SHAPE = 1.0  # past this (a busy machine, a huge layer), stop after MIN_ROUNDS timed rounds
PREFILL_TOKENS = 128  # rows of the prefill-shaped timing (a typical chat prompt)
MAX_COPIES = 64
_CHOICES: dict[tuple, KernelChoice] = {}  # one measurement per process and key: a memo, not a switch
STORE_VERSION = 1  # bump when what a timing means changes (rounds, shapes timed): older files are then ignored


@dataclass(frozen=True)
class KernelChoice:
    """The kernel chosen for one layer shape, and what every candidate measured (µs per batch-1 call)."""

    out_features: int
    in_features: int
    nbits: int
    group_size: int | None
    device: str
    backend: str
    microseconds: dict[str, float]
    prefill_microseconds: dict[str, float]  # the chosen kernel and `dense` at PREFILL_TOKENS rows
    remembered: bool = False  # read from this machine's file of earlier measurements, not timed by this process

    @property
    def prefill_faster(self) -> bool:
        """Whether the chosen kernel runs a prompt-shaped matmul faster than the dense bf16 weight."""
        return self.prefill_microseconds[self.backend] < self.prefill_microseconds["dense"]

    def describe(self) -> str:
        timings = ", ".join(f"{name} {us:.0f}" for name, us in sorted(self.microseconds.items(), key=lambda x: x[1]))
        when = ", measured earlier on this machine" if self.remembered else ""
        return (f"{self.in_features}x{self.out_features} {self.nbits}-bit: {self.backend} "
                f"(µs per GEMV: {timings}{when})")


def fastest_backend(nbits: int, group_size: int | None, out_features: int, in_features: int,
                    device: torch.device, activations: str | None = None) -> KernelChoice:
    """The fastest kernel on this machine for a [out_features, in_features] weight of `nbits` bits (measured once);
    with activations="int8", kernels that quantize the activations are candidates too."""
    device = torch.device(device)
    key = (out_features, in_features, nbits, group_size, device.type, torch.get_num_threads(), activations)
    if key not in _CHOICES:
        names = candidates(nbits, group_size, out_features, in_features, device, activations)
        choice = _remembered(key, names, device)
        if choice is None:
            choice = _measure(names, nbits, group_size, out_features, in_features, device)
            _remember(key, choice, device)
        _CHOICES[key] = choice
    return _CHOICES[key]


def _measure(names: list[str], nbits: int, group_size: int | None, out_features: int, in_features: int,
             device: torch.device) -> KernelChoice:
    timings = time_candidates(names, nbits, group_size, out_features, in_features, device, rows=1)
    backend = _pick(timings, nbits, device)
    prefill = {"dense": timings["dense"]} if backend == "dense" else time_candidates(
        [backend, "dense"], nbits, group_size, out_features, in_features, device, rows=PREFILL_TOKENS)
    prefill.setdefault(backend, prefill["dense"])
    return KernelChoice(out_features, in_features, nbits, group_size, device.type, backend, timings, prefill)


def forget(machine: bool = True) -> None:
    """Drop every choice this process made; with `machine` (the default) also the ones remembered on this machine, so
    the next build times again. `forget(machine=False)` is what a new process on the same machine starts with."""
    _CHOICES.clear()
    if not machine:
        return
    for device in {torch.device("cpu")} | ({torch.device("cuda")} if torch.cuda.is_available() else set()):
        path = store_path(device)
        if path is not None and os.path.isfile(path):
            os.remove(path)


def keep(choice: KernelChoice, activations: str | None = None) -> None:
    """Use `choice` in this process for its layer shape, as if measured here (a choice made elsewhere, or one a test
    sets up): builds at that shape take it instead of timing."""
    key = (choice.out_features, choice.in_features, choice.nbits, choice.group_size, choice.device,
           torch.get_num_threads(), activations)
    _CHOICES[key] = choice


def lookup(out_features: int, in_features: int, nbits: int, backend: str, device) -> KernelChoice | None:
    """The choice this process measured that picked `backend` for this shape, if there is one."""
    device_type = torch.device(device).type
    return next((choice for choice in _CHOICES.values()
                 if (choice.out_features, choice.in_features, choice.nbits, choice.backend, choice.device)
                 == (out_features, in_features, nbits, backend, device_type)), None)


def candidates(nbits: int, group_size: int | None, out_features: int, in_features: int,
               device: torch.device, activations: str | None = None) -> list[str]:
    """Every kernel that can run this layer here, except the slow 'hqq' reference; kernels that quantize the
    activations only with activations="int8"."""
    return [name for name, kernel in KERNELS.items() if name != "hqq" and runs(name, nbits, device)
            and (activations == "int8" or not kernel.quantizes_activations)
            and shape_problem(name, out_features, in_features, _kernel_group(name, group_size)) is None]


def measured_choices() -> list[KernelChoice]:
    """Every choice this process made, in the order made."""
    return list(_CHOICES.values())


def _pick(timings: dict[str, float], nbits: int, device: torch.device) -> str:
    fastest = min(timings, key=timings.get)
    preferred = next((name for name in PREFERRED_BACKENDS if name in timings and runs(name, nbits, device)), None)
    if preferred is not None and timings[preferred] <= timings[fastest] * TIE_MARGIN:
        return preferred
    return fastest


def _kernel_group(backend: str, group_size: int | None) -> int | None:
    return None if KERNELS[backend].per_row else group_size  # the int8 kernels are per row


@torch.inference_mode()
def time_candidates(names: list[str], nbits: int, group_size: int | None, out_features: int, in_features: int,
                     device: torch.device, rows: int) -> dict[str, float]:
    """name -> median µs per call of x [rows, K] (bf16 in, bf16 out) times the weight, interleaved; rows=1 is a
    decode GEMV, timed cache-cold."""
    copies = None if rows == 1 else 1  # a prompt-sized matmul is compute-bound: the cache does not matter
    x = torch.randn(rows, in_features, dtype=torch.bfloat16, device=device)
    timers = {}
    for name in names:
        try:
            layers = _copies(name, nbits, _kernel_group(name, group_size), out_features, in_features, device, copies)
            _run_round(name, layers[:1], x)  # a first call: a kernel that cannot run here fails now, not mid-decode
            timers[name] = _round_timer(name, layers, x)
        except Exception as error:  # noqa: BLE001 (an optional package's kernel may fail in its own ways)
            if KERNELS[name].requires is None:
                raise
            warnings.warn(f"river_hf: the {name!r} kernel failed on a {out_features}x{in_features} {nbits}-bit layer "
                          f"({type(error).__name__}: {error}); it is left out of the choice.", stacklevel=2)
    return interleaved_medians(timers)


def interleaved_medians(rounds: dict[str, Callable[[], float]]) -> dict[str, float]:
    """name -> the median of what `rounds[name]()` returned (µs of one timed round), the candidates taking turns
    round after round (rotated: no fixed first slot) after WARMUP_ROUNDS, so a noisy neighbour slows all of them
    alike; past SECONDS_PER_SHAPE, stop after MIN_ROUNDS timed rounds."""
    names = list(rounds)
    samples: dict[str, list[float]] = {name: [] for name in names}
    started = time.perf_counter()
    for step in range(WARMUP_ROUNDS + ROUNDS):
        for name in names[step % len(names):] + names[:step % len(names)]:
            elapsed = rounds[name]()
            if step >= WARMUP_ROUNDS:
                samples[name].append(elapsed)
        if step + 1 >= WARMUP_ROUNDS + MIN_ROUNDS and time.perf_counter() - started > SECONDS_PER_SHAPE:
            break
    return {name: statistics.median(values) for name, values in samples.items()}


def _round_timer(name: str, copies: list, x: torch.Tensor) -> Callable[[], float]:
    """A timed round of kernel `name` over its copies: on CUDA the replay of the round captured as a CUDA graph (a
    captured decode step's cost is the kernels' GPU time; each eager launch adds microseconds of Python and driver
    time, as long as a small GEMV on a GPU, and more for a Triton kernel than a cuBLAS call), elsewhere the calls."""
    if not x.is_cuda:
        return lambda: _time_calls(lambda: _run_round(name, copies, x), len(copies), x)
    stream = torch.cuda.Stream(x.device)  # warm up on a side stream, as torch.cuda.graph asks
    stream.wait_stream(torch.cuda.current_stream(x.device))
    with torch.cuda.stream(stream):
        _run_round(name, copies, x)  # Triton's autotuning and lazy initialisation happen here, outside the capture
    torch.cuda.current_stream(x.device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _run_round(name, copies, x)
    return lambda: _time_calls(graph.replay, len(copies), x)


def _run_round(name: str, copies: list, x: torch.Tensor) -> None:
    kernel = KERNELS[name]
    for module in copies:
        inputs = x if kernel.activation_dtype is None else cast(x, kernel.activation_dtype)
        cast(kernel.matmul(module["buffers"], module["group"], inputs), torch.bfloat16)


def _time_calls(run: Callable[[], None], calls: int, x: torch.Tensor) -> float:
    """µs per call of `run()`, which makes `calls` calls (the device synchronised on both sides)."""
    _synchronize(x)
    start = time.perf_counter()
    run()
    _synchronize(x)
    return (time.perf_counter() - start) / calls * 1e6


def _copies(name: str, nbits: int, group_size: int | None, out_features: int, in_features: int, device,
            count: int | None = None) -> list:
    """Packed random weights for kernel `name`, enough of them to overflow the last-level cache twice (one, when a
    weight alone does: an LM head then costs its own bytes once per candidate, not several times)."""
    groups = in_features // group_size if group_size else 1
    codes = torch.randint(0, 2 ** nbits, (out_features, in_features), dtype=torch.uint8, device=device)
    scale = torch.rand(out_features, groups, device=device) * 0.01 + 1e-3
    zero = torch.full((out_features, groups), 2.0 ** (nbits - 1), device=device)
    kernel = KERNELS[name]
    buffers = kernel.pack(codes, scale, zero, group_size, nbits)
    nbytes = sum(t.numel() * t.element_size() for t in buffers.values())
    del codes, scale, zero
    count = count or cache_cold_copies(nbytes, device)
    kernel_group = int4_kernel_group(in_features, group_size) if "scales_and_zeros" in buffers else None
    clones = [{key: t.clone() for key, t in buffers.items()} for _ in range(count - 1)]
    prepack = kernel.prepack or (lambda packed, _nbits: packed)
    return [{"buffers": prepack(copy, nbits), "group": kernel_group} for copy in [buffers, *clones]]


def cache_cold_copies(nbytes: int, device: torch.device | str = "cpu") -> int:
    """How many copies of a `nbytes` weight overflow the device's last-level cache twice (the CPU's L3, a GPU's L2),
    so that cycling through them reads each from memory as a decode step does (at most MAX_COPIES; one where a weight
    alone overflows it)."""
    return max(1, min(MAX_COPIES, -(-2 * last_level_cache_bytes(device) // max(nbytes, 1))))


def _synchronize(x: torch.Tensor) -> None:
    if x.is_cuda:
        torch.cuda.synchronize(x.device)


# ---------------------------------------------------------------- remembered choices, per machine


def store_identity(device: torch.device) -> dict:
    """What the store of measurements is keyed by: this machine (`machine.machine_identity`) and the store's format."""
    return {"store_version": STORE_VERSION, **machine_identity(device)}


def store_path(device: torch.device) -> str | None:
    root = cache_root()
    if root is None:
        return None
    key = hashlib.sha256(json.dumps(store_identity(device), sort_keys=True).encode()).hexdigest()[:16]
    return os.path.join(root, "kernel_choices", f"{key}.json")


def _entry_key(key: tuple) -> str:
    out_features, in_features, nbits, group_size, _, threads, activations = key
    quantized = "/int8 activations" if activations else ""
    return f"{out_features}x{in_features}/{nbits}-bit/group {group_size}/{threads} threads{quantized}"


def _read_store(path: str | None) -> dict:
    if path is None or not os.path.isfile(path):
        return {}
    try:
        with open(path) as file:
            content = json.load(file)
        return content["choices"] if isinstance(content.get("choices"), dict) else {}
    except (OSError, ValueError, AttributeError, KeyError):
        return {}  # unreadable: measured again and rewritten


def _remembered(key: tuple, names: list[str], device: torch.device) -> KernelChoice | None:
    """The choice an earlier process made for this key on this machine, if it is still one of today's candidates."""
    entry = remembered_entry(_entry_key(key), device) or {}
    try:
        choice = KernelChoice(**{**{f.name: entry[f.name] for f in fields(KernelChoice) if f.name != "remembered"},
                                 "remembered": True})
    except (KeyError, TypeError):
        return None
    if choice.backend not in names or set(choice.microseconds) != set(names):
        return None  # the kernel set or its fit to this shape changed: time again
    return choice


def _remember(key: tuple, choice: KernelChoice, device: torch.device) -> None:
    remember_entry(_entry_key(key), {name: value for name, value in asdict(choice).items() if name != "remembered"},
                   device)


def remembered_entry(entry_key: str, device: torch.device) -> dict | None:
    """What an earlier process on this machine stored under `entry_key` (a kernel choice, the backbone's dtype)."""
    entry = _read_store(store_path(device)).get(entry_key)
    return entry if isinstance(entry, dict) else None


def remember_entry(entry_key: str, entry: dict, device: torch.device) -> None:
    """Store `entry` in this machine's file of measurements (nothing, with the cache off)."""
    path = store_path(device)
    if path is None:
        return
    choices = _read_store(path)
    choices[entry_key] = entry
    try:
        write_json_atomically(path, {"machine": store_identity(device), "choices": choices})
    except OSError as error:  # remembering is an optimisation: the choice made is still good
        warnings.warn(f"river_hf: could not remember the measured kernel choices in {path!r} ({error}); the next "
                      f"build times them again. Set {CACHE_ENV} to a writable folder, or {CACHE_ENV}=off.",
                      stacklevel=3)
