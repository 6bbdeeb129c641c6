"""Backbone offloading (the paper's fourth step): which backbone layers tokens rarely reach (`choice.py`) and moving
them off the execution device on accelerate's offload hooks (`backbone.py`).

`river_hf.offload` was one module before the subpackages; its names still import from here."""

from .backbone import (offload_backbone, offload_stores, offloaded_layers, reload_backbone,  # noqa: F401
                       weight_residency)
