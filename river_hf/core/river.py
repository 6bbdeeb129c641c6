"""`River`: one river's river-wide state, what is neither per layer nor per call. `build_river` makes one and hands it
to each of the river's RiverLayers (one object: `get_river(model)` in core.twins finds it), as peft's tuner holds its
adapters' state; `remove_river` drops it with the layers.

It holds what the river installed outside its layers (the model-level pass hooks, which `remove_river` removes) and
what the river learns about this machine and model, which a rebuilt river learns afresh: the ExitGain that
`tau="auto"` measures (core.auto_tau) and lossless mode's fallback verdicts (lossless.decode).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(eq=False)
class River:
    pass_hooks: list = field(default_factory=list)  # handles of current_pass.hook_passes, installed on the model
    exit_gain: object | None = None  # core.auto_tau.ExitGain, measured on this river's first tau="auto" call
    exit_gain_warned: bool = False  # "exiting does not pay here" is said once per river
    lossless_fallbacks: dict = field(default_factory=dict)  # RiverSettings -> lossless.draft_control.FallbackMemory
    pushing_twins: bool | None = None  # push_to_hub's `save_twins`, for the save_pretrained it calls
