"""The river on transformers' static cache, its decode steps captured and compiled (one graph per exit depth).

    python examples/static_cache.py                # the packaged SmolLM2-135M-Instruct, inductor on this CPU
    python examples/static_cache.py --model PATH_OR_HUB_ID --device cuda

On CUDA transformers compiles a static-cache decode step by itself (CUDA graphs); on a CPU only with
`compile_config._compile_all_devices = True`, as here. The first step at each exit depth compiles (a progress line
says so); later steps and later calls reuse the graphs.
"""

import argparse

import torch
from transformers import CompileConfig

import river_hf
from river_hf import RiverConfig, RiverQuantConfig
from river_hf.loading.models import build_chat_inputs, load_model_and_tokenizer


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="hub id or local path (default: packaged SmolLM2-135M)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--backend", default="inductor", help="torch.compile backend ('eager': trace only)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    args = parser.parse_args(argv)

    model, tokenizer = load_model_and_tokenizer(args.model, dtype=torch.bfloat16)
    river_hf.build_river(model.to(args.device), RiverQuantConfig())
    # transformers' defaults on CUDA (CUDA graphs); inductor's default mode elsewhere, where it must be told to compile
    compile_config = CompileConfig(backend=args.backend, **({} if args.device == "cuda" else {"mode": "default"}))
    compile_config._compile_all_devices = True
    inputs = {k: v.to(args.device) for k, v in build_chat_inputs(tokenizer, "Name three colours.").items()}
    config = RiverConfig(tau=0.3, max_new_tokens=args.max_new_tokens, do_sample=False,
                         cache_implementation="static", compile_config=compile_config)
    out = model.generate(**inputs, generation_config=config, return_dict_in_generate=True)
    out.cache.check_kv_integrity()  # a RiverStaticCache: every layer's slots hold every position
    print(tokenizer.decode(out.sequences[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))
    print(f"{type(out.cache).__name__}: {out.cache.exit_share():.0%} of the new tokens exited early")
    return out


if __name__ == "__main__":
    main()
