"""`build_river(model, cfg)` / `remove_river(model)`: wrap every decoder layer in a `RiverLayer` (and, with
`quantize_lm_head`, the LM head in a `RiverLMHead`) and put `RiverGenerationMixin` in front of the model's class; and
undo all of it exactly.

The model object stays the same object (so pipelines, accelerate hooks and user references keep working) and stays
an instance of its original class: the river class is a subclass with the same name that only adds `generate`.
"""

from __future__ import annotations

from torch import nn
from tqdm.auto import tqdm

from .adapters import river_host
from .architectures import UnsupportedModelError, find_decoder_layers, output_embedding
from .config import RiverQuantConfig
from .freed_memory import release_freed_memory
from .generation import RiverGenerationMixin
from ..kernels import matmulnbits as ort_kernel
from .river import River
from .twins import AdapterLoadingMixin, AdapterSavingMixin, RiverLayer, make_twin, get_river, twin_linears
from .lm_head import RiverLMHead, install_lm_head, remove_lm_head
from ..offload.backbone import reload_backbone
from .current_pass import hook_passes
from ..kernels.quantize import RiverQuantLinear
from ..kernels.shared_inputs import fuse_shared_inputs, stack_siblings
from ..saving.twin_files import fingerprint
from ..saving.twin_loading import read_stored_twins

_RIVER_CLASSES: dict[type, type] = {}


def build_river(model: nn.Module, quant_config: RiverQuantConfig | None = None, progress: bool = True,
                stored_twins=None) -> nn.Module:
    """Give every decoder layer from `start_layer` on a quantized, KV-sharing twin. Returns the same model.

    Each twin gets its layer's bits (`quant_config.nbits_for(idx)`), so with a schedule each layer runs on the kernel
    for its width (on CPU: int8pack_cpu for 8 bits, int4pack_cpu for 2-4). With `quantize_lm_head`, the LM head also
    gets a quantized copy that the steps which left the backbone use.

    Quantizing takes a few seconds per hundred million parameters on CPU (HQQ's optimizer); a progress bar shows it.
    `stored_twins` (a saved river's twins file or folder, or a `twin_loading.StoredTwins`): the twins it holds that
    fit this model and config are packed from their stored codes, without HQQ; the rest are quantized, with a
    `TwinsMismatchWarning` saying what differs (river_hf.saving.twin_loading).
    A `PeftModel`'s river goes on the model inside it (`get_base_model()`); LoRA layers are merged into the twins.
    """
    if (host := river_host(model)) is not model:
        build_river(host, quant_config, progress, stored_twins)
        model.__class__ = _river_class(type(model), (AdapterSavingMixin,))  # peft saves with the backbone's names
        return model
    quant_config = quant_config if quant_config is not None else RiverQuantConfig()
    if not isinstance(quant_config, RiverQuantConfig):
        raise TypeError(f"`quant_config` must be a RiverQuantConfig; got {type(quant_config).__name__}.")
    if is_river(model):
        raise ValueError("This model already has a river; call river_hf.remove_river(model) before building another.")
    layers = find_decoder_layers(model)
    quant_config.check_model_depth(len(layers))
    # The head first: it fails fast (no output embedding, not a Linear) before the model is touched.
    stored = read_stored_twins(stored_twins, quant_config)  # a corrupted file raises here, before the model is touched
    lm_head = _quantized_lm_head(model, quant_config, stored) if quant_config.quantize_lm_head else None
    from_store = stored.twins(layers, quant_config, progress) if stored is not None else {}
    river = River()  # river-wide state, shared by every RiverLayer of this river
    wrapped = [RiverLayer(layer, from_store.get(idx), layer_idx=idx, num_layers=len(layers),
                          quant_config=quant_config, river=river) for idx, layer in enumerate(layers)]
    to_quantize = [idx for idx in range(quant_config.start_layer, len(layers)) if idx not in from_store]
    for idx in tqdm(to_quantize, desc="river: quantizing twins", disable=not progress or not to_quantize,
                    leave=False):  # no bar when every twin came from the store: nothing is quantized
        wrapped[idx].twin = _twin(layers[idx], idx, quant_config)
    for layer in wrapped:
        if layer.twin is not None:
            fuse_shared_inputs(layer.twin, quant_config)
            stack_siblings(layer.twin, quant_config)
    if _runs_on_onnxruntime(wrapped, lm_head):
        ort_kernel.warn_if_openmp_spins()
    if stored is not None:
        stored.keep_packed()  # this machine's packed layout of the stored twins, for the next load
    for idx, layer in enumerate(wrapped):  # only now, with every twin built: an error above leaves no trace
        layers[idx] = layer
    if lm_head is not None:
        install_lm_head(model, lm_head)
    river.pass_hooks = hook_passes(model)
    model.__class__ = _river_class(type(model))
    return model


def _runs_on_onnxruntime(wrapped: list[RiverLayer], lm_head: RiverLMHead | None) -> bool:
    linears = [linear for layer in wrapped if layer.twin is not None for linear in twin_linears(layer.twin)]
    linears += [lm_head.quantized_head] if lm_head is not None else []
    return any(getattr(linear, "backend", None) == "matmulnbits_cpu" for linear in linears)


def _twin(layer: nn.Module, idx: int, quant_config: RiverQuantConfig) -> nn.Module:
    nbits, group_size = quant_config.nbits_for(idx), quant_config.group_size_for(idx)

    def quantize(linear):
        twin_linear = RiverQuantLinear.from_linear(linear, nbits=nbits, group_size=group_size,
                                                   axis=quant_config.axis, backend=quant_config.backend,
                                                   activations=quant_config.activations)
        twin_linear.source_fingerprint = fingerprint(linear)  # what a saved river checks its twins against
        return twin_linear

    return make_twin(layer, quantize, quant_config.skip_modules, quant_config.lora_twins)


def _quantized_lm_head(model: nn.Module, quant_config: RiverQuantConfig, stored=None) -> RiverLMHead:
    head = output_embedding(model)
    if head is None or not hasattr(model, "set_output_embeddings"):
        raise UnsupportedModelError(
            f"`quantize_lm_head=True`: {type(model).__name__} has no output embedding (get_output_embeddings() "
            f"returned nothing); build the river with quantize_lm_head=False."
        )
    quantized = stored.lm_head(head, quant_config) if stored is not None and isinstance(head, nn.Linear) else None
    if quantized is not None:
        return RiverLMHead(head, quantized, quant_config.lm_head_exact_top_k)
    lm_head = RiverLMHead.from_head(head, nbits=quant_config.head_nbits,
                                    group_size=quant_config.lm_head_group_size, axis=quant_config.axis,
                                    backend=quant_config.backend, activations=quant_config.head_activations,
                                    exact_top_k=quant_config.lm_head_exact_top_k)
    lm_head.quantized_head.source_fingerprint = fingerprint(head)
    return lm_head


def remove_river(model: nn.Module) -> nn.Module:
    """Put the backbone layers (and the original LM head) back and restore the model's class; drops the twins.
    Returns the same model."""
    if (host := river_host(model)) is not model:
        remove_river(host)
        model.__class__ = getattr(model.__class__, "_river_base_class", model.__class__)
        return model
    if not is_river(model):
        raise ValueError("This model has no river to remove (river_hf.build_river was not applied to it).")
    reload_backbone(model)  # offloaded backbone weights first come back, exactly (a no-op when none are offloaded)
    for hook in get_river(model).pass_hooks:
        hook.remove()
    layers = find_decoder_layers(model)
    for idx, layer in enumerate(layers):
        if isinstance(layer, RiverLayer):
            layers[idx] = layer.base_layer
    remove_lm_head(model)
    model.__class__ = model.__class__._river_base_class
    release_freed_memory()  # the twins are gone: their memory goes back to the system now
    return model


def is_river(model: nn.Module) -> bool:
    return isinstance(river_host(model), RiverGenerationMixin)


def _river_class(base: type, mixins: tuple[type, ...] = (RiverGenerationMixin, AdapterLoadingMixin)) -> type:
    """The river subclass of `base` (a transformers model's class, or a PeftModel's with AdapterSavingMixin), made
    once per class. It keeps the name, so pipelines (and peft) recognise the model."""
    if base not in _RIVER_CLASSES:
        attrs = {"__module__": base.__module__, "__qualname__": base.__qualname__, "_river_base_class": base}
        _RIVER_CLASSES[base] = type(base.__name__, (*mixins, base), attrs)
    return _RIVER_CLASSES[base]
