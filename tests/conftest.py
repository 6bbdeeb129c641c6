"""Tiny randomly initialised models, one per supported architecture, built from configs (no hub access)."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SIZES = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=6, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, max_position_embeddings=256, pad_token_id=0, eos_token_id=1,
             bos_token_id=2)

ARCHITECTURES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    # hybrid cache: sliding-window layers (window 5, exceeded by every test) interleaved with full attention
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {
        "sliding_window": 5,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention"] * 2,
    }),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}),
}


def tiny_model(arch: str = "llama", seed: int = 0, **overrides) -> transformers.PreTrainedModel:
    config_name, model_name, extra = ARCHITECTURES[arch]
    config = getattr(transformers, config_name)(**{**SIZES, **extra, **overrides})
    torch.manual_seed(seed)
    return getattr(transformers, model_name)(config).eval()


def plain_copy_with_twins(river_model):
    """A plain (river-less) copy of a river model whose layers >= start_layer ARE the twins: full quantization."""
    import river_hf

    reference = copy.deepcopy(river_model)
    layers = river_hf.architectures.find_decoder_layers(reference)
    for idx, layer in enumerate(layers):
        layers[idx] = layer.twin if layer.twin is not None else layer.base_layer
    reference.__class__ = type(river_model)._river_base_class
    return reference


def mixed_tau(model, ids, start_layer: int = 2) -> float:
    """A threshold inside the model's own similarity range (median over the eligible layers), so that steps exit
    at different depths."""
    import torch.nn.functional as F

    with torch.no_grad():
        states = model(ids, output_hidden_states=True).hidden_states
    num_layers = len(states) - 1
    sims = [F.cosine_similarity(states[l].float(), states[l + 1].float(), dim=-1).mean()
            for l in range(start_layer - 1, num_layers - 1)]
    return torch.stack(sims).median().item()


@pytest.fixture
def prompt_ids():
    torch.manual_seed(1)
    return torch.randint(3, SIZES["vocab_size"], (2, 9))


@pytest.fixture
def left_padded_batch():
    """Two prompts of different lengths, left-padded: (input_ids, attention_mask)."""
    torch.manual_seed(2)
    ids = torch.randint(3, SIZES["vocab_size"], (2, 10))
    mask = torch.ones_like(ids)
    ids[1, :4] = SIZES["pad_token_id"]
    mask[1, :4] = 0
    return ids, mask


def tiny_tokenizer():
    """A word-level tokenizer over the tiny models' 256 ids ("w3 w17 ..."), built locally (no hub)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "</s>": 1, "<s>": 2, **{f"w{i}": i for i in range(3, SIZES["vocab_size"])}}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="</s>", bos_token="<s>",
                                   padding_side="left")


@pytest.fixture
def saved_tiny_model(tmp_path):
    """A tiny Llama and its tokenizer saved to disk, as a user's local checkpoint would be."""
    path = tmp_path / "tiny-llama"
    tiny_model("llama").save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


# A ChatML template like SmolLM2's, short enough to read.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_tiny_tokenizer(chat_template: str | None = CHAT_TEMPLATE) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained in milliseconds: real byte-level decoding (multi-byte characters split across tokens)
    without the hub."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(["what is two plus three? the answer is five. hello world"] * 10, trainer)
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<|im_start|>", eos_token="<|im_end|>")
    wrapped.chat_template = chat_template
    return wrapped


def save_tiny_model(path, chat_template: str | None = CHAT_TEMPLATE, num_layers: int = 4) -> str:
    """A random Llama (hidden 64, GQA 4/2 heads) and its tokenizer in `path`; returns the folder."""
    tokenizer = make_tiny_tokenizer(chat_template)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)
