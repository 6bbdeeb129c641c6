"""river_hf: seamless token-level early exit (River-LLM) for HuggingFace decoder-only LLMs.

    model = river_hf.build_river(model, RiverQuantConfig())   # 4-bit twins for the first quarter, 8-bit after
    out = model.generate(input_ids, generation_config=RiverConfig(tau=0.5), return_dict_in_generate=True)
    out.cache.exit_depth          # backbone layers each position ran
"""

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

from .core.architectures import UnsupportedModelError
from .kernels.backbone_dtype import fastest_dtype
from .core.kv_cache import KVIntegrityError, RiverCache, RiverStaticCache
from .core.config import RiverQuantConfig
from .core.generation import RiverConfig, RiverGenerationMixin
from .saving.hf_quantizer import register_with_transformers
from .core.twins import RiverLayer, river_layers
from .core.lm_head import RiverLMHead
from .lossless.decode import LosslessCache
from .lossless.draft_control import DraftRecord
from .offload.backbone import offload_backbone, offloaded_layers, reload_backbone
from .offload.choice import exit_depth_histogram
from .core.build import build_river, is_river, remove_river
from .core.captured_decode import compile_config_for
from .core.settings import RiverSettings
from .core.signals import ExitSignal, register_signal, unregister_signal

register_with_transformers()

# ---- the module paths before the subpackages (release 0.x): importable for one more release, with a warning --------
MOVED_MODULES = {  # old path under river_hf -> new path under river_hf
    "acceptance": "lossless.acceptance", "adapters": "core.adapters", "architectures": "core.architectures",
    "backbone_dtype": "kernels.backbone_dtype", "cache": "core.kv_cache", "capture": "core.captured_decode",
    "commands": "cli.commands", "commands.bench": "cli.commands.bench",
    "commands.bench_offload": "cli.commands.bench_offload", "commands.calibrate": "cli.commands.calibrate",
    "commands.common": "cli.commands.common", "commands.eval": "cli.commands.eval",
    "commands.generate": "cli.commands.generate", "commands.plot": "cli.commands.plot", "config": "core.config",
    "defaults": "core.auto_tau", "display": "cli.display", "draft_control": "lossless.draft_control",
    "exact_rows": "lossless.exact_rows", "freed_memory": "core.freed_memory", "generation": "core.generation",
    "gguf_cache": "loading.gguf", "hf_integration": "saving.hf_quantizer", "kernel_choice": "kernels.choice",
    "layers": "core.twins", "lm_head": "core.lm_head", "models": "loading.models", "offload_choice": "offload.choice",
    "ort_kernel": "kernels.matmulnbits", "passes": "core.current_pass", "patching": "core.build",
    "quantize": "kernels.quantize", "router": "core.exit_decision", "settings": "core.settings",
    "shared_inputs": "kernels.shared_inputs", "signals": "core.signals", "strategies": "core.kv_strategies",
    "twin_cache": "cli.stored_twins", "twin_store": "saving.twin_files", "user_cache": "cache_folder",
}


class _MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """`import river_hf.config` (an old path) gives the module now at `river_hf.core.config`, the same object, and
    a DeprecationWarning naming the new path."""

    def find_spec(self, fullname, path, target=None):
        old = fullname.removeprefix("river_hf.")
        if fullname.startswith("river_hf.") and old in MOVED_MODULES:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec):
        new = "river_hf." + MOVED_MODULES[spec.name.removeprefix("river_hf.")]
        warnings.warn(f"`{spec.name}` moved to `{new}`; the old path goes in the next release (public names also "
                      f"import from `river_hf` itself)", DeprecationWarning, stacklevel=2)
        return importlib.import_module(new)

    def exec_module(self, module):
        pass  # the module at the new path has run already


# first in line: the path finder would load a second copy of a moved package's modules (river_hf.commands.common)
sys.meta_path.insert(0, _MovedModuleFinder())

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
    "compile_config_for",
    "exit_depth_histogram",
    "fastest_dtype",
    "offload_backbone",
    "offloaded_layers",
    "reload_backbone",
    "is_river",
    "remove_river",
    "river_layers",
]
