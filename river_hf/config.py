"""How the river is built: `RiverQuantConfig`, a transformers quantization config (typed, validated, serialisable).

It works two ways:
- `river_hf.build_river(model, RiverQuantConfig(...))` on a loaded model, or
- `AutoModelForCausalLM.from_pretrained(path, quantization_config=RiverQuantConfig(...))`, through the quantizer that
  `river_hf.hf_integration` registers with transformers under the method name "river".
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field

from transformers.utils.quantization_config import QuantizationConfigMixin

from .quantize import BACKENDS, SUPPORTED_GROUP_SIZES, SUPPORTED_NBITS

RIVER_QUANT_METHOD = "river"


@dataclass
class RiverQuantConfig(QuantizationConfigMixin):
    """Configuration of the exit river: which layers get a quantized twin and how the twins are quantized."""

    nbits: int = field(default=4, metadata={"help": f"Bits per twin weight, one of {SUPPORTED_NBITS}."})
    group_size: int | None = field(
        default=64,
        metadata={"help": f"HQQ quantization group size, one of {SUPPORTED_GROUP_SIZES} (None: one group per row)."},
    )
    axis: int = field(default=1, metadata={"help": "HQQ quantization axis; only 1 (groups along the input dimension)."})
    start_layer: int = field(
        default=1,
        metadata={"help": "L_s: the first decoder layer that has a twin. Tokens run at least this many backbone layers."},
    )
    skip_modules: list[str] = field(
        default_factory=list,
        metadata={"help": "Linear layers (name or name suffix inside a decoder layer, e.g. 'down_proj') kept in "
                  "full precision in the twins; they share the backbone's weights."},
    )
    backend: str = field(
        default="auto",
        metadata={"help": f"Twin kernel, one of {BACKENDS}; 'auto' picks the fastest one for the model's device."},
    )
    quant_method: str = field(default=RIVER_QUANT_METHOD, metadata={"help": "Fixed: 'river'."})

    def __post_init__(self):
        _check_choice("nbits", self.nbits, SUPPORTED_NBITS)
        _check_choice("group_size", self.group_size, SUPPORTED_GROUP_SIZES)
        _check_choice("axis", self.axis, (1,))  # the kernels need groups along the input dimension
        _check_choice("backend", self.backend, BACKENDS)
        _check_choice("quant_method", self.quant_method, (RIVER_QUANT_METHOD,))
        if not _is_int(self.start_layer) or self.start_layer < 1:
            raise ValueError(
                f"`start_layer` must be an integer >= 1 (layer 0 always runs on the backbone, its similarity is the "
                f"first exit signal); got {self.start_layer!r}."
            )
        if isinstance(self.skip_modules, str) or not all(isinstance(name, str) for name in self.skip_modules):
            raise ValueError(f"`skip_modules` must be a list of module names; got {self.skip_modules!r}.")
        self.skip_modules = list(self.skip_modules)

    def check_model_depth(self, num_layers: int) -> None:
        """The river needs at least one twin: start_layer must name an existing layer."""
        if self.start_layer >= num_layers:
            raise ValueError(
                f"`start_layer`={self.start_layer} is out of range: the model has {num_layers} decoder layers, so "
                f"`start_layer` must be between 1 and {num_layers - 1}."
            )

    def to_dict(self) -> dict:
        return {name: getattr(self, name) for name in self.__dataclass_fields__}


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_choice(name: str, value, choices: tuple) -> None:
    # bool is an int subclass: `nbits=True` must not pass as 1.
    if isinstance(value, bool) or value not in choices:
        raise ValueError(f"`{name}`={value!r} is not supported; choose one of {choices}.")
