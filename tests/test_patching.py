"""build_river / remove_river: what gets wrapped, exact restore, and the errors for models we cannot serve."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import river_hf
from river_hf import RiverQuantConfig
from river_hf.kernels.quantize import RiverQuantLinear

from conftest import tiny_model


def test_twins_from_start_layer_share_cache_slots_and_norms():
    model = river_hf.build_river(tiny_model("llama"), RiverQuantConfig(start_layer=2), progress=False)
    layers = river_hf.river_layers(model)
    assert [layer.twin is not None for layer in layers] == [False, False, True, True, True, True]
    for idx, layer in enumerate(layers[2:], start=2):
        assert layer.twin.self_attn.layer_idx == idx
        assert layer.twin.input_layernorm.weight is layer.base_layer.input_layernorm.weight
        quantized = [m for m in layer.twin.modules() if isinstance(m, RiverQuantLinear)]
        assert len(quantized) == 7  # q, k, v, o, gate, up, down
        assert not any(type(m) is nn.Linear for m in layer.twin.modules())


def test_skip_modules_keep_the_backbone_linear():
    model = river_hf.build_river(tiny_model(), RiverQuantConfig(skip_modules=["down_proj"]), progress=False)
    layer = river_hf.river_layers(model)[3]
    assert type(layer.twin.mlp.down_proj) is nn.Linear
    assert layer.twin.mlp.down_proj.weight is layer.base_layer.mlp.down_proj.weight  # shared, not copied
    assert isinstance(layer.twin.mlp.up_proj, RiverQuantLinear)


def test_remove_river_restores_state_dict_and_outputs_exactly(prompt_ids):
    model = tiny_model("qwen3")
    state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    logits = model(prompt_ids).logits
    cls = type(model)
    river_hf.build_river(model, progress=False)
    assert river_hf.is_river(model) and isinstance(model, cls)
    river_hf.remove_river(model)
    assert type(model) is cls and not river_hf.is_river(model)
    restored = model.state_dict()
    assert restored.keys() == state.keys()
    assert all(torch.equal(restored[name], tensor) for name, tensor in state.items())
    assert torch.equal(model(prompt_ids).logits, logits)


def test_printed_model_shows_the_river():
    model = river_hf.build_river(tiny_model(), progress=False)
    text = repr(model)
    assert "layer_idx=1, twin=yes" in text and "layer_idx=0, twin=no" in text and "nbits=4" in text


def test_build_twice_and_remove_without_river_are_errors():
    model = river_hf.build_river(tiny_model(), progress=False)
    with pytest.raises(ValueError, match="already has a river"):
        river_hf.build_river(model)
    with pytest.raises(ValueError, match="no river"):
        river_hf.remove_river(tiny_model())


@pytest.mark.parametrize("start_layer", [6, 99])
def test_start_layer_out_of_range(start_layer):
    with pytest.raises(ValueError, match=r"`start_layer`=\d+ is out of range: the model has 6 decoder layers"):
        river_hf.build_river(tiny_model(), RiverQuantConfig(start_layer=start_layer))


def test_encoder_decoder_model_is_unsupported():
    from transformers import T5Config, T5ForConditionalGeneration

    t5 = T5ForConditionalGeneration(T5Config(vocab_size=64, d_model=32, d_ff=64, num_layers=2, num_heads=2, d_kv=16))
    with pytest.raises(river_hf.UnsupportedModelError, match="encoder-decoder"):
        river_hf.build_river(t5)


def test_model_without_decoder_layers_is_unsupported():
    with pytest.raises(river_hf.UnsupportedModelError, match="found no decoder layers"):
        river_hf.build_river(nn.Sequential(nn.Linear(4, 4)))


def test_layers_without_layer_idx_are_unsupported():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(4, 4)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = nn.Module()
            self.model.layers = nn.ModuleList([Block(), Block()])

    with pytest.raises(river_hf.UnsupportedModelError, match="no attention module with a `layer_idx`"):
        river_hf.build_river(Model())


def test_a_twin_is_a_new_module_tree_over_the_same_tensors():
    from river_hf.core.twins import clone_modules

    layer = tiny_model("llama").model.layers[0]
    clone = clone_modules(layer)
    assert clone is not layer and clone.self_attn is not layer.self_attn and clone.mlp is not layer.mlp
    assert clone.self_attn.q_proj.weight is layer.self_attn.q_proj.weight  # shared, not copied
    assert clone.self_attn.config is layer.self_attn.config
    clone.mlp.set_submodule("down_proj", nn.Identity())  # the original keeps its own
    clone.self_attn.q_proj.register_forward_hook(lambda *args: None)
    clone.input_layernorm.register_buffer("extra", torch.zeros(1))
    assert isinstance(layer.mlp.down_proj, nn.Linear)
    assert not layer.self_attn.q_proj._forward_hooks and "extra" not in layer.input_layernorm._buffers
    assert "mlp.down_proj.weight" in layer.state_dict() and "mlp.down_proj.weight" not in clone.state_dict()
