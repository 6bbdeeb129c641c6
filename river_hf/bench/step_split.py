"""Where a decode step's time goes, per bench system: the matmuls inside the decoder layers, the rest of the decoder
layers (attention, norms, rotary embeddings, the cache update), the river's routing (what a `RiverLayer` does around
the layer it runs: the router's checks, the dispatch, the exit record), and everything outside the decoder layers
(embedding, final norm, LM head, sampling, the generate loop).

One extra generate call per system, after the timed runs, with forward hooks that read the clock around every decoder
layer, every layer a RiverLayer runs and every linear inside them, on decode steps only (one new token per row). The
hooks cost a few µs each, so a split's total is a little above the timed runs' ms per token: read the parts as shares
of a step, and take speeds from the timed runs.
"""

from __future__ import annotations

import time
from collections import defaultdict

import torch
from torch import nn

from ..core.architectures import find_decoder_layers
from ..core.twins import RiverLayer
from ..kernels.quantize import RiverQuantLinear
from .speed import time_generate

PARTS = ("matmuls", "rest_of_layers", "routing", "outside_layers")


def step_split(model, inputs: dict, generation_config) -> dict[str, float]:
    """ms per decoded token of each part of PARTS (and their total) for one generate call of `model`."""
    clock = _HookClock()
    handles = clock.install(model)
    try:
        timing = time_generate(model, inputs, generation_config)
    finally:
        for handle in handles:
            handle.remove()
    steps = max(timing.new_tokens - 1, 1)  # the passes between the first new token and the last
    seconds = clock.seconds
    parts = {"matmuls": seconds["matmuls"], "rest_of_layers": seconds["inner"] - seconds["matmuls"],
             "routing": seconds["layers"] - seconds["inner"], "outside_layers": timing.decode_s - seconds["layers"]}
    split = {name: 1000 * value / steps for name, value in parts.items()}
    return {**split, "total": 1000 * timing.decode_s / steps}


class _HookClock:
    """Sums wall time by kind over decode-step calls: "layers" (each decoder layer), "inner" (the module a
    RiverLayer runs, or the layer itself), "matmuls" (linears inside those)."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)
        self._started: dict[tuple[int, str], float] = {}

    def install(self, model: nn.Module) -> list:
        handles = []
        for layer in find_decoder_layers(model):
            if isinstance(layer, RiverLayer):  # the wrapper's own time is the routing
                handles += self._time(layer, "layers")
                inner = [module for module in (layer.base_layer, layer.twin) if module is not None]
                for module in inner:
                    handles += self._time(module, "inner")
            else:  # a plain layer is its own inner module: no routing
                handles += self._time(layer, "layers", "inner")
                inner = [layer]
            for module in inner:
                for linear in module.modules():
                    if isinstance(linear, (nn.Linear, RiverQuantLinear)):
                        handles += self._time(linear, "matmuls")
        return handles

    def _time(self, module: nn.Module, *kinds: str) -> list:
        kind = kinds[0]
        def before(mod, args, kwargs):
            if _is_decode(args, kwargs):
                _synchronize(args, kwargs)
                self._started[(id(mod), kind)] = time.perf_counter()

        def after(mod, args, kwargs, output):
            started = self._started.pop((id(mod), kind), None)
            if started is not None:
                _synchronize(args, kwargs)
                elapsed = time.perf_counter() - started
                for name in kinds:
                    self.seconds[name] += elapsed

        return [module.register_forward_pre_hook(before, with_kwargs=True),
                module.register_forward_hook(after, with_kwargs=True)]


def _first_tensor(args, kwargs) -> torch.Tensor | None:
    candidates = [*args, kwargs.get("hidden_states"), kwargs.get("input")]
    return next((value for value in candidates if isinstance(value, torch.Tensor)), None)


def _is_decode(args, kwargs) -> bool:
    """One new token per row: hidden states [B, 1, D] (a linear may see them as [B, 1, K] or [B, K])."""
    tensor = _first_tensor(args, kwargs)
    return tensor is not None and (tensor.dim() < 3 or tensor.shape[-2] == 1)


def _synchronize(args, kwargs) -> None:
    tensor = _first_tensor(args, kwargs)
    if tensor is not None and tensor.is_cuda:
        torch.cuda.synchronize(tensor.device)
