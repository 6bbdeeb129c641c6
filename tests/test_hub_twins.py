"""A river pushed to the hub: loading its snapshot fetches the twins file of the same revision (transformers fetches
only weights and config), so no twin is quantized; a repo without twins or a failed fetch falls back to HQQ. No
network: the snapshot is laid out as huggingface_hub's cache does, and the download is replaced."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from huggingface_hub.errors import RemoteEntryNotFoundError
from transformers import AutoModelForCausalLM

import river_hf
from river_hf import RiverQuantConfig
from river_hf.saving import hf_quantizer as hf_integration
from river_hf.saving.twin_files import TWINS_FILE, StoredTwinsError

from conftest import tiny_model

QUANT = dict(backend="auto", nbits=4, group_size=64, start_layer=2, quantize_lm_head=False)
REVISION = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def snapshot(tmp_path):
    """(snapshot folder without the twins file, where the repo's twins file is 'on the hub')."""
    backbone = str(tmp_path / "backbone")
    tiny_model().save_pretrained(backbone)
    river = AutoModelForCausalLM.from_pretrained(backbone, quantization_config=RiverQuantConfig(**QUANT))
    folder = tmp_path / "hub" / "models--someone--my-river" / "snapshots" / REVISION
    river.save_pretrained(str(folder))  # what push_to_hub uploads
    remote = tmp_path / "remote"
    remote.mkdir()
    shutil.move(str(folder / TWINS_FILE), remote / TWINS_FILE)
    return str(folder), str(remote / TWINS_FILE)


def fake_download(monkeypatch, calls, result):
    def download(repo_id, filename, revision=None, cache_dir=None):
        calls.append((repo_id, filename, revision, cache_dir))
        if isinstance(result, Exception):
            raise result
        return result

    monkeypatch.setattr(hf_integration.huggingface_hub, "hf_hub_download", download)


def not_on_the_hub() -> RemoteEntryNotFoundError:
    """huggingface_hub's 404 for a missing file (made without an HTTP response)."""
    error = RemoteEntryNotFoundError.__new__(RemoteEntryNotFoundError)
    Exception.__init__(error, "404: river_twins.safetensors is not in this repo")
    return error


def test_the_twins_of_the_snapshot_revision_are_fetched_and_used(snapshot, monkeypatch, tmp_path, hqq_calls):
    folder, remote = snapshot
    calls, hqq = [], hqq_calls
    fake_download(monkeypatch, calls, remote)
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert river_hf.is_river(model) and hqq[0] == 0
    assert calls == [("someone/my-river", TWINS_FILE, REVISION, str(tmp_path / "hub"))]


def test_a_repo_without_twins_quantizes_quietly(snapshot, monkeypatch, recwarn, hqq_calls):
    folder, _ = snapshot
    calls, hqq = [], hqq_calls
    fake_download(monkeypatch, calls, not_on_the_hub())
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert river_hf.is_river(model) and hqq[0] > 0 and len(calls) == 1
    assert not [w for w in recwarn if "could not fetch" in str(w.message)]


def test_a_failed_fetch_warns_and_quantizes(snapshot, monkeypatch, hqq_calls):
    folder, _ = snapshot
    calls, hqq = [], hqq_calls
    fake_download(monkeypatch, calls, OSError("offline"))
    with pytest.warns(UserWarning, match="could not fetch river_twins.safetensors of someone/my-river"):
        model = AutoModelForCausalLM.from_pretrained(folder)
    assert river_hf.is_river(model) and hqq[0] > 0


def test_a_damaged_download_is_refused(snapshot, monkeypatch, tmp_path):
    monkeypatch.setenv("RIVER_HF_CACHE", str(tmp_path / "cache"))  # nothing packed: the file's tensors are read
    folder, remote = snapshot
    with open(remote, "r+b") as file:
        file.seek(os.path.getsize(remote) - 8)
        file.write(b"\x00" * 8)
    fake_download(monkeypatch, [], remote)
    with pytest.raises(StoredTwinsError, match="unusable"):
        AutoModelForCausalLM.from_pretrained(folder)


def test_plain_folders_and_plain_repos_never_reach_the_hub(tmp_path, monkeypatch):
    calls = []
    fake_download(monkeypatch, calls, OSError("must not be called"))
    plain_snapshot = tmp_path / "hub" / "models--someone--plain" / "snapshots" / REVISION
    tiny_model().save_pretrained(str(plain_snapshot))  # no river quantization_config in its config.json
    for folder in (plain_snapshot, tmp_path / "hub"):
        if folder != plain_snapshot:
            tiny_model().save_pretrained(str(folder))
        AutoModelForCausalLM.from_pretrained(str(folder), quantization_config=RiverQuantConfig(**QUANT),
                                             dtype=torch.float32)
    assert calls == []
