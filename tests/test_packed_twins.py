"""A saved river's load on a machine that loaded it before (river_hf.saving.packed_cache): the kernels' packed layout
kept in the cache folder is mapped back, nothing packed and no stored tensor read, and the river is the same. And what
a load checks the backbone against: sampled fingerprints by default, whole digests with `verify_twins="full"`."""

from __future__ import annotations

import glob
import json
import os
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

import river_hf
from river_hf import RiverQuantConfig
from river_hf.kernels.quantize import RiverQuantLinear
from river_hf.saving import packed_cache, twin_files, twin_loading
from river_hf.saving.integrity import SAMPLED_LAYOUT, digest, sampled_digest, sampled_layout
from river_hf.saving.twin_files import TWINS_FILE, StoredTwinsError, TwinsMismatchWarning

from test_saved_river import (BASE, MIXED_SCHEDULE, assert_same_river, corrupt, loaded_river, saved_backbone,
                              saved_river, without_hqq)


@pytest.fixture
def cache(tmp_path, monkeypatch) -> str:
    """A cache folder of this test's own (nothing packed yet); the packed entries' folder."""
    monkeypatch.setenv("RIVER_HF_CACHE", str(tmp_path / "cache"))
    return str(tmp_path / "cache" / packed_cache.SUBFOLDER)


def entries(folder: str) -> list[str]:
    return sorted(glob.glob(os.path.join(folder, "*.json")))


def load_without_packing(folder, **quant):
    """Load `folder` with packing from codes and reading the file's tensors made to fail."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(RiverQuantLinear, "from_codes", classmethod(lambda *a, **k: pytest.fail("packed from codes")))
        patch.setattr(twin_loading, "load_file", lambda *a, **k: pytest.fail("the twins file's tensors were read"))
        return load(folder, **quant)


def load(folder, **loading):
    """from_pretrained of a saved river, HQQ made to fail; `loading`: RiverQuantConfig's loading fields to set."""
    kwargs = {"quantization_config": RiverQuantConfig(**loading)} if loading else {}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*quantization_config.* from the model will be used")
        return without_hqq(AutoModelForCausalLM.from_pretrained, folder, **kwargs)


def test_the_second_load_maps_the_packed_twins_and_gives_the_same_river(cache, tmp_path):
    saved, folder = saved_river(tmp_path, **MIXED_SCHEDULE)
    assert entries(cache) == [], "the build with HQQ keeps nothing: only a load from codes packs"
    first = without_hqq(AutoModelForCausalLM.from_pretrained, folder)
    assert len(entries(cache)) == 1 and len(glob.glob(os.path.join(cache, "*.bin"))) == 1
    second = load_without_packing(folder)
    assert_same_river(second, saved)
    assert_same_river(second, first)
    linears = [m for m in second.modules() if isinstance(m, RiverQuantLinear)]
    alone = [m for m in linears if m.siblings is None]
    data = glob.glob(os.path.join(cache, "*.bin"))[0]
    assert alone and all(m.scale.untyped_storage().nbytes() == os.path.getsize(data) for m in alone)  # mapped
    # stacked siblings (q/k/v, gate/up: river_hf.kernels.shared_inputs): the stack kept as one, mapped, and the
    # members views of it (nothing concatenated again at the load)
    stacked = [m for m in linears if m.siblings is not None]
    assert stacked and all(m.siblings.stacked.qweight.untyped_storage().nbytes() == os.path.getsize(data)
                           and m.qweight.untyped_storage().data_ptr() == m.siblings.stacked.qweight.untyped_storage()
                           .data_ptr() for m in stacked)
    assert len({id(m.siblings) for m in stacked}) * 5 == len(stacked) * 2  # one stack of 3 per attention, of 2 per MLP
    assert all(m.siblings.stacked.qweight.data_ptr() % 64 == 0 for m in stacked)
    assert all(m.qweight.data_ptr() % 64 == 0 for m in alone if "qweight" in m._buffers)  # the int8 kernel needs it


def test_two_rivers_built_from_one_stored_twins_share_no_module(cache, tmp_path):
    """A StoredTwins handed to build_river twice maps the kept stacks for each river anew: moving one river's twins
    (a module shared between them would move the other's) leaves the other as it was."""
    saved, folder = saved_river(tmp_path, **MIXED_SCHEDULE)
    without_hqq(AutoModelForCausalLM.from_pretrained, folder)  # packs and keeps
    config = RiverQuantConfig(**{**BASE, **MIXED_SCHEDULE})
    stored = twin_loading.StoredTwins.read(folder, config)
    backbone = saved_backbone(tmp_path)
    with pytest.MonkeyPatch.context() as patch:  # every twin mapped from the kept entry
        patch.setattr(RiverQuantLinear, "from_codes", classmethod(lambda *a, **k: pytest.fail("packed from codes")))
        rivers = [without_hqq(river_hf.build_river, AutoModelForCausalLM.from_pretrained(backbone), config,
                              progress=False, stored_twins=stored) for _ in range(2)]
    twin_modules = [{id(m) for m in river.modules() if isinstance(m, RiverQuantLinear)} for river in rivers]
    assert twin_modules[0] and not twin_modules[0] & twin_modules[1]
    stacks = [{id(m.siblings) for m in river.modules() if isinstance(m, RiverQuantLinear) and m.siblings is not None}
              for river in rivers]
    assert stacks[0] and not stacks[0] & stacks[1]
    assert_same_river(rivers[1], saved)


def test_the_packed_twins_survive_a_save_of_the_loaded_river(cache, tmp_path):
    saved, folder = saved_river(tmp_path)
    without_hqq(AutoModelForCausalLM.from_pretrained, folder)
    loaded = load_without_packing(folder)
    again = str(tmp_path / "again")
    loaded.save_pretrained(again)  # the codes read back from mapped buffers; fingerprints carried from the file
    assert_same_river(without_hqq(AutoModelForCausalLM.from_pretrained, again), saved)


def test_each_backend_has_its_own_entry(cache, tmp_path):
    _, folder = saved_river(tmp_path)
    without_hqq(AutoModelForCausalLM.from_pretrained, folder)
    with pytest.raises(pytest.fail.Exception, match="tensors were read"):  # nothing kept for "dense" yet
        load_without_packing(folder, backend="dense")
    load(folder, backend="dense")
    assert len(entries(cache)) == 2
    model = load_without_packing(folder, backend="dense")
    assert {m.backend for m in model.modules() if isinstance(m, RiverQuantLinear)} == {"dense"}


def test_a_flipped_byte_in_the_file_is_not_read_where_the_twins_are_kept_and_full_verification_refuses_it(
        cache, tmp_path):
    saved, folder = saved_river(tmp_path)
    without_hqq(AutoModelForCausalLM.from_pretrained, folder)
    corrupt(os.path.join(folder, TWINS_FILE), "flipped")
    assert_same_river(load_without_packing(folder), saved)  # the kept twins were packed from the intact file
    with pytest.raises(StoredTwinsError, match="do not match their recorded checksums"):
        load(folder, verify_twins="full")


@pytest.mark.parametrize("where", ["a lone linear", "a stack of siblings"])
def test_a_damaged_packed_entry_is_packed_again_under_full_verification(cache, tmp_path, where):
    saved, folder = saved_river(tmp_path)
    without_hqq(AutoModelForCausalLM.from_pretrained, folder)
    data = glob.glob(os.path.join(cache, "*.bin"))[0]
    with open(entries(cache)[0]) as file:
        index = json.load(file)
    entry = next(iter(index["stacks"].values())) if where == "a stack of siblings" else next(
        entry for entry in index["linears"].values() if "buffers" in entry)
    dtype, shape, offset, nbytes = entry["buffers"]["scale"][:4]
    with open(data, "r+b") as file:
        file.seek(offset + nbytes // 2)
        byte = file.read(1)
        file.seek(-1, os.SEEK_CUR)
        file.write(bytes([byte[0] ^ 0x10]))
    with pytest.warns(UserWarning, match="packed twins kept in .* are damaged"):
        loaded = load(folder, verify_twins="full")
    assert_same_river(loaded, saved)
    assert_same_river(load_without_packing(folder), saved)  # the entry was written again


def test_a_truncated_or_missing_data_file_is_packed_again(cache, tmp_path):
    saved, folder = saved_river(tmp_path)
    without_hqq(AutoModelForCausalLM.from_pretrained, folder)
    data = glob.glob(os.path.join(cache, "*.bin"))[0]
    os.truncate(data, os.path.getsize(data) - 64)
    assert_same_river(without_hqq(AutoModelForCausalLM.from_pretrained, folder), saved)
    os.remove(glob.glob(os.path.join(cache, "*.bin"))[0])
    assert_same_river(without_hqq(AutoModelForCausalLM.from_pretrained, folder), saved)
    assert_same_river(load_without_packing(folder), saved)


def test_only_the_most_recently_used_entries_are_kept(cache, tmp_path, monkeypatch):
    monkeypatch.setattr(packed_cache, "MAX_ENTRIES", 2)
    linear = RiverQuantLinear.from_linear(torch.nn.Linear(64, 32), nbits=4, group_size=64, backend="dense")
    for index in range(4):
        packed_cache.write_packed(f"key{index}", {"lm_head": linear})
        os.utime(os.path.join(cache, f"key{index}.json"), (index, index))  # written in this order
    assert [os.path.basename(p) for p in entries(cache)] == ["key2.json", "key3.json"]
    assert len(glob.glob(os.path.join(cache, "*.bin"))) == 2  # no data file without its index
    kept = packed_cache.read_packed("key2", "sampled")
    assert torch.equal(kept.linear("lm_head").dequantized_weight(), linear.dequantized_weight())
    assert packed_cache.read_packed("key0", "sampled") is None


def test_no_cache_folder_keeps_nothing_and_an_unwritable_one_only_warns(tmp_path, monkeypatch):
    saved, folder = saved_river(tmp_path)
    monkeypatch.setenv("RIVER_HF_CACHE", "off")
    assert_same_river(without_hqq(AutoModelForCausalLM.from_pretrained, folder), saved)
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("RIVER_HF_CACHE", str(blocker))
    with pytest.warns(UserWarning, match="could not keep the packed twins"):
        loaded = without_hqq(AutoModelForCausalLM.from_pretrained, folder)
    assert_same_river(loaded, saved)


# ---------------------------------------------------------------- sampled fingerprints


def unsampled_element(weight: torch.Tensor) -> tuple[int, int]:
    """(row, column) of an element that lies in none of sampled_digest's runs."""
    runs, run_bytes = SAMPLED_LAYOUT
    size = weight.numel() * weight.element_size()
    step = (size - run_bytes) // (runs - 1)
    assert step > 2 * run_bytes, "the weight must be larger than the sample"
    flat = (run_bytes + step // 2) // weight.element_size()
    return divmod(flat, weight.shape[1])


def test_a_sampled_digest_sees_another_or_a_fine_tuned_weight_not_a_lone_element_a_full_digest_sees():
    torch.manual_seed(0)
    weight = torch.randn(512, 1024, dtype=torch.bfloat16)  # 1 MiB, 8x its sample
    tuned = weight + 1e-2 * torch.randn_like(weight)  # every element moves, as fine-tuning or a merged LoRA does
    lone = weight.clone()
    lone[unsampled_element(weight)] += 1
    first = weight.clone()
    first[0, 0] += 1  # the first run starts at the first byte
    assert sampled_digest(weight.clone()) == sampled_digest(weight)
    assert len({sampled_digest(t) for t in (weight, tuned, first, weight.float(), weight.T.contiguous())}) == 5
    assert sampled_digest(lone) == sampled_digest(weight) and digest(lone) != digest(weight)
    small = torch.randn(64, 64)  # no larger than the sample: every byte is hashed
    changed = small.clone()
    changed[37, 5] += 1
    assert sampled_digest(changed) != sampled_digest(small)


def test_a_changed_weight_is_caught_by_sample_and_a_lone_element_by_full_verification(cache, tmp_path, hqq_calls):
    # intermediate 2048: the MLP weights (float32, 512 KiB) are 4x larger than the sample
    folder = str(tmp_path / "river")
    loaded_river(saved_backbone(tmp_path, intermediate_size=2048)).save_pretrained(folder)
    path = os.path.join(folder, "model.safetensors")
    weights = load_file(path)
    name = "model.layers.3.mlp.down_proj.weight"
    original = weights[name].clone()
    weights[name] = original + 1e-3 * torch.randn_like(original)  # fine-tuned
    save_file(weights, path, metadata={"format": "pt"})
    hqq_calls[0] = 0
    with pytest.warns(TwinsMismatchWarning, match=r"layer 3: the backbone weights differ .*down_proj"):
        AutoModelForCausalLM.from_pretrained(folder)
    assert hqq_calls[0] == 7
    weights[name] = original.clone()
    weights[name][unsampled_element(original)] += 1  # one element the sample does not read
    save_file(weights, path, metadata={"format": "pt"})
    hqq_calls[0] = 0
    with warnings.catch_warnings():
        warnings.simplefilter("error", TwinsMismatchWarning)
        AutoModelForCausalLM.from_pretrained(folder)  # the documented miss of the default check
    assert hqq_calls[0] == 0
    with pytest.warns(TwinsMismatchWarning, match=r"layer 3: the backbone weights differ .*down_proj"):
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*quantization_config.* from the model will be used")
            loaded = AutoModelForCausalLM.from_pretrained(folder, quantization_config=RiverQuantConfig(
                verify_twins="full"))
    assert hqq_calls[0] == 7 and loaded.config.quantization_config.verify_twins == "full"


def stored_sampled_fingerprints(folder: str) -> list[str]:
    record = twin_loading.StoredTwins.read(folder).record
    return [entry["sampled_fingerprint"] for layer in record["layers"].values() for entry in layer["linears"].values()]


def test_a_file_sampled_with_the_first_layout_still_verifies_and_still_catches_a_change(cache, tmp_path, hqq_calls,
                                                                                      monkeypatch):
    first_layout = (32, 4096)  # what format-5 files written before the layout was named hold, tagged "sampled"
    assert sampled_layout(sampled_digest(torch.zeros(9), first_layout)) == first_layout
    assert sampled_layout(sampled_digest(torch.zeros(9))) == SAMPLED_LAYOUT != first_layout
    assert sampled_layout("float32:[9]:sampled7:36:00") is None and sampled_layout("no digest") is None
    written_then = twin_files.sampled_fingerprint
    folder = str(tmp_path / "river")
    with monkeypatch.context() as written_before:
        written_before.setattr(twin_files, "sampled_fingerprint", lambda linear: written_then(linear, first_layout))
        loaded_river(saved_backbone(tmp_path, intermediate_size=2048)).save_pretrained(folder)
    assert all(":sampled:" in stored for stored in stored_sampled_fingerprints(folder))
    hqq_calls[0] = 0
    with warnings.catch_warnings():
        warnings.simplefilter("error", TwinsMismatchWarning)
        AutoModelForCausalLM.from_pretrained(folder)
    assert hqq_calls[0] == 0
    path = os.path.join(folder, "model.safetensors")
    weights = load_file(path)
    name = "model.layers.3.mlp.down_proj.weight"
    weights[name] = weights[name] + 1e-3 * torch.randn_like(weights[name])
    save_file(weights, path, metadata={"format": "pt"})
    with pytest.warns(TwinsMismatchWarning, match=r"layer 3: the backbone weights differ .*down_proj"):
        AutoModelForCausalLM.from_pretrained(folder)
    assert hqq_calls[0] == 7


def test_verify_twins_is_checked_by_the_config():
    with pytest.raises(ValueError, match="verify_twins"):
        RiverQuantConfig(verify_twins="some")
    assert RiverQuantConfig().verify_twins == "sampled"
    assert river_hf.RiverQuantConfig(verify_twins="full").to_dict()["verify_twins"] == "full"


def test_a_config_passed_for_a_saved_river_sets_its_loading_fields_only(tmp_path):
    _, folder = saved_river(tmp_path)  # backend "auto", 4-bit twins
    with pytest.warns(UserWarning, match=r"loading attributes \(e.g. \['backend', 'verify_twins'\]\) will be "):
        loaded = without_hqq(AutoModelForCausalLM.from_pretrained, folder, quantization_config=RiverQuantConfig(
            nbits=8, backend="dense", verify_twins="full"))
    config = loaded.config.quantization_config
    assert (config.nbits, config.backend, config.verify_twins) == (4, "dense", "full")
    assert {m.backend for m in loaded.modules() if isinstance(m, RiverQuantLinear)} == {"dense"}
