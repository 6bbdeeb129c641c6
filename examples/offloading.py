"""Offload the backbone layers that few tokens reach: they leave memory and page in for the steps that run them.

    python examples/offloading.py                 # the packaged SmolLM2-135M-Instruct
    python examples/offloading.py --model PATH_OR_HUB_ID --layers 20 21 22
"""

import argparse

import torch

import river_hf
from river_hf import RiverConfig, RiverQuantConfig
from river_hf.loading.models import build_chat_inputs, load_model_and_tokenizer


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="hub id or local path (default: packaged SmolLM2-135M)")
    parser.add_argument("--layers", type=int, nargs="+", default=None,
                        help="backbone layers to offload (default: 'auto', those under 5%% of decoded tokens reach)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    args = parser.parse_args(argv)

    model, tokenizer = load_model_and_tokenizer(args.model, dtype=torch.bfloat16)
    river_hf.build_river(model, RiverQuantConfig())
    inputs = build_chat_inputs(tokenizer, "Write one sentence about the sea.")
    config = RiverConfig(tau=0.3, max_new_tokens=args.max_new_tokens, do_sample=False)
    resident = model.generate(**inputs, generation_config=config)

    # "auto" measures which layers the decoded tokens of `inputs` reach, and offloads the rarely reached ones
    river_hf.offload_backbone(model, layers=args.layers or "auto", to="disk", inputs=[inputs["input_ids"]],
                              generation_config=config)
    print("offloaded backbone layers:", river_hf.offloaded_layers(model))
    offloaded = model.generate(**inputs, generation_config=config)
    print("same tokens as the resident river:", torch.equal(resident, offloaded))
    river_hf.reload_backbone(model)  # the exact weights back in memory
    return resident, offloaded


if __name__ == "__main__":
    main()
