"""Reading a saved river's twins back: `StoredTwins` reads a twins file (river_hf.saving.twin_files), checks it,
and gives each river layer the stored twin that fits it, packed for the kernel the config asks for; a layer whose
twin does not fit is left to HQQ, with one `TwinsMismatchWarning` saying why.

What is checked, and when: the record (which twin is stored where, with its bits and fingerprints) at once, against
its digest; each stored tensor against its checksum when the tensors are first needed; each backbone weight against
the fingerprint of the weight its twin was made from, by sample (`verify_twins="sampled"`, the default) or whole
(`"full"`). The kernels' packed layout made at a load is kept per machine (river_hf.saving.packed_cache): the next
load on that machine maps it, and reads no stored tensor.
"""

from __future__ import annotations

import json
import os
import warnings

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file
from torch import nn
from tqdm.auto import tqdm

from ..core.adapters import stored_linear_name
from ..core.twins import make_twin
from ..kernels.quantize import RiverQuantLinear
from .integrity import checksum, digest, record_digest, record_problem, sampled_layout
from .packed_cache import entry_key, read_packed, write_packed
from .twin_files import (METADATA_KEY, READ_FORMATS, RECORD_DIGEST_KEY, TWINS_FILE, SourceFingerprint,
                         TwinsMismatchWarning, fingerprint, sampled_fingerprint, unpack_codes, unusable_file_error)


class _Mismatch(Exception):
    """One layer's stored twin does not fit; the message says why."""


class StoredTwins:
    """One twins file: its record, read and checked at once (`read`), and its stored tensors, read and checked
    against their checksums when first needed (`tensors`): a load whose packed twins this machine keeps
    (river_hf.saving.packed_cache) reads none of them."""

    def __init__(self, path: str, record: dict, record_key: str, tensors: dict[str, torch.Tensor] | None = None):
        self.path, self.record, self.record_key = path, record, record_key
        self._tensors = tensors
        self._packed: dict = {}  # (backend, activations) -> the cache entry read (or None)
        self._newly_packed: dict[tuple, dict[str, RiverQuantLinear]] = {}  # what this load packed, to keep
        self._placed: dict[str, tuple[nn.Module, str]] = {}  # stored key -> (twin, path): where it was put

    @classmethod
    def read(cls, path: str | os.PathLike, quant_config=None) -> "StoredTwins":
        """Read `path` (a twins file, or a folder holding one) and check its record; a `StoredTwinsError` naming the
        file when it is truncated, corrupted or not a river_hf twins file. Its stored tensors are read and checked
        now too, unless `quant_config` (the config the twins will be loaded for) finds them packed on this machine
        and does not ask for `verify_twins="full"`."""
        path = str(path)
        if os.path.isdir(path):
            path = os.path.join(path, TWINS_FILE)
        # from_pretrained reads the twins inside transformers' meta-device context (a torch function mode): every
        # small torch op of the 600+ checksums would go through it, ~0.1 s of a SmolLM2 load. Nothing here is a
        # tensor subclass or should land on the meta device, so the mode is set aside while reading.
        with torch._C.DisableTorchFunction():
            stored = cls._read_record(path)
            if quant_config is None or quant_config.verify_twins == "full" or not stored.all_packed(quant_config):
                stored.tensors  # noqa: B018 (reads and checks them)
        return stored

    @classmethod
    def _read_record(cls, path: str) -> "StoredTwins":
        try:
            with safe_open(path, framework="pt") as handle:
                metadata = handle.metadata() or {}
            text = metadata[METADATA_KEY]
            record = json.loads(text)
        except (SafetensorError, OSError, KeyError, ValueError) as error:
            raise unusable_file_error(path, f"it cannot be read as a river_hf twins file "
                           f"({type(error).__name__}: {error})")
        if not isinstance(record, dict) or record.get("format") not in READ_FORMATS:
            raise unusable_file_error(path, f"its format is "
                           f"{record.get('format') if isinstance(record, dict) else None!r}, "
                           f"this river_hf reads formats {', '.join(map(str, READ_FORMATS))}")
        if record["format"] >= 4 and metadata.get(RECORD_DIGEST_KEY) != record_digest(text):
            raise unusable_file_error(path, "its record (which twin is stored where, with its bits and fingerprint) "
                           "does not match the record's digest")
        if (problem := record_problem(record)) is not None:
            raise unusable_file_error(path, f"its record is damaged ({problem})")
        return cls(path, record, record_digest(text))

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        """The stored tensors (CPU), each checked against its recorded checksum (format 2: digest) on first use."""
        if self._tensors is None:
            with torch._C.DisableTorchFunction():
                self._tensors = self._checked_tensors()
        return self._tensors

    def _checked_tensors(self) -> dict[str, torch.Tensor]:
        try:
            tensors = load_file(self.path)
        except (SafetensorError, OSError, ValueError) as error:
            raise unusable_file_error(self.path, f"its tensors cannot be read ({type(error).__name__}: {error})")
        expected, check = (self.record.get("digests", {}), digest) if self.record["format"] == 2 else \
            (self.record.get("checksums", {}), checksum)
        bad = sorted(name for name in expected.keys() | tensors.keys()
                     if name not in tensors or expected.get(name) != check(tensors[name]))
        if bad:
            raise unusable_file_error(self.path, f"{len(bad)} stored tensors do not match "
                           f"their recorded {check.__name__}s "
                           f"({', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''})")
        return tensors

    def packed(self, quant_config, activations: str | None):
        """This machine's packed layout of these twins for the config's backend and `activations` (the twins' or the
        LM head's) (packed_cache.PackedTwins), or None."""
        asked = (quant_config.backend, activations)
        if asked not in self._packed:
            self._packed[asked] = read_packed(entry_key(self.record_key, *asked), quant_config.verify_twins)
        return self._packed[asked]

    def all_packed(self, quant_config) -> bool:
        """Whether this machine keeps the twins (and an LM head's activations, where they differ) packed for the
        config."""
        asked = {quant_config.activations}
        if quant_config.quantize_lm_head:
            asked.add(quant_config.head_activations)
        return all(self.packed(quant_config, activations) is not None for activations in asked)

    def keep_packed(self) -> None:
        """Keep what this load packed for the CPU (with what it found kept) for the next load on this machine."""
        for asked, linears in self._newly_packed.items():
            kept = self._packed.get(asked)
            found = {} if kept is None else {key: kept.linear(key) for key in kept.index["linears"]}
            write_packed(entry_key(self.record_key, *asked),
                         {**found, **{key: self._now(key, linear) for key, linear in linears.items()}})
        self._newly_packed.clear()
        self._placed.clear()

    def _now(self, key: str, packed: RiverQuantLinear) -> RiverQuantLinear:
        """What stands where the linear packed for `key` was put: the build may since have stacked it with its
        siblings (river_hf.kernels.shared_inputs), and the stack is what the next load should map."""
        twin, path = self._placed.get(key, (None, None))
        now = None if twin is None else twin.get_submodule(path)
        return now if isinstance(now, RiverQuantLinear) else packed

    @classmethod
    def next_to(cls, checkpoint_files: list[str] | None, quant_config=None) -> "StoredTwins | None":
        """The twins saved beside a checkpoint (the folder of its first weight file), or None when there are none."""
        if not checkpoint_files:
            return None
        path = os.path.join(os.path.dirname(str(checkpoint_files[0])), TWINS_FILE)
        return cls.read(path, quant_config) if os.path.isfile(path) else None

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
                          f"HQQ at every load (slow); save the river again (save_pretrained(..., save_twins=True)) to "
                          f"store them.", TwinsMismatchWarning, stacklevel=3)
        return built

    def lm_head(self, head: nn.Linear, quant_config) -> RiverQuantLinear | None:
        """The stored quantized LM head when it fits `head` and the config; else None, with a warning."""
        stored = self.record.get("lm_head")
        try:
            if stored is None:
                raise _Mismatch("no quantized LM head is stored")
            _check_asked(stored, quant_config.head_nbits, quant_config.lm_head_group_size, "lm_head_nbits")
            return self._linear(stored["linear"], head, quant_config, quant_config.head_activations)
        except _Mismatch as mismatch:
            warnings.warn(f"river: the stored twins in {self.path} do not fit the LM head: {mismatch}. It is "
                          f"quantized again with HQQ at every load (slow); save the river again "
                          f"(save_pretrained(..., save_twins=True)) to store it.", TwinsMismatchWarning, stacklevel=3)
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
            twin.set_submodule(path, self._linear(stored["linears"][name], linear, quant_config,
                                                  quant_config.activations))
            self._placed[stored["linears"][name]["key"]] = (twin, path)
        return twin

    def _linear(self, entry: dict, source: nn.Linear, quant_config, activations: str | None) -> RiverQuantLinear:
        """The stored twin of `source` (checked against its fingerprint), packed for the config's `backend` and
        `activations` (the twins' or the LM head's) on its device: mapped from this machine's packed twins when they
        hold it, else packed from the stored codes."""
        source_fingerprint = self._checked_source(entry, source, quant_config.verify_twins)
        key, device = entry["key"], source.weight.device
        packed = self.packed(quant_config, activations) if device.type == "cpu" else None
        if packed is not None and key in packed:
            linear = packed.linear(key)
        else:
            codes = unpack_codes(self.tensors[f"{key}.codes"], entry["packed"])
            linear = RiverQuantLinear.from_codes(codes, self.tensors[f"{key}.scale"], self.tensors[f"{key}.zero"],
                                                 self.tensors.get(f"{key}.bias"), nbits=entry["nbits"],
                                                 group_size=entry["group_size"], backend=quant_config.backend,
                                                 device=device, activations=activations)
            if device.type == "cpu":
                self._newly_packed.setdefault((quant_config.backend, activations), {})[key] = linear
        linear.source_fingerprint = source_fingerprint
        return linear

    @staticmethod
    def _checked_source(entry: dict, source: nn.Linear, verify: str) -> SourceFingerprint:
        """`source`'s fingerprint, after checking it against the entry's: the sampled one, read with the layout it was
        stored with, unless `verify` is "full", or the file (format < 5) has none, or its layout is not one river_hf
        writes (then the whole digest decides). _Mismatch when it differs."""
        stored = entry.get("sampled_fingerprint")
        layout = sampled_layout(stored) if verify != "full" and isinstance(stored, str) else None
        if layout is None:
            now = fingerprint(source)
            stored, seen = entry["fingerprint"], now.full
        else:
            seen = sampled_fingerprint(source, layout)
            now = SourceFingerprint(entry["fingerprint"], seen)  # its full digest, as the sample vouches for it
        if seen != stored:
            raise _Mismatch(f"the backbone weights differ from those the twins were made from (`{entry['key']}`: "
                            f"{_difference(stored, seen)})")
        return now


def read_stored_twins(stored_twins, quant_config=None) -> StoredTwins | None:
    """None, a StoredTwins, or a path (a twins file or its folder) to read for `quant_config`."""
    if stored_twins is None or isinstance(stored_twins, StoredTwins):
        return stored_twins
    return StoredTwins.read(stored_twins, quant_config)


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
