"""Random-initialised Llama-architecture models built from shapes in code: speed and memory at 0.1B-3B parameters
without a download (`river-hf bench --random-model NAME`). Random weights say nothing about fidelity; the bench
records only speed, memory and bytes for them.

The shapes are those of public checkpoints (hidden size, depth, MLP width, attention / KV heads, vocabulary; every
one ties its embeddings); `tiny-test` is for the unit tests.
"""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

_FIELDS = ("hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads", "num_key_value_heads",
           "vocab_size")
SHAPES = {name: dict(zip(_FIELDS, values)) for name, values in {
    "smollm2-135m": (576, 30, 1536, 9, 3, 49152),
    "qwen-0.5b": (896, 24, 4864, 14, 2, 151936),   # Qwen2.5-0.5B's widths on the Llama architecture
    "llama-3.2-1b": (2048, 16, 8192, 32, 8, 128256),
    "llama-3.2-3b": (3072, 28, 8192, 24, 8, 128256),
    "llama-3.1-8b": (4096, 32, 14336, 32, 8, 128256),
    "tiny-test": (64, 2, 128, 4, 2, 256),
}.items()}
UNTIED = {"llama-3.1-8b"}  # the shapes whose checkpoints keep an LM head of their own (the smaller ones tie it)
PROMPT_LENGTH = 64  # tokens per random prompt (a short chat turn)


def shape_config(name: str) -> LlamaConfig:
    """The LlamaConfig of shape `name` (embeddings tied as its checkpoint ties them, no special tokens: every run
    generates a fixed length)."""
    if name not in SHAPES:
        raise ValueError(f"`random_model`={name!r} is not a known shape; choose one of {sorted(SHAPES)}.")
    return LlamaConfig(**SHAPES[name], tie_word_embeddings=name not in UNTIED, max_position_embeddings=4096,
                       bos_token_id=None, eos_token_id=None, pad_token_id=None)


def random_model(name: str, seed: int = 0, device: str = "cpu",
                 dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    """A Llama of shape `name` with random weights (HF's own initialisation after torch.manual_seed(seed)),
    created directly in `dtype` (never a copy in another dtype: a 3B model is 6 GiB in bf16), in eval mode."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(shape_config(name), dtype=dtype)
    return model.to(device).eval()


def random_prompts(vocab_size: int, count: int, length: int = PROMPT_LENGTH, seed: int = 0,
                   device: str = "cpu") -> list[dict]:
    """`count` prompts of `length` random token ids each: {input_ids, attention_mask}, [1, length]."""
    generator = torch.Generator().manual_seed(seed)
    prompts = []
    for _ in range(count):
        ids = torch.randint(0, vocab_size, (1, length), generator=generator).to(device)
        prompts.append({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    return prompts
