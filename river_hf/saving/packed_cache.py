"""The kernels' packed layout of a saved river's twins, kept per machine: a saved river's second load on a machine
maps its twins' packed buffers back from the cache folder instead of packing them from the stored codes.

Why a cache and not a file beside the checkpoint: the packed layout is not portable (the int4 CPU kernel's blocking
depends on the CPU's instruction set, 'fastest' picks kernels per machine), so the twins file keeps HQQ's codes and
each machine keeps its own packing, under `<cache folder>/packed_twins/`:
- `<key>.json`: the index (per stored linear: its kernel, bits, shape and each buffer's dtype, shape, offset and
  checksum; a stacked sibling (river_hf.kernels.shared_inputs): its stack and place in it, the stack kept once, so
  a load maps the stack and its members' views and stacks nothing again);
- `<key>-<nonce>.bin`: the buffers, each at a 64-byte aligned offset. It is memory-mapped copy-on-write
  (`torch.UntypedStorage.from_file`): nothing is read at load, pages come in as the twins first run, and the int8
  kernel gets the alignment it needs (it crashes on a weight that is not 16-byte aligned, torch 2.13).
`key` hashes the twins file's record digest (the record holds a checksum of every stored tensor: another file is
another key), the backend and activations asked, this machine's identity (CPU model and torch dispatch, torch
version, kernels installed: `kernels.machine.machine_identity`) and PACKED_VERSION. An entry is written by the load
that packed (index last, through a rename: a reader sees a whole entry or none) and is trusted by its index and the
size of its buffers file; `verify_twins="full"` checks every buffer against its checksum, and a damaged entry is
then packed again with a warning. The MAX_ENTRIES most recently used entries are kept. `RIVER_HF_CACHE=off`: no
cache, every load packs.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import secrets
import warnings

import torch

from ..cache_folder import cache_root, write_json_atomically
from ..kernels.machine import machine_identity
from ..kernels.quantize import RiverQuantLinear
from ..kernels.shared_inputs import stacked_members
from .integrity import checksum

PACKED_VERSION = 2  # bump when what a buffer means changes: older entries are then never read
SUBFOLDER = "packed_twins"
MAX_ENTRIES = 4  # saved rivers whose packing is kept (an 8B river's is a few GB)
_ALIGN = 64


def entry_key(record_digest: str, backend: str, activations: str | None) -> str:
    identity = {"version": PACKED_VERSION, "record": record_digest, "backend": backend, "activations": activations,
                **machine_identity(torch.device("cpu"))}
    return hashlib.blake2b(json.dumps(identity, sort_keys=True).encode(), digest_size=16).hexdigest()


def _folder() -> str | None:
    root = cache_root()
    return None if root is None else os.path.join(root, SUBFOLDER)


class PackedTwins:
    """One cache entry, mapped: the packed twin linears of one twins file on this machine, by stored key."""

    def __init__(self, index: dict, whole: torch.Tensor):
        self.index, self.whole = index, whole
        self._members: dict[str, tuple[list, set]] = {}  # stack name -> (its members, the indices handed out)

    def __contains__(self, key: str) -> bool:
        return key in self.index["linears"]

    def linear(self, key: str) -> RiverQuantLinear:
        """The twin linear stored under `key`, on CPU, its buffers views of the mapped file (a stacked sibling: of its
        stack's rows, the stack answering its calls)."""
        entry = self.index["linears"][key]
        if "stack" not in entry:
            return self._linear(entry)
        name, index = entry["stack"], entry["index"]
        members, handed = self._members.get(name, (None, set()))
        if members is None or index in handed:  # each member handed out once: another river gets modules of its own
            stack = self.index["stacks"][name]
            members, handed = stacked_members(self._linear(stack), stack["sizes"]), set()
            self._members[name] = (members, handed)
        handed.add(index)
        return members[index]

    def _linear(self, entry: dict) -> RiverQuantLinear:
        buffers = {name: self._tensor(spec) for name, spec in entry["buffers"].items()}
        bias = buffers.pop("bias", None)
        return RiverQuantLinear(entry["in_features"], entry["out_features"], entry["nbits"], entry["group_size"],
                                entry["backend"], buffers, bias)

    def _tensor(self, spec: list) -> torch.Tensor:
        dtype, shape, offset, nbytes = spec[:4]
        return self.whole[offset:offset + nbytes].view(getattr(torch, dtype)).view(shape)

    def damaged_buffers(self) -> list[str]:
        """The buffers whose bytes do not match their recorded checksum (reads the whole entry)."""
        entries = {**self.index["linears"], **self.index["stacks"]}
        return [f"{key}.{name}" for key, entry in entries.items()
                for name, spec in entry.get("buffers", {}).items() if checksum(self._tensor(spec)) != spec[4]]


def read_packed(key: str, verify: str) -> PackedTwins | None:
    """The cache entry `key`, or None (no cache folder, no entry, an unreadable or, with verify="full", damaged one:
    those are packed again)."""
    folder = _folder()
    if folder is None or not os.path.isfile(index_path := os.path.join(folder, f"{key}.json")):
        return None
    try:
        with open(index_path) as file:
            index = json.load(file)
        data_path = os.path.join(folder, index["data_file"])
        if index.get("version") != PACKED_VERSION or os.path.getsize(data_path) != index["data_bytes"]:
            return None
        storage = torch.UntypedStorage.from_file(data_path, shared=False, nbytes=index["data_bytes"])
    except (OSError, ValueError, KeyError, TypeError, RuntimeError):
        return None
    packed = PackedTwins(index, torch.empty(0, dtype=torch.uint8).set_(storage))
    if verify == "full" and (damaged := packed.damaged_buffers()):
        warnings.warn(f"river: the packed twins kept in {data_path} are damaged ({len(damaged)} buffers, e.g. "
                      f"{damaged[0]}); they are packed again from the twins file.", stacklevel=4)
        return None
    try:
        os.utime(index_path)  # most recently used: kept when older entries are dropped
    except OSError:
        pass  # a read-only cache folder still serves its entries
    return packed


def write_packed(key: str, linears: dict[str, RiverQuantLinear]) -> None:
    """Keep `linears` (CPU twin linears by stored key) as the cache entry `key`. A failure to write (disk full, no
    permission) only costs the next load its packing: it warns and returns."""
    folder = _folder()
    if folder is None or not linears:
        return
    data_name = f"{key}-{secrets.token_hex(4)}.bin"
    partial = os.path.join(folder, f".{data_name}.partial")
    try:
        os.makedirs(folder, exist_ok=True)
        index = {"version": PACKED_VERSION, "data_file": data_name, "linears": {}, "stacks": {}}
        stacks: dict[int, str] = {}  # id(StackedSiblings) -> its name in the index
        with open(partial, "wb") as file:
            for name, linear in linears.items():
                if linear.siblings is None:
                    index["linears"][name] = _write_linear(file, linear)
                    continue
                group = linear.siblings
                if id(group) not in stacks:
                    stacks[id(group)] = f"stack{len(stacks)}"
                    index["stacks"][stacks[id(group)]] = {**_write_linear(file, group.stacked), "sizes": group.sizes}
                index["linears"][name] = {"stack": stacks[id(group)], "index": linear.sibling_index}
            index["data_bytes"] = file.tell()
        os.replace(partial, os.path.join(folder, data_name))
        write_json_atomically(os.path.join(folder, f"{key}.json"), index)
        _drop_old_entries(folder)
    except OSError as error:
        warnings.warn(f"river: could not keep the packed twins in {folder} ({error}); the next load packs them "
                      f"again.", stacklevel=4)
    finally:
        if os.path.exists(partial):
            os.remove(partial)


def _write_linear(file, linear: RiverQuantLinear) -> dict:
    buffers = {}
    for name, tensor in linear._buffers.items():
        if tensor is None:
            continue
        tensor = tensor.detach().contiguous()
        file.write(bytes(-file.tell() % _ALIGN))  # pad: every buffer starts 64-byte aligned
        offset = file.tell()
        raw = tensor.reshape(-1).view(torch.uint8)
        file.write(raw.numpy().data)
        buffers[name] = [str(tensor.dtype).removeprefix("torch."), list(tensor.shape), offset, raw.numel(),
                         checksum(tensor)]
    return {"backend": linear.backend, "nbits": linear.nbits, "group_size": linear.group_size,
            "in_features": linear.in_features, "out_features": linear.out_features, "buffers": buffers}


def _drop_old_entries(folder: str) -> None:
    """Keep the MAX_ENTRIES most recently used entries, and no data file that no index names."""
    indexes = sorted(glob.glob(os.path.join(folder, "*.json")), key=_modified, reverse=True)
    for path in indexes[MAX_ENTRIES:]:
        _remove(path)
    named = set()
    for path in indexes[:MAX_ENTRIES]:
        try:
            with open(path) as file:
                named.add(json.load(file)["data_file"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
    for path in glob.glob(os.path.join(folder, "*.bin")):
        if os.path.basename(path) not in named:
            _remove(path)


def _modified(path: str) -> float:
    try:
        return os.path.getmtime(path)
    except OSError:  # removed by another process meanwhile
        return 0.0


def _remove(path: str) -> None:
    """Remove a file another process may have removed first (or, on Windows, still maps: kept, tried again later)."""
    try:
        os.remove(path)
    except OSError:
        pass
