"""The `generate()` hook: `RiverConfig` (a `GenerationConfig`) and `RiverGenerationMixin`.

`model.generate(..., generation_config=RiverConfig(tau=0.97))` on a model that `build_river` prepared: the mixin
makes a `RiverCache` holding a fresh `ExitRouter`, passes it to HF's own `generate` as the cache, and lets HF do
everything else (greedy, sampling, beams, stopping, streaming, padding). Without river settings, `generate` runs the
untouched backbone: the layers see a plain cache and never call a twin.
"""

from __future__ import annotations

import dataclasses
import os
from contextlib import contextmanager

import torch
from transformers import GenerationConfig
from transformers.utils import ModelOutput

from .kv_cache import ExitRecord, RiverCache, RiverRun
from .captured_decode import (STATIC_IMPLEMENTATIONS, CapturedDecode, check_passed_static_cache, check_static_river,
    requested_setting, static_cache_settings, static_river_cache, warn_shared_inductor_cache)
from .config import RiverQuantConfig
from .twins import backbone_layers, river_layers, get_river, twins_prefill_faster
from .lm_head import original_lm_head
from .auto_tau import FULL_EXIT, NEVER_EXITS, ExitGain, auto_settings, measure_exit_gain
from ..lossless.decode import LosslessCache, lossless_generate_kwargs
from .exit_decision import ExitRouter
from .settings import AUTO_TAU, RIVER_FIELDS, RiverSettings, river_field_defaults, river_fields_doc
from .kv_strategies import check_beam_search, make_strategy
from ..saving import twin_files as twin_store

class RiverConfig(GenerationConfig):
    """A `GenerationConfig` with the river's exit settings (the fields of `river_hf.RiverSettings`, validated there).

    Every other argument is a `GenerationConfig` argument (max_new_tokens, do_sample, num_beams, ...).

    Args:
{fields}
    """

    def __init__(self, **kwargs):
        river = {name: kwargs.pop(name) for name in RIVER_FIELDS if name in kwargs}
        for name, default in river_field_defaults().items():
            setattr(self, name, river.get(name, default))
        super().__init__(**kwargs)  # ends with self.validate()

    def validate(self, *args, **kwargs):
        super().validate(*args, **kwargs)
        settings = self.river_settings()  # raises ValueError naming a bad field
        for name in RIVER_FIELDS:  # the checked values, as plain Python ones (a numpy integer becomes an int): JSON
            setattr(self, name, getattr(settings, name))

    def update(self, defaults_only=False, allow_custom_entries=False, **kwargs):
        # HF's `generate` merges the model's defaults into the config it was given with exactly these flags. A river
        # model hands HF a plain GenerationConfig (see RiverGenerationMixin), so a RiverConfig only gets here when
        # the model has no river, where it would otherwise be silently ignored.
        if defaults_only and allow_custom_entries:
            raise ValueError(
                "`generation_config` is a RiverConfig, but this model has no river, so nothing would exit. Call "
                "`river_hf.build_river(model, RiverQuantConfig(...))` first (or load the model with "
                "`quantization_config=RiverQuantConfig(...)`), or pass a plain GenerationConfig."
            )
        return super().update(defaults_only=defaults_only, allow_custom_entries=allow_custom_entries, **kwargs)

    def river_settings(self) -> RiverSettings:
        return RiverSettings.from_object(self)


RiverConfig.__doc__ = RiverConfig.__doc__.replace("{fields}", river_fields_doc(indent="        "))


def river_settings_from(generation_config, kwargs: dict, model_default=None) -> RiverSettings | None:
    """This call's river settings, or None for a plain backbone run.

    Sources, by priority: river kwargs (`generate(..., tau=0.9)`), the `generation_config` passed, then the model's
    own `generation_config` (a loaded generation_config.json may carry `tau`). Pops the river kwargs so that HF's
    `generate` does not reject them as unknown model kwargs.
    """
    overrides = {name: kwargs.pop(name) for name in RIVER_FIELDS if name in kwargs}
    # a RiverConfig always asks for the river (a tau set to None afterwards is refused by RiverSettings, not ignored)
    source = next((cfg for cfg in (generation_config, model_default)
                   if isinstance(cfg, RiverConfig) or getattr(cfg, "tau", None) is not None), None)
    if source is None and "tau" not in overrides:
        return None
    return RiverSettings.from_object(source, **overrides)


def without_river_fields(generation_config):
    """The same generation settings as a plain `GenerationConfig`: the river's part lives in the cache's router."""
    if generation_config is None:
        return None
    values = {key: value for key, value in generation_config.to_dict().items()
              if key not in RIVER_FIELDS and key != "compile_config"}
    plain = GenerationConfig.from_dict(values)
    # the object itself: its dict form drops `_compile_all_devices` (compiling on CPU) and cannot hold a callable
    # backend
    plain.compile_config = generation_config.compile_config
    return plain


# A river's `generate` runs under `torch.inference_mode` instead of transformers' `no_grad`: at batch 1 a decode step
# is hundreds of ops of a few µs each, and autograd's per-op bookkeeping (version counters, view tracking) is a share
# of every one. Plain and river steps alike (the backbone a bench compares against runs the same way); measured in
# benchmarks/README.md#inference-mode-every-generate-runs-under-torchinference_mode
# (`benchmarks/scripts/inference_mode.py` switches this off to compare).
GENERATE_IN_INFERENCE_MODE = True


def as_normal_tensors(output):
    """`generate`'s result with its tensors (sequences, scores, logits, ...) cloned out of inference mode, so that a
    caller can use them in autograd afterwards (e.g. the sequences of an RL step). The cache is left as it is."""
    if isinstance(output, torch.Tensor):
        return output.clone() if output.is_inference() else output
    if isinstance(output, (tuple, list)):
        return type(output)(as_normal_tensors(item) for item in output)
    if isinstance(output, ModelOutput):
        for key, value in output.items():
            if isinstance(value, (torch.Tensor, tuple, list)):
                output[key] = as_normal_tensors(value)
    return output


class RiverGenerationMixin:
    """Mixed in front of the model's class by `build_river`: routes `generate` through a `RiverCache`."""

    def generate(self, inputs=None, generation_config=None, **kwargs):
        with torch.inference_mode(GENERATE_IN_INFERENCE_MODE):
            output = self._river_generate(inputs, generation_config, **kwargs)
        return as_normal_tensors(output)

    def _river_generate(self, inputs, generation_config, **kwargs):
        settings = river_settings_from(generation_config, kwargs, model_default=self.generation_config)
        # None where exiting does not pay on this machine
        if settings is not None and settings.tau == AUTO_TAU:
            resolved = resolve_auto_tau(self, settings)
            # a RiverCache the caller passed still gets its exit record (every step at full depth)
            passed_cache = isinstance(kwargs.get("cache", kwargs.get("past_key_values")), ExitRecord)
            settings = dataclasses.replace(settings, tau=NEVER_EXITS) if resolved is None and passed_cache else resolved
        plain_config = without_river_fields(generation_config)
        if settings is None:
            return super().generate(inputs, generation_config=plain_config, **kwargs)
        implementation = requested_setting("cache_implementation", generation_config, kwargs,
                                           self.generation_config)
        check_static_river(self, settings, implementation)
        check_beam_search(settings.kv_strategy,
                          requested_setting("num_beams", generation_config, kwargs, self.generation_config))
        if implementation in STATIC_IMPLEMENTATIONS and kwargs.get("cache", kwargs.get("past_key_values")) is None:
            # transformers sizes the static cache; `_prepare_static_cache` below makes it this call's river cache
            with static_cache_settings(settings):
                return super().generate(inputs, generation_config=plain_config, **kwargs)
        kwargs["cache"] = self._river_cache(settings, kwargs)
        def setting(name: str):
            return requested_setting(name, generation_config, kwargs, self.generation_config)

        # generate expands the input's rows for beams and return sequences before the cache sees them
        rows = _input_rows(inputs, kwargs) * max(setting("num_beams") or 1, setting("num_return_sequences") or 1)
        check_passed_static_cache(kwargs["cache"], _input_length(inputs, kwargs), setting("max_new_tokens"),
                                  batch_size=rows or None, dtype=self.dtype)
        if settings.lossless:  # the river drafts, the backbone verifies (river_hf.lossless.decode)
            kwargs.update(lossless_generate_kwargs(settings, kwargs))
        return super().generate(inputs, generation_config=plain_config, **kwargs)

    def _prepare_static_cache(self, cache_implementation, batch_size, max_cache_len, prefill_chunk_size,
                              model_kwargs):
        # transformers' hook for making the cache of `cache_implementation="static"`: a river call gets a
        # RiverStaticCache of the same length (river_hf.core.captured_decode)
        cache = super()._prepare_static_cache(cache_implementation=cache_implementation, batch_size=batch_size,
                                              max_cache_len=max_cache_len, prefill_chunk_size=prefill_chunk_size,
                                              model_kwargs=model_kwargs)
        return static_river_cache(self, cache, model_kwargs, new_river_cache)

    def get_compiled_call(self, compile_config):
        # transformers' compiled decode step (its torch.compile of __call__), steered per step onto the graph of the
        # step's planned exit depth (river_hf.core.captured_decode)
        warn_shared_inductor_cache(self.device)
        return CapturedDecode(self, super().get_compiled_call(compile_config))

    def save_pretrained(self, save_directory, *args, save_twins: bool | None = None, **kwargs):
        """Save the backbone's own checkpoint (original layers and LM head, exactly), and with `save_twins` the twins
        too (river_twins.safetensors, river_hf.saving.twin_files), so that loading the folder reads them instead of
        running HQQ. `save_twins=True` also writes the river's RiverQuantConfig into config.json, so a plain
        `from_pretrained(folder)` loads the river. Default (None): store them when config.json carries a
        RiverQuantConfig anyway (a model loaded with `quantization_config=RiverQuantConfig(...)`), whose folder loads
        as a river; a river made with `build_river` saves the plain backbone, as before. A save without twins removes
        an old twins file from the folder."""
        save_twins = get_river(self).pushing_twins if save_twins is None else save_twins
        save_twins = self._saves_twins_by_default() if save_twins is None else save_twins
        if not isinstance(save_twins, bool):
            raise ValueError(f"`save_twins` must be True, False or None (the default); got {save_twins!r}.")
        push = kwargs.pop("push_to_hub", False) and save_twins  # transformers would upload before the twins exist
        with _river_quant_config_saved(self, save_twins), backbone_layers(self), original_lm_head(self):
            result = super().save_pretrained(save_directory, *args, **kwargs)
        if not kwargs.get("is_main_process", True):
            return result
        if save_twins:
            twin_store.save_twins(self, save_directory)
        else:
            twin_store.remove_twins(save_directory)
        if push:  # saved here with the twins; now the same files go up through push_to_hub
            hub_kwargs = {name: kwargs[name] for name in ("commit_message", "create_pr", "token", "private")
                          if name in kwargs}
            repo_id = kwargs.get("repo_id", os.fspath(save_directory).rstrip(os.sep).split(os.sep)[-1])
            return self.push_to_hub(repo_id, save_twins=True, **hub_kwargs)
        return result

    def push_to_hub(self, repo_id: str, *args, save_twins: bool | None = None, **kwargs):
        """transformers' `push_to_hub`, whose upload holds the twins file when `save_twins` (or the default of
        `save_pretrained`: a model loaded with a RiverQuantConfig) says to save them."""
        river = get_river(self)
        river.pushing_twins = save_twins  # push_to_hub calls save_pretrained without our arguments
        try:
            return super().push_to_hub(repo_id, *args, **kwargs)
        finally:
            river.pushing_twins = None

    def _saves_twins_by_default(self) -> bool:
        return isinstance(getattr(self.config, "quantization_config", None), RiverQuantConfig)

    def _river_cache(self, settings: RiverSettings, kwargs: dict) -> RiverCache:
        # (not `or`: an empty Cache is falsy, it has len() 0)
        user_cache = kwargs.pop("cache", None)
        user_cache = kwargs.pop("past_key_values", None) if user_cache is None else user_cache
        if user_cache is not None and not isinstance(user_cache, ExitRecord):
            raise ValueError(
                f"`cache`: a river generate needs a `RiverCache` or `RiverStaticCache` (it records each position's "
                f"exit); got "
                f"{type(user_cache).__name__}. Pass no cache and river_hf makes one."
            )
        if user_cache is None and settings.lossless:
            user_cache = LosslessCache(config=self.config.get_text_config(decoder=True))
        return new_river_cache(self, settings, kwargs.get("attention_mask"), cache=user_cache)


@contextmanager
def _river_quant_config_saved(model, save_twins: bool):
    """With the twins saved, config.json must name the river's RiverQuantConfig (a `build_river` model has none), so
    that loading the folder goes through the river quantizer and finds them."""
    config = model.config
    if not save_twins or getattr(config, "quantization_config", None) is not None:
        yield
        return
    config.quantization_config = next(layer.quant_config for layer in river_layers(model) if layer.twin is not None)
    try:
        yield
    finally:
        del config.quantization_config


def _input_ids(inputs, kwargs: dict):
    return inputs if inputs is not None else kwargs.get("input_ids", kwargs.get("inputs_embeds"))


def _input_length(inputs, kwargs: dict) -> int:
    ids = _input_ids(inputs, kwargs)
    return 0 if ids is None else ids.shape[1]


def _input_rows(inputs, kwargs: dict) -> int:
    """The batch size of the input (0 when there is none: generate starts from a BOS token)."""
    ids = _input_ids(inputs, kwargs)
    return 0 if ids is None else ids.shape[0]


def new_river_cache(model, settings: RiverSettings, attention_mask=None, cache: ExitRecord | None = None
                    ) -> ExitRecord:
    """A RiverCache with a fresh router for `model` (for generate, or for driving the model's forward yourself)."""
    layers = river_layers(model)
    if settings.tau == AUTO_TAU:  # driving the forward yourself: where exiting does not pay, nothing exits
        measured = resolve_auto_tau(model, settings)
        settings = measured or dataclasses.replace(settings, tau=NEVER_EXITS)
    text_config = model.config.get_text_config(decoder=True)
    strategy = make_strategy(settings.kv_strategy, layers, text_config)
    if strategy.runs_prompt_on_backbone:
        settings = dataclasses.replace(settings, prefill_exit="none")
    elif settings.prefill_exit == "auto":
        settings = dataclasses.replace(settings, prefill_exit="sequence" if twins_prefill_faster(layers) else "none")
    start_layer = next(layer.layer_idx for layer in layers if layer.twin is not None)
    router = ExitRouter(settings, start_layer=start_layer, num_layers=len(layers))
    router.min_depth = _min_exit_depth(settings, strategy, start_layer, len(layers))
    router.prompt_mask = attention_mask
    run = RiverRun(router=router, strategy=strategy)
    if cache is None:
        return RiverCache(config=text_config, run=run)
    cache.start_run(run)
    return cache


def resolve_auto_tau(model, settings: RiverSettings) -> RiverSettings | None:
    """tau="auto" resolved for `model`'s river, the one place it is (generate, new_river_cache and the bench's
    defaults system call this): the signal's default tau where this river's exits pay on this machine, else None (the
    plain backbone). The river's ExitGain is measured on the first call and kept in its `River`."""
    return auto_settings(settings, get_river(model), lambda: measure_river_exit_gain(model))


def measure_river_exit_gain(model) -> ExitGain:
    """Time `model`'s decode step on the backbone against one exited at the river's start (river_hf.core.auto_tau)."""
    return measure_exit_gain(model, new_river_cache(model, FULL_EXIT))


def _min_exit_depth(settings: RiverSettings, strategy, start_layer: int, num_layers: int) -> int:
    """No exit before the twins start, nor before the user's / the strategy's minimum exit layer."""
    wanted = settings.min_exit_layer if settings.min_exit_layer is not None else strategy.default_min_exit_depth(
        start_layer)
    if wanted >= num_layers:
        raise ValueError(
            f"`min_exit_layer`={wanted} leaves nothing to exit: the model has {num_layers} layers, so it must be "
            f"below {num_layers}."
        )
    return max(wanted, start_layer)
