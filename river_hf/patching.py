"""`build_river(model, cfg)` / `remove_river(model)`: wrap every decoder layer in a `RiverLayer` and put
`RiverGenerationMixin` in front of the model's class; and undo both exactly.

The model object stays the same object (so pipelines, accelerate hooks and user references keep working) and stays
an instance of its original class: the river class is a subclass with the same name that only adds `generate`.
"""

from __future__ import annotations

from functools import partial

from torch import nn
from tqdm.auto import tqdm

from .architectures import find_decoder_layers
from .config import RiverQuantConfig
from .generation import RiverGenerationMixin
from .layers import RiverLayer, StepState, make_twin, river_layers  # noqa: F401  (river_layers re-exported)
from .quantize import RiverQuantLinear

_RIVER_CLASSES: dict[type, type] = {}


def build_river(model: nn.Module, quant_config: RiverQuantConfig | None = None, progress: bool = True) -> nn.Module:
    """Give every decoder layer from `start_layer` on a quantized, KV-sharing twin. Returns the same model.

    Quantizing takes a few seconds per hundred million parameters on CPU (HQQ's optimizer); a progress bar shows it.
    """
    quant_config = quant_config if quant_config is not None else RiverQuantConfig()
    if not isinstance(quant_config, RiverQuantConfig):
        raise TypeError(f"`quant_config` must be a RiverQuantConfig; got {type(quant_config).__name__}.")
    if is_river(model):
        raise ValueError("This model already has a river; call river_hf.remove_river(model) before building another.")
    layers = find_decoder_layers(model)
    quant_config.check_model_depth(len(layers))
    quantize = partial(RiverQuantLinear.from_linear, nbits=quant_config.nbits, group_size=quant_config.group_size,
                       axis=quant_config.axis, backend=quant_config.backend)
    indices = range(len(layers))
    step_state = StepState()  # one per model: every layer (and a river LM head) sees the same pass
    for idx in tqdm(indices, desc="river: quantizing twins", disable=not progress, leave=False):
        layer = layers[idx]
        twin = make_twin(layer, quantize, quant_config.skip_modules) if idx >= quant_config.start_layer else None
        layers[idx] = RiverLayer(layer, twin, layer_idx=idx, num_layers=len(layers), quant_config=quant_config,
                                 step_state=step_state)
    model.__class__ = _river_class(type(model))
    return model


def remove_river(model: nn.Module) -> nn.Module:
    """Put the backbone layers back and restore the model's class; drops the twins. Returns the same model."""
    if not is_river(model):
        raise ValueError("This model has no river to remove (river_hf.build_river was not applied to it).")
    layers = find_decoder_layers(model)
    for idx, layer in enumerate(layers):
        if isinstance(layer, RiverLayer):
            layers[idx] = layer.base_layer
    model.__class__ = model.__class__._river_base_class
    return model


def is_river(model: nn.Module) -> bool:
    return isinstance(model, RiverGenerationMixin)


def _river_class(base: type) -> type:
    """The river subclass of `base`, made once per class. It keeps the name, so pipelines recognise the model."""
    if base not in _RIVER_CLASSES:
        attrs = {"__module__": base.__module__, "__qualname__": base.__qualname__, "_river_base_class": base}
        _RIVER_CLASSES[base] = type(base.__name__, (RiverGenerationMixin, base), attrs)
    return _RIVER_CLASSES[base]
