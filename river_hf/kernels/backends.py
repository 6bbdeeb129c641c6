"""Which kernel a twin linear runs on: `backend="auto"` takes the device's preferred kernel for the width (CPU:
int4pack for 2-4 bits, int8pack for 8, w8a8 with activations="int8"; CUDA: tinygemm for 2-4 bits, gemlite's int8
GEMV for 8 where gemlite is installed), `backend="fastest"` the one `kernels.choice` measured fastest at the layer's
shape (on CPU and CUDA), an explicit backend is checked (it must run here, at this shape, with its packages
installed); stored codes get a kernel that can read their grouping. Fallbacks warn: 'hqq' on CPU, 'dense' on CUDA.
"""

from __future__ import annotations

import warnings

import torch

from ..checks import check_choice, install_hint
from .choice import fastest_backend
from .registry import KERNELS, PREFERRED_BACKENDS, SUPPORTED_NBITS, runs, shape_problem

BACKENDS = ("auto", "fastest", *KERNELS)
# What 'auto' and 'fastest' may do to activations: None keeps the kernels weight-only; "int8" also lets 8-bit twins
# run on kernels that round each token's activations to int8 (KERNELS[...].quantizes_activations), a fidelity cost
ACTIVATIONS = (None, "int8")


def backend_nbits(backend: str) -> tuple[int, ...]:
    """The bit widths `backend` can run (on its device); 'auto', 'fastest', 'dense' and 'hqq': all of them."""
    check_choice("backend", backend, BACKENDS)
    return SUPPORTED_NBITS if backend in ("auto", "fastest") else KERNELS[backend].nbits


def fast_backend(nbits: int, device: torch.device, activations: str | None = None) -> str | None:
    quantizing = tuple(name for name, kernel in KERNELS.items()
                       if kernel.quantizes_activations and kernel.unmeasured_pick)
    preferred = (quantizing if activations == "int8" else ()) + PREFERRED_BACKENDS
    return next((name for name in preferred if runs(name, nbits, device)), None)


def fallback_backend(device: torch.device) -> str:
    """Where no fast kernel runs a layer: on CUDA 'dense' (the dequantized bf16 weight: the backbone's speed and
    bytes), since 'hqq' dequantizes the whole weight on every call, a full extra pass over it per GEMV (issue 31
    measured an eager river at 0.81x the backbone on an H200 with its 8-bit head there); elsewhere 'hqq', which
    keeps the twin at its quantized size."""
    return "dense" if torch.device(device).type == "cuda" else "hqq"


def warn_slow(nbits: int, device: torch.device, reason: str, fallback: str | None = None) -> str:
    """Warn that a layer runs on a slow kernel (`fallback`, default `fallback_backend`), and return its name."""
    fallback = fallback or fallback_backend(device)
    cost = ("as fast as the full-precision layer, with no byte saving" if fallback == "dense" else
            "slower than the full-precision layer")
    hint = ""
    if device.type == "cuda" and nbits == 8 and not KERNELS["gemlite_int8_cuda"].available():
        hint = f"; the fast 8-bit kernel {install_hint('gemlite', 'cuda')}"
    # The message holds no layer shape, so Python's warning filter shows it once, not once per linear layer.
    warnings.warn(f"RiverQuantLinear: {reason}; using backend {fallback!r}, which dequantizes the whole weight "
                  f"{'once' if fallback == 'dense' else 'on every call'} and is {cost} ({nbits}-bit on "
                  f"{device.type}){hint}.", stacklevel=3)
    return fallback


def resolve_backend(backend: str, nbits: int, device: torch.device, activations: str | None = None) -> str:
    """The kernel a twin linear will run on. 'auto' -> the fastest one that runs `nbits` on `device`:
    CPU: 2/3/4 bits -> 'int4pack_cpu', 8 -> 'int8pack_cpu' ('w8a8_cpu' with activations="int8"); CUDA: 2/3/4 ->
    'tinygemm_cuda', 8 -> 'gemlite_int8_cuda' (with gemlite); otherwise `fallback_backend` (with a warning). An
    explicit backend is returned as is if it can run there, else ValueError."""
    check_choice("nbits", nbits, SUPPORTED_NBITS)
    check_choice("backend", backend, BACKENDS)
    check_choice("activations", activations, ACTIVATIONS)
    device = torch.device(device)
    if backend in ("auto", "fastest"):  # 'fastest' needs the layer's shape: `fit_layer` measures it
        fast = fast_backend(nbits, device, activations)
        if fast is None:
            return warn_slow(nbits, device, f"no fast kernel for {nbits}-bit weights on {device.type}")
        return fast
    kernel = KERNELS[backend]
    if kernel.requires and not kernel.available():
        raise ValueError(f"`backend`={backend!r} {install_hint(*kernel.requires)}; or choose another backend.")
    if not runs(backend, nbits, device):
        usable = tuple(name for name in KERNELS if runs(name, nbits, device))
        raise ValueError(f"`backend`={backend!r} cannot run {nbits}-bit weights on {device.type}; "
                         f"choose one of {('auto', 'fastest') + usable}.")
    return backend


def fit_layer(requested: str, nbits: int, group_size: int | None, weight: torch.Tensor,
               activations: str | None) -> tuple[str, int | None]:
    """The (backend, group_size) one layer's weight [N, K] will use; warns when that is not what was asked."""
    if requested == "fastest":
        backend = fastest_backend(nbits, group_size, *weight.shape, weight.device, activations).backend
        return backend, None if KERNELS[backend].per_row else group_size
    backend = resolve_backend(requested, nbits, weight.device, activations)
    problem = shape_problem(backend, *weight.shape, group_size)
    if problem and requested not in ("auto", "fastest"):
        raise ValueError(f"`backend`={requested!r} cannot run this layer: {problem}.")
    if problem:
        backend = warn_slow(nbits, weight.device, f"{backend!r} cannot run some layers ({problem})")
    elif requested == "hqq":
        fast = fast_backend(nbits, weight.device)
        warn_slow(nbits, weight.device, f"backend 'hqq' was asked for ({fast or 'no kernel'} is the fast one here)",
                  fallback="hqq")
    if KERNELS[backend].per_row and group_size is not None:
        warnings.warn(f"RiverQuantLinear: {backend!r} runs 8-bit weights with one group per output row; "
                      f"`group_size`={group_size} is ignored.", stacklevel=2)
        group_size = None
    return backend, group_size


def readable(backend: str, nbits: int, group_size: int | None, out_features: int, in_features: int) -> bool:
    """Whether `backend` can run codes already grouped by `group_size` (stored codes cannot be regrouped: the int8
    kernels read one (scale, zero) per row)."""
    if KERNELS[backend].per_row and group_size is not None:
        return False
    return shape_problem(backend, out_features, in_features, group_size) is None


def backend_for_codes(requested: str, nbits: int, group_size: int | None, out_features: int, in_features: int,
                       device: torch.device, activations: str | None) -> str:
    """The kernel for stored codes: chosen as for a fresh layer ('fastest' measures, 'auto' takes the preferred one),
    among the kernels that can read the codes' grouping; 'dense' (any grouping, the backbone's speed) otherwise."""
    if requested == "fastest":
        choice = fastest_backend(nbits, group_size, out_features, in_features, device, activations)
        if readable(choice.backend, nbits, group_size, out_features, in_features):
            return choice.backend  # what a fresh build picks (the preferred kernel wins close calls)
        usable = [name for name in choice.microseconds if readable(name, nbits, group_size, out_features,
                                                                    in_features)]
        return min(usable, key=choice.microseconds.get) if usable else fallback_backend(device)
    backend = resolve_backend(requested, nbits, device, activations)
    if readable(backend, nbits, group_size, out_features, in_features):
        return backend
    if requested not in ("auto", "fastest"):
        raise ValueError(f"`backend`={requested!r} cannot run these stored {nbits}-bit codes of a "
                         f"[{out_features}, {in_features}] weight grouped by `group_size`={group_size}; use "
                         f"backend='auto' or 'dense'.")
    return "dense"
