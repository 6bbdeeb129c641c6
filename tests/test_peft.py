"""Rivers on LoRA-adapted models (river_hf.core.adapters): a `peft.PeftModel`, and a transformers model carrying LoRA
layers in place (what transformers' `add_adapter` / `load_adapter` build, through `peft.inject_adapter_in_model`).

The twin of a LoRA-adapted linear is its quantized base weight with the LoRA in full precision on top; other variants
(DoRA) and other tuners (IA3) become one quantized linear of their merged weight. The references below are built
independently: from peft's own LoRA layers with their base layer quantized, and from peft's own `merge_and_unload`.
"""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch
from peft import IA3Config, PeftModel, get_peft_model
from peft.tuners.tuners_utils import BaseTunerLayer
from transformers.pytorch_utils import Conv1D

import river_hf
from river_hf import RiverQuantConfig
from river_hf.core.adapters import LoraOnQuantized
from river_hf.core.architectures import find_decoder_layers
from river_hf.core.twins import RiverLayer, make_twin
from river_hf.kernels.quantize import RiverQuantLinear

from conftest import NUM_LAYERS, SIZES, decoded_depths, generate, river_of, tiny_model
from peft_models import MAKERS, START, TARGETS, adapted, lora_config, peft_model_of  # noqa: F401 (adapted: a fixture)


def quantize(linear):
    return RiverQuantLinear.from_linear(linear, nbits=4, group_size=64, backend="auto")  # what river_of asks


def lora_on_quantized_full_quantization(adapted_model):
    """Independent reference for tau = -1: the adapted model whose layers from START on run peft's own LoRA layers
    over a quantized base linear (quantized W + the full-precision LoRA, peft's forward), every other linear there
    quantized; the layers before START stay adapted."""
    reference = copy.deepcopy(adapted_model)
    for layer in find_decoder_layers(reference)[START:]:
        for module in list(layer.modules()):
            if isinstance(module, BaseTunerLayer):
                module.base_layer = quantize(module.get_base_layer())
        for name, module in list(layer.named_modules()):
            if type(module) is torch.nn.Linear and "lora_" not in name:
                layer.set_submodule(name, quantize(module))
    return reference


def merged_full_quantization(adapted_model):
    """Independent reference for tau = -1: the adapted model whose layers from START on are twins quantized from
    peft's own merge of the adapters (`merge_and_unload` on a copy); the layers before START stay adapted."""
    reference = copy.deepcopy(adapted_model)
    merged = copy.deepcopy(adapted_model)
    merged = merged.merge_and_unload() if isinstance(merged, PeftModel) else _merged_in_place(merged)
    layers, merged_layers = find_decoder_layers(reference), find_decoder_layers(merged)
    for idx in range(START, NUM_LAYERS):
        layers[idx] = make_twin(merged_layers[idx], quantize, [])
    return reference


def _merged_in_place(model):
    for name, module in list(model.named_modules()):
        if isinstance(module, BaseTunerLayer):
            module.merge()
            model.set_submodule(name, module.get_base_layer())
    return model


def test_adapters_change_the_model(adapted, prompt_ids):
    # the tests below could not fail if the adapters did nothing
    plain = generate(tiny_model("llama"), prompt_ids, output_logits=True).logits[0]
    assert not torch.allclose(generate(adapted, prompt_ids, output_logits=True).logits[0], plain)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
@pytest.mark.parametrize("maker", list(MAKERS))
def test_tau_above_one_equals_the_adapted_model(arch, maker, prompt_ids):
    model = MAKERS[maker](arch)
    expected = generate(model, prompt_ids).sequences
    river_of(model)
    out = generate(model, prompt_ids, tau=1.5)
    assert torch.equal(out.sequences, expected)
    assert torch.equal(generate(model, prompt_ids).sequences, expected)  # plain generate: the adapted backbone
    out.cache.check_kv_integrity()


def assert_tau_minus_one_equals(model, reference, prompt_ids):
    out = generate(model, prompt_ids, tau=-1, output_logits=True)
    expected = generate(reference, prompt_ids, output_logits=True)
    assert (out.cache.exit_depth == START).all()
    assert torch.equal(out.sequences, expected.sequences)
    torch.testing.assert_close(torch.stack(out.logits), torch.stack(expected.logits))
    out.cache.check_kv_integrity()


def test_tau_minus_one_equals_quantized_w_plus_the_full_precision_lora(adapted, prompt_ids):
    reference = lora_on_quantized_full_quantization(adapted)
    merged = merged_full_quantization(adapted)
    river_of(adapted)
    assert_tau_minus_one_equals(adapted, reference, prompt_ids)
    # the two candidates differ here, so the comparison above tells them apart
    with torch.no_grad():
        assert not torch.allclose(reference(prompt_ids).logits, merged(prompt_ids).logits)


def test_merged_lora_twins_are_one_quantized_linear_of_peft_merge(adapted, prompt_ids):
    reference = merged_full_quantization(adapted)
    river_of(adapted, lora_twins="merged")
    assert_tau_minus_one_equals(adapted, reference, prompt_ids)
    twin = river_hf.river_layers(adapted)[START].twin
    assert not [module for module in twin.modules() if isinstance(module, LoraOnQuantized)]
    assert isinstance(twin.self_attn.q_proj, RiverQuantLinear)


def test_lora_twins_takes_only_its_two_choices():
    with pytest.raises(ValueError, match=r"`lora_twins`='fast' is not supported.*full_precision.*merged"):
        RiverQuantConfig(lora_twins="fast")
    assert RiverQuantConfig(lora_twins="merged").to_dict()["lora_twins"] == "merged"


def test_lora_twins_are_quantized_w_with_a_copy_of_the_lora(adapted):
    river_of(adapted)
    layer = river_hf.river_layers(adapted)[START]
    twin, backbone = layer.twin, layer.base_layer
    assert not [name for name, module in twin.named_modules() if isinstance(module, BaseTunerLayer)]
    assert not [name for name, _ in twin.named_modules() if "lora_" in name or name.endswith("base_layer")]
    assert isinstance(twin.self_attn.k_proj, RiverQuantLinear)  # not adapted: a plain twin linear
    for name in ("self_attn.q_proj", "mlp.down_proj"):
        lora, adapted_linear = twin.get_submodule(name), backbone.get_submodule(name)
        assert isinstance(lora, LoraOnQuantized) and isinstance(lora.quantized, RiverQuantLinear)
        assert torch.equal(lora.quantized.dequantized_weight(),  # the codes of W alone
                           quantize(adapted_linear.get_base_layer()).dequantized_weight())
        down, up = adapted_linear.lora_A["default"].weight, adapted_linear.lora_B["default"].weight
        assert torch.equal(lora.down_0, down) and torch.equal(lora.up_0, up)
        assert lora.down_0.data_ptr() != down.data_ptr() and lora.scalings == [adapted_linear.scaling["default"]]


def test_a_lora_bias_stays_on_top_too(prompt_ids):
    torch.manual_seed(3)
    model = get_peft_model(tiny_model("llama"), lora_config(lora_bias=True)).eval()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, BaseTunerLayer):
                module.lora_B["default"].bias.normal_()  # peft starts it at zero
    reference = lora_on_quantized_full_quantization(model)
    river_of(model)
    lora_twin = river_hf.river_layers(model)[START].twin.self_attn.q_proj
    assert isinstance(lora_twin, LoraOnQuantized) and lora_twin.up_bias_0 is not None
    assert_tau_minus_one_equals(model, reference, prompt_ids)


VARIANTS = {  # adapters that are not a plain LoRA: their twins quantize peft's merge
    "dora": lambda: get_peft_model(tiny_model("llama"), lora_config(use_dora=True)),
    "ia3": lambda: get_peft_model(tiny_model("llama"), IA3Config(target_modules=TARGETS, init_ia3_weights=False,
                                                                 feedforward_modules=["down_proj"])),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_variants_and_other_tuners_take_the_merged_twin(variant, prompt_ids):
    torch.manual_seed(3)
    model = VARIANTS[variant]().eval()
    assert not torch.equal(generate(model, prompt_ids).sequences, generate(tiny_model("llama"), prompt_ids).sequences)
    expected = generate(model, prompt_ids).sequences
    reference = merged_full_quantization(model)
    river_of(model)
    twin = river_hf.river_layers(model)[START].twin
    assert isinstance(twin.self_attn.q_proj, RiverQuantLinear) and isinstance(twin.mlp.down_proj, RiverQuantLinear)
    assert not any(isinstance(module, LoraOnQuantized) for module in twin.modules())
    assert torch.equal(generate(model, prompt_ids, tau=1.5).sequences, expected)
    assert_tau_minus_one_equals(model, reference, prompt_ids)


@pytest.mark.parametrize("state", ["disabled", "merged"])
def test_disabled_or_merged_adapters_give_one_twin_of_the_base_weight(state, prompt_ids):
    # what peft computes then is its base layer alone: W (disabled), or W with the adapters merged in
    model = peft_model_of()
    reference = merged_full_quantization(model) if state == "merged" else river_of(tiny_model("llama"))
    if state == "merged":
        model.merge_adapter()
    else:
        model.base_model.disable_adapter_layers()
    river_of(model)
    assert isinstance(river_hf.river_layers(model)[START].twin.self_attn.q_proj, RiverQuantLinear)
    expected = generate(reference, prompt_ids, tau=-1) if state == "disabled" else generate(reference, prompt_ids)
    assert torch.equal(generate(model, prompt_ids, tau=-1).sequences, expected.sequences)


def test_mixed_exits_keep_every_position_in_cache(adapted, prompt_ids, scripted_exits):
    river_of(adapted)
    plan = [2, 4, 6, 3, 5, 2, 6, 4, 3, 5, 2]
    out = generate(adapted, prompt_ids, max_new_tokens=len(plan) + 1, tau=0.5, exit_signal=scripted_exits(plan))
    assert torch.equal(decoded_depths(out.cache)[0], torch.tensor(plan))
    out.cache.check_kv_integrity()


def test_a_peft_models_river_lives_on_the_model_inside_it():
    model = peft_model_of()
    peft_class = type(model)
    river_of(model)
    assert river_hf.is_river(model) and river_hf.is_river(model.get_base_model())
    # the PeftModel gets a same-named subclass only for saving its adapter (tests/test_peft_save.py); its generate
    # is peft's, which calls the river's
    assert isinstance(model, peft_class) and type(model).__name__ == peft_class.__name__
    assert type(model).generate is peft_class.generate
    river_hf.remove_river(model)
    assert type(model) is peft_class


# ---------------------------------------------------------------- bad input and the exact undo


def _conv1d_adapted_model():
    """LoRA on a transformers Conv1D (GPT-2's linear) inside a decoder layer: not a linear the twins can quantize."""
    model = tiny_model("llama")
    for layer in find_decoder_layers(model):
        mlp = layer.mlp
        conv = Conv1D(nf=SIZES["hidden_size"], nx=SIZES["intermediate_size"])
        conv.weight.data.copy_(mlp.down_proj.weight.data.T)
        mlp.down_proj = conv
    torch.manual_seed(3)
    return get_peft_model(model, lora_config(["q_proj", "down_proj"], fan_in_fan_out=True)).eval()


def test_adapter_on_a_non_linear_is_a_clear_error_leaving_no_trace():
    model = _conv1d_adapted_model()
    state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"`mlp.down_proj`.*Conv1D.*skip_modules.*merge_and_unload"):
        river_of(model)
    assert not river_hf.is_river(model)
    assert not any(isinstance(layer, RiverLayer) for layer in find_decoder_layers(model))
    assert model.state_dict().keys() == state.keys()
    assert all(torch.equal(tensor, state[name]) for name, tensor in model.state_dict().items())


def test_skipping_the_non_linear_shares_the_adapted_layer(prompt_ids):
    model = _conv1d_adapted_model()
    expected = generate(model, prompt_ids).sequences
    river_of(model, skip_modules=["down_proj"])
    layer = river_hf.river_layers(model)[START]
    assert layer.twin.mlp.down_proj is layer.base_layer.mlp.down_proj  # the adapted Conv1D itself, unquantized
    assert isinstance(layer.twin.self_attn.q_proj, LoraOnQuantized)  # an nn.Linear: peft unset fan_in_fan_out
    assert torch.equal(generate(model, prompt_ids, tau=1.5).sequences, expected)
    generate(model, prompt_ids, tau=-1).cache.check_kv_integrity()


def test_adapter_outside_the_decoder_layers_needs_nothing(prompt_ids):
    torch.manual_seed(3)
    model = get_peft_model(tiny_model("llama"), lora_config(["embed_tokens", "q_proj"])).eval()
    expected = generate(model, prompt_ids).sequences
    river_of(model)
    assert torch.equal(generate(model, prompt_ids, tau=1.5).sequences, expected)


def test_remove_river_restores_the_adapted_model_exactly(adapted, prompt_ids):
    state = {name: tensor.clone() for name, tensor in adapted.state_dict().items()}
    modules = dict(adapted.named_modules())
    with torch.no_grad():
        expected = adapted(prompt_ids).logits
    river_of(adapted, quantize_lm_head=True)
    generate(adapted, prompt_ids, tau=-1)
    river_hf.remove_river(adapted)
    assert not river_hf.is_river(adapted)
    assert adapted.state_dict().keys() == state.keys()
    assert all(torch.equal(tensor, state[name]) for name, tensor in adapted.state_dict().items())
    assert all(module is modules[name] for name, module in adapted.named_modules())
    with torch.no_grad():
        assert torch.equal(adapted(prompt_ids).logits, expected)


@pytest.mark.parametrize("code", [
    "import sys, river_hf; assert 'peft' not in sys.modules",  # not imported for models without adapters
    "import sys; sys.modules['peft'] = None; import river_hf",  # peft not installed: river_hf still imports
])
def test_river_hf_imports_without_peft(code):
    subprocess.run([sys.executable, "-c", code], check=True)
