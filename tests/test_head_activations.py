"""`RiverQuantConfig(lm_head_activations=...)`: the quantized LM head's kernel may round activations (W8A8) apart
from the twins, or stay weight-only while the twins do; the default follows `activations`."""

from __future__ import annotations

import glob
import os

import pytest
import torch

import river_hf
from river_hf import RiverQuantConfig
from river_hf.core.config import AS_TWINS
from river_hf.core.lm_head import river_lm_head
from river_hf.kernels.quantize import RiverQuantLinear
from river_hf.kernels.registry import runs
from river_hf.saving import packed_cache

from conftest import assert_full_quantization_is_exact, generate, river_of, tiny_model
from test_packed_twins import entries, load, load_without_packing
from test_saved_river import assert_same_river, saved_river

pytestmark = [pytest.mark.skipif(not runs("w8a8_cpu", 8, torch.device("cpu")),
                                 reason="no fbgemm/x86 quantized engine in this torch"),
              pytest.mark.usefixtures("one_thread")]


def kernels(model) -> tuple[set[str], str]:
    """(the twins' kernels, the quantized head's kernel)."""
    head = river_lm_head(model).quantized_head
    twins = {m.backend for m in model.modules() if isinstance(m, RiverQuantLinear) and m is not head}
    return twins, head.backend


# ---------------------------------------------------------------- the setting


def test_the_head_follows_the_twins_unless_told_otherwise():
    assert RiverQuantConfig().lm_head_activations == AS_TWINS
    assert RiverQuantConfig().head_activations is None
    assert RiverQuantConfig(activations="int8").head_activations == "int8"
    assert RiverQuantConfig(lm_head_activations="int8").head_activations == "int8"
    assert RiverQuantConfig(activations="int8", lm_head_activations=None).head_activations is None
    saved = RiverQuantConfig(lm_head_activations="int8").to_dict()
    assert RiverQuantConfig.from_dict(saved).head_activations == "int8"
    older = {k: v for k, v in RiverQuantConfig(activations="int8").to_dict().items() if k != "lm_head_activations"}
    assert RiverQuantConfig.from_dict(older).head_activations == "int8"  # a config saved before the field
    assert "lm_head_activations" in RiverQuantConfig(lm_head_activations=None).get_loading_attributes()


def test_bad_settings_name_the_field():
    with pytest.raises(ValueError, match="`lm_head_activations`='int4'"):
        RiverQuantConfig(lm_head_activations="int4")
    with pytest.raises(ValueError, match="`backend`='w8a8_cpu'.*`lm_head_activations`=None"):
        RiverQuantConfig(nbits=8, backend="w8a8_cpu", activations="int8", lm_head_activations=None)
    RiverQuantConfig(nbits=8, backend="w8a8_cpu", activations="int8", lm_head_activations=None,
                     quantize_lm_head=False)  # no head to keep weight-only: fine


# ---------------------------------------------------------------- the river


def test_a_w8a8_head_over_weight_only_twins_keeps_the_invariants(prompt_ids):
    model = tiny_model("llama")
    plain = generate(model, prompt_ids).sequences
    river = river_of(model, nbits=8, group_size=None, quantize_lm_head=True, backend="auto",
                     lm_head_activations="int8")
    assert kernels(river) == ({"int8pack_cpu"}, "w8a8_cpu")
    assert_full_quantization_is_exact(river, prompt_ids, plain)
    river_hf.remove_river(river)
    assert torch.equal(generate(model, prompt_ids).sequences, plain)


def test_w8a8_twins_under_a_weight_only_head(prompt_ids):
    model = tiny_model("llama")
    plain = generate(model, prompt_ids).sequences
    river = river_of(model, nbits=8, group_size=None, quantize_lm_head=True, backend="auto", activations="int8",
                     lm_head_activations=None)
    assert kernels(river) == ({"w8a8_cpu"}, "int4pack_cpu")  # lm_head_nbits='auto': a weight-only head is 4-bit
    assert_full_quantization_is_exact(river, prompt_ids, plain)


def test_a_saved_river_loads_its_head_on_w8a8_and_keeps_that_packing_apart(tmp_path, monkeypatch):
    monkeypatch.setenv("RIVER_HF_CACHE", str(tmp_path / "cache"))
    cache = str(tmp_path / "cache" / packed_cache.SUBFOLDER)
    saved, folder = saved_river(tmp_path, nbits=8, group_size=None, quantize_lm_head=True, lm_head_nbits=8)
    weight_only = load(folder, backend="auto")
    assert kernels(weight_only) == ({"int8pack_cpu"}, "int8pack_cpu")
    assert len(entries(cache)) == 1
    first = load(folder, backend="auto", lm_head_activations="int8")
    assert kernels(first) == ({"int8pack_cpu"}, "w8a8_cpu")
    assert len(entries(cache)) == 2, "the head's W8A8 packing is an entry of its own"
    again = load_without_packing(folder, backend="auto", lm_head_activations="int8")
    assert kernels(again) == ({"int8pack_cpu"}, "w8a8_cpu")
    ids = torch.tensor([[1, 5, 9, 14, 3, 7]])
    for model in (first, again):  # every step exits: the head's W8A8 logits decide each token
        out = generate(model, ids, tau=-1)
        out.cache.check_kv_integrity()
        assert torch.equal(out.sequences, generate(first, ids, tau=-1).sequences)
    assert torch.equal(generate(again, ids, tau=1.5).sequences, generate(saved, ids, tau=1.5).sequences)
    assert not glob.glob(os.path.join(cache, "*.tmp*"))


def test_a_river_saved_with_its_head_on_w8a8_comes_back_the_same(tmp_path, monkeypatch):
    monkeypatch.setenv("RIVER_HF_CACHE", str(tmp_path / "cache"))
    saved, folder = saved_river(tmp_path, nbits=4, group_size=64, quantize_lm_head=True, lm_head_nbits=8,
                                lm_head_activations="int8")
    assert kernels(saved) == ({"int4pack_cpu"}, "w8a8_cpu")
    loaded = load(folder)  # the saved config carries the setting
    assert loaded.config.quantization_config.lm_head_activations == "int8"
    assert kernels(loaded) == ({"int4pack_cpu"}, "w8a8_cpu")
    assert_same_river(loaded, saved)
