"""`river-hf bench --random-model NAME`: speed, memory and weight bytes of a random-initialised Llama shape
(`shapes.py`), no download and no fidelity (random weights), for the speed-vs-parameters plot.

Every system runs in ONE process, interleaved after warm-up, against the same backbone. Two twin precisions need two
river builds, so they are built one after the other on the same backbone: the 8-bit twins first, kept alive by
static full-quantization models (`systems.static_full_quant` copies only module containers: they share the
backbone's weights and hold the twins), then the river is removed and rebuilt with 4-bit twins and the quantized
8-bit LM head, which the "+head" static models take as their head. The river model that remains runs the backbone,
full quantization through the router and random routing.

    record = bench_random_model("llama-3.2-1b", QUICK, RiverQuantConfig(group_size=64, backend="fastest"))
"""

from __future__ import annotations

from dataclasses import replace

from transformers import GenerationConfig

from ..config import RiverQuantConfig
from ..generation import RiverConfig
from ..lm_head import river_lm_head
from ..patching import build_river, remove_river
from .run import BenchSettings, environment, finish_record, peak_rss_bytes, run_bench
from .shapes import PROMPT_LENGTH, SHAPES, random_model, random_prompts
from .systems import (
    BACKBONE,
    System,
    _copy_containers,
    fixed_length,
    random_systems,
    static_full_quant,
)

SCALING_EXIT_RATES = (0.5, 0.9)
NOT_MEASURED = "not measured: random weights"


def twin_configs(quant: RiverQuantConfig) -> dict[str, RiverQuantConfig]:
    """The two builds: 8-bit twins (per row: the int8 kernels read one scale per row) without a quantized head, then
    4-bit twins with the 8-bit head; group size, start layer and backend as `quant` says."""
    return {"8-bit": replace(quant, nbits=8, group_size=None, quantize_lm_head=False),
            "4-bit": replace(quant, nbits=4, quantize_lm_head=True, lm_head_nbits=8)}


def with_head(static_model, head):
    """A container copy of a static model whose output embedding is `head` (shared, not copied)."""
    clone = _copy_containers(static_model, [])
    name = next(key for key, module in clone._modules.items() if module is static_model.get_output_embeddings())
    clone._modules[name] = head
    return clone


def scaling_systems(model, quant: RiverQuantConfig, max_new_tokens: int, exit_rates=SCALING_EXIT_RATES,
                    seed: int = 0, build=build_river, stages: dict | None = None) -> list[System]:
    """Build both rivers on `model` (it ends as the 4-bit river with the quantized head) and return the systems.
    `build(model, config)` builds one river (default `build_river`, with its progress bar); `stages` gets the peak
    RSS after each build."""
    fixed, configs = fixed_length(max_new_tokens), twin_configs(quant)
    stages = stages if stages is not None else {}
    stages["backbone"] = peak_rss_bytes()
    build(model, configs["8-bit"])
    static8 = static_full_quant(model)
    remove_river(model)  # the 8-bit twins live on in static8
    stages["8-bit twins"] = peak_rss_bytes()
    build(model, configs["4-bit"])
    stages["4-bit twins + head"] = peak_rss_bytes()
    static4 = static_full_quant(model)
    head = river_lm_head(model).quantized_head
    plain = GenerationConfig(**fixed)
    statics = [("static 4-bit", static4), ("static 4-bit+head", with_head(static4, head)),
               ("static 8-bit", static8), ("static 8-bit+head", with_head(static8, head))]
    return [System(BACKBONE, "backbone", plain),
            System("full-quant 4-bit+head (river)", "full-quant", RiverConfig(tau=-1.0, **fixed), tau=-1.0),
            *[System(name, "static-full-quant", plain, model=static) for name, static in statics],
            *random_systems(list(exit_rates), seed, fixed)]


def bench_random_model(name: str, settings: BenchSettings, quant: RiverQuantConfig, *, device: str = "cpu",
                       exit_rates=SCALING_EXIT_RATES, seed: int = 0, prompt_length: int = PROMPT_LENGTH,
                       build=build_river, arguments: dict | None = None) -> dict:
    """The whole scaling bench of shape `name` as one JSON-ready record (speed, memory, bytes; no fidelity)."""
    started = environment()
    model = random_model(name, seed=seed, device=device)
    parameters = model.num_parameters()
    stages: dict[str, int] = {}
    systems = scaling_systems(model, quant, settings.max_new_tokens, exit_rates, seed, build, stages)
    prompts = random_prompts(model.config.vocab_size, settings.prompts, prompt_length, seed, device)
    record = run_bench(model, prompts, settings, systems, fidelity=False)
    texts = [f"{prompt_length} random token ids (seed {seed}, prompt {idx})" for idx in range(settings.prompts)]
    record = finish_record(record, f"random:{name}", device, "random token ids", texts, arguments, started)
    record["prompts"]["fidelity"] = 0
    record["fidelity"] = NOT_MEASURED
    record["random_model"] = {"name": name, "shape": SHAPES[name], "parameters": parameters,
                              "prompt_length": prompt_length, "seed": seed, "peak_rss_after_bytes": stages,
                              "twin_builds": {label: config.to_dict() for label, config in twin_configs(quant).items()}}
    return record
