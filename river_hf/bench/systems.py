"""The systems a benchmark compares, built from one river model without copying any weight:

- `backbone`: the river model under a plain `GenerationConfig` (no twin runs);
- `full-quant`: the river at tau = -1 (every layer from `start_layer` on runs on its twin);
- `static-full-quant`: a plain model whose layers from `start_layer` on ARE the twins: no `RiverLayer`, no router,
  no exit record. It computes exactly what full-quant computes, so full-quant's speed as a share of it is the
  river's routing overhead;
- `river tau=t`: the river at each tau of a grid.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from ..architectures import find_decoder_layers
from ..layers import RiverLayer, river_layers, twin_linears
from ..patching import is_river

# The packaged SmolLM2-135M: decoder layers 2-28 have cos(h_in, h_out) of about 0.92-0.98, so tau <= 0.9 exits
# nearly every token after 2 layers and tau >= 0.995 hardly ever exits. The README sweep (4-bit group-64 twins) spans
# 1.4x faster at 88.5% match (0.97) to backbone speed at 98.7% match (0.99): the useful range is 0.95-0.995.
SMOLLM2_TAUS = (0.95, 0.97, 0.975, 0.98, 0.985, 0.99, 0.995)
SMOLLM2_QUICK_TAUS = (0.97, 0.98, 0.99)
# Other models: quantiles of their own decode-step similarities, since the useful range differs by model.
GRID_QUANTILES = (0.1, 0.25, 0.4, 0.5, 0.6, 0.75, 0.9)
QUICK_GRID_QUANTILES = (0.25, 0.5, 0.75)

BACKBONE, FULL_QUANT, STATIC_FULL_QUANT = "backbone", "full-quant", "static-full-quant"


def river_name(tau: float) -> str:
    return f"tau={tau:g}"


def static_full_quant(river_model: nn.Module) -> nn.Module:
    """A plain model whose decoder layers from `start_layer` on are the river's twins and the others its backbone
    layers. Only module containers are copied (the model, the path down to the layer list): every parameter,
    buffer and twin is shared with `river_model`, so it costs no memory and stays valid as long as the river does.
    """
    layers = find_decoder_layers(river_model)
    path = next(name for name, module in river_model.named_modules() if module is layers)
    reference = _copy_containers(river_model, path.split(".") if path else [])
    static_layers = find_decoder_layers(reference)
    for idx, layer in enumerate(river_layers(river_model)):
        static_layers[idx] = layer.twin if layer.twin is not None else layer.base_layer
    if is_river(river_model):
        reference.__class__ = type(river_model)._river_base_class
    return reference


def _copy_containers(module: nn.Module, path: list[str]) -> nn.Module:
    """A shallow copy of `module` with its own child table, recursively along `path` (e.g. ["model", "layers"])."""
    clone = copy.copy(module)
    clone._modules = dict(module._modules)  # a shallow copy shares the child table: give it its own
    if path:
        clone._modules[path[0]] = _copy_containers(module._modules[path[0]], path[1:])
    return clone


def default_taus(river_model: nn.Module, inputs: dict, packaged: bool, quick: bool) -> list[float]:
    """The tau grid: SMOLLM2_TAUS for the packaged model; otherwise quantiles of the model's own similarities."""
    if packaged:
        return list(SMOLLM2_QUICK_TAUS if quick else SMOLLM2_TAUS)
    sims = layer_similarities(river_model, inputs)
    quantiles = torch.tensor(QUICK_GRID_QUANTILES if quick else GRID_QUANTILES)
    return sorted({round(value, 4) for value in torch.quantile(sims, quantiles).tolist()})


@torch.no_grad()
def layer_similarities(river_model: nn.Module, inputs: dict) -> torch.Tensor:
    """cos(h_in, h_out) of every layer that may exit (layer index >= start_layer - 1, not the last) at every
    position of one prompt, run on the backbone: a flat float32 tensor, the signal the router thresholds."""
    start_layer = next(layer.layer_idx for layer in river_layers(river_model) if layer.twin is not None)
    states = river_model(**inputs, output_hidden_states=True).hidden_states  # num_layers + 1 of [1, T, D]
    sims = [F.cosine_similarity(states[idx].float(), states[idx + 1].float(), dim=-1).flatten()
            for idx in range(start_layer - 1, len(states) - 2)]
    return torch.cat(sims)


def weight_bytes(river_model: nn.Module) -> dict[str, int]:
    """Bytes of the backbone's tensors (parameters and buffers) and of the twins' own (the shared norms and skipped
    linears count once, for the backbone)."""
    sizes = {"backbone": 0, "twins": 0}
    seen: set[int] = set()
    tensors = [*river_model.named_parameters(), *river_model.named_buffers()]
    for name, tensor in tensors:  # named_* list a shared tensor under its first name: the backbone layer's
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        sizes["twins" if ".twin." in f".{name}" else "backbone"] += tensor.numel() * tensor.element_size()
    return sizes


def twin_description(river_model: nn.Module) -> dict:
    """How the twins were built (the RiverQuantConfig) and the kernel they actually run on."""
    layers = river_layers(river_model)
    quant = next(layer.quant_config for layer in layers if isinstance(layer, RiverLayer))
    kernels = sorted({linear.backend for layer in layers if layer.twin is not None
                      for linear in twin_linears(layer.twin)})
    return {"nbits": quant.nbits, "group_size": quant.group_size, "start_layer": quant.start_layer,
            "skip_modules": list(quant.skip_modules), "backend": quant.backend, "kernels": kernels,
            "num_layers": len(layers)}


def twin_label(twins: dict) -> str:
    """One line for beside every table and figure."""
    skip = f", {'/'.join(twins['skip_modules'])} kept" if twins["skip_modules"] else ""
    return (f"twins: {twins['nbits']}-bit HQQ, group {twins['group_size']}, from layer {twins['start_layer']} "
            f"of {twins['num_layers']}, kernel {'/'.join(twins['kernels']) or twins['backend']}{skip}")
