"""The real packaged SmolLM2-135M-Instruct (slow: loading the GGUF takes ~20 s, so one model serves the module)."""

from __future__ import annotations

import pytest
import torch

from river_hf.loading.models import build_chat_inputs, load_model_and_tokenizer

from conftest import count_twin_calls, decoded_depths, generate, plain_copy_with_twins, river_of

pytestmark = pytest.mark.slow

START = 27  # three twins keep the build to a few seconds; the mechanism is the same for every layer


@pytest.fixture(scope="module")
def smollm2():
    model, tokenizer = load_model_and_tokenizer(None)
    inputs = build_chat_inputs(tokenizer, "Natalia sold clips to 48 of her friends in April. How many in May?")
    expected = generate(model, inputs["input_ids"], inputs["attention_mask"], max_new_tokens=16).sequences
    river_of(model, start_layer=START)
    return model, inputs, expected


def river_generate(model, inputs, tau):
    return generate(model, inputs["input_ids"], inputs["attention_mask"], tau=tau, max_new_tokens=16)


def test_smollm2_tau_above_one_equals_the_backbone(smollm2):
    model, inputs, expected = smollm2
    calls = count_twin_calls(model)
    out = river_generate(model, inputs, tau=1.5)
    assert torch.equal(out.sequences, expected)
    assert calls[0] == 0
    out.cache.check_kv_integrity()


def test_smollm2_tau_minus_one_equals_the_twin_model(smollm2):
    model, inputs, _ = smollm2
    out = river_generate(model, inputs, tau=-1)
    assert (out.cache.exit_depth == START).all()
    reference = plain_copy_with_twins(model).generate(**inputs, max_new_tokens=16, do_sample=False)
    assert torch.equal(out.sequences, reference)
    out.cache.check_kv_integrity()


def test_smollm2_mixed_exits_keep_the_cache_complete(smollm2):
    model, inputs, _ = smollm2
    # Decode-step cosines of layers 26-28 straddle 0.97 on this prompt (measured: depths 27, 28, 29 and 30 occur).
    out = river_generate(model, inputs, tau=0.97)
    assert decoded_depths(out.cache).unique().numel() > 1, "the threshold should give a mix of exit depths"
    out.cache.check_kv_integrity()
