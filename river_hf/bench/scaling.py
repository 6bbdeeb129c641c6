"""`river-hf bench --random-model NAME`: speed, memory and weight bytes of a random-initialised Llama shape
(`shapes.py`), no download and no fidelity (random weights), for the speed-vs-parameters plot.

The twins are quantized by plain min-max rounding (`quantize.plain_rounding`): on random weights HQQ's optimizer
would only change code values nobody reads, and it takes half an hour at the 3B shape on 2 cores.
Every system runs in ONE process, interleaved after warm-up, against the same backbone. Two twin precisions need two
river builds, so they are built one after the other on the same backbone: the 8-bit twins first, kept alive by
static full-quantization models (`systems.static_full_quant` copies only module containers: they share the
backbone's weights and hold the twins), then the river is removed and rebuilt with 4-bit twins and the quantized
LM head (as `quant.lm_head_nbits` says; `river-hf bench` passes 8, the issue's full quantization, unless told
otherwise), which the "+head" static models take as their head. The river model that remains runs the backbone,
full quantization through the router and random routing.

    record = bench_random_model("llama-3.2-1b", QUICK, RiverQuantConfig(backend="fastest", lm_head_nbits=8))
"""

from __future__ import annotations

from dataclasses import replace

import torch
from transformers import GenerationConfig

from ..core.config import RiverQuantConfig
from ..core.generation import RiverConfig
from ..core.lm_head import river_lm_head
from ..core.build import build_river, remove_river
from ..kernels.quantize import plain_rounding
from .systems import FULL_QUANT_RIVER
from .run import BenchSettings, dtype_name, environment, finish_record, peak_rss_bytes, run_bench
from .shapes import PROMPT_LENGTH, SHAPES, random_model, random_prompts
from .systems import (
    BACKBONE,
    System,
    _copy_containers,
    compiled_systems,
    compiles_by_default,
    fixed_length,
    random_systems,
    static_full_quant,
)

SCALING_EXIT_RATES = (0.5, 0.9)
TWIN_BITS = (8, 4)  # the builds, in build order
RANDOM_MODEL_HEAD_NBITS = 8  # the CLI's head for these builds: full quantization is 4-bit twins + an 8-bit head
NOT_MEASURED = "not measured: random weights"


def twin_configs(quant: RiverQuantConfig, twin_bits=TWIN_BITS) -> dict[str, RiverQuantConfig]:
    """The builds: 8-bit twins (per row: the int8 kernels read one scale per row), then 4-bit twins; the last build
    (the river that stays) also quantizes the LM head, to `quant.lm_head_nbits` (8 where only 8-bit twins are built:
    their per-row codes have no groups for a 4-bit head). Group size, start layer, backend and activations as
    `quant` says. `twin_bits` keeps only some (e.g. (4,) where two builds do not fit in memory: the 3B shape on a
    24 GiB machine; (8,) for 8-bit twins with the 8-bit head)."""
    only_8 = tuple(twin_bits) == (8,)
    eight = "8-bit W8A8" if quant.activations == "int8" else "8-bit"  # its own line in the scaling plot
    configs = {8: (eight, replace(quant, nbits=8, group_size=None, quantize_lm_head=only_8, lm_head_nbits=8)),
               4: ("4-bit", replace(quant, nbits=4, quantize_lm_head=True))}
    unknown = sorted(set(twin_bits) - set(configs))
    if unknown or not twin_bits:
        raise ValueError(f"`twin_bits`={tuple(twin_bits)!r}: use 4, 8 or both.")
    return dict(configs[bits] for bits in TWIN_BITS if bits in twin_bits)


def with_head(static_model, head):
    """A container copy of a static model whose output embedding is `head` (shared, not copied)."""
    clone = _copy_containers(static_model, [])
    name = next(key for key, module in clone._modules.items() if module is static_model.get_output_embeddings())
    clone._modules[name] = head
    return clone


def scaling_systems(model, quant: RiverQuantConfig, max_new_tokens: int, exit_rates=SCALING_EXIT_RATES,
                    seed: int = 0, build=build_river, stages: dict | None = None,
                    twin_bits=TWIN_BITS, compiled: bool = False) -> list[System]:
    """Build the rivers of `twin_bits` on `model` (it ends as the last one: the 4-bit river with the quantized head
    when 4 is among them) and return the systems. `build(model, config)` builds one river (default `build_river`,
    with its progress bar); `stages` gets the peak RSS after each build. `compiled` adds the compiled static-cache
    backbone and the captured river systems (`systems.compiled_systems`)."""
    fixed, configs = fixed_length(max_new_tokens), twin_configs(quant, twin_bits)
    stages = stages if stages is not None else {}
    stages["backbone"] = peak_rss_bytes()
    statics, head = {}, None
    for label, config in configs.items():
        if statics:
            remove_river(model)  # the earlier build's twins live on in its static model
        build(model, config)
        stages[label + (" twins + head" if config.quantize_lm_head else " twins")] = peak_rss_bytes()
        statics[label] = static_full_quant(model)
        head = river_lm_head(model).quantized_head if config.quantize_lm_head else head
    plain = GenerationConfig(**fixed)
    suffix = head_suffix(list(configs.values())[-1]) if head is not None else ""
    last = list(configs)[-1] + suffix
    return [System(BACKBONE, "backbone", plain),
            System(f"full-quant {last} (river)", "full-quant", RiverConfig(**FULL_QUANT_RIVER, **fixed), tau=-1.0),
            *_static_systems(statics, head, plain, suffix),
            *random_systems(list(exit_rates), seed, fixed),
            *(compiled_systems(str(model.device), fixed, exit_rates, seed) if compiled else [])]


def head_suffix(config: RiverQuantConfig) -> str:
    """How a system's name shows the quantized head: "+head" for the 8-bit one (the names of the records so far),
    "+4-bit head" for another."""
    return "+head" if config.head_nbits == 8 else f"+{config.head_nbits}-bit head"


def _static_systems(statics: dict, head, plain, suffix: str = "+head") -> list[System]:
    """Each build's static full quantization, with and without the quantized head (when one was built)."""
    systems = []
    for label in sorted(statics, key=lambda label: int(label.split("-")[0])):  # 4-bit first, as before
        variants = [(f"static {label}", statics[label])]
        if head is not None:
            variants.append((f"static {label}{suffix}", with_head(statics[label], head)))
        systems += [System(name, "static-full-quant", plain, model=static) for name, static in variants]
    return systems


def bench_random_model(name: str, settings: BenchSettings, quant: RiverQuantConfig, *, device: str = "cpu",
                       exit_rates=SCALING_EXIT_RATES, seed: int = 0, prompt_length: int = PROMPT_LENGTH,
                       build=build_river, arguments: dict | None = None, twin_bits=TWIN_BITS,
                       dtype: torch.dtype = torch.bfloat16, compiled: bool | None = None) -> dict:
    """The whole scaling bench of shape `name` as one JSON-ready record (speed, memory, bytes; no fidelity).
    `compiled` (default: on CUDA) adds the compiled backbone and the captured river systems."""
    compiled = compiles_by_default(device) if compiled is None else compiled
    started = environment()
    model = random_model(name, seed=seed, device=device, dtype=dtype)
    parameters = model.num_parameters()
    stages: dict[str, int] = {}
    with plain_rounding():  # random weights: HQQ's optimizer would change codes nobody reads, for minutes
        systems = scaling_systems(model, quant, settings.max_new_tokens, exit_rates, seed, build, stages, twin_bits,
                                  compiled)
    prompts = random_prompts(model.config.vocab_size, settings.prompts, prompt_length, seed, device)
    record = run_bench(model, prompts, settings, systems, fidelity=False)
    texts = [f"{prompt_length} random token ids (seed {seed}, prompt {idx})" for idx in range(settings.prompts)]
    record = finish_record(record, f"random:{name}", device, dtype_name(model), "random token ids", texts, arguments,
                           started)
    record["prompts"]["fidelity"] = 0
    record["fidelity"] = NOT_MEASURED
    record["random_model"] = {"name": name, "shape": SHAPES[name], "parameters": parameters,
                              "prompt_length": prompt_length, "seed": seed, "peak_rss_after_bytes": stages,
                              "hqq_optimizer": False,  # plain_rounding: same kernels and bytes, faster builds
                              "twin_builds": {label: {**config.to_dict(), "lm_head_nbits": config.head_nbits}
                                              for label, config in twin_configs(quant, twin_bits).items()}}
    return record
