"""PEFT adapters (LoRA and peft's other tuner layers) inside the river's decoder layers.

A LoRA-adapted linear computes W x + scaling * B A x. Its twin is one `RiverQuantLinear` of the merged weight
W + scaling * B A of the adapters active when the river was built: peft's own `merge` makes that weight, on a copy of
the adapter layer (the model's weights are never touched). Keeping B A in full precision on top of a quantized W was
measured against it and was not more faithful, at two extra matmuls per adapted linear (docs/peft.md).

The twins are a snapshot of the adapter state. A fingerprint of that state (which tuner layers exist, their active
and merged adapters, whether adapters are disabled, the identity and version of their tensors) is recorded when the
river is built and checked whenever a river generate makes its cache: after `set_adapter`, `load_adapter`,
`disable_adapters`, `merge_and_unload`, ... a river generate raises and says to rebuild the river. Plain generate
runs the backbone, adapters and all, whatever their state.

peft is imported only when it is already loaded (a model cannot carry peft layers otherwise), so river_hf imports
and runs without it.
"""

from __future__ import annotations

import copy
import sys

from torch import nn

REBUILD = "Rebuild the river: `river_hf.remove_river(model)`, then `river_hf.build_river(model, quant_config)`."


def tuner_layers(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, layer) of every peft tuner layer (LoRA's `LoraLayer` and the others) inside `module`, outermost only."""
    if "peft" not in sys.modules:
        return []
    from peft.tuners.tuners_utils import BaseTunerLayer

    found = [(name, sub) for name, sub in module.named_modules() if isinstance(sub, BaseTunerLayer)]
    return [(name, sub) for name, sub in found if not any(name.startswith(outer + ".") for outer, _ in found)]


def river_host(model: nn.Module) -> nn.Module:
    """The model a river is built on: a `PeftModel`'s river goes on the transformers model inside it, which runs
    `generate` and every forward pass (so the river's generate and its pass hooks are there); any other model is its
    own host."""
    if "peft" not in sys.modules:
        return model
    from peft import PeftModel

    return model.get_base_model() if isinstance(model, PeftModel) else model


# ---------------------------------------------------------------- what a twin uses for an adapted linear


def twin_replacements(layer: nn.Module, is_skipped) -> dict[str, nn.Module]:
    """For each tuner layer in decoder layer `layer`: the module its twin holds at that name.

    A skipped one (`is_skipped(name)`, from `skip_modules`) is the backbone's own adapter layer, shared (full
    precision, and any adapter change reaches it); any other becomes an `nn.Linear` holding what the adapter layer
    computes now (base weight plus its active adapters), which the twin then quantizes. Raises ValueError, before
    anything is changed, for an adapter on a module that is not a linear.
    """
    layers = tuner_layers(layer)
    for name, adapted in layers:
        if not is_skipped(name):
            _check_linear(name, adapted)
    return {name: adapted if is_skipped(name) else merged_linear(adapted) for name, adapted in layers}


def _check_linear(name: str, adapted: nn.Module) -> None:
    base = adapted.get_base_layer()
    if type(base) is not nn.Linear:  # Conv1D, Embedding, Conv2d, a quantized base (bnb, hqq, ...)
        raise ValueError(
            f"`{name}` carries a peft adapter ({type(adapted).__name__}) on a {type(base).__name__}, not an "
            f"nn.Linear: the river's twins quantize linear layers only. Add `{name.split('.')[-1]}` to "
            f"`skip_modules` (the twins then share the adapted layer in full precision), or merge the adapters "
            f"into the weights first (`model = model.merge_and_unload()`) and build the river on that."
        )


def merged_linear(adapted: nn.Module) -> nn.Linear:
    """A new nn.Linear computing what the tuner layer `adapted` computes now, made by peft's own merge on a copy."""
    scratch = copy.deepcopy(adapted)  # one linear's weights, briefly: merge writes into its base weight in place
    if scratch.disable_adapters:
        if scratch.merged:
            scratch.unmerge()  # what peft's forward does with disabled adapters that were merged
    elif not scratch.merged:
        scratch.merge()  # the active adapters (peft's safe, variant-aware merge: DoRA included)
    merged = scratch.get_base_layer()
    merged.requires_grad_(False)
    return merged


# ---------------------------------------------------------------- the adapter fingerprint


def adapter_state(layer: nn.Module) -> dict[str, tuple]:
    """A fingerprint of the adapters in decoder layer `layer`: {tuner layer name: its state}. Cheap: no tensor data
    is read, only identities and in-place versions (an optimizer step bumps them)."""
    return {name: _state_of(adapted) for name, adapted in tuner_layers(layer)}


def _state_of(adapted: nn.Module) -> tuple:
    active = tuple(adapted.active_adapters)
    used = [(name, tensor) for name, tensor in adapted.named_parameters()
            if name.startswith("base_layer.") or any(f".{adapter}." in f".{name}." for adapter in active)]
    scaling = getattr(adapted, "scaling", {})
    return (
        id(adapted), active, tuple(adapted.merged_adapters), bool(adapted.disable_adapters),
        tuple(scaling.get(adapter) for adapter in active),
        tuple((name, id(tensor), tensor.data_ptr(), tensor._version) for name, tensor in used),
    )


_FIELDS = ("adapter layer object", "active adapters", "merged adapters", "adapters disabled", "scaling",
           "adapter or base weights")
_SHOWN = ("active adapters", "merged adapters", "adapters disabled", "scaling")


def describe_change(built: dict[str, tuple], now: dict[str, tuple]) -> str | None:
    """What differs between two fingerprints of one decoder layer, in words (a few modules); None when nothing."""
    changes = [f"`{name}`: adapter layer gone (merge_and_unload / unload?)" for name in sorted(built.keys() - now.keys())]
    changes += [f"`{name}`: new adapter layer (load_adapter / add_adapter?)" for name in sorted(now.keys() - built.keys())]
    for name in sorted(built.keys() & now.keys()):
        field, before, after = next(((field, *pair) for field, *pair in zip(_FIELDS, built[name], now[name])
                                     if pair[0] != pair[1]), (None, None, None))
        if field in _SHOWN:
            changes.append(f"`{name}`: {field} {before} -> {after}")
        elif field is not None:
            changes.append(f"`{name}`: {field} changed")
    more = f" and {len(changes) - 3} more" if len(changes) > 3 else ""
    return "; ".join(changes[:3]) + more if changes else None


def check_unchanged(river_layer) -> None:
    """Raise ValueError when the adapters of `river_layer`'s backbone layer changed since its twin was built."""
    change = describe_change(river_layer.adapter_state, adapter_state(river_layer.base_layer))
    if change is not None:
        raise ValueError(
            f"The model's peft adapters changed after its river was built (decoder layer {river_layer.layer_idx}: "
            f"{change}), so the twins no longer compute the adapted layers. {REBUILD} Plain generate (no river "
            f"settings) still runs the adapted backbone."
        )
