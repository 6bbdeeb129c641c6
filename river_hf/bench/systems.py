"""The systems a benchmark compares, built from one river model without copying any weight:

- `backbone`: the river model under a plain `GenerationConfig` (no twin runs);
- `full-quant`: the river at tau = -1 (every layer from `start_layer` on runs on its twin);
- `static-full-quant`: a plain model whose layers from `start_layer` on ARE the twins: no `RiverLayer`, no router,
  no exit record. It computes exactly what full-quant computes, so full-quant's speed as a share of it is the
  river's routing overhead;
- `river tau=t`: the river at each tau of a grid.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace

import torch
from torch import nn
from transformers import GenerationConfig

from ..core.architectures import find_decoder_layers
from ..core.config import bits_label
from ..core.generation import RiverConfig, resolve_auto_tau
from ..core.twins import RiverLayer, river_layers, twin_linears
from ..core.build import is_river
from ..core.captured_decode import compile_config_for
from ..core.settings import RiverSettings
from ..core.signals import cosine_score, update_norm_score
from ..core.kv_strategies import strategy_names
from .fidelity import Fidelity, Reference, measure_fidelity

# The packaged SmolLM2-135M: decoder layers 2-28 have cos(h_in, h_out) of about 0.92-0.98, so tau <= 0.9 exits
# nearly every token after 2 layers and tau >= 0.995 hardly ever exits. The README sweep (4-bit group-64 twins) spans
# 1.4x faster at 88.5% match (0.97) to backbone speed at 98.7% match (0.99): the useful range is 0.95-0.995.
SMOLLM2_TAUS = (0.95, 0.97, 0.975, 0.98, 0.985, 0.99, 0.995)
SMOLLM2_QUICK_TAUS = (0.97, 0.98, 0.99)
# Other models: quantiles of their own decode-step similarities, since the useful range differs by model.
GRID_QUANTILES = (0.1, 0.25, 0.4, 0.5, 0.6, 0.75, 0.9)
QUICK_GRID_QUANTILES = (0.25, 0.5, 0.75)

BACKBONE, FULL_QUANT, STATIC_FULL_QUANT = "backbone", "full-quant", "static-full-quant"
# Full quantization: every step, the prompt's too, leaves the backbone at the river's start (the paper's; the cosine
# at tau -1 exits prompts as well, where the default confidence signal never exits a prompt).
FULL_QUANT_RIVER = {"tau": -1.0, "exit_signal": "cosine"}
EVAL_FULL_QUANT = "full-quant (tau=-1)"  # eval's reports have always named full quantization with its tau
# KV strategies at two thresholds (the paper's Fig. 3): relaxed and strict, for the packaged SmolLM2 (cosine).
SMOLLM2_STRATEGY_TAUS = (0.97, 0.985)
STRATEGY_GRID_QUANTILES = (0.25, 0.75)
# The random-routing baseline's exit rates (share of decoded tokens sent to the twins at a random layer).
# p=1 still keeps about half the layers on the backbone (the exit depth is uniform), so the curve ends near 1.25x.
EXIT_RATES = (0.2, 0.4, 0.6, 0.8, 1.0)
QUICK_EXIT_RATES = (0.3, 0.6, 1.0)


@dataclass
class System:
    """One thing a bench measures: how to generate with it, how to measure its fidelity, and what it is."""

    name: str
    kind: str  # "backbone", "full-quant", "static-full-quant", "river", "random" or "strategy"
    config: GenerationConfig  # what `generate` gets (a RiverConfig for the river's systems)
    model: nn.Module | None = None  # None: the bench's river model
    tau: float | None = None
    signal: str | None = None
    strategy: str | None = None
    exit_rate: float | None = None

    @property
    def river_settings(self) -> RiverSettings | None:
        """For teacher-forced fidelity; None measures the system as a plain model."""
        return self.config.river_settings() if isinstance(self.config, RiverConfig) else None

    def describe(self) -> dict:
        return {"name": self.name, "kind": self.kind, "tau": self.tau, "signal": self.signal,
                "strategy": self.strategy, "exit_rate": self.exit_rate}

    def fidelity(self, river_model: nn.Module, references: list[Reference]) -> Fidelity:
        """Teacher-forced fidelity against backbone references (on its own model, if it has one)."""
        return measure_fidelity(self.model or river_model, references, self.river_settings)


def fixed_length(max_new_tokens: int) -> dict:
    """Every speed run generates exactly this many tokens, greedily."""
    return dict(max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False)


def reference_systems(static_model: nn.Module, fixed: dict) -> list[System]:
    """The backbone, full quantization through the river (tau=-1) and the static full-quant model."""
    return [System(BACKBONE, "backbone", GenerationConfig(**fixed)),
            System(FULL_QUANT, "full-quant", RiverConfig(**FULL_QUANT_RIVER, **fixed), tau=-1.0),
            System(STATIC_FULL_QUANT, "static-full-quant", GenerationConfig(**fixed), model=static_model)]


def signal_systems(signal: str, taus: list[float], fixed: dict, signal_layer: int | None = None) -> list[System]:
    """The river with one exit signal at each tau (the paper's cosine keeps the plain names `tau=t`)."""
    extra = {"signal_layer": signal_layer} if signal == "cosine_first" and signal_layer is not None else {}
    return [river_system(tau, fixed, exit_signal=signal, **extra) for tau in taus]


COMPILED_BACKBONE = "backbone (compiled)"
CAPTURED = " (captured)"  # the name suffix of a river system whose decode steps run as captured graphs


def is_compiled(config: GenerationConfig) -> bool:
    """A system whose decode steps transformers compiles (a static cache with a compile config)."""
    return getattr(config, "cache_implementation", None) == "static" and config.compile_config is not None


def compiled_systems(device: str, fixed: dict, exit_rates=(), seed: int = 0) -> list[System]:
    """What a user who knows transformers' static cache and compile has (the compiled backbone), and the river's
    systems captured the same way (river_hf.core.captured_decode): full quantization and random routing at each rate."""
    static = dict(fixed, cache_implementation="static", compile_config=compile_config_for(device))
    return [System(COMPILED_BACKBONE, "backbone", GenerationConfig(**static)),
            System(FULL_QUANT + CAPTURED, "full-quant", RiverConfig(**FULL_QUANT_RIVER, **static), tau=-1.0),
            *[System(f"random p={rate:g}{CAPTURED}", "random",
                     RiverConfig(exit_signal="random", exit_rate=rate, seed=seed, **static), exit_rate=rate,
                     signal="random") for rate in exit_rates]]


def compiles_by_default(device: str) -> bool:
    """Whether a bench adds the compiled systems when not told: on CUDA (seconds to compile), not on a CPU (minutes)."""
    return torch.device(device).type == "cuda"


def captured_systems(device: str, fixed: dict, defaults: System | None = None) -> list[System]:
    """A model's compiled systems: the compiled backbone, full quantization captured and, where the defaults exit,
    the defaults captured (their signal plans every step: two graphs). Random routing stays eager here: captured, it
    compiles one graph per depth drawn."""
    systems = compiled_systems(device, fixed)
    if defaults is not None and isinstance(defaults.config, RiverConfig):
        static = dict(fixed, cache_implementation="static", compile_config=compile_config_for(device))
        systems.append(System(defaults.name + CAPTURED, "defaults",
                              RiverConfig(tau=defaults.tau, exit_signal=defaults.signal, **static), tau=defaults.tau,
                              signal=defaults.signal))
    return systems


def random_systems(rates: list[float], seed: int, fixed: dict) -> list[System]:
    """Blind mixing: each decoded token goes to the twins at a random layer with probability p (no signal)."""
    return [System(f"random p={rate:g}", "random",
                   RiverConfig(exit_signal="random", exit_rate=rate, seed=seed, **fixed), exit_rate=rate,
                   signal="random") for rate in rates]


def strategy_systems(strategies: list[str], taus: list[float], fixed: dict) -> list[System]:
    """Every KV strategy at each tau, with the same (cosine) exit decision."""
    return [System(f"{strategy} tau={tau:g}", "strategy",
                   RiverConfig(tau=tau, exit_signal="cosine", kv_strategy=strategy, **fixed),
                   tau=tau, signal="cosine", strategy=strategy) for strategy in strategies for tau in taus]


def river_system(tau: float, fixed: dict | None = None, **river) -> System:
    """The river at one tau with any other river settings (`exit_signal`, `kv_strategy`, ...): what calibrate probes."""
    river = {"exit_signal": "cosine", **river}  # the bench's plain `tau=t` systems are the paper's cosine
    signal = river["exit_signal"]
    return System(river_name(tau, signal), "river", RiverConfig(tau=tau, **river, **(fixed or {})), tau=tau,
                  signal=signal, strategy=river.get("kv_strategy"))


def eval_systems(taus: list[float], river: bool = True, generation: dict | None = None, **settings) -> list[System]:
    """What `river-hf eval` compares, named as its reports name them: the backbone, then (with `river`) full
    quantization and the river at each tau (repeated taus once; tau -1 is full quantization already), the river with
    any other river `settings` (`exit_signal`, `kv_strategy`, ...)."""
    generation = generation or {}
    systems = [System(BACKBONE, "backbone", GenerationConfig(**generation))]
    if river:
        systems.append(System(EVAL_FULL_QUANT, "full-quant", RiverConfig(**FULL_QUANT_RIVER, **generation), tau=-1.0))
        for tau in dict.fromkeys(tau for tau in taus if tau != -1):
            system = river_system(tau, generation, **settings)
            systems.append(replace(system, name=f"river {river_name(tau, system.signal)}"))
    return systems


def river_name(tau: float, signal: str = "cosine") -> str:
    return f"tau={tau:g}" if signal == "cosine" else f"{signal} tau={tau:g}"


@dataclass
class Sweep:
    """What one bench run compares, as plain values: the cosine river at `taus` (None: `default_taus`) with the
    references, each of `signals` at `signal_taus` (None: quantiles of its own scores), random routing at
    `exit_rates` (None: EXIT_RATES, or QUICK_EXIT_RATES with `quick`); or, given `strategies` (names, or "all"), the
    backbone and each KV strategy at `strategy_taus` instead. `packaged`: the model is the packaged SmolLM2, whose
    measured grids are used."""

    taus: list[float] | None = None
    signals: list[str] = field(default_factory=list)
    signal_taus: list[float] | None = None
    signal_layer: int | None = None
    exit_rates: list[float] | None = None
    seed: int = 0
    strategies: list[str] | None = None
    strategy_taus: list[float] | None = None
    packaged: bool = False
    quick: bool = False
    defaults: bool = True  # also the river at its defaults (tau 'auto'), as a user's plain RiverConfig() runs it
    compiled: bool | None = None  # also the compiled backbone and captured rivers (None: on CUDA only)

    def systems(self, river_model: nn.Module, inputs: dict, max_new_tokens: int) -> list[System]:
        """The systems, every one generating exactly `max_new_tokens`; `inputs`: one chat prompt, for the grids
        taken from the model's own scores."""
        fixed = fixed_length(max_new_tokens)
        if self.strategies:
            names = list(strategy_names()) if "all" in self.strategies else list(dict.fromkeys(self.strategies))
            taus = self.strategy_taus or strategy_taus(river_model, inputs, self.packaged)
            return [reference_systems(None, fixed)[0], *strategy_systems(names, taus, fixed)]
        taus = self.taus if self.taus is not None else default_taus(river_model, inputs, self.packaged, self.quick)
        systems = reference_systems(static_full_quant(river_model), fixed)
        defaults = defaults_system(river_model, fixed) if self.defaults else None
        systems += [defaults] if defaults is not None else []
        device = str(river_model.device)
        if compiles_by_default(device) if self.compiled is None else self.compiled:
            systems += captured_systems(device, fixed, defaults)
        systems += signal_systems("cosine", river_taus(taus), fixed)
        for signal in dict.fromkeys(self.signals):
            grid = self.signal_taus or signal_taus(river_model, inputs, signal, self.quick, self.signal_layer)
            systems += signal_systems(signal, river_taus(grid), fixed, self.signal_layer)
        rates = self.exit_rates
        if rates is None:
            rates = QUICK_EXIT_RATES if self.quick else EXIT_RATES
        return systems + random_systems(list(rates), self.seed, fixed)


def defaults_system(river_model: nn.Module, fixed: dict) -> System:
    """What `generate(generation_config=RiverConfig())` runs on this machine: tau 'auto' resolved here, once (it
    measures the river's ExitGain): the default signal at its default tau, or the plain backbone where exiting does
    not pay."""
    settings = resolve_auto_tau(river_model, RiverSettings())
    if settings is None:
        return System("defaults (exiting does not pay here: the backbone)", "defaults", GenerationConfig(**fixed))
    return System(f"defaults ({river_name(settings.tau, settings.exit_signal)})", "defaults",
                  RiverConfig(tau=settings.tau, exit_signal=settings.exit_signal, **fixed), tau=settings.tau,
                  signal=settings.exit_signal)


def river_taus(taus: list[float]) -> list[float]:
    """The grid without duplicates and without tau <= -1 (that is full-quant, measured anyway)."""
    return sorted({float(tau) for tau in taus if tau > -1.0})


def static_full_quant(river_model: nn.Module) -> nn.Module:
    """A plain model whose decoder layers from `start_layer` on are the river's twins and the others its backbone
    layers. Only module containers are copied (the model, the path down to the layer list): every parameter,
    buffer and twin is shared with `river_model`, so it costs no memory and stays valid as long as the river does.
    """
    layers = find_decoder_layers(river_model)
    path = next(name for name, module in river_model.named_modules() if module is layers)
    reference = _copy_containers(river_model, path.split(".") if path else [])
    static_layers = find_decoder_layers(reference)
    for idx, layer in enumerate(river_layers(river_model)):
        static_layers[idx] = layer.twin if layer.twin is not None else layer.base_layer
    if is_river(river_model):
        reference.__class__ = type(river_model)._river_base_class
    return reference


def _copy_containers(module: nn.Module, path: list[str]) -> nn.Module:
    """A shallow copy of `module` with its own child table, recursively along `path` (e.g. ["model", "layers"])."""
    clone = copy.copy(module)
    clone._modules = dict(module._modules)  # a shallow copy shares the child table: give it its own
    if path:
        clone._modules[path[0]] = _copy_containers(module._modules[path[0]], path[1:])
    return clone


def default_taus(river_model: nn.Module, inputs: dict, packaged: bool, quick: bool) -> list[float]:
    """The tau grid: SMOLLM2_TAUS for the packaged model; otherwise quantiles of the model's own similarities."""
    if packaged:
        return list(SMOLLM2_QUICK_TAUS if quick else SMOLLM2_TAUS)
    sims = layer_similarities(river_model, inputs)
    quantiles = torch.tensor(QUICK_GRID_QUANTILES if quick else GRID_QUANTILES)
    return sorted({round(value, 4) for value in torch.quantile(sims, quantiles).tolist()})


@torch.no_grad()
def layer_similarities(river_model: nn.Module, inputs: dict, signal: str = "cosine",
                       signal_layer: int | None = None) -> torch.Tensor:
    """The exit signal's score (cos(h_in, h_out); 1 - |h_out - h_in| / |h_in| for "update_norm"; the top-1
    probability for "confidence", once per position) of every layer
    that may exit (layer index >= start_layer - 1, not the last; "cosine_first": only its one layer) at every position
    of one prompt, run on the backbone: a flat float32 tensor, the value the router thresholds."""
    start_layer = next(layer.layer_idx for layer in river_layers(river_model) if layer.twin is not None)
    output = river_model(**inputs, output_hidden_states=True)
    if signal == "confidence":  # the top-1 probability at every position
        return torch.softmax(output.logits[0].float(), dim=-1).amax(dim=-1)
    states = output.hidden_states  # num_layers + 1 of [1, T, D]
    depths = range(start_layer, len(states) - 1)  # depth d: the output of layer d - 1
    if signal == "cosine_first":
        depths = [max(signal_layer or start_layer, start_layer)]
    score = update_norm_score if signal == "update_norm" else cosine_score
    return torch.cat([score(states[depth - 1], states[depth]).flatten() for depth in depths])


def signal_taus(river_model: nn.Module, inputs: dict, signal: str, quick: bool,
                signal_layer: int | None = None) -> list[float]:
    """A tau grid for a signal other than the packaged model's cosine: quantiles of the signal's own scores."""
    scores = layer_similarities(river_model, inputs, signal, signal_layer)
    quantiles = torch.tensor(QUICK_GRID_QUANTILES if quick else GRID_QUANTILES)
    return sorted({round(value, 4) for value in torch.quantile(scores, quantiles).tolist()})


def strategy_taus(river_model: nn.Module, inputs: dict, packaged: bool) -> list[float]:
    """The two thresholds of the KV-strategy comparison: relaxed and strict."""
    if packaged:
        return list(SMOLLM2_STRATEGY_TAUS)
    scores = layer_similarities(river_model, inputs)
    return sorted({round(value, 4) for value in torch.quantile(scores, torch.tensor(STRATEGY_GRID_QUANTILES)).tolist()})


def weight_bytes(river_model: nn.Module) -> dict[str, int]:
    """Bytes of the backbone's tensors (parameters and buffers) and of the twins' own (the shared norms and skipped
    linears count once, for the backbone)."""
    sizes = {"backbone": 0, "twins": 0}
    seen: set[int] = set()
    tensors = [*river_model.named_parameters(), *river_model.named_buffers()]
    for name, tensor in tensors:  # named_* list a shared tensor under its first name: the backbone layer's
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        own = ".twin." in f".{name}" or ".quantized_head." in f".{name}"  # a twin layer's, or the quantized head's
        sizes["twins" if own else "backbone"] += tensor.numel() * tensor.element_size()
    return sizes


def twin_description(river_model: nn.Module) -> dict:
    """How the twins were built (the RiverQuantConfig) and the kernel they actually run on."""
    layers = river_layers(river_model)
    quant = next(layer.quant_config for layer in layers if isinstance(layer, RiverLayer))
    kernels = sorted({linear.backend for layer in layers if layer.twin is not None
                      for linear in twin_linears(layer.twin)})
    # what was built: nbits='auto' as the schedule it became for this depth (the rule itself under "nbits_rule")
    rule = {"nbits_rule": quant.nbits} if isinstance(quant.nbits, str) else {}
    return {"nbits": quant.resolved_nbits(len(layers)), **rule, "group_size": quant.group_size,
            "start_layer": quant.start_layer,
            "quantize_lm_head": quant.quantize_lm_head, "lm_head_nbits": quant.head_nbits,
            "skip_modules": list(quant.skip_modules), "backend": quant.backend, "kernels": kernels,
            "num_layers": len(layers)}


def twin_label(twins: dict) -> str:
    """One line for beside every table and figure."""
    skip = f", {'/'.join(twins['skip_modules'])} kept" if twins["skip_modules"] else ""
    nbits = bits_label(twins["nbits"])
    skip += f", LM head {twins['lm_head_nbits']}-bit for exited steps" if twins.get("quantize_lm_head") else ""
    return (f"twins: {nbits}-bit HQQ, group {twins['group_size']}, from layer {twins['start_layer']} "
            f"of {twins['num_layers']}, kernel {'/'.join(twins['kernels']) or twins['backend']}{skip}")
