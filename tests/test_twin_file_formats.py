"""The twins file's formats: format 3 checks each stored tensor against a checksum; format 2 files (digests) are
still read, with the same checks; what a checksum sees and what only a digest sees."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from river_hf.saving.twin_files import FORMAT_VERSION, METADATA_KEY, TWINS_FILE, StoredTwinsError, checksum, digest
from river_hf.saving.twin_loading import StoredTwins

from test_saved_river import assert_same_river, corrupt, saved_river, without_hqq


def rewrite_as_format_2(path: str) -> None:
    """The same twins, written as river_hf wrote them before format 3: a digest per stored tensor."""
    with safe_open(path, framework="pt") as handle:
        record = json.loads(handle.metadata()[METADATA_KEY])
    tensors = load_file(path)
    record["format"] = 2
    del record["checksums"]
    record["digests"] = {name: digest(tensor) for name, tensor in tensors.items()}
    save_file(tensors, path, metadata={METADATA_KEY: json.dumps(record)})


def test_a_new_file_records_a_checksum_per_stored_tensor(tmp_path):
    _, folder = saved_river(tmp_path)
    stored = StoredTwins.read(folder)
    assert stored.record["format"] == FORMAT_VERSION == 5 and "digests" not in stored.record
    assert stored.record["checksums"] == {name: checksum(tensor) for name, tensor in stored.tensors.items()}


def test_a_format_2_file_loads_the_same_river_without_hqq(tmp_path):
    saved, folder = saved_river(tmp_path)
    rewrite_as_format_2(os.path.join(folder, TWINS_FILE))
    assert StoredTwins.read(folder).record["format"] == 2
    assert_same_river(without_hqq(AutoModelForCausalLM.from_pretrained, folder), saved)


def test_a_damaged_format_2_file_is_still_refused(tmp_path):
    _, folder = saved_river(tmp_path)
    path = os.path.join(folder, TWINS_FILE)
    rewrite_as_format_2(path)
    corrupt(path, "flipped")
    with pytest.raises(StoredTwinsError, match="do not match their recorded digests"):
        StoredTwins.read(folder)


def test_a_checksum_sees_any_changed_element_but_not_a_row_swap_which_a_digest_sees():
    """Why both exist: a damaged file changes bytes (the checksum finds it); a backbone weight whose rows were
    permuted keeps its sum, so the twins' fingerprints are digests, with a sample per row."""
    torch.manual_seed(0)
    weight = torch.randn(64, 96, dtype=torch.bfloat16)
    changed, swapped = weight.clone(), weight.clone()
    changed[40, 17] = changed[40, 17] + 1
    swapped[[3, 4]] = weight[[4, 3]]
    assert checksum(changed) != checksum(weight) == checksum(weight.clone())
    assert checksum(swapped) == checksum(weight) and digest(swapped) != digest(weight)
    odd = torch.arange(13, dtype=torch.uint8)  # a tail shorter than 8 bytes counts too
    bumped = odd.clone()
    bumped[12] += 1
    assert checksum(odd) != checksum(bumped)


def test_a_saved_load_shows_the_stored_twins_bar_and_no_quantizing_bar(tmp_path, capsys):
    _, folder = saved_river(tmp_path)
    capsys.readouterr()
    without_hqq(AutoModelForCausalLM.from_pretrained, folder)
    bars = capsys.readouterr().err
    assert "river: loading stored twins" in bars and "quantizing" not in bars
