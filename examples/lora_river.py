"""A river on a LoRA-adapted model (peft): each adapted linear's twin is its quantized base weight with the LoRA on
top, in full precision. Needs `pip install river-hf[peft]`.

    python examples/lora_river.py                  # the packaged SmolLM2-135M-Instruct, a fresh LoRA
    python examples/lora_river.py --model PATH_OR_HUB_ID --adapter PATH_TO_A_PEFT_ADAPTER
"""

import argparse

import torch
from transformers import GenerationConfig

import river_hf
from river_hf import RiverConfig, RiverQuantConfig
from river_hf.loading.models import build_chat_inputs, load_model_and_tokenizer


def adapted(model, adapter: str | None):
    """A PeftModel: the adapter at `adapter`, or a fresh LoRA on the attention projections (random B, so that it
    changes the outputs, as a trained one would)."""
    from peft import LoraConfig, PeftModel, get_peft_model

    if adapter is not None:
        return PeftModel.from_pretrained(model, adapter)
    peft_model = get_peft_model(model, LoraConfig(r=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    return peft_model.eval()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="hub id or local path (default: packaged SmolLM2-135M)")
    parser.add_argument("--adapter", default=None, help="a saved peft adapter (default: a fresh random LoRA)")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    args = parser.parse_args(argv)

    model, tokenizer = load_model_and_tokenizer(args.model, dtype=torch.bfloat16)
    peft_model = adapted(model, args.adapter)
    river_hf.build_river(peft_model, RiverQuantConfig())
    inputs = build_chat_inputs(tokenizer, "Say hello in French.")
    fixed = dict(max_new_tokens=args.max_new_tokens, do_sample=False)
    river = peft_model.generate(**inputs, generation_config=RiverConfig(tau=1.5, **fixed))  # tau > 1: nothing exits
    plain = peft_model.generate(**inputs, generation_config=GenerationConfig(**fixed))  # the adapted model
    print("tau > 1 gives the adapted model's tokens:", torch.equal(river, plain))
    exited = peft_model.generate(**inputs, generation_config=RiverConfig(tau=-1, **fixed))  # every token on twins
    print(tokenizer.decode(exited[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))
    return river, plain


if __name__ == "__main__":
    main()
