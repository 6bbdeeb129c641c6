"""river_hf inside a transformers pipeline: pass a RiverConfig as the generation config.

    python examples/pipeline_example.py                 # the packaged SmolLM2-135M-Instruct
    python examples/pipeline_example.py --model HuggingFaceTB/SmolLM2-360M-Instruct
"""

import argparse

import torch
from transformers import pipeline

import river_hf
from river_hf import RiverConfig, RiverQuantConfig
from river_hf.loading.models import load_model_and_tokenizer


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="hub id or local path (default: packaged SmolLM2-135M)")
    parser.add_argument("--tau", type=lambda text: text if text == "auto" else float(text), default="auto")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    args = parser.parse_args(argv)

    model, tokenizer = load_model_and_tokenizer(args.model, dtype=torch.bfloat16)
    river_hf.build_river(model, RiverQuantConfig(start_layer=1))
    generator = pipeline("text-generation", model=model, tokenizer=tokenizer)

    config = RiverConfig(tau=args.tau, max_new_tokens=args.max_new_tokens, do_sample=False)
    if tokenizer.chat_template:
        prompt = [{"role": "user", "content": "Give me three words that rhyme with 'river'."}]
    else:
        prompt = "Three words that rhyme with river:"
    result = generator(prompt, generation_config=config)
    reply = result[0]["generated_text"]
    print(reply[-1]["content"] if isinstance(reply, list) else reply)
    return result


if __name__ == "__main__":
    main()
