"""river_hf: seamless token-level early exit (River-LLM) for HuggingFace decoder-only LLMs.

    model = river_hf.build_river(model, RiverQuantConfig())   # 4-bit twins for the first quarter, 8-bit after
    out = model.generate(input_ids, generation_config=RiverConfig(tau=0.5), return_dict_in_generate=True)
    out.cache.exit_depth          # backbone layers each position ran
"""

from .architectures import UnsupportedModelError
from .backbone_dtype import fastest_dtype
from .cache import KVIntegrityError, RiverCache, RiverStaticCache
from .config import RiverQuantConfig
from .generation import RiverConfig, RiverGenerationMixin
from .hf_integration import register_with_transformers
from .layers import RiverLayer, river_layers
from .lm_head import RiverLMHead
from .lossless import LosslessCache
from .draft_control import DraftRecord
from .offload import offload_backbone, offloaded_layers, reload_backbone
from .offload_choice import exit_depth_histogram
from .patching import build_river, is_river, remove_river
from .settings import RiverSettings
from .signals import ExitSignal, register_signal, unregister_signal

register_with_transformers()

__all__ = [
    "DraftRecord",
    "KVIntegrityError",
    "LosslessCache",
    "RiverCache",
    "RiverStaticCache",
    "RiverConfig",
    "RiverGenerationMixin",
    "RiverLMHead",
    "RiverLayer",
    "RiverQuantConfig",
    "RiverSettings",
    "ExitSignal",
    "register_signal",
    "unregister_signal",
    "UnsupportedModelError",
    "build_river",
    "exit_depth_histogram",
    "fastest_dtype",
    "offload_backbone",
    "offloaded_layers",
    "reload_backbone",
    "is_river",
    "remove_river",
    "river_layers",
]
