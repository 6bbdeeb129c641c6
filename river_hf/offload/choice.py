"""Which backbone layers to offload: given indices, checked, or "auto", read off a measured exit-depth histogram.

A decoded token of exit depth d ran backbone layers 0 .. d-1 (d = num_layers: it never exited), so backbone layer l
runs for the share of tokens with depth > l. "auto" offloads the layers from `start_layer` on whose share is below
`max_share`: each of them costs a page-in on only that share of decode steps. The histogram is measured by a short
river run on prompts (`exit_depth_histogram`, like `river-hf calibrate`), or given, e.g. a bench record's
`exit_depth_histogram` ({depth: decoded tokens}; string keys are fine).
"""

from __future__ import annotations

import copy
import warnings
from collections import Counter
from collections.abc import Mapping

import torch

from ..checks import checked_histogram, is_int
from ..core.config import DEFAULT_OFFLOAD_MAX_SHARE
from ..core.generation import RiverConfig


def layer_shares(histogram: Mapping, num_layers: int) -> list[float]:
    """Per decoder layer, the share of decoded tokens that ran it on the backbone (a token of depth d runs layers
    below d)."""
    counts = checked_histogram("histogram", histogram, num_layers)
    total = sum(counts.values())
    return [sum(n for depth, n in counts.items() if depth > layer) / total for layer in range(num_layers)]


def rarely_run_layers(histogram: Mapping, num_layers: int, start_layer: int,
                      max_share: float = DEFAULT_OFFLOAD_MAX_SHARE) -> list[int]:
    """The layers from `start_layer` on that run for fewer than `max_share` of decoded tokens."""
    _check_share(max_share)
    shares = layer_shares(histogram, num_layers)
    return [layer for layer in range(start_layer, num_layers) if shares[layer] < max_share]


@torch.no_grad()
def exit_depth_histogram(model, inputs, generation_config: RiverConfig) -> dict[int, int]:
    """{exit depth: decoded tokens} of a river run: `generation_config` (a RiverConfig: the exit settings you will
    decode with, and max_new_tokens) on each of `inputs` (input-id tensors [B, T], or dicts with input_ids and
    attention_mask)."""
    if not isinstance(generation_config, RiverConfig):
        raise ValueError(f"`generation_config` must be a RiverConfig holding the exit settings you will decode with "
                         f"(e.g. RiverConfig(tau=0.3, exit_signal='confidence', max_new_tokens=32)); got "
                         f"{type(generation_config).__name__}.")
    items = _checked_inputs(inputs)  # all of them before anything runs
    config = copy.deepcopy(generation_config)
    config.return_dict_in_generate = True
    counts: Counter = Counter()
    for item in items:
        cache = model.generate(**item, generation_config=config).cache
        counts.update(cache.exit_depth[:, cache.prompt_length:].flatten().tolist())
    return dict(sorted(counts.items()))


def _checked_inputs(inputs) -> list[dict]:
    """Each of `inputs` as generate's keyword arguments: an id tensor [B, T] of integers, or a mapping holding one as
    `input_ids` (and its attention_mask, else ones); a ValueError naming `inputs` otherwise."""
    if isinstance(inputs, (str, bytes, torch.Tensor, Mapping)) or not hasattr(inputs, "__iter__"):
        raise ValueError(f"`inputs` must be a list of prompts (id tensors [batch, tokens], or dicts with "
                         f"`input_ids`); got {type(inputs).__name__}.")
    items = []
    for index, item in enumerate(inputs):
        item = dict(item) if isinstance(item, Mapping) else {"input_ids": item}
        ids = item.get("input_ids")
        if not (isinstance(ids, torch.Tensor) and ids.dim() == 2 and not ids.dtype.is_floating_point
                and not ids.dtype.is_complex and ids.dtype != torch.bool and ids.numel() > 0):
            raise ValueError(f"`inputs`[{index}] must be an integer id tensor [batch, tokens] (or a dict with one as "
                             f"`input_ids`); got {item.get('input_ids', item)!r:.80}.")
        item.setdefault("attention_mask", torch.ones_like(ids))
        items.append(item)
    if not items:
        raise ValueError("`inputs` is empty: give at least one prompt to measure exit depths on.")
    return items


def choose_layers(model, wrapped, layers="auto", *, histogram: Mapping | None = None, inputs=None,
                  generation_config: RiverConfig | None = None,
                  max_share: float = DEFAULT_OFFLOAD_MAX_SHARE) -> list[int]:
    """The sorted decoder-layer indices to offload: `layers` checked, or for "auto" the rarely run ones of
    `histogram` (measured now from `inputs` and `generation_config` when not given)."""
    start_layer = next(layer.layer_idx for layer in wrapped if layer.twin is not None)
    if isinstance(layers, str):
        if layers != "auto":
            raise ValueError(f"`layers`={layers!r} is not supported; give 'auto' or a list of decoder-layer indices.")
        return _auto_layers(model, len(wrapped), start_layer, histogram, inputs, generation_config, max_share)
    return check_layers(layers, len(wrapped), start_layer)


def check_layers(layers, num_layers: int, start_layer: int) -> list[int]:
    """Explicit indices: integers, each a layer with a twin (start_layer .. num_layers - 1); duplicates dropped."""
    if not isinstance(layers, (list, tuple, range)) or not all(is_int(idx) for idx in layers):
        raise ValueError(f"`layers` must be 'auto' or a list of decoder-layer indices (integers); got {layers!r}.")
    if len(layers) == 0:
        raise ValueError("`layers` is empty: name the decoder layers to offload, or pass layers='auto'.")
    for idx in layers:
        if not 0 <= idx < num_layers:
            raise ValueError(f"`layers`: {idx} is out of range: the model has {num_layers} decoder layers "
                             f"(0..{num_layers - 1}).")
        if idx < start_layer:
            raise ValueError(f"`layers`: decoder layer {idx} has no twin (the river starts at start_layer="
                             f"{start_layer}): every token runs it on the backbone, so it stays on the device. "
                             f"Offload layers {start_layer}..{num_layers - 1} only.")
    return sorted({int(idx) for idx in layers})


def _auto_layers(model, num_layers, start_layer, histogram, inputs, generation_config, max_share) -> list[int]:
    _check_share(max_share)
    if histogram is None:
        if inputs is None or generation_config is None:
            raise ValueError("`layers`='auto' needs a measured exit-depth histogram: pass `histogram=` ({depth: "
                             "tokens}, e.g. from a bench record), or `inputs=` (prompt ids) and "
                             "`generation_config=` (the RiverConfig you will decode with) to measure one now.")
        histogram = exit_depth_histogram(model, inputs, generation_config)
    chosen = rarely_run_layers(histogram, num_layers, start_layer, max_share)
    if not chosen:
        warnings.warn(f"offload_backbone(layers='auto'): every backbone layer from start_layer={start_layer} on runs "
                      f"for at least max_share={max_share:g} of decoded tokens; nothing was offloaded.", stacklevel=3)
    return chosen


def _check_share(max_share) -> None:
    if isinstance(max_share, bool) or not isinstance(max_share, (int, float)) or not 0 < max_share <= 1:
        raise ValueError(f"`max_share` must be a share of decoded tokens in (0, 1], e.g. 0.05; got {max_share!r}.")
