"""Saved rivers: the twins stored next to the backbone's checkpoint in a portable form, loaded without HQQ.

    model.save_pretrained(folder, save_twins=True)      # model.safetensors + config.json + river_twins.safetensors
    AutoModelForCausalLM.from_pretrained(folder)        # the backbone loads, the twins are read back: no HQQ

`river_twins.safetensors` holds, for every twin linear (`layers.{i}.{name}`) and the quantized LM head (`lm_head`),
HQQ's codes (uint8; two 4-bit codes per byte for 2-4 bits), `scale` and `zero` (float32 [N, G]) and the bias: not a
kernel's packed layout, which depends on the device and CPU instruction set, and is made again at load for the
backend the config asks for (`RiverQuantLinear.from_codes`). Its metadata ("river_twins", JSON) records what the
twins were made from: per layer the bits and group size asked, per linear the fingerprint of the weight it quantized
(`fingerprint`), and a digest of every stored tensor (a corrupted file is refused, never half used).

At load, a layer's twin comes from the file only if the config asks that layer for the same bits and group size,
the same linears are quantized (`skip_modules`), and each backbone weight has the recorded fingerprint; any other
layer (and a head that does not match) is rebuilt with HQQ, with one `TwinsMismatchWarning` naming the layers and
what differs. `warnings.simplefilter("error", TwinsMismatchWarning)` turns that into a refusal.

A LoRA-adapted linear's twin stores the codes of its base weight W alone, under the linear's own name (as a river
without adapters does): the LoRA on top is not stored, it is copied from the live adapter when the twin is made, so
one twins file serves the base model and every LoRA on it (river_hf.core.adapters). Merged twins (DoRA, IA3, ...) store
the merged weight's codes and fingerprint, which fit only the same adapter.
"""

from __future__ import annotations

import json
import os
import tempfile
import warnings

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from torch import nn
from tqdm.auto import tqdm

from ..core.adapters import stored_linear_name
from ..core.twins import make_twin, river_layers, twin_linears
from ..core.lm_head import river_lm_head
from ..kernels.quantize import RiverQuantLinear
from .integrity import checksum, digest, record_digest, record_problem

TWINS_FILE = "river_twins.safetensors"
METADATA_KEY = "river_twins"
RECORD_DIGEST_KEY = "river_twins_record_digest"  # format 4: a digest of the record itself
# 4: the record (which twin is stored under which key, its bits and fingerprint) has a digest of its own: a flipped
# bit there would otherwise load one layer's codes into another's twin; 3: each stored tensor is checked against a
# checksum (not a digest: the row samples cost more than the sums over the 600+ tensors of a file); 2: digests (still
# read); 1: digests summed elements (refused: save again)
FORMAT_VERSION = 4
READ_FORMATS = (2, 3, 4)


class StoredTwinsError(ValueError):
    """A twins file that cannot be used as it is (truncated, corrupted, not a river_hf twins file)."""


class TwinsMismatchWarning(UserWarning):
    """Stored twins that do not fit the model being loaded: those twins are rebuilt with HQQ."""


# ---------------------------------------------------------------- fingerprints


def fingerprint(linear: nn.Linear) -> str:
    """The fingerprint of the weight (and bias) a twin linear is quantized from."""
    parts = [digest(linear.weight)] + ([digest(linear.bias)] if linear.bias is not None else [])
    return "|".join(parts)


# ---------------------------------------------------------------- saving


def _pack_codes(codes: torch.Tensor, nbits: int) -> tuple[torch.Tensor, bool]:
    """[N, K] uint8 -> two codes per byte (even column in the low nibble) when they fit in 4 bits and K is even."""
    if nbits > 4 or codes.shape[1] % 2:
        return codes, False
    return codes[:, 0::2] | (codes[:, 1::2] << 4), True


def _unpack_codes(stored: torch.Tensor, packed: bool) -> torch.Tensor:
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
            "fingerprint": linear.source_fingerprint}


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
        record["lm_head"] = {"nbits": config.lm_head_nbits, "group_size": config.lm_head_group_size,
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


# ---------------------------------------------------------------- loading


class _Mismatch(Exception):
    """One layer's stored twin does not fit; the message says why."""


class StoredTwins:
    """The content of one twins file, read and checked in full (`read`): tensors on CPU and their metadata."""

    def __init__(self, path: str, record: dict, tensors: dict[str, torch.Tensor]):
        self.path, self.record, self.tensors = path, record, tensors

    @classmethod
    def read(cls, path: str | os.PathLike) -> "StoredTwins":
        """Read `path` (a twins file, or a folder holding one) and check every tensor against its digest; a
        `StoredTwinsError` naming the file when it is truncated, corrupted or not a river_hf twins file."""
        path = str(path)
        if os.path.isdir(path):
            path = os.path.join(path, TWINS_FILE)
        # from_pretrained reads the twins inside transformers' meta-device context (a torch function mode): every
        # small torch op of the 600+ digests would go through it, ~0.1 s of a SmolLM2 load. Nothing here is a tensor
        # subclass or should land on the meta device, so the mode is set aside while reading.
        with torch._C.DisableTorchFunction():
            return cls._read(path)

    @classmethod
    def _read(cls, path: str) -> "StoredTwins":
        try:
            with safe_open(path, framework="pt") as handle:
                metadata = handle.metadata() or {}
            tensors = load_file(path)
            record = json.loads(metadata[METADATA_KEY])
        except (SafetensorError, OSError, KeyError, ValueError) as error:
            raise _corrupt(path, f"it cannot be read as a river_hf twins file ({type(error).__name__}: {error})")
        if not isinstance(record, dict) or record.get("format") not in READ_FORMATS:
            raise _corrupt(path, f"its format is {record.get('format') if isinstance(record, dict) else None!r}, "
                           f"this river_hf reads formats {', '.join(map(str, READ_FORMATS))}")
        if record["format"] >= 4 and metadata.get(RECORD_DIGEST_KEY) != record_digest(metadata[METADATA_KEY]):
            raise _corrupt(path, "its record (which twin is stored where, with its bits and fingerprint) does not "
                           "match the record's digest")
        if (problem := record_problem(record)) is not None:
            raise _corrupt(path, f"its record is damaged ({problem})")
        expected, check = (record.get("digests", {}), digest) if record["format"] == 2 else \
            (record.get("checksums", {}), checksum)
        bad = sorted(name for name in expected.keys() | tensors.keys()
                     if name not in tensors or expected.get(name) != check(tensors[name]))
        if bad:
            raise _corrupt(path, f"{len(bad)} stored tensors do not match their recorded {check.__name__}s "
                           f"({', '.join(bad[:3])}"
                           f"{', ...' if len(bad) > 3 else ''})")
        return cls(path, record, tensors)

    @classmethod
    def next_to(cls, checkpoint_files: list[str] | None) -> "StoredTwins | None":
        """The twins saved beside a checkpoint (the folder of its first weight file), or None when there are none."""
        if not checkpoint_files:
            return None
        path = os.path.join(os.path.dirname(str(checkpoint_files[0])), TWINS_FILE)
        return cls.read(path) if os.path.isfile(path) else None

    def twins(self, layers: list[nn.Module], quant_config, progress: bool = True) -> dict[int, nn.Module]:
        """{layer index: twin} for every river layer whose stored twin fits (packed for `quant_config.backend`);
        one TwinsMismatchWarning for the others, which the caller builds with HQQ."""
        built, reasons = {}, {}
        for idx in tqdm(range(quant_config.start_layer, len(layers)), desc="river: loading stored twins",
                        disable=not progress, leave=False):
            try:
                built[idx] = self._twin(layers[idx], idx, quant_config)
            except _Mismatch as mismatch:
                reasons.setdefault(str(mismatch), []).append(idx)
        if reasons:
            details = "; ".join(f"{_layer_list(indices)}: {reason}" for reason, indices in reasons.items())
            warnings.warn(f"river: the stored twins in {self.path} do not fit {details}. Those twins are rebuilt with "
                          f"HQQ (slow); save the river again (save_pretrained(..., save_twins=True)) to store them.",
                          TwinsMismatchWarning, stacklevel=3)
        return built

    def lm_head(self, head: nn.Linear, quant_config) -> RiverQuantLinear | None:
        """The stored quantized LM head when it fits `head` and the config; else None, with a warning."""
        stored = self.record.get("lm_head")
        try:
            if stored is None:
                raise _Mismatch("no quantized LM head is stored")
            _check_asked(stored, quant_config.lm_head_nbits, quant_config.lm_head_group_size, "lm_head_nbits")
            return self._linear(stored["linear"], head, quant_config)
        except _Mismatch as mismatch:
            warnings.warn(f"river: the stored twins in {self.path} do not fit the LM head: {mismatch}. It is "
                          f"quantized again with HQQ.", TwinsMismatchWarning, stacklevel=3)
            return None

    def _twin(self, layer: nn.Module, idx: int, quant_config) -> nn.Module:
        stored = self.record["layers"].get(str(idx))
        if stored is None:
            covered = sorted(map(int, self.record["layers"]))
            raise _Mismatch(f"no twin stored for these layers (stored: {_layer_list(covered)}; `start_layer` "
                            f"{self.record.get('config', {}).get('start_layer')} stored, {quant_config.start_layer} "
                            f"asked)")
        _check_asked(stored, quant_config.nbits_for(idx), quant_config.group_size_for(idx), "nbits")
        sources: list[nn.Linear] = []  # the linears make_twin would quantize, as it hands them over
        twin = make_twin(layer, lambda linear: sources.append(linear) or linear, quant_config.skip_modules,
                         quant_config.lora_twins)
        paths = {id(module): name for name, module in twin.named_modules()}
        # stored name -> (where the linear sits in the twin, the linear); an adapted linear's W is stored under the
        # adapted linear's name, its LoRA comes from the live adapter (river_hf.core.adapters.LoraOnQuantized)
        quantized = {stored_linear_name(twin, paths[id(linear)]): (paths[id(linear)], linear) for linear in sources}
        if quantized.keys() != stored["linears"].keys():
            raise _Mismatch(f"other linears are quantized (stored {sorted(stored['linears'])}, now "
                            f"{sorted(quantized)}): `skip_modules` differs")
        for name, (path, linear) in quantized.items():
            twin.set_submodule(path, self._linear(stored["linears"][name], linear, quant_config))
        return twin

    def _linear(self, entry: dict, source: nn.Linear, quant_config) -> RiverQuantLinear:
        """The stored twin of `source` (checked against its fingerprint), packed for the config's `backend` (and
        `activations`) on its device."""
        source_fingerprint = fingerprint(source)
        if source_fingerprint != entry["fingerprint"]:
            raise _Mismatch(f"the backbone weights differ from those the twins were made from (`{entry['key']}`: "
                            f"{_difference(entry['fingerprint'], source_fingerprint)})")
        key = entry["key"]
        codes = _unpack_codes(self.tensors[f"{key}.codes"], entry["packed"])
        bias = self.tensors.get(f"{key}.bias")
        linear = RiverQuantLinear.from_codes(codes, self.tensors[f"{key}.scale"], self.tensors[f"{key}.zero"],
                                             bias,
                                             nbits=entry["nbits"], group_size=entry["group_size"],
                                             backend=quant_config.backend, device=source.weight.device,
                                             activations=quant_config.activations)
        linear.source_fingerprint = source_fingerprint
        return linear


def read_stored_twins(stored_twins) -> StoredTwins | None:
    """None, a StoredTwins, or a path (a twins file or its folder) to read."""
    if stored_twins is None or isinstance(stored_twins, StoredTwins):
        return stored_twins
    return StoredTwins.read(stored_twins)


def _check_asked(stored: dict, nbits: int, group_size: int | None, bits_field: str) -> None:
    if stored["nbits"] != nbits:
        raise _Mismatch(f"`{bits_field}`: {stored['nbits']} stored, {nbits} asked")
    if stored["group_size"] != group_size:
        raise _Mismatch(f"`group_size`: {stored['group_size']} stored, {group_size} asked")


def _difference(stored: str, now: str) -> str:
    """What differs between two fingerprints, in words."""
    stored_dtype, stored_shape = stored.split(":")[:2]
    dtype, shape = now.split(":")[:2]
    if stored_shape != shape:
        return f"shape {stored_shape} stored, {shape} now"
    if stored_dtype != dtype:
        return f"dtype {stored_dtype} stored, {dtype} now"
    return "same shape and dtype, other values"


def _layer_list(indices: list[int]) -> str:
    """[1, 2, 3, 7] -> 'layers 1-3, 7'."""
    runs: list[list[int]] = []
    for idx in sorted(indices):
        if runs and runs[-1][1] == idx - 1:
            runs[-1][1] = idx
        else:
            runs.append([idx, idx])
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
    return ("layer " if len(indices) == 1 else "layers ") + text


def _corrupt(path: str, why: str) -> StoredTwinsError:
    return StoredTwinsError(f"The stored twins file {path} is unusable: {why}. Nothing was loaded from it. Save the "
                            f"river again (model.save_pretrained(folder, save_twins=True)), or delete the file to "
                            f"rebuild the twins with HQQ.")
