"""`RiverLayer`: one decoder layer of the backbone plus (from start_layer on) its quantized twin.

The wrapper never looks inside the HF layer: it passes the call's positional and keyword arguments through
unchanged to whichever of the two runs, so attention, masks and rotary embeddings stay HF's. The twin is a copy of
the layer whose linear layers are quantized and whose attention keeps the same `layer_idx`, so its K/V land in
the backbone's cache slot. Norms (and any other non-linear parameter) are shared with the backbone, not copied.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch
from torch import nn

from .adapters import adapter_state, check_unchanged, twin_replacements
from .architectures import UnsupportedModelError, find_decoder_layers, hidden_of
from .current_pass import river_cache_of
from ..kernels.choice import lookup
from ..kernels.quantize import RiverQuantLinear
from .kv_strategies import RiverStrategy
from .river import River

_RIVER = RiverStrategy([])  # a RiverCache made by hand, with a router but no strategy, runs the river


class RiverLayer(nn.Module):
    """Dispatches one decoder layer to the backbone or its twin, as the step's `ExitRouter` decides."""

    def __init__(self, base_layer: nn.Module, twin: nn.Module | None, layer_idx: int, num_layers: int,
                 quant_config=None, river: River | None = None):
        super().__init__()
        self.base_layer = base_layer
        self.twin = twin
        self.layer_idx = layer_idx
        self.num_layers = num_layers
        self.quant_config = quant_config  # the RiverQuantConfig the twin was built with
        self.adapter_state = adapter_state(base_layer)  # peft adapters now: the twin is built from them (adapters.py)
        self.river = river if river is not None else River()  # river-wide state, one object per river (core.river)

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs):
        cache = river_cache_of(kwargs)
        if cache is None:
            return self.base_layer(hidden_states, *args, **kwargs)  # plain generate: the untouched backbone
        # a captured step (river_hf.core.captured_decode): its path was fixed before it began
        if cache.planned_depth is not None:
            return self._planned_module(cache.planned_depth)(hidden_states, *args, **kwargs)
        if self.twin is not None and cache.recorded_length == 0:
            # a river pass's first step: a twin built from peft adapters that have changed since is an error, not
            # drift (here, not in river_layers: remove_river must still work on such a model)
            check_unchanged(self)
        run = cache.run
        router, strategy = run.router, run.strategy or _RIVER
        if self.layer_idx == 0:
            router.begin_step(hidden_states.shape[1], is_first_step=cache.recorded_length == 0)
            strategy.begin_step(cache, router)
        # profiling covers decode steps only: per-token costs, as the bench reports them
        started = _clock(hidden_states) if run.profile and not router.is_prefill else None
        if router.exited:  # the strategy decides what a skipped layer does (the river: its twin)
            output = strategy.run_skipped(self, hidden_states, args, kwargs, cache)
            part = "skipped"
        else:
            output = strategy.run_backbone(self, hidden_states, args, kwargs, cache)
            part = "backbone"
        if started is not None:
            cache.add_time(part, _clock(hidden_states) - started)
        if part == "backbone":
            router.observe(self.layer_idx, hidden_states, hidden_of(output))
        if self.layer_idx == self.num_layers - 1:
            cache.record_step(router.depth, hidden_states.shape[0], hidden_states.shape[1], hidden_states.device)
        return output

    def _planned_module(self, depth: int) -> nn.Module:
        """Backbone below the step's exit depth, twin from it on. Traced by dynamo: `depth` is a constant of the
        graph, so the router, the strategy and the exit record stay outside it."""
        return self.twin if self.twin is not None and self.layer_idx >= depth else self.base_layer

    def __getattr__(self, name: str):
        # HF model loops read attributes of their layers (e.g. `attention_type` for the mask): answer for the backbone.
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("base_layer"), name)

    def extra_repr(self) -> str:
        return f"layer_idx={self.layer_idx}, twin={'yes' if self.twin is not None else 'no'}"

    def unload_and_optionally_merge_module(self, merge: bool, safe_merge: bool, adapter_names) -> RiverLayer:
        # peft's unload (merge_and_unload, unload) takes any module with a `base_layer` for one of its adapter
        # wrappers, unless it offers this method (peft's hook for modules that unload themselves). A RiverLayer is not
        # an adapter wrapper: it stays, and the adapter layers inside it are unloaded on their own.
        return self


def _clock(tensor: torch.Tensor) -> float:
    """Wall time for profiling; on CUDA it waits for queued kernels first, so a layer's time is its own."""
    if tensor.is_cuda:
        torch.cuda.synchronize(tensor.device)
    return time.perf_counter()


def make_twin(layer: nn.Module, quantize_linear, skip_modules: list[str], lora_twins: str = "full_precision"
              ) -> nn.Module:
    """A copy of `layer` whose nn.Linear modules are quantized; every other parameter is shared, not copied.

    `quantize_linear(linear) -> nn.Module` makes one quantized linear layer. A LoRA-adapted linear becomes its
    quantized base weight with the active LoRA in full precision on top (`adapters.LoraOnQuantized`; with
    `lora_twins="merged"`, one quantized linear of W + s·B·A); other peft adapter layers (DoRA, IA3, ...) one
    quantized linear of their merged weight; a skipped one is shared as it is (river_hf.core.adapters).
    """
    def is_skipped(name: str) -> bool:
        return _is_skipped(name, skip_modules)

    _refuse_packed_weights(layer, is_skipped)
    adapted = twin_replacements(layer, is_skipped, lora_twins)  # first: a bad adapter raises before any work is done
    twin = clone_modules(layer)
    for name, module in adapted.items():
        twin.set_submodule(name, module)
    for name, module in list(twin.named_modules()):
        if isinstance(module, nn.Linear) and not is_skipped(name):
            twin.set_submodule(name, quantize_linear(module))
    return twin


def clone_modules(module: nn.Module) -> nn.Module:
    """A copy of `module`'s tree of modules sharing every parameter, buffer and plain attribute (its config too): only
    the module objects and their registries (submodules, parameters, buffers, hooks) are new, so setting a submodule
    of the copy leaves `module` as it was. deepcopy, even with a memo of the tensors, walked and copied every
    attribute object: about 800 deepcopy calls per SmolLM2 layer."""
    clone = module.__class__.__new__(module.__class__)
    clone.__dict__ = {name: _registry_copy(value) for name, value in module.__dict__.items()}
    clone._modules = {name: None if child is None else clone_modules(child) for name, child in module._modules.items()}
    return clone


def _registry_copy(value):
    """A module's registries (dicts and sets of its __dict__: parameters, buffers, hooks) are copied, not shared."""
    return value.copy() if isinstance(value, (dict, set)) else value


def _refuse_packed_weights(layer: nn.Module, is_skipped) -> None:
    """A linear whose weight is already packed into integers (transformers' GgufLinear, bitsandbytes' 4-bit Linear)
    cannot be quantized again: HQQ would read its bytes as numbers. Refused before anything is built."""
    for name, module in layer.named_modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor) and not weight.is_floating_point() and not is_skipped(name):
            raise UnsupportedModelError(
                f"`{name}` ({type(module).__name__}) keeps its weights packed as {weight.dtype}, so no twin can be "
                f"quantized from it. Load the model with float weights (a GGUF: "
                f"`from_pretrained(..., gguf_file=..., quantization_config=GgufConfig(dequantize=True))`, as "
                f"river_hf.loading.models.load_model_and_tokenizer does), "
                f"or keep it out of the twins with `skip_modules`.")


def _is_skipped(name: str, skip_modules: list[str]) -> bool:
    """`name`, or a module it lies in, is one of `skip_modules` (e.g. "down_proj" skips "mlp.down_proj" and
    "mlp.down_proj.base_layer")."""
    parts = name.split(".")
    prefixes = [".".join(parts[:end]) for end in range(1, len(parts) + 1)]
    return any(prefix == skip or prefix.endswith("." + skip) for prefix in prefixes for skip in skip_modules)


def river_layers(model: nn.Module) -> list[RiverLayer]:
    """The model's RiverLayers (one per decoder layer); a clear error when the model has no river."""
    layers = [layer for layer in find_decoder_layers(model) if isinstance(layer, RiverLayer)]
    if not layers:
        raise ValueError(
            "This model has no river: call `river_hf.build_river(model, RiverQuantConfig(...))` first, or load it "
            "with `from_pretrained(..., quantization_config=RiverQuantConfig(...))`."
        )
    return layers


def get_river(model: nn.Module) -> River:
    """The model's `River` (its river-wide state); a clear error when the model has no river."""
    return river_layers(model)[0].river


def twin_linears(twin: nn.Module) -> list[RiverQuantLinear]:
    return [module for module in twin.modules() if isinstance(module, RiverQuantLinear)]


def twins_prefill_faster(layers: list[RiverLayer]) -> bool:
    """Whether the twins, summed over their linears, ran a prompt-shaped matmul faster than dense bf16 weights when
    `backend='fastest'` measured them; True (the paper's sequence-level prompt exit) where nothing was measured. A
    river built with another backend measured nothing, even where this process timed the same shapes for another
    river: its prompts exit whatever the machine (what it does must not depend on what ran before it)."""
    if any(layer.quant_config is None or layer.quant_config.backend != "fastest" for layer in layers):
        return True
    chosen = dense = 0.0
    for layer in layers:
        for linear in twin_linears(layer.twin) if layer.twin is not None else []:
            choice = lookup(linear.out_features, linear.in_features, linear.nbits, linear.backend, linear.scale.device)
            if choice is None:
                return True
            chosen += choice.prefill_microseconds[choice.backend]
            dense += choice.prefill_microseconds["dense"]
    return chosen < dense or dense == 0.0


class AdapterLoadingMixin:
    """Part of the river class (build_river): peft's injection (`load_adapter`, `add_adapter`) matches modules by name,
    so it would also try to adapt the twins' quantized linears and fail halfway. It runs on the plain backbone layers
    instead; a new active adapter then makes the next river generate ask for a rebuild (river_hf.core.adapters)."""

    def load_adapter(self, *args, **kwargs):
        with backbone_layers(self):
            return super().load_adapter(*args, **kwargs)

    def add_adapter(self, *args, **kwargs):
        with backbone_layers(self):
            return super().add_adapter(*args, **kwargs)


class AdapterSavingMixin:
    """Part of a river PeftModel's class (build_river on a PeftModel): peft names an adapter's tensors by the module
    names it finds, which inside a river are the RiverLayers' (`layers.3.base_layer.self_attn...`), and a plain model
    would not load them. Saving runs on the plain backbone layers, so the adapter file is the one the plain
    PeftModel writes."""

    def save_pretrained(self, *args, **kwargs):
        with backbone_layers(self.get_base_model()):
            return super().save_pretrained(*args, **kwargs)


@contextmanager
def backbone_layers(model: nn.Module):
    """Inside the block the model's decoder layers are the plain backbone layers again (the RiverLayers return
    after it, twins untouched): for saving exactly the original checkpoint."""
    layers = find_decoder_layers(model)
    wrapped = list(layers)
    for idx, layer in enumerate(wrapped):
        if isinstance(layer, RiverLayer):
            layers[idx] = layer.base_layer
    try:
        yield model
    finally:
        for idx, layer in enumerate(wrapped):
            layers[idx] = layer

