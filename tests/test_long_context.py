"""Nothing lost at length: 2k, 4k and 8k-token prompts built from the GSM8K text the package ships, and sliding
windows shorter than the prompt, with exits before and after the window's edge.

Invariants, as everywhere: tau > 1 equals the backbone token for token; every layer's cache holds every position
(a sliding layer: its window) for a random exit pattern; lossless output equals the backbone's; tau = -1 equals a
plain model whose layers are the twins (so a twin sees the same window its backbone layer would).
"""

from __future__ import annotations

import pytest
import torch

from river_hf.bench.data import load_prompts

from conftest import SIZES, decoded_depths, generate, plain_copy_with_twins, river_of, tiny_model

WINDOW = 512  # the sliding windows below: shorter than every long prompt
NEW_TOKENS = 12


def gsm8k_ids(length: int) -> torch.Tensor:
    """[1, length] ids from the shipped GSM8K questions' bytes (real text's repetitions and rhythm, in the tiny
    models' 256-id vocabulary; ids 0-2 are pad/eos/bos and never appear)."""
    text = " ".join(load_prompts(400).prompts).encode()
    while len(text) < length:
        text += text
    return torch.tensor([[3 + byte % (SIZES["vocab_size"] - 3) for byte in text[:length]]])


def long_model(arch: str, **overrides):
    return tiny_model(arch, max_position_embeddings=8192 + 64, **overrides)


def sliding(arch: str) -> dict:
    """A config whose sliding layers keep WINDOW positions (gemma3: alternating with full attention)."""
    if arch == "gemma3":
        return dict(sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"] * 3)
    return dict(sliding_window=WINDOW, use_sliding_window=True) if arch == "qwen2" else dict(sliding_window=WINDOW)


def check_exact_and_whole(model, ids) -> None:
    """tau > 1 is the backbone; random exits (80% of decoded tokens, at random depths) leave no hole."""
    backbone = generate(model, ids, max_new_tokens=NEW_TOKENS).sequences
    river_of(model)
    assert torch.equal(generate(model, ids, tau=1.5, max_new_tokens=NEW_TOKENS).sequences, backbone)
    out = generate(model, ids, exit_signal="random", exit_rate=0.8, seed=0, max_new_tokens=NEW_TOKENS)
    assert decoded_depths(out.cache).unique().numel() >= 2
    out.cache.check_kv_integrity()


@pytest.mark.parametrize("length", [2048, 4096, 8192])
def test_long_prompts_lose_nothing(length):
    check_exact_and_whole(long_model("llama"), gsm8k_ids(length))


def test_lossless_at_8k_is_the_backbone():
    model = long_model("llama")
    ids = gsm8k_ids(8192)
    backbone = generate(model, ids, max_new_tokens=NEW_TOKENS).sequences
    river_of(model)
    out = generate(model, ids, tau=-1, lossless=True, num_draft_tokens=4, draft_fallback=False,
                   max_new_tokens=NEW_TOKENS)
    assert torch.equal(out.sequences, backbone)


@pytest.mark.parametrize("arch", ["mistral", "qwen2", "gemma3"])
def test_sliding_windows_shorter_than_the_prompt(arch):
    check_exact_and_whole(long_model(arch, **sliding(arch)), gsm8k_ids(4 * WINDOW))


@pytest.mark.parametrize("arch", ["mistral", "gemma3"])
def test_exits_across_the_window_edge_keep_its_semantics(arch):
    """The prompt ends 6 positions before the window's edge and decoding crosses it: every position (the prompt's
    too) leaves at the start layer, and the output equals a plain model whose layers are the twins, which slides its
    window as the backbone's attention does."""
    model = river_of(long_model(arch, **sliding(arch)))
    ids = gsm8k_ids(WINDOW - 6)
    out = generate(model, ids, tau=-1, max_new_tokens=NEW_TOKENS)  # the cosine at tau=-1: prompts exit too
    assert (out.cache.exit_depth == 2).all() and out.cache.exit_depth.shape[1] > WINDOW
    out.cache.check_kv_integrity()
    reference = generate(plain_copy_with_twins(model), ids, max_new_tokens=NEW_TOKENS).sequences
    assert torch.equal(out.sequences, reference)
