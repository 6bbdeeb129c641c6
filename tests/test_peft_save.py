"""peft saves the adapter of a river-built PeftModel under the plain model's names (river_hf.core.twins
.AdapterSavingMixin): the file is the one the plain PeftModel writes, and a plain model loads it."""

from __future__ import annotations

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file

import river_hf

from conftest import generate, tiny_model

START = 2


def assert_same_state(actual: dict, expected: dict) -> None:
    assert list(actual) == list(expected)  # same keys, same order
    assert all(torch.equal(actual[key], expected[key]) for key in expected)


def test_peft_saves_the_adapter_of_a_river_model_as_of_the_plain_one(tmp_path, prompt_ids):
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"], init_lora_weights=False)
    torch.manual_seed(3)
    plain = get_peft_model(tiny_model("llama"), config).eval()
    plain.save_pretrained(tmp_path / "plain")
    peft_class = type(plain)
    river_hf.build_river(plain, river_hf.RiverQuantConfig(start_layer=START, backend="auto", nbits=4,
                                                          quantize_lm_head=False), progress=False)
    plain.save_pretrained(tmp_path / "river")
    expected = load_file(tmp_path / "plain" / "adapter_model.safetensors")
    assert_same_state(load_file(tmp_path / "river" / "adapter_model.safetensors"), expected)
    reloaded = PeftModel.from_pretrained(tiny_model("llama"), tmp_path / "river").eval()
    assert torch.equal(generate(reloaded, prompt_ids).sequences, generate(plain, prompt_ids).sequences)
    assert river_hf.is_river(plain) and type(plain) is not peft_class and type(plain).__name__ == peft_class.__name__
    river_hf.remove_river(plain)
    assert type(plain) is peft_class and not river_hf.is_river(plain)
