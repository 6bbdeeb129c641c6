"""Stream a river's answer token by token with transformers' TextStreamer.

    python examples/streaming.py                  # the packaged SmolLM2-135M-Instruct
    python examples/streaming.py --model PATH_OR_HUB_ID --prompt "..."
"""

import argparse

import torch
from transformers import TextStreamer

import river_hf
from river_hf import RiverConfig, RiverQuantConfig
from river_hf.loading.models import build_chat_inputs, load_model_and_tokenizer


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="hub id or local path (default: packaged SmolLM2-135M)")
    parser.add_argument("--prompt", default="Tell me one fact about rivers.")
    parser.add_argument("--tau", type=float, default=0.3, help="the confidence signal's tau")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    args = parser.parse_args(argv)

    model, tokenizer = load_model_and_tokenizer(args.model, dtype=torch.bfloat16)
    river_hf.build_river(model, RiverQuantConfig())
    inputs = build_chat_inputs(tokenizer, args.prompt)
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)  # prints as tokens arrive
    out = model.generate(**inputs, streamer=streamer, return_dict_in_generate=True,
                         generation_config=RiverConfig(tau=args.tau, max_new_tokens=args.max_new_tokens,
                                                       do_sample=False))
    print(f"{out.cache.exit_share():.0%} of the streamed tokens exited early")
    return out


if __name__ == "__main__":
    main()
