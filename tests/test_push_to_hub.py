"""push_to_hub uploads the twins file with the checkpoint when the save stores twins (no network: transformers' hub
calls are replaced by recorders of what would be uploaded)."""

from __future__ import annotations

import os

import pytest
import transformers.modeling_utils
import transformers.utils.hub
from transformers import AutoModelForCausalLM
from transformers.utils.hub import PushToHubMixin

import river_hf
from river_hf import RiverQuantConfig
from river_hf.core.twins import get_river
from river_hf.saving.twin_files import TWINS_FILE
from river_hf.saving.twin_loading import StoredTwins

from conftest import tiny_model

QUANT = dict(backend="auto", nbits=4, group_size=64, start_layer=2, quantize_lm_head=False)


class FakeRepo:
    def __init__(self, repo_id):
        self.repo_id = repo_id


class FakeApi:
    def create_repo(self, repo_id, **kwargs):
        return FakeRepo(repo_id)


class FakeCard:
    def save(self, path):
        open(path, "w").close()


@pytest.fixture
def uploads(monkeypatch):
    """[(repo_id, {file name: twins file readable?})] for every upload transformers would make."""
    made = []

    def upload(self, working_dir, repo_id, files_timestamps, **kwargs):
        files = {}
        for name in os.listdir(working_dir):
            if files_timestamps.get(name) is None or os.path.getmtime(os.path.join(working_dir, name)) > \
                    files_timestamps[name]:
                files[name] = StoredTwins.read(os.path.join(working_dir, name)) if name == TWINS_FILE else None
        made.append((repo_id, files))

    monkeypatch.setattr(PushToHubMixin, "_upload_modified_files", upload)
    for module in (transformers.utils.hub, transformers.modeling_utils):
        monkeypatch.setattr(module, "hf_api", FakeApi, raising=False)
    monkeypatch.setattr(transformers.utils.hub, "create_and_tag_model_card", lambda *a, **k: FakeCard())
    monkeypatch.setattr(transformers.modeling_utils, "create_and_tag_model_card", lambda *a, **k: FakeCard(),
                        raising=False)
    return made


def loaded_river(tmp_path):
    folder = str(tmp_path / "backbone")
    tiny_model().save_pretrained(folder)
    return AutoModelForCausalLM.from_pretrained(folder, quantization_config=RiverQuantConfig(**QUANT))


def test_push_to_hub_uploads_the_twins_of_a_model_loaded_as_a_river(tmp_path, uploads):
    loaded_river(tmp_path).push_to_hub("someone/my-river")
    ((repo_id, files),) = uploads
    assert repo_id == "someone/my-river" and "config.json" in files and "model.safetensors" in files
    assert isinstance(files[TWINS_FILE], StoredTwins)


def test_push_to_hub_of_a_build_river_model_uploads_twins_only_when_asked(tmp_path, uploads):
    model = river_hf.build_river(tiny_model(), RiverQuantConfig(**QUANT), progress=False)
    model.push_to_hub("someone/plain")
    model.push_to_hub("someone/with-twins", save_twins=True)
    (_, plain), (_, with_twins) = uploads
    assert TWINS_FILE not in plain and isinstance(with_twins[TWINS_FILE], StoredTwins)
    assert get_river(model).pushing_twins is None  # the next save_pretrained is not told to save twins


def test_save_pretrained_with_push_to_hub_uploads_after_the_twins_are_written(tmp_path, uploads):
    model = loaded_river(tmp_path)
    model.save_pretrained(str(tmp_path / "my-river"), push_to_hub=True, repo_id="someone/my-river")
    ((repo_id, files),) = uploads
    assert repo_id == "someone/my-river" and isinstance(files[TWINS_FILE], StoredTwins)
    assert os.path.isfile(tmp_path / "my-river" / TWINS_FILE)  # and the local folder has them too
