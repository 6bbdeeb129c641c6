"""Save a river with its twins, and load it back without running HQQ.

    python examples/saved_river.py                 # the packaged SmolLM2-135M-Instruct
    python examples/saved_river.py --model PATH_OR_HUB_ID --folder my-river
"""

import argparse
import tempfile
import time

import torch
from transformers import AutoModelForCausalLM

import river_hf
from river_hf import RiverConfig, RiverQuantConfig
from river_hf.loading.models import build_chat_inputs, load_model_and_tokenizer


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="hub id or local path (default: packaged SmolLM2-135M)")
    parser.add_argument("--folder", default=None, help="where to save (default: a temporary folder)")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    args = parser.parse_args(argv)
    folder = args.folder or tempfile.mkdtemp(prefix="river_")

    model, tokenizer = load_model_and_tokenizer(args.model, dtype=torch.bfloat16)
    river_hf.build_river(model, RiverQuantConfig())
    model.save_pretrained(folder, save_twins=True)  # the backbone's checkpoint + river_twins.safetensors
    tokenizer.save_pretrained(folder)

    started = time.perf_counter()
    loaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)  # config.json names the river
    print(f"loaded the river from {folder} in {time.perf_counter() - started:.2f} s (twins read, not quantized)")

    inputs = build_chat_inputs(tokenizer, "Name a river in Europe.")
    config = RiverConfig(tau=-1, max_new_tokens=args.max_new_tokens, do_sample=False)  # every token on the twins
    before, after = (m.generate(**inputs, generation_config=config) for m in (model, loaded))
    print("same tokens as the river that was saved:", torch.equal(before, after))
    return before, after


if __name__ == "__main__":
    main()
