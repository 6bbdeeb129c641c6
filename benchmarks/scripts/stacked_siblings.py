"""Do stacked siblings (q/k/v and gate/up as one GEMV each, river_hf.kernels.shared_inputs) make the captured river
faster? One process, interleaved, against the compiled backbone: the river with its stacks as built, and a deep copy
of it with every member running alone again (`unstack`: the same kernels and codes, one call per linear).

    python benchmarks/scripts/stacked_siblings.py                      # packaged SmolLM2, chat + GSM8K prompts
    python benchmarks/scripts/stacked_siblings.py --rounds 3 --tau 0.3 --max-new-tokens 64
    python benchmarks/scripts/stacked_siblings.py --random-model llama-3.2-1b --prompts 2

Systems (each a static-cache generate compiled as transformers compiles it, `compile_config` told to compile on a
CPU): the compiled backbone, the default river (confidence at --tau) and full quantization (tau=-1), each stacked and
unstacked. A first round over every prompt compiles; the medians of the rounds after it are reported, with each
unstacked system's share of tokens equal to its stacked twin's (where "fastest" moved a member onto the stack's
kernel, e.g. an 8-bit layer's k/v from dense to int8pack, rounding may differ: the codes are the same).
"""

from __future__ import annotations

import argparse
import copy
import statistics

import torch
from transformers import GenerationConfig

from river_hf import RiverConfig, RiverQuantConfig, build_river, river_layers
from river_hf.bench.data import load_prompts
from river_hf.bench.shapes import SHAPES, random_model, random_prompts
from river_hf.bench.speed import time_generate
from river_hf.core.captured_decode import compile_config_for
from river_hf.kernels.quantize import plain_rounding
from river_hf.kernels.shared_inputs import unstack
from river_hf.loading.models import build_chat_inputs, load_model_and_tokenizer

CHAT = ["Write a short poem about the sea.", "Explain what a hash table is to a beginner."]


def prompts_and_model(args):
    """(prompts, model with the default river) for --random-model or the packaged/--model checkpoint."""
    if args.random_model:
        model = random_model(args.random_model)
        with plain_rounding():  # random weights: HQQ's optimizer would only change codes nobody reads
            build_river(model, RiverQuantConfig(), progress=False)
        return random_prompts(model.config.vocab_size, args.prompts, 64), model
    model, tokenizer = load_model_and_tokenizer(args.model, dtype=torch.bfloat16)
    build_river(model, RiverQuantConfig())
    texts = (CHAT + load_prompts(args.prompts).prompts)[:2 * args.prompts]
    return [build_chat_inputs(tokenizer, text) for text in texts], model


def systems(model, unstacked, args) -> dict:
    fixed = dict(max_new_tokens=args.max_new_tokens, min_new_tokens=args.max_new_tokens, do_sample=False,
                 cache_implementation="static", compile_config=compile_config_for("cpu"))
    found = {"backbone compiled": (model, GenerationConfig(**fixed))}
    for label, tau in ((f"river (tau {args.tau:g})", args.tau), ("full quantization", -1.0)):
        found[f"{label}, stacked"] = (model, RiverConfig(tau=tau, **fixed))
        found[f"{label}, unstacked"] = (unstacked, RiverConfig(tau=tau, **fixed))
    return found


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a hub id or local path (default: the packaged SmolLM2)")
    parser.add_argument("--random-model", choices=sorted(SHAPES), default=None)
    parser.add_argument("--tau", type=float, default=0.3, help="the confidence signal's tau (its default: 0.3)")
    parser.add_argument("--prompts", type=int, default=2, help="GSM8K questions beside as many chat prompts")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args(argv)
    torch._dynamo.config.recompile_limit = 64  # prompts of several lengths, two rivers, two exit depths each
    prompts, model = prompts_and_model(args)
    unstacked = copy.deepcopy(model)
    members = sum(unstack(layer.twin) for layer in river_layers(unstacked) if layer.twin is not None)
    runs = systems(model, unstacked, args)
    rates, tokens = {name: [] for name in runs}, {name: [] for name in runs}
    for round_index in range(args.rounds + 1):  # round 0 compiles
        for prompt in prompts:
            for name, (system, config) in runs.items():
                timed = time_generate(system, prompt, config)
                if round_index:
                    rates[name].append(timed.decode_tokens_per_s)
                else:
                    new = system.generate(**prompt, generation_config=config)[0, prompt["input_ids"].shape[1]:]
                    tokens[name] += new.tolist()
    medians = {name: statistics.median(values) for name, values in rates.items()}
    base = medians["backbone compiled"]
    print(f"{members} twin linears stacked; medians of {args.rounds} rounds x {len(prompts)} prompts, "
          f"{args.max_new_tokens} new tokens, torch threads {torch.get_num_threads()}")
    same = {}
    for name, rate in medians.items():
        twin = name.replace("unstacked", "stacked")
        if name != twin:
            same[name] = statistics.mean(a == b for a, b in zip(tokens[name], tokens[twin]))
        note = f"  (tokens equal to the stacked run: {same[name]:.1%})" if name in same else ""
        print(f"{name:38s} {rate:6.1f} tok/s  {rate / base:.3f}x the compiled backbone{note}")
    return {"members": members, "tokens_per_s": medians, "same_tokens": same}


if __name__ == "__main__":
    main()
