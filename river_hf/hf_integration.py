"""`from_pretrained(..., quantization_config=RiverQuantConfig(...))`: river_hf's quantizer, registered in transformers.

The backbone loads as usual (full precision); once its weights are in (and tied: transformers ties the embeddings
before this hook), the quantizer builds the river, with the config's bit schedule and quantized LM head if any.
transformers' own `HqqConfig` quantize-on-load is broken in 5.x (no `get_quantize_ops`), so nothing here relies on it.
"""

from __future__ import annotations

from transformers.quantizers import HfQuantizer
from transformers.quantizers.auto import (
    AUTO_QUANTIZATION_CONFIG_MAPPING,
    AUTO_QUANTIZER_MAPPING,
    register_quantization_config,
    register_quantizer,
)

from .config import RIVER_QUANT_METHOD, RiverQuantConfig
from .offload import offload_backbone
from .patching import build_river


class RiverHfQuantizer(HfQuantizer):
    """Builds the exit river after the backbone's weights are loaded; no weight is quantized while loading."""

    requires_calibration = False

    def _process_model_before_weight_loading(self, model, **kwargs):
        return model

    def _process_model_after_weight_loading(self, model, **kwargs):
        config = self.quantization_config
        build_river(model, config)
        if config.offload is not None:  # the backbone weights rarely run leave the device (river_hf.offload)
            offload_backbone(model, layers=config.offload_layers, to=config.offload, folder=config.offload_folder,
                             histogram=config.offload_exit_histogram, max_share=config.offload_max_share)
        return model

    def is_serializable(self, **kwargs) -> bool:
        # RiverGenerationMixin.save_pretrained writes the backbone's checkpoint (original layers and LM head) plus
        # this config; loading it rebuilds the twins and the quantized head (storing them would only duplicate the
        # backbone in another form).
        return True

    @property
    def is_trainable(self) -> bool:
        return False


def register_with_transformers() -> None:
    """Register the "river" quantization method once (importing river_hf does it)."""
    if RIVER_QUANT_METHOD not in AUTO_QUANTIZATION_CONFIG_MAPPING:
        register_quantization_config(RIVER_QUANT_METHOD)(RiverQuantConfig)
    if RIVER_QUANT_METHOD not in AUTO_QUANTIZER_MAPPING:
        register_quantizer(RIVER_QUANT_METHOD)(RiverHfQuantizer)
