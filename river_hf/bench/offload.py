"""`river-hf bench --offload`: the backbone, full quantization, the river and the river with its rarely run backbone
layers offloaded (river_hf.offload.backbone), compared on speed, fidelity, resident weight bytes and memory (the paper's
Table 6 analogue).

- Speed and fidelity: one process, interleaved after warm-up (`run.run_bench`). The offloaded river is a deep copy of
  the river model, offloaded; the static full-quant model shares the river's weights (speed only: it holds no memory
  of its own).
- Page-in cost: one more generate on the offloaded copy, its hooks' page-in time over the steps that fetched weights.
- Memory: each system in a fresh subprocess (`bench.memory`), since RSS does not reliably go down within a process.

    record = bench_offload(river_model, prompts, QUICK, RiverConfig(tau=0.26, exit_signal="confidence"), spec)
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from dataclasses import asdict, dataclass, field

from transformers import GenerationConfig

from ..core.architectures import find_decoder_layers
from ..core.generation import RiverConfig
from ..core.twins import river_layers
from ..offload.backbone import offload_backbone, offload_stores, weight_residency
from ..offload.choice import exit_depth_histogram, layer_shares, rarely_run_layers
from .run import BenchSettings, run_bench
from .speed import time_generate
from .systems import BACKBONE, STATIC_FULL_QUANT, System, fixed_length, static_full_quant

RIVER, OFFLOADED = "river", "river+offload"
MEMORY_SYSTEMS = (BACKBONE, STATIC_FULL_QUANT, RIVER, OFFLOADED)


@dataclass
class ModelSpec:
    """How a memory subprocess loads the same model: the packaged/hub/local model, or a random shape."""

    model: str | None = None
    gguf_file: str | None = None
    random_model: str | None = None
    seed: int = 0
    device: str = "cpu"
    dtype: str = "bfloat16"  # the parent's backbone dtype, as `--dtype` made it (random shapes too)
    quant: dict = field(default_factory=dict)  # RiverQuantConfig.to_dict()


def offload_systems(river_model, offloaded_model, river_config: RiverConfig, max_new_tokens: int) -> list[System]:
    """Backbone, static full quantization, the river and the offloaded river, each generating exactly
    `max_new_tokens` with the same exit settings."""
    fixed = fixed_length(max_new_tokens)
    config = RiverConfig(**{**_river_fields(river_config), **fixed})
    signal = config.river_settings().exit_signal
    return [System(BACKBONE, "backbone", GenerationConfig(**fixed)),
            System(STATIC_FULL_QUANT, "static-full-quant", GenerationConfig(**fixed),
                   model=static_full_quant(river_model)),
            System(RIVER, "river", config, tau=config.tau, signal=signal),
            System(OFFLOADED, "river", config, model=offloaded_model, tau=config.tau, signal=signal)]


def bench_offload(model, prompt_inputs: list[dict], settings: BenchSettings, river_config: RiverConfig,
                  spec: ModelSpec, to: str = "disk", layers="auto", max_share: float | None = None,
                  folder: str | None = None, fidelity: bool = True, memory: bool = True) -> dict:
    """The whole offload bench on a river model as one JSON-ready record (see the module docstring)."""
    fixed_config = RiverConfig(**{**_river_fields(river_config), **fixed_length(settings.max_new_tokens)})
    histogram = exit_depth_histogram(model, prompt_inputs[:settings.prompts], fixed_config)
    num_layers = len(river_layers(model))
    start_layer = next(layer.layer_idx for layer in river_layers(model) if layer.twin is not None)
    share = {} if max_share is None else {"max_share": max_share}
    chosen = rarely_run_layers(histogram, num_layers, start_layer, **share) if layers == "auto" else list(layers)
    offloaded = copy.deepcopy(model)
    if chosen:
        offload_backbone(offloaded, layers=chosen, to=to, folder=folder)
    systems = offload_systems(model, offloaded, river_config, settings.max_new_tokens)
    record = run_bench(model, prompt_inputs, settings, systems, fidelity=fidelity)
    record["offload"] = {"to": to, "layers": chosen, "requested": layers, "max_share": max_share,
                         "measured_histogram": {str(k): v for k, v in histogram.items()},
                         "layer_shares": layer_shares(histogram, num_layers),
                         "page_in": page_in_cost(offloaded, prompt_inputs[0], fixed_config, chosen),
                         "residency": {RIVER: weight_residency(model), OFFLOADED: weight_residency(offloaded)}}
    if memory:
        ids = prompt_inputs[0]["input_ids"][0].tolist()
        record["offload"]["memory"] = {name: measure_memory(spec, name, ids, fixed_config, to, chosen, folder)
                                       for name in MEMORY_SYSTEMS}
    return record


def page_in_cost(offloaded, inputs: dict, config: RiverConfig, layers: list[int]) -> dict:
    """One generate on the offloaded model: the hooks' page-in seconds over the steps that ran an offloaded layer
    (a step of exit depth d runs backbone layers < d; the prompt's step counts when it ran them)."""
    stores = offload_stores(offloaded)
    if not stores:
        return {"fetching_steps": 0, "ms_per_fetching_step": None}
    for store in stores:
        store.stats.reset()
    timing = time_generate(offloaded, inputs, config)
    depths = timing.exit_depths or []
    first = min(layers)  # every step that ran any offloaded layer ran this one (depths are prefixes)
    modules = sum(1 for name in offloaded.hf_device_map if name.startswith(f"{_prefix(offloaded)}.{first}."))
    fetching = sum(store.stats.loads_by_layer.get(first, 0) for store in stores) // max(modules, 1)
    seconds = sum(store.stats.seconds for store in stores)
    loads = sum(store.stats.loads for store in stores)
    decode_s = timing.decode_s
    return {"fetching_steps": fetching, "decoded_steps": len(depths), "module_loads": loads,
            "page_in_s": seconds, "ms_per_fetching_step": 1000 * seconds / fetching if fetching else None,
            "ms_per_module_load": 1000 * seconds / loads if loads else None,
            "share_of_generate_time": seconds / (timing.prefill_s + decode_s) if decode_s == decode_s else None}


def measure_memory(spec: ModelSpec, system: str, input_ids: list[int], config: RiverConfig, to: str,
                   layers: list[int], folder: str | None) -> dict:
    """Run one system in a fresh Python process (`python -m river_hf.bench.memory`) and return what it measured."""
    job = {"spec": asdict(spec), "system": system, "input_ids": input_ids,
           "river": _river_fields(config), "max_new_tokens": config.max_new_tokens,
           "offload": {"to": to, "layers": layers, "folder": folder}}
    done = subprocess.run([sys.executable, "-m", "river_hf.bench.memory"], input=json.dumps(job),
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the memory run of {system!r} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _prefix(model) -> str:
    layers = find_decoder_layers(model)
    return next(name for name, module in model.named_modules() if module is layers)


def _river_fields(config: RiverConfig) -> dict:
    return {name: value for name, value in asdict(config.river_settings()).items() if value is not None}


def offload_table(record: dict) -> str:
    """The Table 6 analogue: per system, speed, match, resident weight bytes and the memory peaks."""
    memory = record["offload"].get("memory", {})
    base_bytes = memory.get(BACKBONE, {}).get("resident_weight_bytes") or record["memory"]["backbone_weight_bytes"]
    lines = ["| system | decode tok/s | vs backbone | match | weights on device | vs bf16 backbone | RssAnon "
             "decode peak | RSS decode peak |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for system in record["systems"]:
        sm, fid = system["summary"], system["fidelity"]
        mem = memory.get(system["name"], {})
        resident = mem.get("resident_weight_bytes")
        match = f"{fid['match']:.1%}" if fid.get("match") is not None else "n/a"
        lines.append(
            f"| {system['name']} | {sm['decode_tokens_per_s']:.1f} | {sm['speed_ratio']:.2f}x | {match} | "
            f"{_mib(resident)} | {resident / base_bytes:.2f}x | {_mib(mem.get('peak_anon_decode_bytes'))} | "
            f"{_mib(mem.get('peak_rss_decode_bytes'))} |" if resident else
            f"| {system['name']} | {sm['decode_tokens_per_s']:.1f} | {sm['speed_ratio']:.2f}x | {match} | | | | |")
    page = record["offload"]["page_in"]
    if page.get("ms_per_fetching_step") is not None:
        lines.append(f"\npage-in: {page['ms_per_fetching_step']:.1f} ms per backbone step that fetched weights "
                     f"({page['fetching_steps']} steps of {page['decoded_steps']} decoded + the prompt's, "
                     f"{page['ms_per_module_load']:.3f} ms per module load); offloaded layers "
                     f"{record['offload']['layers']} to {record['offload']['to']}")
    return "\n".join(lines)


def _mib(value) -> str:
    return "" if value is None else f"{value / 2**20:.1f} MiB"
