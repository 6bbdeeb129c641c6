"""river_hf.loading.gguf: a local GGUF is converted once; later loads read the cached folder, with the same tensors."""

import os

import pytest
import torch

from river_hf.loading import gguf as gguf_cache, models
from river_hf.loading.models import load_model_and_tokenizer

from conftest import make_tiny_tokenizer, tiny_model


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv(gguf_cache.CACHE_ENV, str(root))
    return root


@pytest.fixture
def fake_gguf(tmp_path, monkeypatch):
    """A .gguf file whose "conversion" is a tiny random model; records which loads parsed the GGUF."""
    path = tmp_path / "models" / "tiny.Q4.gguf"
    path.parent.mkdir()
    path.write_bytes(b"GGUF stand-in")
    conversions = []
    real_load = models.load_pretrained

    def load(folder, dtype, **kwargs):
        if "gguf_file" not in kwargs:
            return real_load(folder, dtype)
        conversions.append(kwargs["gguf_file"])
        return tiny_model("llama").to(dtype), make_tiny_tokenizer()

    monkeypatch.setattr(models, "load_pretrained", load)
    return path, conversions


def _same_weights(first, second) -> bool:
    a, b = first.state_dict(), second.state_dict()
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def test_second_load_reads_the_cache_not_the_gguf(cache_dir, fake_gguf):
    path, conversions = fake_gguf
    first, tokenizer = load_model_and_tokenizer(str(path), dtype=torch.float32)
    second, cached_tokenizer = load_model_and_tokenizer(str(path), dtype=torch.float32)
    assert conversions == ["tiny.Q4.gguf"]  # parsed once
    assert _same_weights(first, second)
    assert cached_tokenizer("hello world").input_ids == tokenizer("hello world").input_ids
    assert cached_tokenizer.chat_template == tokenizer.chat_template
    folder = gguf_cache.cached_folder(str(path), torch.float32)
    assert folder.startswith(str(cache_dir)) and gguf_cache.is_complete(folder)
    # the converting start names the model as later starts do: what is keyed by that name (kept twins) is found
    assert first.name_or_path == first.config._name_or_path == second.name_or_path == folder


def test_the_key_follows_the_file_and_the_dtype(cache_dir, fake_gguf):
    path, _ = fake_gguf
    bf16 = gguf_cache.cached_folder(str(path), torch.bfloat16)
    assert bf16 != gguf_cache.cached_folder(str(path), torch.float32)
    path.write_bytes(b"a different GGUF stand-in")  # another size: converted again, never the old tensors
    assert gguf_cache.cached_folder(str(path), torch.bfloat16) != bf16


def test_an_interrupted_conversion_is_converted_again(cache_dir, fake_gguf):
    path, conversions = fake_gguf
    folder = gguf_cache.cached_folder(str(path), torch.float32)
    os.makedirs(folder)
    (open(os.path.join(folder, "config.json"), "w")).write("{")  # leftovers of a crash: no completion marker
    load_model_and_tokenizer(str(path), dtype=torch.float32)
    assert conversions == ["tiny.Q4.gguf"] and gguf_cache.is_complete(folder)
    load_model_and_tokenizer(str(path), dtype=torch.float32)
    assert conversions == ["tiny.Q4.gguf"]


def test_off_switch_converts_every_time(monkeypatch, fake_gguf):
    monkeypatch.setenv(gguf_cache.CACHE_ENV, "off")
    path, conversions = fake_gguf
    load_model_and_tokenizer(str(path), dtype=torch.float32)
    load_model_and_tokenizer(str(path), dtype=torch.float32)
    assert conversions == ["tiny.Q4.gguf"] * 2


def test_an_unwritable_cache_warns_and_still_loads(tmp_path, monkeypatch, fake_gguf):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the cache folder should be")
    monkeypatch.setenv(gguf_cache.CACHE_ENV, str(blocker / "cache"))
    path, conversions = fake_gguf
    with pytest.warns(UserWarning, match="could not cache the converted GGUF.*RIVER_HF_CACHE"):
        model, _ = load_model_and_tokenizer(str(path), dtype=torch.float32)
    assert model.config.num_hidden_layers > 0 and conversions == ["tiny.Q4.gguf"]


def test_a_failed_write_leaves_no_partial_folder(cache_dir, fake_gguf, monkeypatch):
    path, _ = fake_gguf
    tokenizer_save = type(make_tiny_tokenizer()).save_pretrained
    monkeypatch.setattr(type(make_tiny_tokenizer()), "save_pretrained",
                        lambda self, *a, **k: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.warns(UserWarning, match="disk full"):
        load_model_and_tokenizer(str(path), dtype=torch.float32)
    monkeypatch.setattr(type(make_tiny_tokenizer()), "save_pretrained", tokenizer_save)
    parent = os.path.dirname(gguf_cache.cached_folder(str(path), torch.float32))
    assert os.listdir(parent) == []  # neither the staging folder nor a folder without its marker


@pytest.mark.slow
def test_packaged_model_from_the_cache_equals_the_gguf(cache_dir):
    direct, tokenizer = load_model_and_tokenizer()
    cached, cached_tokenizer = load_model_and_tokenizer()
    folder, name = models.default_model_path()
    assert gguf_cache.is_complete(gguf_cache.cached_folder(os.path.join(folder, name), torch.bfloat16))
    assert _same_weights(direct, cached)
    assert cached.lm_head.weight.data_ptr() == cached.model.embed_tokens.weight.data_ptr()  # still tied
    inputs = models.build_chat_inputs(cached_tokenizer, "What is 2+3?")
    assert inputs["input_ids"].tolist() == models.build_chat_inputs(tokenizer, "What is 2+3?")["input_ids"].tolist()
    plain = direct.generate(**inputs, max_new_tokens=8, do_sample=False)
    assert torch.equal(plain, cached.generate(**inputs, max_new_tokens=8, do_sample=False))


def test_a_river_refuses_gguf_packed_linears_and_says_how_to_load(tmp_path):
    from transformers.integrations.gguf.utils import GgufLinear

    import river_hf
    from river_hf import RiverQuantConfig, UnsupportedModelError

    model = tiny_model("llama")
    layer = model.model.layers[3]
    layer.mlp.up_proj = GgufLinear(layer.mlp.up_proj.in_features, layer.mlp.up_proj.out_features, ggml_type=2)
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    with pytest.raises(UnsupportedModelError, match=r"`mlp.up_proj` \(GgufLinear\).*GgufConfig\(dequantize=True\)"):
        river_hf.build_river(model, RiverQuantConfig(backend="auto"), progress=False)
    assert not river_hf.is_river(model) and all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    # kept out of the twins, it is shared as it is
    river_hf.build_river(model, RiverQuantConfig(backend="auto", skip_modules=["up_proj"]), progress=False)
    assert river_hf.is_river(model)
