"""Adapters changed after a river is built (set, disabled, merged, deleted, trained, added, unloaded; transformers'
own adapter methods): river generate asks for a rebuild, plain generate runs the adapted backbone, and a rebuilt
river follows the new state."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import PeftModel, inject_adapter_in_model
from peft.functional import delete_adapter, set_adapter
from peft.tuners.tuners_utils import BaseTunerLayer

import river_hf

from conftest import SIZES, generate, river_of, tiny_model
from peft_models import START, adapted, lora_config, peft_model_of  # noqa: F401 (adapted: a fixture)


# ---------------------------------------------------------------- adapter changes after the river is built


def _add_second_adapter(model):
    if isinstance(model, PeftModel):
        model.add_adapter("other", lora_config(["q_proj"]))
    else:
        inject_adapter_in_model(lora_config(["q_proj"]), model, adapter_name="other")
        set_adapter(model, "default")  # injecting made "other" active; the river is built on "default"


def _disable(model):
    for module in model.modules():
        if isinstance(module, BaseTunerLayer):
            module.enable_adapters(False)


CHANGES = {  # what changes the adapted layers after the river is built
    "set_adapter": lambda model: set_adapter(model, "other"),
    "disable_adapters": _disable,
    "merge_adapter": lambda model: [m.merge() for m in model.modules() if isinstance(m, BaseTunerLayer)],
    "delete_adapter": lambda model: (set_adapter(model, "other"),
                                     delete_adapter(model, adapter_name="default", prefix="lora_")),
    "weights_trained": lambda model: [m.lora_B["default"].weight.add_(0.1) for m in model.modules()
                                      if isinstance(m, BaseTunerLayer)],
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_adapter_changes_make_river_generate_ask_for_a_rebuild(adapted, prompt_ids, change):
    _add_second_adapter(adapted)
    river_of(adapted)
    with torch.no_grad():
        CHANGES[change](adapted)
    with pytest.raises(ValueError, match=r"adapters changed after its river was built.*remove_river"):
        generate(adapted, prompt_ids, tau=-1)
    plain = generate(adapted, prompt_ids).sequences  # plain generate runs the adapted backbone, whatever its state
    river_hf.remove_river(adapted)
    assert torch.equal(generate(adapted, prompt_ids).sequences, plain)
    river_of(adapted)  # the rebuilt river follows the new state
    assert torch.equal(generate(adapted, prompt_ids, tau=1.5).sequences, plain)
    generate(adapted, prompt_ids, tau=-1).cache.check_kv_integrity()


def test_an_inactive_adapter_and_a_round_trip_keep_the_twins(adapted, prompt_ids):
    _add_second_adapter(adapted)
    river_of(adapted)
    before = generate(adapted, prompt_ids, tau=-1).sequences
    set_adapter(adapted, "other")
    set_adapter(adapted, "default")  # back as built: the twins are consistent again
    assert torch.equal(generate(adapted, prompt_ids, tau=-1).sequences, before)


def test_peft_disable_adapter_context_raises_inside_and_works_after():
    model, ids = peft_model_of(), torch.randint(3, SIZES["vocab_size"], (1, 6))
    river_of(model)
    before = generate(model, ids, tau=-1).sequences
    with model.disable_adapter():
        with pytest.raises(ValueError, match="adapters disabled False -> True"):
            generate(model, ids, tau=-1)
        generate(model, ids)
    assert torch.equal(generate(model, ids, tau=-1).sequences, before)


@pytest.mark.parametrize("merge", [True, False])
def test_merge_and_unload_then_rebuild(prompt_ids, merge):
    model = peft_model_of()
    # merged: what peft's merge computes; unloaded: the original model (unload drops the adapters, weights untouched)
    expected = generate(copy.deepcopy(model).merge_and_unload() if merge else tiny_model("llama"), prompt_ids).sequences
    river_of(model)
    twin = river_hf.river_layers(model)[START].twin
    lora_twin, twin_modules = twin.self_attn.q_proj, dict(twin.named_modules())
    down = lora_twin.down_0.clone()
    base = model.merge_and_unload() if merge else model.unload()
    assert river_hf.is_river(base)  # the river was on this model all along
    # peft's unload visited the backbone's adapter layers only: the twins are as built
    assert dict(twin.named_modules()) == twin_modules and torch.equal(lora_twin.down_0, down)
    with pytest.raises(ValueError, match="adapter layer gone"):
        generate(base, prompt_ids, tau=-1)
    assert torch.equal(generate(base, prompt_ids).sequences, expected)
    river_hf.remove_river(base)
    river_of(base)
    assert torch.equal(generate(base, prompt_ids, tau=1.5).sequences, expected)


def test_peft_add_adapter_after_build_is_refused_by_peft_and_the_river_keeps_working(prompt_ids):
    model = peft_model_of()
    river_of(model)
    before = generate(model, prompt_ids, tau=-1).sequences
    with pytest.raises(ValueError, match="Target module LoraOnQuantized"):  # peft would adapt the twins' linears
        model.add_adapter("late", lora_config(["q_proj"]))
    assert torch.equal(generate(model, prompt_ids, tau=-1).sequences, before)


def _transformers_accepts_this_peft() -> bool:
    from transformers.integrations.peft import MIN_PEFT_VERSION, check_peft_version
    try:
        check_peft_version(min_version=MIN_PEFT_VERSION)
    except ValueError:
        return False
    return True


def test_transformers_integration_methods(prompt_ids, monkeypatch, tmp_path):
    """transformers' own add_adapter / load_adapter / set_adapter / disable_adapters / enable_adapters on a river model.
    transformers 5.24 asks for peft >= 0.22, which the package registry here does not have (0.21.2 is its newest); these
    methods run on 0.21.2 once that version gate is lowered, so where the installed peft is older, the test lowers it
    (the methods, not the gate, are what a river must work with)."""
    if not _transformers_accepts_this_peft():
        import peft
        import transformers.integrations.peft as transformers_peft
        monkeypatch.setattr(transformers_peft, "MIN_PEFT_VERSION", peft.__version__)
    model = tiny_model("llama")
    model.add_adapter(lora_config(), adapter_name="default")
    expected = generate(model, prompt_ids).sequences
    river_of(model)
    assert torch.equal(generate(model, prompt_ids, tau=1.5).sequences, expected)
    # transformers injects the new adapter into the backbone layers only (not the twins) and makes it the active one
    model.add_adapter(lora_config(["q_proj"]), adapter_name="other")
    assert model.active_adapters() == ["other"]
    with pytest.raises(ValueError, match="Rebuild the river"):
        generate(model, prompt_ids, tau=1.5)
    model.set_adapter("default")  # the adapter the twins were built for: the river is exact again
    assert torch.equal(generate(model, prompt_ids, tau=1.5).sequences, expected)
    model.disable_adapters()
    with pytest.raises(ValueError, match="adapters disabled"):
        generate(model, prompt_ids, tau=-1)
    model.enable_adapters()
    assert torch.equal(generate(model, prompt_ids, tau=1.5).sequences, expected)
    donor = tiny_model("llama")
    donor.add_adapter(lora_config(["q_proj"]))
    donor.save_pretrained(tmp_path)  # a model carrying adapters saves the adapter alone
    model.load_adapter(str(tmp_path), adapter_name="loaded")  # into the backbone layers; transformers activates it
    assert model.active_adapters() == ["loaded"]
    with pytest.raises(ValueError, match="Rebuild the river"):
        generate(model, prompt_ids, tau=1.5)
    model.set_adapter("default")
    assert torch.equal(generate(model, prompt_ids, tau=1.5).sequences, expected)
