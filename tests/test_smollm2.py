"""The real packaged SmolLM2-135M-Instruct (slow: loading the GGUF takes ~20 s, so one model serves the module)."""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig

import river_hf
from river_hf import RiverConfig, RiverQuantConfig
from river_hf.models import build_chat_inputs, load_model_and_tokenizer

from conftest import plain_copy_with_twins

pytestmark = pytest.mark.slow

START = 27  # three twins keep the build to a few seconds; the mechanism is the same for every layer


@pytest.fixture(scope="module")
def smollm2():
    model, tokenizer = load_model_and_tokenizer(None)
    inputs = build_chat_inputs(tokenizer, "Natalia sold clips to 48 of her friends in April. How many in May?")
    expected = model.generate(**inputs, generation_config=GenerationConfig(max_new_tokens=16, do_sample=False))
    river_hf.build_river(model, RiverQuantConfig(start_layer=START), progress=False)
    return model, inputs, expected


def generate(model, inputs, tau):
    config = RiverConfig(tau=tau, max_new_tokens=16, do_sample=False)
    return model.generate(**inputs, generation_config=config, return_dict_in_generate=True)


def test_smollm2_tau_above_one_equals_the_backbone(smollm2):
    model, inputs, expected = smollm2
    calls = [0]
    for layer in river_hf.river_layers(model)[START:]:
        layer.twin.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    out = generate(model, inputs, tau=1.5)
    assert torch.equal(out.sequences, expected)
    assert calls[0] == 0
    out.cache.check_kv_integrity()


def test_smollm2_tau_minus_one_equals_the_twin_model(smollm2):
    model, inputs, _ = smollm2
    out = generate(model, inputs, tau=-1)
    assert (out.cache.exit_depth == START).all()
    reference = plain_copy_with_twins(model).generate(**inputs, max_new_tokens=16, do_sample=False)
    assert torch.equal(out.sequences, reference)
    out.cache.check_kv_integrity()


def test_smollm2_mixed_exits_keep_the_cache_complete(smollm2):
    model, inputs, _ = smollm2
    # Decode-step cosines of layers 26-28 straddle 0.97 on this prompt (measured: depths 27, 28, 29 and 30 occur).
    out = generate(model, inputs, tau=0.97)
    decoded = out.cache.exit_depth[0, out.cache.prompt_length:]
    assert decoded.unique().numel() > 1, "the threshold should give a mix of exit depths"
    out.cache.check_kv_integrity()
