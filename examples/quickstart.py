"""Quickstart: build a river on a causal LM and generate with token-level early exit.

    python examples/quickstart.py                       # the packaged SmolLM2-135M-Instruct
    python examples/quickstart.py --model Qwen/Qwen2.5-0.5B-Instruct --tau 0.5
"""

import argparse

import torch

import river_hf
from river_hf import RiverConfig, RiverQuantConfig
from river_hf.loading.models import build_chat_inputs, load_model_and_tokenizer


def tau_value(text: str):
    return text if text == "auto" else float(text)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="hub id or local path (default: packaged SmolLM2-135M)")
    parser.add_argument("--prompt", default="What is the capital of France? Answer in one sentence.")
    parser.add_argument("--tau", type=tau_value, default="auto",
                        help="the confidence signal's threshold, or 'auto' (the default: measured per machine)")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    args = parser.parse_args(argv)

    model, tokenizer = load_model_and_tokenizer(args.model, dtype=torch.bfloat16)
    # 0. The dtype whose decode GEMV is faster on this machine: bf16 unless fp32 wins (then an exact upcast)
    model = model.to(river_hf.fastest_dtype(model))
    # 1. Give every decoder layer from start_layer on an HQQ twin that shares its KV-cache slot (the defaults: 4-bit
    #    twins for the first quarter of the layers, 8-bit after, and an 8-bit LM head for the steps that exit).
    model = river_hf.build_river(model, RiverQuantConfig())

    # 2. Generate as usual; the RiverConfig carries the exit settings (default: the confidence signal, tau 'auto').
    inputs = build_chat_inputs(tokenizer, args.prompt)
    out = model.generate(**inputs, generation_config=RiverConfig(tau=args.tau, max_new_tokens=args.max_new_tokens,
                                                                 do_sample=False),
                         return_dict_in_generate=True)
    new_tokens = out.sequences[0, inputs["input_ids"].shape[1]:]
    print(tokenizer.decode(new_tokens, skip_special_tokens=True))

    # 3. The cache is complete (every layer holds every position) and records each position's exit depth.
    cache = out.cache
    if not isinstance(cache, river_hf.RiverCache):  # tau 'auto' where exiting does not pay here: the backbone ran
        print("nothing exited: on this machine a step on the twins is not faster than a backbone step")
        river_hf.remove_river(model)
        return out
    cache.check_kv_integrity()
    num_layers = len(river_hf.river_layers(model))
    print(f"mean exit depth {cache.mean_exit_depth():.2f} of {num_layers} layers, "
          f"{cache.exit_share():.0%} of generated tokens exited early")

    # 4. remove_river restores the original model exactly.
    river_hf.remove_river(model)
    return out


if __name__ == "__main__":
    main()
