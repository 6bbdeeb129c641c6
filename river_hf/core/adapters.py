"""PEFT adapters (LoRA and peft's other tuner layers) inside the river's decoder layers.

A LoRA-adapted linear computes W x + scaling * B A x. Its twin is a `LoraOnQuantized`: the quantized base weight W
plus the LoRA of the adapters active when the river was built, in full precision on top (two rank-r matmuls per
adapted linear per twin step). On the packaged SmolLM2 that measured more faithful than quantizing the merged weight
W + scaling * B A (docs/peft.md), and it keeps a twin linear's codes those of W alone (so a saved river's twins serve
the base model and every LoRA on it). Other variants (DoRA, a LoRA bias, ...) and peft's other tuners (IA3, LoHa,
...) become one quantized linear of peft's own merge of them, made on a copy of the adapter layer (the model's
weights are never touched).

The twins are a snapshot of the adapter state (the LoRA weights in a twin are copies). A fingerprint of that state
(which tuner layers exist, their active and merged adapters, whether adapters are disabled, the identity and version
of their tensors) is recorded when the river is built and checked whenever a river generate makes its cache: after
`set_adapter`, `load_adapter`, `disable_adapters`, `merge_and_unload`, training, ... a river generate raises and
says to rebuild the river. Plain generate runs the backbone, adapters and all, whatever their state.

peft is imported only when it is already loaded (a model cannot carry peft layers otherwise), so river_hf imports
and runs without it.
"""

from __future__ import annotations

import copy
import sys

import torch
from torch import nn
from torch.nn import functional as F

REBUILD = "Rebuild the river: `river_hf.remove_river(model)`, then `river_hf.build_river(model, quant_config)`."


def tuner_layers(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, layer) of every peft tuner layer (LoRA's `LoraLayer` and the others) inside `module`, outermost only."""
    if sys.modules.get("peft") is None:  # not loaded (or known missing): no model here carries peft layers
        return []
    from peft.tuners.tuners_utils import BaseTunerLayer

    found = [(name, sub) for name, sub in module.named_modules() if isinstance(sub, BaseTunerLayer)]
    return [(name, sub) for name, sub in found if not any(name.startswith(outer + ".") for outer, _ in found)]


def river_host(model: nn.Module) -> nn.Module:
    """The model a river is built on: a `PeftModel`'s river goes on the transformers model inside it, which runs
    `generate` and every forward pass (so the river's generate and its pass hooks are there); any other model is its
    own host."""
    if sys.modules.get("peft") is None:  # not loaded (or known missing): no model here carries peft layers
        return model
    from peft import PeftModel

    return model.get_base_model() if isinstance(model, PeftModel) else model


# ---------------------------------------------------------------- what a twin uses for an adapted linear


def twin_replacements(layer: nn.Module, is_skipped, lora_twins: str = "full_precision") -> dict[str, nn.Module]:
    """For each tuner layer in decoder layer `layer`: the module its twin holds at that name.

    A skipped one (`is_skipped(name)`, from `skip_modules`) is the backbone's own adapter layer, shared (full
    precision, and any adapter change reaches it); any other becomes what `twin_of_adapted` makes, whose nn.Linear
    the twin then quantizes. Raises ValueError, before anything is changed, for an adapter on a module that is not a
    linear.
    """
    layers = tuner_layers(layer)
    for name, adapted in layers:
        if not is_skipped(name):
            _check_linear(name, adapted)
    return {name: adapted if is_skipped(name) else twin_of_adapted(adapted, lora_twins) for name, adapted in layers}


def twin_of_adapted(adapted: nn.Module, lora_twins: str = "full_precision") -> nn.Module:
    """What a twin holds for the tuner layer `adapted` (on an nn.Linear): with `lora_twins="full_precision"` a
    `LoraOnQuantized` around its base linear for a plain LoRA; else (`"merged"`, or DoRA, IA3, LoHa, ...) one
    nn.Linear of what it computes now (peft's merge on a copy)."""
    adapters = plain_lora_adapters(adapted) if lora_twins == "full_precision" else None
    if adapters is None:
        return merged_linear(adapted)
    return LoraOnQuantized(adapted.get_base_layer(), adapters,
                           cast_input=getattr(adapted, "cast_input_dtype_enabled", True))


LoraWeights = tuple[torch.Tensor, torch.Tensor, "torch.Tensor | None", float]  # A, B, B's bias, scaling


def plain_lora_adapters(adapted: nn.Module) -> list[LoraWeights] | None:
    """[(A [r, K], B [N, r], B's bias [N] or None (`lora_bias`), scaling)] copies, one per active adapter of a LoRA
    `Linear` that adds scaling * B(A x) to its base and nothing else; None where that is not what it computes now:
    adapters disabled or merged into the base (the base alone is then exact), a variant (DoRA, ...), fan-in-fan-out,
    or not a LoRA layer at all."""
    from peft.tuners.lora import Linear as LoraLinear

    if not isinstance(adapted, LoraLinear) or adapted.disable_adapters or adapted.merged or adapted.fan_in_fan_out:
        return None
    present = [name for name in adapted.active_adapters if name in adapted.lora_A]  # peft skips the others too
    if not present or any(_is_variant(adapted, name) for name in present):
        return None
    return [(_copy(adapted.lora_A[name].weight), _copy(adapted.lora_B[name].weight), _copy(adapted.lora_B[name].bias),
             adapted.scaling[name]) for name in present]


def _copy(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return None if tensor is None else tensor.detach().clone()


def _is_variant(adapted: nn.Module, name: str) -> bool:
    return (name in getattr(adapted, "lora_variant", {}) or bool(getattr(adapted, "use_dora", {}).get(name))
            or adapted.lora_A[name].bias is not None)


class LoraOnQuantized(nn.Module):
    """The twin of a LoRA-adapted linear: quantized(W)(x) + sum over the adapters of scaling * B(A(x)), in peft's
    own order of operations (x cast to the LoRA weights' dtype, the sum cast back to the base output's dtype; no
    dropout: inference).

    `quantized` holds the adapted layer's base nn.Linear until make_twin replaces it by its quantized twin; the LoRA
    weights are copies, as buffers (`down_i` = A, `up_i` = B, `up_bias_i`; a snapshot, like the quantized W: the adapter
    fingerprint asks for a rebuild when the backbone's change). Deliberately nothing peft recognises: not a tuner
    layer, no `base_layer`, no `lora_` names, so peft's set_adapter, merge_and_unload, get_peft_model_state_dict, ...
    never visit it. A saved river stores `quantized` under the adapted linear's own name (`stored_linear_name`)."""

    def __init__(self, base: nn.Module, adapters: list[LoraWeights], cast_input: bool = True):
        super().__init__()
        self.quantized = base
        self.scalings = [float(scaling) for *_, scaling in adapters]
        self.cast_input = cast_input  # peft's `cast_input_dtype_enabled`
        for idx, (down, up, up_bias, _) in enumerate(adapters):
            self.register_buffer(f"down_{idx}", down)  # A [r, K]
            self.register_buffer(f"up_{idx}", up)  # B [N, r]
            self.register_buffer(f"up_bias_{idx}", up_bias)  # [N] or None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., K] -> [..., N]
        result = self.quantized(x)
        dtype = result.dtype
        for idx, scaling in enumerate(self.scalings):
            buffers = self._buffers
            down, up, up_bias = buffers[f"down_{idx}"], buffers[f"up_{idx}"], buffers[f"up_bias_{idx}"]
            if self.cast_input and x.dtype != down.dtype:
                x = x.to(down.dtype)
            result = result + F.linear(F.linear(x, down), up, up_bias) * scaling
        return result.to(dtype)

    def extra_repr(self) -> str:
        ranks = [self._buffers[f"down_{idx}"].shape[0] for idx in range(len(self.scalings))]
        return f"ranks={ranks}, scalings={self.scalings}"


def stored_linear_name(twin: nn.Module, name: str) -> str:
    """The name a saved river stores twin linear `name` under: a `LoraOnQuantized`'s quantized W goes by the adapted
    linear's own name ("self_attn.q_proj", as in a river without adapters), so its codes fit both."""
    parent, _, child = name.rpartition(".")
    return parent if child == "quantized" and isinstance(twin.get_submodule(parent), LoraOnQuantized) else name


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
    changes = [f"`{name}`: adapter layer gone (merge_and_unload / unload?)"
               for name in sorted(built.keys() - now.keys())]
    changes += [f"`{name}`: new adapter layer (load_adapter / add_adapter?)"
                for name in sorted(now.keys() - built.keys())]
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
