"""The command line keeps the twins it built (river_hf.cli.stored_twins): the next run packs them without HQQ and runs
the same river; changed weights, other twin settings, a damaged file or RIVER_HF_CACHE=off never reuse stale twins."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM

import river_hf
from river_hf import RiverConfig, RiverQuantConfig, cache_folder as user_cache
from river_hf.kernels import quantize
from river_hf.cli import stored_twins as twin_cache
from river_hf.cli import main
from river_hf.saving.twin_files import TWINS_FILE, TwinsMismatchWarning

from conftest import save_tiny_model

CONFIG = dict(nbits=4, group_size=32, start_layer=1, backend="auto", quantize_lm_head=False)


@pytest.fixture
def model_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(user_cache.CACHE_ENV, str(tmp_path / "cache"))
    return save_tiny_model(tmp_path / "model")


def load(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def refuse_hqq(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("HQQ ran although the twins were kept")
    monkeypatch.setattr(quantize, "hqq_quantize", refuse)


def exited_tokens(model):
    inputs = torch.tensor([[1, 5, 9, 3, 7]])
    return model.generate(inputs, generation_config=RiverConfig(tau=-1.0, exit_signal="cosine", max_new_tokens=6,
                                                                do_sample=False))


def test_the_second_build_reads_the_kept_twins_and_runs_the_same_river(model_dir, monkeypatch):
    first = twin_cache.build_river_cached(load(model_dir), RiverQuantConfig(**CONFIG), progress=False)
    folder = twin_cache.twins_folder(first, RiverQuantConfig(**CONFIG))
    assert os.path.isfile(os.path.join(folder, TWINS_FILE))
    assert twin_cache.has_kept_twins(load(model_dir), RiverQuantConfig(**CONFIG))
    refuse_hqq(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("error", TwinsMismatchWarning)
        second = twin_cache.build_river_cached(load(model_dir), RiverQuantConfig(**CONFIG), progress=False)
    assert torch.equal(exited_tokens(first), exited_tokens(second))
    for a, b in zip(river_hf.river_layers(first)[1:], river_hf.river_layers(second)[1:]):
        for (name, x), (_, y) in zip(a.twin.named_buffers(), b.twin.named_buffers()):
            assert torch.equal(x, y), name


def test_other_twin_settings_are_kept_apart(model_dir):
    model = load(model_dir)
    folders = {twin_cache.twins_folder(model, RiverQuantConfig(**{**CONFIG, **change}))
               for change in ({}, {"nbits": 8}, {"group_size": 64}, {"start_layer": 2}, {"quantize_lm_head": True})}
    assert len(folders) == 5
    # chosen at load
    assert twin_cache.twins_folder(model, RiverQuantConfig(**{**CONFIG, "backend": "dense"})) in folders


def test_changed_weights_under_the_same_name_are_rebuilt_and_kept_again(model_dir, tmp_path):
    twin_cache.build_river_cached(load(model_dir), RiverQuantConfig(**CONFIG), progress=False)
    changed = load(model_dir)
    with torch.no_grad():
        changed.model.layers[2].mlp.down_proj.weight.mul_(1.5)
    changed.save_pretrained(model_dir)
    with pytest.warns(TwinsMismatchWarning, match="layer 2"):
        twin_cache.build_river_cached(load(model_dir), RiverQuantConfig(**CONFIG), progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", TwinsMismatchWarning)  # the file was written again: it fits now
        twin_cache.build_river_cached(load(model_dir), RiverQuantConfig(**CONFIG), progress=False)


def test_a_damaged_file_warns_and_is_rebuilt(model_dir):
    model = twin_cache.build_river_cached(load(model_dir), RiverQuantConfig(**CONFIG), progress=False)
    path = os.path.join(twin_cache.twins_folder(model, RiverQuantConfig(**CONFIG)), TWINS_FILE)
    with open(path, "r+b") as file:
        file.seek(os.path.getsize(path) - 16)
        file.write(b"\xff" * 16)
    with pytest.warns(UserWarning, match="kept twins .* are unusable"):
        twin_cache.build_river_cached(load(model_dir), RiverQuantConfig(**CONFIG), progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        twin_cache.build_river_cached(load(model_dir), RiverQuantConfig(**CONFIG), progress=False)


def test_cache_off_keeps_nothing(model_dir, monkeypatch, tmp_path):
    monkeypatch.setenv(user_cache.CACHE_ENV, "off")
    model = twin_cache.build_river_cached(load(model_dir), RiverQuantConfig(**CONFIG), progress=False)
    assert river_hf.is_river(model) and twin_cache.twins_folder(model, RiverQuantConfig(**CONFIG)) is None
    assert not (tmp_path / "cache").exists()


def test_the_command_line_says_it_read_the_kept_twins(model_dir, capsys):
    arguments = ["generate", "hello", "--model", model_dir, "--max-new-tokens", "3", "--tau", "-1", "--nbits", "4"]
    assert main(arguments) == 0
    assert "building river: quantizing" in capsys.readouterr().err
    assert main(arguments) == 0
    assert "building river: reading the twins an earlier run kept for" in capsys.readouterr().err
