"""Finding a model's decoder layers, without per-architecture forward code.

The river works on any causal LM that keeps its decoder layers in an `nn.ModuleList` and whose attention modules
carry `layer_idx` (that index is the cache slot the twin shares). A short list of finders, first non-None wins
(peft's dispatcher style); add one here for a new layout.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


class UnsupportedModelError(ValueError):
    """The model does not have what the river needs; the message says what is missing."""


def _from_get_decoder(model: nn.Module) -> nn.ModuleList | None:
    get_decoder = getattr(model, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else None
    layers = getattr(decoder, "layers", None)
    return layers if isinstance(layers, nn.ModuleList) else None


def _from_attribute_path(*path: str) -> Callable[[nn.Module], nn.ModuleList | None]:
    def finder(model: nn.Module) -> nn.ModuleList | None:
        node = model
        for name in path:
            node = getattr(node, name, None)
        return node if isinstance(node, nn.ModuleList) else None

    return finder


LAYER_FINDERS: list[Callable[[nn.Module], nn.ModuleList | None]] = [
    _from_get_decoder,                                   # Llama, Mistral, Qwen2/3, Gemma3, Phi3, ...
    _from_attribute_path("model", "layers"),
    _from_attribute_path("model", "language_model", "layers"),
    _from_attribute_path("transformer", "h"),
]


def find_decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of a causal LM, checked for what the river needs (raises UnsupportedModelError)."""
    config = getattr(model, "config", None)
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(
            f"{type(model).__name__} is an encoder-decoder model; river_hf supports decoder-only causal LMs."
        )
    layers = next((found for finder in LAYER_FINDERS if (found := finder(model)) is not None), None)
    if layers is None or len(layers) == 0:
        raise UnsupportedModelError(
            f"{type(model).__name__}: found no decoder layers in an nn.ModuleList (looked at get_decoder().layers, "
            f"model.layers, model.language_model.layers, transformer.h). river_hf wraps decoder layers; add a finder "
            f"to river_hf.core.architectures.LAYER_FINDERS for this layout."
        )
    for idx, layer in enumerate(layers):
        check_layer_idx(layer, idx, type(model).__name__)
    return layers


def hidden_of(layer_output) -> torch.Tensor:
    """Decoder layers return the hidden state, or (in some architectures/versions) a tuple starting with it."""
    return layer_output[0] if isinstance(layer_output, (tuple, list)) else layer_output


def output_embedding(model: nn.Module) -> nn.Module | None:
    """The model's LM head (`get_output_embeddings()`), or None when it has none."""
    get_head = getattr(model, "get_output_embeddings", None)
    return get_head() if callable(get_head) else None


def layer_cache_index(layer: nn.Module) -> int | None:
    """The `layer_idx` of the layer's attention (its cache slot), or None if it has none."""
    base = getattr(layer, "base_layer", layer)  # a RiverLayer answers for its backbone layer
    for module in base.modules():
        if isinstance(getattr(module, "layer_idx", None), int) and module is not base:
            return module.layer_idx
    return getattr(base, "layer_idx", None) if isinstance(getattr(base, "layer_idx", None), int) else None


def check_layer_idx(layer: nn.Module, position: int, model_name: str) -> None:
    found = layer_cache_index(layer)
    if found is None:
        raise UnsupportedModelError(
            f"{model_name}: decoder layer {position} ({type(layer).__name__}) has no attention module with a "
            f"`layer_idx`; the river's twins write K/V into the backbone's cache slot by that index."
        )
    if found != position:
        raise UnsupportedModelError(
            f"{model_name}: decoder layer {position} writes cache slot {found}; river_hf needs one slot per layer "
            f"(layer i -> slot i). Models that share K/V across layers are not supported."
        )
