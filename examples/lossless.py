"""Lossless mode: the river drafts tokens, the backbone verifies them; greedy output is the backbone's, bit for bit.

    python examples/lossless.py                   # the packaged SmolLM2-135M-Instruct
    python examples/lossless.py --model PATH_OR_HUB_ID --draft-tokens 4
"""

import argparse

import torch
from transformers import GenerationConfig

import river_hf
from river_hf import RiverConfig, RiverQuantConfig
from river_hf.loading.models import build_chat_inputs, load_model_and_tokenizer


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="hub id or local path (default: packaged SmolLM2-135M)")
    parser.add_argument("--draft-tokens", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    args = parser.parse_args(argv)

    model, tokenizer = load_model_and_tokenizer(args.model, dtype=torch.bfloat16)
    river_hf.build_river(model, RiverQuantConfig())
    inputs = build_chat_inputs(tokenizer, "What is 12 times 7?")
    fixed = dict(max_new_tokens=args.max_new_tokens, do_sample=False)
    out = model.generate(**inputs, generation_config=RiverConfig(lossless=True, num_draft_tokens=args.draft_tokens,
                                                                 draft_fallback=False, **fixed),
                         return_dict_in_generate=True)
    plain = model.generate(**inputs, generation_config=GenerationConfig(**fixed))  # the backbone alone
    print(tokenizer.decode(out.sequences[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))
    print("identical to the backbone's greedy output:", torch.equal(out.sequences, plain))
    print(out.cache.drafts.summary())
    return out, plain


if __name__ == "__main__":
    main()
