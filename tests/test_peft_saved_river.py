"""Saved rivers of LoRA-adapted models (river_hf.saving.twin_files with river_hf.core.adapters): a LoRA-adapted linear's
twin stores the codes of its base weight W alone, under the linear's own name, so the twins file of the base model's
river and of any LoRA river on it are the same file; the LoRA on top comes from the live adapter when the river is
built. Merged twins (DoRA, or `lora_twins="merged"`) store the merged weight, which fits only the same adapter."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from peft import get_peft_model
from peft.tuners.tuners_utils import BaseTunerLayer

import river_hf
from river_hf import RiverQuantConfig
from river_hf.kernels import quantize
from river_hf.core.adapters import LoraOnQuantized
from river_hf.saving.twin_files import TwinsMismatchWarning, save_twins
from river_hf.saving.twin_loading import StoredTwins

from conftest import decoded_depths, generate, tiny_model
from test_peft import MAKERS, START, lora_config, peft_model_of

CONFIG = dict(backend="auto", nbits=4, group_size=64, start_layer=START, quantize_lm_head=False)
PLAN = [2, 4, 6, 3, 5, 2, 6, 4]


def build(model, stored_twins=None, **config):
    return river_hf.build_river(model, RiverQuantConfig(**{**CONFIG, **config}), progress=False,
                                stored_twins=stored_twins)


def without_hqq(build_it):
    """`build_it()` with HQQ made to fail: nothing may be quantized from scratch."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(quantize, "hqq_quantize", lambda *a, **k: pytest.fail("HQQ ran: a twin was built from scratch"))
        return build_it()


def saved_twins_of(model, folder) -> StoredTwins:
    build(model)
    folder.mkdir(exist_ok=True)
    save_twins(model, folder)
    return StoredTwins.read(folder)


def river_outputs(model, ids, scripted_exits):
    """tau = -1 logits and a mixed exit pattern's tokens, with KV integrity checked."""
    full = generate(model, ids, tau=-1, output_logits=True)
    mixed = generate(model, ids, max_new_tokens=len(PLAN) + 1, tau=0.5, exit_signal=scripted_exits(PLAN))
    assert torch.equal(decoded_depths(mixed.cache)[0], torch.tensor(PLAN))
    mixed.cache.check_kv_integrity()
    return torch.stack(full.logits), mixed.sequences


@pytest.mark.parametrize("maker", list(MAKERS))
def test_a_lora_rivers_twins_file_is_the_base_models(maker, tmp_path):
    base = saved_twins_of(tiny_model("llama"), tmp_path / "base")
    adapted = saved_twins_of(MAKERS[maker](), tmp_path / "adapted")
    assert adapted.record["layers"] == base.record["layers"]  # names, bits, fingerprints of W
    assert "self_attn.q_proj" in adapted.record["layers"][str(START)]["linears"]
    assert adapted.tensors.keys() == base.tensors.keys()
    assert all(torch.equal(tensor, base.tensors[name]) for name, tensor in adapted.tensors.items())


@pytest.mark.parametrize("source", ["adapted", "base"])
@pytest.mark.parametrize("maker", list(MAKERS))
def test_a_lora_river_loads_w_without_hqq_and_takes_the_live_lora(maker, source, tmp_path, prompt_ids,
                                                                   scripted_exits):
    saved_model = MAKERS[maker]() if source == "adapted" else tiny_model("llama")
    saved_twins_of(saved_model, tmp_path)
    model = MAKERS[maker]()
    with torch.no_grad():  # another LoRA on the same base weights than the one saved
        for module in model.modules():
            if isinstance(module, BaseTunerLayer):
                module.lora_B["default"].weight.mul_(-1.5)
    scratch = build(copy.deepcopy(model))
    without_hqq(lambda: build(model, stored_twins=tmp_path))
    layer = river_hf.river_layers(model)[START]
    lora_twin = layer.twin.self_attn.q_proj
    assert isinstance(lora_twin, LoraOnQuantized)
    assert torch.equal(lora_twin.up_0, layer.base_layer.self_attn.q_proj.lora_B["default"].weight)  # the live LoRA
    expected_logits, expected_tokens = river_outputs(scratch, prompt_ids[:1], scripted_exits)
    logits, tokens = river_outputs(model, prompt_ids[:1], scripted_exits)
    assert torch.equal(logits, expected_logits) and torch.equal(tokens, expected_tokens)


def test_merged_twins_fit_only_their_own_adapter(tmp_path, prompt_ids):
    torch.manual_seed(3)
    dora = get_peft_model(tiny_model("llama"), lora_config(use_dora=True)).eval()
    saved_twins_of(copy.deepcopy(dora), tmp_path)
    without_hqq(lambda: build(dora, stored_twins=tmp_path))  # the same DoRA: every twin from the file
    model = peft_model_of()  # a plain LoRA on the same base: its adapted linears' W differs from DoRA's merge
    scratch = build(copy.deepcopy(model))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", TwinsMismatchWarning)
        build(model, stored_twins=tmp_path)
    messages = [str(w.message) for w in caught if issubclass(w.category, TwinsMismatchWarning)]
    assert len(messages) == 1 and "backbone weights differ" in messages[0]
    assert torch.equal(generate(model, prompt_ids, tau=-1).sequences, generate(scratch, prompt_ids, tau=-1).sequences)


def test_merged_lora_twins_saved_are_rebuilt_for_full_precision_lora_twins(tmp_path, prompt_ids):
    merged = build(peft_model_of(), lora_twins="merged")
    save_twins(merged, tmp_path)
    without_hqq(lambda: build(peft_model_of(), stored_twins=tmp_path, lora_twins="merged"))  # same: from the file
    model, scratch = peft_model_of(), build(peft_model_of())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", TwinsMismatchWarning)
        build(model, stored_twins=tmp_path)  # full-precision LoRA twins need W's codes, not the merge's
    messages = [str(w.message) for w in caught if issubclass(w.category, TwinsMismatchWarning)]
    assert len(messages) == 1 and "backbone weights differ" in messages[0]
    assert torch.equal(generate(model, prompt_ids, tau=-1).sequences, generate(scratch, prompt_ids, tau=-1).sequences)
