"""`from_pretrained(..., quantization_config=RiverQuantConfig(...))`: river_hf's quantizer, registered in transformers.

The backbone loads as usual (full precision); once its weights are in (and tied: transformers ties the embeddings
before this hook), the quantizer builds the river, with the config's bit schedule and quantized LM head if any. A
folder saved with its twins (river_twins.safetensors beside the weights) gives them back without HQQ.
transformers' own `HqqConfig` quantize-on-load is broken in 5.x (no `get_quantize_ops`), so nothing here relies on it.
"""

from __future__ import annotations

import json
import os
import warnings

import huggingface_hub
from huggingface_hub.errors import RemoteEntryNotFoundError
from transformers.quantizers import HfQuantizer
from transformers.quantizers import auto as quantizer_registry
from transformers.quantizers.auto import (
    AUTO_QUANTIZATION_CONFIG_MAPPING,
    AUTO_QUANTIZER_MAPPING,
    register_quantization_config,
    register_quantizer,
)

from ..core.config import RIVER_QUANT_METHOD, RiverQuantConfig
from ..offload.backbone import offload_backbone
from ..core.build import build_river
from .twin_files import TWINS_FILE, StoredTwinsError
from .twin_loading import StoredTwins


class RiverHfQuantizer(HfQuantizer):
    """Builds the exit river after the backbone's weights are loaded; no weight is quantized while loading."""

    requires_calibration = False

    def _process_model_before_weight_loading(self, model, checkpoint_files=None, **kwargs):
        # Twins saved beside the checkpoint (save_pretrained(..., save_twins=True)) are read and checked now: a
        # corrupted file fails before the backbone's weights are loaded, and nothing is half built.
        config = self.quantization_config
        self.stored_twins = StoredTwins.next_to(checkpoint_files, config) or _twins_from_hub(checkpoint_files, config)
        return model

    def _process_model_after_weight_loading(self, model, **kwargs):
        config = self.quantization_config
        stored, self.stored_twins = getattr(self, "stored_twins", None), None  # the codes go into the twins
        build_river(model, config, stored_twins=stored)
        if config.offload is not None:  # the backbone weights rarely run leave the device (river_hf.offload.backbone)
            offload_backbone(model, layers=config.offload_layers, to=config.offload, folder=config.offload_folder,
                             histogram=config.offload_exit_histogram, max_share=config.offload_max_share)
        return model

    def is_serializable(self, **kwargs) -> bool:
        # RiverGenerationMixin.save_pretrained writes the backbone's checkpoint (original layers and LM head), this
        # config and, by default, the twins in a portable form (river_hf.saving.twin_files); loading the folder reads
        # them back (or rebuilds those that no longer fit).
        return True

    @property
    def is_trainable(self) -> bool:
        return False

    @property
    def is_compileable(self) -> bool:
        # transformers compiles a static-cache decode step only when the quantizer allows it: a river's steps are
        # captured per exit depth (river_hf.core.captured_decode)
        return True


def _twins_from_hub(checkpoint_files, quant_config) -> StoredTwins | None:
    """A river pushed to the hub (`push_to_hub`): transformers downloads its weights and config, not the twins file.
    When the checkpoint is a hub snapshot whose config.json names the river quantizer, fetch the twins file of the
    same revision; a repo without one, or a fetch that fails (offline: with a warning), leaves the twins to HQQ."""
    repo = _hub_snapshot(os.path.dirname(str(checkpoint_files[0]))) if checkpoint_files else None
    if repo is None:
        return None
    repo_id, revision, cache_dir = repo
    try:
        return StoredTwins.read(huggingface_hub.hf_hub_download(repo_id, TWINS_FILE, revision=revision,
                                                                cache_dir=cache_dir), quant_config)
    except RemoteEntryNotFoundError:
        return None
    except StoredTwinsError:  # downloaded but damaged: refused like a local file
        raise
    except (OSError, ValueError) as error:  # offline, no network, a hub error: the river is still built, slowly
        warnings.warn(f"river: could not fetch {TWINS_FILE} of {repo_id} ({type(error).__name__}: {error}); the "
                      f"twins are quantized with HQQ instead.", stacklevel=3)
        return None


def _hub_snapshot(folder: str) -> tuple[str, str, str] | None:
    """(repo id, revision, hub cache folder) when `folder` is a hub snapshot (<cache>/models--org--name/snapshots/
    <revision>) of a river (config.json names the river quantizer); else None."""
    snapshots, revision = os.path.split(os.path.normpath(folder))
    repo_folder, name = os.path.split(snapshots)
    cache_dir, repo_name = os.path.split(repo_folder)
    if name != "snapshots" or not repo_name.startswith("models--"):
        return None
    try:
        with open(os.path.join(folder, "config.json")) as file:
            method = (json.load(file).get("quantization_config") or {}).get("quant_method")
    except (OSError, ValueError, AttributeError):
        return None
    if method != RIVER_QUANT_METHOD:
        return None
    return repo_name.removeprefix("models--").replace("--", "/"), revision, cache_dir


def register_with_transformers() -> None:
    """Register the "river" quantization method once (importing river_hf does it)."""
    if RIVER_QUANT_METHOD not in AUTO_QUANTIZATION_CONFIG_MAPPING:
        register_quantization_config(RIVER_QUANT_METHOD)(RiverQuantConfig)
    if RIVER_QUANT_METHOD not in AUTO_QUANTIZER_MAPPING:
        register_quantizer(RIVER_QUANT_METHOD)(RiverHfQuantizer)
    # transformers' loading attributes: a config passed to from_pretrained for a saved (pre-quantized) model gives way
    # to the saved one except for the fields `get_loading_attributes` names. Only the configs in this tuple take
    # part, and transformers has no function to add one: the tuple is extended, once.
    if RiverQuantConfig not in quantizer_registry.LOADING_ATTRIBUTES_CONFIG_TYPES:
        quantizer_registry.LOADING_ATTRIBUTES_CONFIG_TYPES += (RiverQuantConfig,)
