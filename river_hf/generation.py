"""The `generate()` hook: `RiverConfig` (a `GenerationConfig`) and `RiverGenerationMixin`.

`model.generate(..., generation_config=RiverConfig(tau=0.97))` on a model that `build_river` prepared: the mixin
makes a `RiverCache` holding a fresh `ExitRouter`, passes it to HF's own `generate` as the cache, and lets HF do
everything else (greedy, sampling, beams, stopping, streaming, padding). Without river settings, `generate` runs the
untouched backbone: the layers see a plain cache and never call a twin.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

from transformers import GenerationConfig

from .cache import RiverCache
from .layers import backbone_layers, river_layers
from .lm_head import original_lm_head
from .router import EXIT_POLICIES, PREFILL_EXITS, ExitRouter, RiverSettings
from .signals import EXIT_SIGNALS
from .strategies import KV_STRATEGIES, make_strategy

# Exit threshold on cos(h_in, h_out), chosen for the packaged SmolLM2-135M with 4-bit group-64 twins: the fastest tau
# of a measured sweep whose teacher-forced next-token match stays >= 90% (README "Choosing tau"). The paper's
# 0.5-0.9 suits Llama-3; on SmolLM2 it exits nearly every token after 2 layers.
DEFAULT_TAU = 0.975
RIVER_FIELDS = ("tau", "prefill_exit", "exit_policy", "kv_strategy", "min_exit_layer", "exit_signal", "exit_rate",
                "seed", "signal_layer")


class RiverConfig(GenerationConfig):
    """A `GenerationConfig` with the river's exit settings.

    Args:
        tau (`float`, defaults to 0.975): exit threshold on s = cos(h_in, h_out) of a backbone layer. A value above 1
            never exits (output equals the backbone); -1 exits as early as allowed (at `start_layer`: the paper's
            "full quantization"). The paper's 0.5–0.9 suits Llama-3; models differ (see README "Choosing tau").
        prefill_exit (`str` or `int`, defaults to "sequence"): how the prompt exits: "sequence" = one switch layer
            for all prompt tokens, chosen by the same threshold on their mean similarity; "none" = full backbone;
            an int = switch after that many backbone layers.
        exit_policy (`str`, defaults to "batch_min"): how rows of a batch agree: "batch_min" = the batch exits when
            every row's similarity exceeds tau (the paper's min over the batch).
        kv_strategy (`str`, defaults to "river"): what the layers an exited token skips do about its K/V. "river" =
            they run on the KV-sharing twins (the paper). The baselines, for comparison (README "KV strategies"):
            "recompute", "state_propagation", "mask", "mono_decreasing"; they run the prompt on the full backbone.
        min_exit_layer (`int`, *optional*): no token exits before this many backbone layers. Defaults to the
            river's start layer, or half the layers for "mask" (which needs a minimum exit layer).
        exit_signal (`str`, defaults to "cosine"): what decides an exit. "cosine" = cos(h_in, h_out) > tau after
            each layer (the paper); "cosine_first" = decided once, at `signal_layer`; "update_norm" =
            1 - |h_out - h_in| / |h_in| > tau; "confidence" = the previous token's top-1 probability > tau,
            decided at the first eligible depth; "random" = no signal, for the honest baseline (needs `exit_rate`).
        exit_rate (`float`, *optional*): with `exit_signal="random"`, the probability that a decoded token exits
            (at a uniformly random eligible layer).
        seed (`int`, *optional*): seed of the "random" signal's generator.
        signal_layer (`int`, *optional*): with `exit_signal="cosine_first"`, the depth (backbone layers run) at
            which the single decision is made; defaults to the first eligible depth.
        kwargs: any `GenerationConfig` argument (max_new_tokens, do_sample, num_beams, ...).
    """

    def __init__(self, tau: float = DEFAULT_TAU, prefill_exit: str | int = "sequence",
                 exit_policy: str = "batch_min", kv_strategy: str = "river", min_exit_layer: int | None = None,
                 exit_signal: str = "cosine", exit_rate: float | None = None, seed: int | None = None,
                 signal_layer: int | None = None, **kwargs):
        self.tau = tau
        self.prefill_exit = prefill_exit
        self.exit_policy = exit_policy
        self.kv_strategy = kv_strategy
        self.min_exit_layer = min_exit_layer
        self.exit_signal = exit_signal
        self.exit_rate = exit_rate
        self.seed = seed
        self.signal_layer = signal_layer
        super().__init__(**kwargs)  # ends with self.validate()

    def validate(self, *args, **kwargs):
        super().validate(*args, **kwargs)
        validate_river_fields(self)

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
        return RiverSettings(tau=float(self.tau), **{name: getattr(self, name) for name in RIVER_FIELDS[1:]})


def validate_river_fields(config) -> None:
    """Check tau / prefill_exit / exit_policy wherever they came from (a RiverConfig or a loaded GenerationConfig)."""
    tau = getattr(config, "tau", None)
    if isinstance(tau, bool) or not isinstance(tau, numbers.Real) or math.isnan(tau):
        raise ValueError(
            f"`tau` must be a real number (the exit threshold on cos(h_in, h_out): > 1 never exits, -1 exits as "
            f"early as allowed); got {tau!r}."
        )
    prefill_exit = getattr(config, "prefill_exit", "sequence")
    if not (prefill_exit in PREFILL_EXITS or (_is_int(prefill_exit) and prefill_exit >= 1)):
        raise ValueError(
            f"`prefill_exit`={prefill_exit!r} is not supported; use one of {PREFILL_EXITS} or an int >= 1 (the number "
            f"of backbone layers every prompt token runs)."
        )
    exit_policy = getattr(config, "exit_policy", "batch_min")
    if exit_policy not in EXIT_POLICIES:
        raise ValueError(f"`exit_policy`={exit_policy!r} is not supported; choose one of {EXIT_POLICIES}.")
    kv_strategy = getattr(config, "kv_strategy", "river")
    if kv_strategy not in KV_STRATEGIES:
        raise ValueError(f"`kv_strategy`={kv_strategy!r} is not supported; choose one of {KV_STRATEGIES}.")
    _validate_signal_fields(config)
    for name in ("min_exit_layer", "signal_layer"):
        value = getattr(config, name, None)
        if value is not None and not (_is_int(value) and value >= 1):
            raise ValueError(f"`{name}` must be None or an int >= 1 (a number of backbone layers); got {value!r}.")


def _validate_signal_fields(config) -> None:
    exit_signal = getattr(config, "exit_signal", "cosine")
    if exit_signal not in EXIT_SIGNALS:
        raise ValueError(f"`exit_signal`={exit_signal!r} is not supported; choose one of {EXIT_SIGNALS}.")
    exit_rate = getattr(config, "exit_rate", None)
    if exit_signal == "random" and exit_rate is None:
        raise ValueError("`exit_signal`='random' needs `exit_rate`: the probability (0 to 1) that a token exits.")
    if exit_rate is not None and (isinstance(exit_rate, bool) or not isinstance(exit_rate, numbers.Real)
                                  or not 0.0 <= exit_rate <= 1.0):
        raise ValueError(f"`exit_rate` must be a probability between 0 and 1; got {exit_rate!r}.")
    seed = getattr(config, "seed", None)
    if seed is not None and not _is_int(seed):
        raise ValueError(f"`seed` must be None or an int; got {seed!r}.")


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def river_settings_from(generation_config, kwargs: dict, model_default=None) -> RiverSettings | None:
    """This call's river settings, or None for a plain backbone run.

    Sources, by priority: river kwargs (`generate(..., tau=0.9)`), the `generation_config` passed, then the model's
    own `generation_config` (a loaded generation_config.json may carry `tau`). Pops the river kwargs so that HF's
    `generate` does not reject them as unknown model kwargs.
    """
    overrides = {name: kwargs.pop(name) for name in RIVER_FIELDS if name in kwargs}
    source = next((cfg for cfg in (generation_config, model_default) if getattr(cfg, "tau", None) is not None), None)
    if source is None and "tau" not in overrides:
        return None
    fields = {name: getattr(source, name) for name in RIVER_FIELDS if hasattr(source, name)}
    return RiverConfig(**{**fields, **overrides}).river_settings()


def without_river_fields(generation_config):
    """The same generation settings as a plain `GenerationConfig`: the river's part lives in the cache's router."""
    if generation_config is None:
        return None
    values = {key: value for key, value in generation_config.to_dict().items() if key not in RIVER_FIELDS}
    return GenerationConfig.from_dict(values)


class RiverGenerationMixin:
    """Mixed in front of the model's class by `build_river`: routes `generate` through a `RiverCache`."""

    def generate(self, inputs=None, generation_config=None, **kwargs):
        settings = river_settings_from(generation_config, kwargs, model_default=self.generation_config)
        if settings is not None:
            kwargs["cache"] = self._river_cache(settings, kwargs)
        return super().generate(inputs, generation_config=without_river_fields(generation_config), **kwargs)

    def save_pretrained(self, *args, **kwargs):
        """Save the backbone's own checkpoint. Twins are never stored: a model loaded with
        `quantization_config=RiverQuantConfig(...)` saves that config, and loading the folder rebuilds them."""
        with backbone_layers(self), original_lm_head(self):
            return super().save_pretrained(*args, **kwargs)

    def _river_cache(self, settings: RiverSettings, kwargs: dict) -> RiverCache:
        # (not `or`: an empty Cache is falsy, it has len() 0)
        user_cache = kwargs.pop("cache", None)
        user_cache = kwargs.pop("past_key_values", None) if user_cache is None else user_cache
        if user_cache is not None and not isinstance(user_cache, RiverCache):
            raise ValueError(
                f"`cache`: a river generate needs a `RiverCache` (it records each position's exit); got "
                f"{type(user_cache).__name__}. Pass no cache and river_hf makes one."
            )
        return new_river_cache(self, settings, kwargs.get("attention_mask"), cache=user_cache)


def new_river_cache(model, settings: RiverSettings, attention_mask=None, cache: RiverCache | None = None) -> RiverCache:
    """A RiverCache with a fresh router for `model` (for generate, or for driving the model's forward yourself)."""
    layers = river_layers(model)
    text_config = model.config.get_text_config(decoder=True)
    strategy = make_strategy(settings.kv_strategy, layers, text_config)
    if strategy.runs_prompt_on_backbone:
        settings = dataclasses.replace(settings, prefill_exit="none")
    start_layer = next(layer.layer_idx for layer in layers if layer.twin is not None)
    router = ExitRouter(settings, start_layer=start_layer, num_layers=len(layers))
    router.min_depth = _min_exit_depth(settings, strategy, start_layer, len(layers))
    router.prompt_mask = attention_mask
    if router.signal.needs_confidence:
        router.signal.step_state = layers[0].step_state
        layers[0].step_state.last_confidence = None  # a new call: no previous token yet
    if cache is None:
        cache = RiverCache(config=text_config, num_layers=len(layers))
    cache.router, cache.num_layers, cache.strategy = router, len(layers), strategy
    return cache


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
