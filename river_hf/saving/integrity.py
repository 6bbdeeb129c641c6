"""What makes a twins file trustworthy: an exact, cheap identity of each stored tensor (`checksum`, and `digest`
for the weights twins were made from), a digest of the record that says which twin is stored where, and a check of
that record's structure. A file that fails any of them is refused (twin_files.StoredTwinsError), never half used.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from ..kernels.quantize import SUPPORTED_GROUP_SIZES, SUPPORTED_NBITS

_SAMPLE_STRIDE = 7919  # a prime: row i is sampled at column (i * 7919) mod K, so every row and column is reached
_INT_VIEWS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
ENTRY_FIELDS = {"key", "nbits", "group_size", "shape", "packed", "bias", "fingerprint"}


def digest(tensor: torch.Tensor) -> str:
    """A cheap, exact identity of a tensor: dtype, shape, its `checksum` and a hash of one element per row (a shuffle
    that keeps the sum does not keep the sample). One read of the tensor at memory speed."""
    data = tensor.detach()
    flat, raw = _bytes(data)
    rows = data.shape[0] if data.dim() > 1 else 1
    cols = max(flat.numel() // max(rows, 1), 1)
    row = np.arange(rows if flat.numel() else 0, dtype=np.int64)
    bits = raw.view(_INT_VIEWS[flat.element_size()]) if raw.numel() else raw
    sample = _elements(bits, row * cols + (row * _SAMPLE_STRIDE) % cols)
    sample_hash = hashlib.blake2b(sample.tobytes(), digest_size=8).hexdigest()
    return f"{str(data.dtype).removeprefix('torch.')}:{list(data.shape)}:{_checksum(raw)}:{sample_hash}"


def checksum(tensor: torch.Tensor) -> str:
    """The wrap-around sum of a tensor's bytes read as 64-bit words, and the byte sum of a tail shorter than 8 bytes
    (modular integer addition: the same on any device, thread count and summation order; any single changed element
    changes exactly one word, so the sum). What a stored tensor is checked against: it finds a damaged file, and
    costs a fraction of `digest` over the hundreds of tensors of a twins file."""
    return _checksum(_bytes(tensor.detach())[1])


def _bytes(data: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the tensor flattened, its bytes as uint8)."""
    flat = data.contiguous().reshape(-1)
    nbytes = flat.numel() * flat.element_size()
    return flat, flat.view(torch.uint8) if nbytes else flat.new_empty(0, dtype=torch.uint8)


def _checksum(raw: torch.Tensor) -> str:
    whole = raw.numel() // 8 * 8  # the tail (< 8 bytes) is summed byte by byte
    words = _word_sum(raw if whole == raw.numel() else raw[:whole])
    tail = int(raw[whole:].sum(dtype=torch.int64)) if whole < raw.numel() else 0
    return f"{words:016x}.{tail}"


def _word_sum(raw: torch.Tensor) -> int:
    """The sum mod 2^64 of `raw` (bytes, a multiple of 8) read as 64-bit words. numpy on CPU: torch's int64 sum
    takes ~8 ms for any tensor over ~1 MB on this project's CPU, numpy's uint64 sum runs at memory speed (and wraps
    the same way)."""
    if raw.device.type == "cpu":
        return int(raw.numpy().view(np.uint64).sum(dtype=np.uint64))
    return int(raw.view(torch.int64).sum()) % (1 << 64)


def _elements(bits: torch.Tensor, positions: np.ndarray) -> np.ndarray:
    """bits[positions] as a numpy array (indexed in numpy on CPU: a few small torch ops per tensor cost more than
    reading the tensor, over the hundreds of tensors of a load)."""
    if bits.device.type == "cpu":
        return bits.numpy()[positions]
    return bits[torch.from_numpy(positions).to(bits.device)].cpu().numpy()


def record_digest(text: str) -> str:
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def record_problem(record: dict) -> str | None:
    """What is wrong with a twins record's structure (every format), or None: each stored linear's entry has its
    fields, sits under the key of its own place (layers.{index}.{name}, lm_head), with bits and groups river_hf
    writes. Formats before 4 have no digest of the record: this still names the file instead of a KeyError."""
    layers, head = record.get("layers"), record.get("lm_head")
    if not isinstance(layers, dict) or head is not None and not isinstance(head, dict):
        return "no table of stored layers"
    entries = []
    for idx, layer in layers.items():
        if not (isinstance(idx, str) and idx.isdigit() and isinstance(layer, dict)
                and isinstance(layer.get("linears"), dict)):
            return f"layer entry {idx!r}"
        entries += [(f"layers.{idx}.{name}", entry) for name, entry in layer["linears"].items()]
    if head is not None:
        entries.append(("lm_head", head.get("linear")))
    for key, entry in entries:
        if not isinstance(entry, dict) or not ENTRY_FIELDS <= entry.keys() or entry["key"] != key:
            return f"the entry of `{key}`"
        if entry["nbits"] not in SUPPORTED_NBITS or entry["group_size"] not in SUPPORTED_GROUP_SIZES:
            return f"`{key}` stored with nbits={entry['nbits']!r}, group_size={entry['group_size']!r}"
    return None
