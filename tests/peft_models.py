"""The LoRA-adapted tiny models the PEFT tests share (test_peft.py, test_peft_changes.py): a `peft.PeftModel` and a
transformers model carrying LoRA layers in place, and the `adapted` fixture that gives each in turn."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model, inject_adapter_in_model

from conftest import tiny_model

START = 2  # river_of's default
TARGETS = ["q_proj", "v_proj", "down_proj"]


def lora_config(targets=TARGETS, **kwargs) -> LoraConfig:
    # non-zero B (init_lora_weights=False), so that the adapters change what the model computes
    return LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False, **kwargs)


def peft_model_of(arch: str = "llama") -> PeftModel:
    torch.manual_seed(3)
    return get_peft_model(tiny_model(arch), lora_config()).eval()


def in_place_model_of(arch: str = "llama"):
    torch.manual_seed(3)
    return inject_adapter_in_model(lora_config(), tiny_model(arch)).eval()


MAKERS = {"peft_model": peft_model_of, "in_place": in_place_model_of}


@pytest.fixture(params=list(MAKERS))
def adapted(request):
    """A tiny Llama carrying LoRA adapters, either way."""
    return MAKERS[request.param]()
