"""The river's decode steps captured (static cache + torch.compile, river_hf.core.captured_decode) against the compiled
backbone.

    python benchmarks/scripts/captured_decode.py                          # packaged SmolLM2-135M, GSM8K + chat prompts
    python benchmarks/scripts/captured_decode.py --rounds 3 --tau 0.3 --max-new-tokens 64
    python benchmarks/scripts/captured_decode.py --model PATH_OR_HUB_ID --device cuda --mode reduce-overhead
    python benchmarks/scripts/captured_decode.py --nbits 8 --tau 0.5      # all-8-bit twins, a stricter exit
    python benchmarks/scripts/captured_decode.py --lm-head-activations int8  # the exited steps' head on W8A8
    python benchmarks/scripts/captured_decode.py --profile                # + where a decoded token's time goes
    python benchmarks/scripts/captured_decode.py --skip-module-guards     # compiled without nn.Module guards
    python benchmarks/scripts/captured_decode.py --cpp-wrapper            # inductor's C++ wrapper, every system
    python benchmarks/scripts/captured_decode.py --fidelity-only --backend auto   # the rivers' match alone

Systems, each one `generate` call per prompt, interleaved after a warm-up that pays the compilation (its seconds are
printed): the backbone eager (dynamic cache) and compiled (transformers' `cache_implementation="static"` with its
`compile_config`: what a user who knows HF's switches already has), the default river (the confidence signal) eager and
captured, and full quantization (every decode step on the twins) captured. Ratios are against the compiled backbone.
`match` is the share of each system's new tokens equal to the eager backbone's, position by position, until the
first difference (greedy decoding): a single early difference sends the rest of the output elsewhere, so it is a harsh
measure. `teacher-forced match` is the one the targets use (river_hf.bench.fidelity, as `river-hf bench` reports it):
the share of next tokens equal to the backbone's along the backbone's own continuation, per step, for the river's
settings run eagerly on the dynamic cache (a captured step computes the same layers; inductor may round differently).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from transformers import CompileConfig, GenerationConfig

from river_hf import RiverConfig, RiverQuantConfig, build_river, river_layers
from river_hf.bench.data import load_prompts
from river_hf.bench.fidelity import backbone_references, measure_fidelity
from river_hf.bench.speed import longest_prompt, time_generate
from river_hf.cli.commands.common import nbits_arg
from river_hf.core.settings import RiverSettings
from river_hf.loading.models import build_chat_inputs, load_model_and_tokenizer

CHAT = ["Write a short poem about the sea.", "Explain what a hash table is to a beginner.",
        "Give three tips for staying focused while studying."]


def systems(args) -> dict:
    # --skip-module-guards: dynamo checks no guards on nn.Module state between steps (torch's "unsafe" filter: a
    # module changed after compiling goes unnoticed), for the compiled backbone and the captured rivers alike
    skip = torch.compiler.skip_guard_on_all_nn_modules_unsafe
    options = {"guard_filter_fn": skip} if args.skip_module_guards else {}
    if args.cpp_wrapper:  # inductor's C++ wrapper around its kernels instead of Python: less overhead per op
        options["cpp_wrapper"] = True
    options = options or None
    compile_config = CompileConfig(mode=args.mode, fullgraph=False, options=options)
    compile_config._compile_all_devices = True  # transformers compiles on CUDA by itself; on CPU only when told
    fixed = dict(max_new_tokens=args.max_new_tokens, min_new_tokens=args.max_new_tokens, do_sample=False)
    static = dict(cache_implementation="static", compile_config=compile_config)
    return {
        "backbone eager": GenerationConfig(**fixed),
        "backbone compiled": GenerationConfig(**fixed, **static),
        "river eager": RiverConfig(tau=args.tau, **fixed),
        "river captured": RiverConfig(tau=args.tau, **fixed, **static),
        "full quantization captured": RiverConfig(tau=-1.0, **fixed, **static),
    }


def interleaved_rates(model, systems: dict, inputs: list[dict], rounds: int) -> dict[str, float]:
    """Median decode tok/s of each system, name -> (generation config, setup called before each of its runs, e.g.
    to swap a head setting in), interleaved over `rounds` after a first round over every prompt that compiles."""
    rates = {name: [] for name in systems}
    for round_index in range(rounds + 1):  # round 0 compiles, at every prompt's cache length
        for prompt in inputs:
            for name, (config, setup) in systems.items():
                setup()
                rate = time_generate(model, prompt, config).decode_tokens_per_s
                if round_index:
                    rates[name].append(rate)
    return {name: statistics.median(values) for name, values in rates.items()}


def prefix_match(tokens: list[int], reference: list[int]) -> tuple[int, int]:
    """(tokens equal to the reference before the first difference, tokens compared)."""
    same = 0
    for token, expected in zip(tokens, reference):
        if token != expected:
            break
        same += 1
    return same, len(reference)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="A hub id or local path (default: the packaged SmolLM2).")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--mode", default=None, help="torch.compile mode (default: inductor's; CUDA: reduce-overhead)")
    parser.add_argument("--tau", type=float, default=0.3, help="the confidence signal's tau (its default: 0.3)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--gsm8k", type=int, default=3, help="GSM8K questions (beside the chat prompts)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--nbits", type=nbits_arg, default="auto", metavar="auto|N|SCHEDULE",
                        help="the twins' precision, as RiverQuantConfig(nbits=...) (default: auto)")
    parser.add_argument("--start-layer", type=int, default=None,
                        help="RiverQuantConfig(start_layer=...): backbone layers every token runs (default: its own)")
    parser.add_argument("--backend", default=None,
                        help="RiverQuantConfig(backend=...): the twins' kernels (default: 'fastest', timed per shape)")
    parser.add_argument("--fidelity-only", action="store_true",
                        help="only the rivers' teacher-forced match (no timing, nothing compiled)")
    parser.add_argument("--activations", choices=["int8"], default=None,
                        help="RiverQuantConfig(activations='int8'): 8-bit twins and head may run on W8A8")
    parser.add_argument("--lm-head-activations", choices=["int8"], default=None,
                        help="RiverQuantConfig(lm_head_activations='int8'): the 8-bit head of exited steps may run on "
                             "W8A8 (default: weight-only, as the twins)")
    parser.add_argument("--skip-module-guards", action="store_true",
                        help="compile every system with torch.compiler.skip_guard_on_all_nn_modules_unsafe")
    parser.add_argument("--cpp-wrapper", action="store_true",
                        help="compile every system with inductor's cpp_wrapper (CompileConfig(options=...))")
    parser.add_argument("--profile", action="store_true",
                        help="split each system's decode step into matmuls, attention and the rest (torch.profiler)")
    parser.add_argument("--fidelity-tokens", type=int, default=64,
                        help="teacher-forced tokens per prompt for the rivers' match (0: skip)")
    args = parser.parse_args(argv)

    model, tokenizer = load_model_and_tokenizer(args.model, dtype=torch.bfloat16)
    quant_config = RiverQuantConfig(nbits=args.nbits, **start_layer(args), **kernel_settings(args))
    model = build_river(model.to(args.device), quant_config)
    prompts = [build_chat_inputs(tokenizer, text) for text in CHAT + load_prompts(args.gsm8k).prompts]
    prompts = [{key: value.to(args.device) for key, value in inputs.items()} for inputs in prompts]
    configs = systems(args)
    if args.fidelity_only:
        fidelity = teacher_forced_match(model, prompts, configs, args.fidelity_tokens or 64)
        print(f"CPU {torch.backends.cpu.get_cpu_capability()}, backend {quant_config.backend}: teacher-forced match "
              + ", ".join(f"{name} {match:.1%}" for name, match in fidelity.items()))
        return fidelity
    warm_up = {}
    for name, config in configs.items():  # the compiled systems compile here, at the longest cache any run needs
        started = time.perf_counter()
        time_generate(model, longest_prompt(prompts), config)
        warm_up[name] = time.perf_counter() - started
    timings = {name: [] for name in configs}
    for _ in range(args.rounds):
        for inputs in prompts:
            for name, config in configs.items():
                timings[name].append(time_generate(model, inputs, config))
    fidelity = teacher_forced_match(model, prompts, configs, args.fidelity_tokens)
    results = report(args, warm_up, timings, fidelity, num_layers=len(river_layers(model)))
    if args.profile:
        print_step_splits({name: step_split(model, prompts[0], config, args.max_new_tokens)
                           for name, config in configs.items()})
    return results


MATMUL_NAMES = ("mm", "linear")                     # aten::mm, addmm, bmm, _weight_int4pack_mm..., mkldnn linears
ATTENTION_NAMES = ("scaled_dot_product", "attention")


def step_split(model, inputs: dict, config, tokens: int, repeats: int = 3) -> dict:
    """Milliseconds per decoded token in matmul ops, attention ops and everything else (profiler self times of the
    ops inductor calls out to, wall clock for the total): a generate of `tokens` new tokens minus one of 1, so the
    prompt's share cancels. The profiler adds a few µs per op, more to eager systems (many ops) than captured ones.
    Each generate runs `repeats` times and each part keeps its fastest: one run descheduled inside a matmul (a 2-core
    CI machine did it for ~110 ms) would otherwise make the one-token run outweigh the long one."""
    full, one = (_fastest_parts([profiled_generate(model, inputs, config, n) for _ in range(repeats)])
                 for n in (tokens, 1))
    return {part: (full[part] - one[part]) / (tokens - 1) for part in full}


def _fastest_parts(runs: list[dict]) -> dict:
    """Each measured part's minimum over the runs; `rest` recomputed so the parts still add up to the total."""
    fastest = {part: min(run[part] for run in runs) for part in ("matmuls", "attention", "total")}
    return {**fastest, "rest": fastest["total"] - fastest["matmuls"] - fastest["attention"]}


def profiled_generate(model, inputs: dict, config, new_tokens: int) -> dict:
    """One generate of `new_tokens` under torch.profiler: ms in matmul ops, attention ops, the rest, and wall total."""
    config = copy.deepcopy(config)
    config.max_new_tokens = config.min_new_tokens = new_tokens  # a static cache keeps its longer length: no recompile
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
        started = time.perf_counter()
        model.generate(**inputs, generation_config=config)
        total = (time.perf_counter() - started) * 1e3
    parts = {"matmuls": 0.0, "attention": 0.0}
    for event in profiler.key_averages():
        op = event.key.split("::")[-1]
        part = ("attention" if any(name in op for name in ATTENTION_NAMES)
                else "matmuls" if any(name in op for name in MATMUL_NAMES) else None)
        if part:
            parts[part] += event.self_cpu_time_total / 1e3
    return {**parts, "rest": total - parts["matmuls"] - parts["attention"], "total": total}


def print_step_splits(splits: dict) -> None:
    print("where a decoded token's time goes, ms (torch.profiler, one prompt):")
    print(f"{'system':28s} {'matmuls':>8s} {'attention':>9s} {'rest':>8s} {'total':>8s}")
    for name, split in splits.items():
        print(f"{name:28s} {split['matmuls']:8.2f} {split['attention']:9.2f} {split['rest']:8.2f} "
              f"{split['total']:8.2f}")


def start_layer(args) -> dict:
    return {} if args.start_layer is None else {"start_layer": args.start_layer}


def kernel_settings(args) -> dict:
    """The kernel settings asked on the command line (backend, activations)."""
    asked = {"activations": args.activations, "lm_head_activations": args.lm_head_activations, "backend": args.backend}
    return {name: value for name, value in asked.items() if value is not None}


def teacher_forced_match(model, prompts: list[dict], configs: dict, tokens: int) -> dict:
    """Each river system's teacher-forced next-token match (its settings run eagerly), by system name."""
    if tokens <= 0:
        return {}
    references = backbone_references(model, [inputs["input_ids"] for inputs in prompts], tokens, progress=True)
    return {name: measure_fidelity(model, references, RiverSettings.from_object(config)).match
            for name, config in configs.items() if isinstance(config, RiverConfig)}


def report(args, warm_up: dict, timings: dict, fidelity: dict, num_layers: int) -> dict:
    base = statistics.median(t.decode_tokens_per_s for t in timings["backbone compiled"])
    reference = timings["backbone eager"]
    device = torch.cuda.get_device_name() if args.device == "cuda" else f"CPU {torch.backends.cpu.get_cpu_capability()}"
    print(f"{device}, {torch.get_num_threads()} threads, torch {torch.__version__}; {len(reference)} runs per system "
          f"({args.rounds} rounds), {args.max_new_tokens} new tokens, confidence tau {args.tau}, twins nbits "
          f"{args.nbits}, start layer {args.start_layer or 'default'}, activations "
          f"{args.activations or 'weight-only'}, LM head activations {args.lm_head_activations or 'as the twins'}")
    print(f"{'system':28s} {'warm-up s':>9s} {'tok/s':>7s} {'x compiled backbone':>19s} {'exit share':>10s} "
          f"{'match':>6s} {'teacher-forced match':>20s}")
    results = {}
    for name, runs in timings.items():
        rate = statistics.median(t.decode_tokens_per_s for t in runs)
        exited = [depth < num_layers for t in runs for depth in (t.exit_depths or [])]
        share = sum(exited) / len(exited) if exited else 0.0
        pairs = [prefix_match(t.token_ids, r.token_ids) for t, r in zip(runs, reference)]
        match = sum(same for same, _ in pairs) / sum(total for _, total in pairs)
        forced = fidelity.get(name)
        results[name] = dict(warm_up_s=warm_up[name], tokens_per_s=rate, ratio=rate / base, exit_share=share,
                             match=match, teacher_forced_match=forced)
        forced_text = "" if forced is None else f"{forced:.1%}"
        print(f"{name:28s} {warm_up[name]:9.1f} {rate:7.1f} {rate / base:19.2f} {share:10.0%} {match:6.1%} "
              f"{forced_text:>20s}")
    return results


if __name__ == "__main__":
    main()
