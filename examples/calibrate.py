"""Find the fastest tau of the paper's cosine signal that keeps a next-token match target on your own prompts.

    python examples/calibrate.py                  # the packaged SmolLM2-135M-Instruct, 95% match
    python examples/calibrate.py --model PATH_OR_HUB_ID --target-match 0.97 --prompts "..." "..."

The match is teacher-forced: along the backbone's own greedy continuation of each prompt, the share of positions
where the river predicts the backbone's next token. `river-hf calibrate` does the same from the command line.
"""

import argparse

import torch

import river_hf
from river_hf import RiverConfig, RiverQuantConfig
from river_hf.bench.calibrate import calibrate
from river_hf.loading.models import build_chat_inputs, load_model_and_tokenizer

PROMPTS = ["What is the capital of Italy?", "Explain photosynthesis in one sentence."]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="hub id or local path (default: packaged SmolLM2-135M)")
    parser.add_argument("--target-match", type=float, default=0.95)
    parser.add_argument("--prompts", nargs="+", default=PROMPTS)
    parser.add_argument("--tokens", type=int, default=32, help="backbone tokens per prompt to match along")
    args = parser.parse_args(argv)

    model, tokenizer = load_model_and_tokenizer(args.model, dtype=torch.bfloat16)
    river_hf.build_river(model, RiverQuantConfig())
    found = calibrate(model, tokenizer, args.prompts, args.target_match, tokens=args.tokens)
    chosen = found.chosen
    print(f"tau {chosen.tau:.4f}: match {chosen.match:.1%}, mean exit depth {chosen.mean_exit_depth:.1f} "
          f"({len(found.probes)} taus measured)")
    config = RiverConfig(exit_signal="cosine", tau=chosen.tau, max_new_tokens=24, do_sample=False)
    out = model.generate(**build_chat_inputs(tokenizer, args.prompts[0]), generation_config=config)
    print(tokenizer.decode(out[0], skip_special_tokens=True))
    return found


if __name__ == "__main__":
    main()
