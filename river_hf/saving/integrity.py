"""What makes a twins file trustworthy: an exact, cheap identity of each stored tensor (`checksum`, and `digest`
for the weights twins were made from), a digest of the record that says which twin is stored where, and a check of
that record's structure. A file that fails any of them is refused (twin_files.StoredTwinsError), never half used.
`sampled_digest` is the identity a load checks backbone weights with by default: a fixed, strided sample of their
bytes (the odds of a missed change are in docs/saved-rivers.md).
"""

from __future__ import annotations

import functools
import hashlib
import re

import numpy as np
import torch

from ..kernels.quantize import SUPPORTED_GROUP_SIZES, SUPPORTED_NBITS

_SAMPLE_STRIDE = 7919  # a prime: row i is sampled at column (i * 7919) mod K, so every row and column is reached
# sampled_digest reads this many runs of this many bytes per tensor (all of a smaller one): 128 KiB, a handful of
# pages, wherever the tensor is large. Runs of several pages, not scattered elements: a plain load maps the checkpoint
# and touches nothing, and each page first read costs a fault, so the pages read and the faults taken are the cost
# (8 runs of 16 KiB read the same bytes as 32 of 4 KiB in half the time: 20 vs 42 ms over the 1B shape's 113
# weights in a fresh process, benchmarks/README.md). The layout is written into the digest ("sampled8x16384"), so
# a file keeps verifying when it changes; format-5 files written before it say "sampled", which meant 32 x 4 KiB.
SAMPLED_LAYOUT = (8, 16384)
_FIRST_SAMPLED_LAYOUT = (32, 4096)
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


def sampled_digest(tensor: torch.Tensor, layout: tuple[int, int] = SAMPLED_LAYOUT) -> str:
    """dtype, shape and a position-weighted word sum of each of `layout` = (runs, run bytes) runs at evenly spaced
    offsets (the same offsets for the same shape and dtype; the first run at the start, the last at the end), or of
    every byte of a tensor no larger than that. Reads 128 KiB of any tensor: it tells another checkpoint, a
    fine-tuned or a merged weight from the one a twin was made from, and any change inside the sample, but not a lone
    element changed outside it (`digest` reads every byte). A changed word in a run always changes that run's sum:
    each word is multiplied by its own odd weight, which is invertible modulo 2^64."""
    run_count, run_size = layout
    data = tensor.detach()
    _, raw = _bytes(data)
    size = raw.numel()
    if size <= run_count * run_size:
        starts, run_bytes = [0], size // 8 * 8
    else:
        step = (size - run_size) // (run_count - 1) // 8 * 8
        starts, run_bytes = [index * step for index in range(run_count)], run_size
    sample = raw[:starts[-1] + run_bytes] if raw.device.type == "cpu" else \
        torch.cat([raw[start:start + run_bytes] for start in starts]).cpu()
    words = sample.numpy().view(np.uint64) if run_bytes else np.zeros(0, dtype=np.uint64)
    if raw.device.type == "cpu" and len(starts) > 1:  # the runs as rows of a view of the tensor's words: no copy
        runs = np.lib.stride_tricks.as_strided(words, (len(starts), run_bytes // 8), (starts[1], 8), writeable=False)
    else:
        runs = words.reshape(len(starts), run_bytes // 8)
    sums = (runs * _word_weights(run_bytes // 8)).sum(axis=1, dtype=np.uint64)
    tail = raw[size // 8 * 8:].cpu().numpy().tobytes() if size <= run_count * run_size else b""
    sample_hash = hashlib.blake2b(sums.tobytes() + tail, digest_size=8).hexdigest()
    tag = "sampled" if layout == _FIRST_SAMPLED_LAYOUT else f"sampled{run_count}x{run_size}"
    return f"{str(data.dtype).removeprefix('torch.')}:{list(data.shape)}:{tag}:{size}:{sample_hash}"


def sampled_layout(sampled: str) -> tuple[int, int] | None:
    """The (runs, run bytes) a stored sampled digest (or fingerprint: digests joined by "|") was taken with, or None
    when it is not one."""
    fields = sampled.split("|")[0].split(":")
    tag = fields[2] if len(fields) == 5 else ""
    if tag == "sampled":
        return _FIRST_SAMPLED_LAYOUT
    match = re.fullmatch(r"sampled(\d{1,3})x(\d{1,9})", tag)
    if match is None or int(match[1]) < 2 or int(match[2]) % 8:
        return None
    return int(match[1]), int(match[2])


@functools.lru_cache(maxsize=8)
def _word_weights(count: int) -> np.ndarray:
    """`count` distinct odd 64-bit weights (odd: multiplying by one is a bijection modulo 2^64)."""
    with np.errstate(over="ignore"):
        return (np.arange(count, dtype=np.uint64) * np.uint64(2) + np.uint64(1)) * np.uint64(0x9E3779B97F4A7C15)


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
    fields = ENTRY_FIELDS | ({"sampled_fingerprint"} if record.get("format", 0) >= 5 else set())
    for key, entry in entries:
        if not isinstance(entry, dict) or not fields <= entry.keys() or entry["key"] != key:
            return f"the entry of `{key}`"
        if entry["nbits"] not in SUPPORTED_NBITS or entry["group_size"] not in SUPPORTED_GROUP_SIZES:
            return f"`{key}` stored with nbits={entry['nbits']!r}, group_size={entry['group_size']!r}"
    return None
