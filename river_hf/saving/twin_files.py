"""Saved rivers: the twins stored next to the backbone's checkpoint in a portable form, loaded without HQQ.

    model.save_pretrained(folder, save_twins=True)      # model.safetensors + config.json + river_twins.safetensors
    AutoModelForCausalLM.from_pretrained(folder)        # the backbone loads, the twins are read back: no HQQ

`river_twins.safetensors` holds, for every twin linear (`layers.{i}.{name}`) and the quantized LM head (`lm_head`),
HQQ's codes (uint8; two 4-bit codes per byte for 2-4 bits), `scale` and `zero` (float32 [N, G]) and the bias: not a
kernel's packed layout, which depends on the device and CPU instruction set, and is made again at load for the
backend the config asks for (`RiverQuantLinear.from_codes`). Its metadata ("river_twins", JSON) records what the
twins were made from: per layer the bits and group size asked, per linear the fingerprints of the weight it quantized
(`fingerprint`: whole and sampled), and a checksum of every stored tensor, with a digest of the record itself (a
corrupted file is refused, never half used). Reading it back: river_hf.saving.twin_loading.

A LoRA-adapted linear's twin stores the codes of its base weight W alone, under the linear's own name (as a river
without adapters does): the LoRA on top is not stored, it is copied from the live adapter when the twin is made, so
one twins file serves the base model and every LoRA on it (river_hf.core.adapters). Merged twins (DoRA, IA3, ...) store
the merged weight's codes and fingerprint, which fit only the same adapter.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass

import torch
from safetensors.torch import save_file
from torch import nn

from ..core.adapters import stored_linear_name
from ..core.twins import river_layers, twin_linears
from ..core.lm_head import river_lm_head
from ..kernels.quantize import RiverQuantLinear
from .integrity import SAMPLED_LAYOUT, checksum, digest, record_digest, sampled_digest

TWINS_FILE = "river_twins.safetensors"
METADATA_KEY = "river_twins"
RECORD_DIGEST_KEY = "river_twins_record_digest"  # format 4: a digest of the record itself
# 5: each linear's entry also holds the sampled fingerprint of its source weight (what a load checks by default);
# 4: the record (which twin is stored under which key, its bits and fingerprint) has a digest of its own: a flipped
# bit there would otherwise load one layer's codes into another's twin; 3: each stored tensor is checked against a
# checksum (not a digest: the row samples cost more than the sums over the 600+ tensors of a file); 2: digests (still
# read); 1: digests summed elements (refused: save again)
FORMAT_VERSION = 5
READ_FORMATS = (2, 3, 4, 5)


class StoredTwinsError(ValueError):
    """A twins file that cannot be used as it is (truncated, corrupted, not a river_hf twins file)."""


class TwinsMismatchWarning(UserWarning):
    """Stored twins that do not fit the model being loaded: those twins are rebuilt with HQQ."""


# ---------------------------------------------------------------- fingerprints


@dataclass(frozen=True)
class SourceFingerprint:
    """What a twin linear was quantized from: `full`, the digest of its weight (and bias), one read of every byte;
    `sampled`, their sampled digest, 128 KiB of each (integrity.sampled_digest). A save stores both; a load checks
    the one `verify_twins` asks for."""

    full: str
    sampled: str


def fingerprint(linear: nn.Linear) -> SourceFingerprint:
    """The fingerprint of the weight (and bias) a twin linear is quantized from."""
    return SourceFingerprint("|".join(map(digest, _sources(linear))), sampled_fingerprint(linear))


def sampled_fingerprint(linear: nn.Linear, layout: tuple[int, int] = SAMPLED_LAYOUT) -> str:
    """The sampled digests of the weight (and bias), each read with `layout` (integrity.sampled_digest)."""
    return "|".join(sampled_digest(source, layout) for source in _sources(linear))


def _sources(linear: nn.Linear) -> list[torch.Tensor]:
    return [linear.weight] + ([linear.bias] if linear.bias is not None else [])


# ---------------------------------------------------------------- saving


def _pack_codes(codes: torch.Tensor, nbits: int) -> tuple[torch.Tensor, bool]:
    """[N, K] uint8 -> two codes per byte (even column in the low nibble) when they fit in 4 bits and K is even."""
    if nbits > 4 or codes.shape[1] % 2:
        return codes, False
    return codes[:, 0::2] | (codes[:, 1::2] << 4), True


def unpack_codes(stored: torch.Tensor, packed: bool) -> torch.Tensor:
    if not packed:
        return stored
    return torch.stack([stored & 15, stored >> 4], dim=-1).reshape(stored.shape[0], -1)


def _linear_entry(key: str, linear: RiverQuantLinear, tensors: dict) -> dict:
    """Put one twin linear's portable tensors into `tensors` under `key`; its metadata entry."""
    if linear.source_fingerprint is None:
        raise ValueError(f"`{key}`: this twin linear has no record of the weight it was made from; build the river "
                         f"with river_hf.build_river (or from_pretrained) before saving its twins.")
    codes, packed = _pack_codes(linear.codes().cpu(), linear.nbits)
    tensors[f"{key}.codes"] = codes.contiguous()
    tensors[f"{key}.scale"] = linear.scale.detach().float().cpu().contiguous()
    tensors[f"{key}.zero"] = linear.zero.detach().float().cpu().contiguous()
    if linear.bias is not None:
        tensors[f"{key}.bias"] = linear.bias.detach().cpu().contiguous()
    return {"key": key, "nbits": linear.nbits, "group_size": linear.group_size,
            "shape": [linear.out_features, linear.in_features], "packed": packed, "bias": linear.bias is not None,
            "fingerprint": linear.source_fingerprint.full, "sampled_fingerprint": linear.source_fingerprint.sampled}


def twin_settings(config) -> dict:
    """The RiverQuantConfig fields the twins depend on (the kernel backend is not one: it is chosen at load)."""
    fields = ("nbits", "group_size", "axis", "start_layer", "skip_modules", "quantize_lm_head", "lm_head_nbits")
    return {name: config.to_dict()[name] for name in fields}


def save_twins(model: nn.Module, folder: str | os.PathLike) -> str:
    """Write the river's twins (and quantized LM head) to `folder`/river_twins.safetensors; returns the path.
    Written to a temporary file first and renamed: an interrupted save leaves no truncated file."""
    layers = river_layers(model)
    tensors: dict[str, torch.Tensor] = {}
    record = {"format": FORMAT_VERSION, "layers": {}, "lm_head": None}
    for layer in layers:
        if layer.twin is None:
            continue
        config = layer.quant_config
        record["config"] = twin_settings(config)
        names = {id(module): stored_linear_name(layer.twin, name) for name, module in layer.twin.named_modules()}
        record["layers"][str(layer.layer_idx)] = {
            "nbits": config.nbits_for(layer.layer_idx), "group_size": config.group_size_for(layer.layer_idx),
            "linears": {names[id(linear)]: _linear_entry(f"layers.{layer.layer_idx}.{names[id(linear)]}", linear,
                                                         tensors) for linear in twin_linears(layer.twin)}}
    head = river_lm_head(model)
    if head is not None:
        config = layers[-1].quant_config
        record["lm_head"] = {"nbits": config.head_nbits, "group_size": config.lm_head_group_size,
                             "linear": _linear_entry("lm_head", head.quantized_head, tensors)}
    record["checksums"] = {name: checksum(tensor) for name, tensor in tensors.items()}
    path = os.path.join(folder, TWINS_FILE)
    handle, partial = tempfile.mkstemp(prefix=".river_twins-", suffix=".partial", dir=folder)
    os.close(handle)
    try:
        text = json.dumps(record)
        save_file(tensors, partial, metadata={METADATA_KEY: text, RECORD_DIGEST_KEY: record_digest(text)})
        os.replace(partial, path)
    finally:
        if os.path.exists(partial):
            os.remove(partial)
    return path


def remove_twins(folder: str | os.PathLike) -> None:
    """Remove a twins file left in `folder` by an earlier save (a save without twins must not leave old ones)."""
    path = os.path.join(folder, TWINS_FILE)
    if os.path.isfile(path):
        os.remove(path)


def unusable_file_error(path: str, why: str) -> StoredTwinsError:
    return StoredTwinsError(f"The stored twins file {path} is unusable: {why}. Nothing was loaded from it. Save the "
                            f"river again (model.save_pretrained(folder, save_twins=True)), or delete the file to "
                            f"rebuild the twins with HQQ.")
