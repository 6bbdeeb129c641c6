"""Does `torch.compile` of parts of each layer make decoding faster on this machine? The paper compiles its twins
("partial graph compilation"); this measures it for the parts of a decoder layer that carry no `layer_idx` (the MLP
and the two RMSNorms), so one compiled graph serves every layer, on the backbone and on the twins alike, and for whole
decoder layers, each its own graph (`--parts layer`): what a decode step decided inside the step (a similarity signal
between its extremes, river_hf.core.captured_decode) could capture, one layer at a time, with the exit decision read
between them.

    python benchmarks/scripts/compile_twins.py                      # SmolLM2-135M, 4-bit twins, 3 rounds of 48 tokens
    python benchmarks/scripts/compile_twins.py --parts mlp --rounds 5
    python benchmarks/scripts/compile_twins.py --parts layer --whole-step   # + transformers' whole compiled step
    python benchmarks/scripts/compile_twins.py --model PATH_OR_HUB_ID

Four systems, interleaved after a warm-up that pays the compilation: the backbone eager and compiled, and full
quantization (tau=-1: every decode step leaves after layer 0 and runs the twins) eager and compiled. Compiling is
done by swapping each chosen submodule for a `torch.compile` wrapper of itself in its parent, so one model serves
all four (the wrappers and dynamo's cache persist between swaps). Prints the compile time, the graphs and
recompilations dynamo counted, and the median decode ms/token of each system.
Whole decoder layers (`--parts layer`) run over transformers' static cache (fixed shapes: a dynamic cache grows every
step), eager or with each layer compiled. Attention writes the cache at its `layer_idx`, which dynamo specialises on,
so every layer is a graph of its own: the script raises dynamo's recompile limit for that (past it, eager again).
`--whole-step` adds the backbone and full quantization with the whole decode step compiled by transformers (static
cache + `compile_config`, one graph per exit depth: what a planned river step runs), the reference the layer-by-layer
graphs would have to approach.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn
from transformers import CompileConfig, GenerationConfig

from river_hf import RiverConfig, RiverQuantConfig, build_river
from river_hf.bench.speed import time_generate
from river_hf.bench.data import load_prompts
from river_hf.core.twins import river_layers
from river_hf.loading.models import build_chat_inputs, load_model_and_tokenizer

PARTS = {"mlp": ("mlp",), "norms": ("input_layernorm", "post_attention_layernorm"),
         "mlp+norms": ("mlp", "input_layernorm", "post_attention_layernorm"), "layer": ()}
# One graph per layer (backbone and twin) and prompt shape, where dynamo's defaults allow 8 per code object
LAYER_RECOMPILE_LIMIT = 1024


class Swaps:
    """Each chosen submodule of each layer, with a compiled wrapper of itself; `use(layers, compiled)` puts one or
    the other in place."""

    def __init__(self, layers: list[nn.Module], names: tuple[str, ...]):
        self.entries = [(layer, name, getattr(layer, name), torch.compile(getattr(layer, name)))
                        for layer in layers for name in names if isinstance(getattr(layer, name, None), nn.Module)]

    def use(self, compiled: bool) -> None:
        for layer, name, eager, wrapper in self.entries:
            layer._modules[name] = wrapper if compiled else eager


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", choices=list(PARTS), default="mlp+norms")
    parser.add_argument("--whole-step", action="store_true",
                        help="also time the backbone and full quantization with transformers' whole compiled step")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--model", default=None, help="A hub id or local path (default: the packaged SmolLM2).")
    args = parser.parse_args(argv)

    model, tokenizer = load_model_and_tokenizer(args.model)
    build_river(model, RiverQuantConfig(nbits=4, group_size=64, start_layer=1), progress=False)
    layers = river_layers(model)
    whole_layers = args.parts == "layer"
    if whole_layers:  # the RiverLayer's two modules swapped, so the river still routes between them
        torch._dynamo.config.recompile_limit = LAYER_RECOMPILE_LIMIT
        torch._dynamo.config.accumulated_recompile_limit = LAYER_RECOMPILE_LIMIT
        backbone = Swaps(layers, ("base_layer",))
        twins = Swaps([layer for layer in layers if layer.twin is not None], ("twin",))
    else:
        backbone = Swaps([layer.base_layer for layer in layers], PARTS[args.parts])
        twins = Swaps([layer.twin for layer in layers if layer.twin is not None], PARTS[args.parts])
    inputs = build_chat_inputs(tokenizer, load_prompts(1).prompts[0])
    fixed = dict(max_new_tokens=args.max_new_tokens, min_new_tokens=args.max_new_tokens, do_sample=False)
    static = dict(cache_implementation="static") if whole_layers or args.whole_step else {}
    whole_step = CompileConfig(fullgraph=False)
    whole_step._compile_all_devices = True  # transformers compiles a CPU step only when told
    systems = {"backbone eager": (False, None), "backbone compiled": (True, "backbone"),
               "full-quant eager": (False, None), "full-quant compiled": (True, "twins")}
    if args.whole_step:
        systems.update({"backbone whole step compiled": (False, "step"),
                        "full-quant whole step compiled": (False, "step")})

    def run(name: str) -> float:
        compiled, which = systems[name]
        backbone.use(compiled and which == "backbone")
        twins.use(compiled and which == "twins")
        # eager steps over the static cache where layers are compiled, so both run the same cache
        cache = dict(static, compile_config=whole_step) if which == "step" else static
        config = (RiverConfig(tau=-1.0, exit_signal="cosine", **fixed, **cache) if name.startswith("full-quant")
                  else GenerationConfig(**fixed, **cache))
        timing = time_generate(model, inputs, config)
        return 1000.0 / timing.decode_tokens_per_s

    compile_seconds = {}
    for name in systems:  # warm-up; the compiled systems compile here
        started = time.perf_counter()
        run(name)
        compile_seconds[name] = time.perf_counter() - started
    counters = dict(torch._dynamo.utils.counters["stats"])
    ms = {name: [] for name in systems}
    for _ in range(args.rounds):
        for name in systems:
            ms[name].append(run(name))
    print(f"CPU capability {torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}; parts compiled: {args.parts}")
    print(f"dynamo: {counters}; recompiles after warm-up: "
          f"{dict(torch._dynamo.utils.counters['stats']) != counters}")
    results = {name: {"warm_up_s": compile_seconds[name], "ms_per_token": statistics.median(ms[name])}
               for name in systems}
    for name in systems:
        print(f"{name:30s} warm-up {compile_seconds[name]:6.1f} s   decode {statistics.median(ms[name]):6.2f} ms/token "
              f"(rounds: {', '.join(f'{value:.1f}' for value in ms[name])})")

    backbone.use(False)
    twins.use(False)  # the model leaves as it came
    return results


if __name__ == "__main__":
    main()
