"""Backbone passes whose every row is computed as a one-token decode step computes it (lossless mode's verification).

A pass over k + 1 tokens gives the same numbers as k + 1 one-token steps only up to rounding: kernels that see
several rows at once sum in another order. Measured on the project's AVX2 CPU with SmolLM2-135M: in bf16 the linears
are batch-invariant there (a 5-row matmul equals five 1-row ones bit for bit) but attention over 5 queries with a
causal mask is not; in fp32 neither is. A near-tie argmax then flips some tokens
later, so greedy lossless decoding drifted from the plain model's output (docs/lossless.md;
`benchmarks/scripts/verify_rows.py` measures it).

Inside `ExactRows(model).rows(k + 1)`:
- attention goes through an attention function registered with transformers' `AttentionInterface`
  ("river_rows_sdpa", "river_rows_eager", with the base implementation's mask function), which calls the model's own
  attention function once per query row, with the keys and mask a one-token step holds;
- every `nn.Linear` whose kernel is not batch-invariant at this shape (probed once per shape, dtype, device, row
  count and thread count) runs its rows one at a time.

Attention implementations other than sdpa and eager (flash, flex) are left as they are.
"""

from __future__ import annotations

import functools
import sys
from contextlib import contextmanager, nullcontext

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

PREFIX = "river_rows_"
BASES = ("sdpa", "eager")


def _base_attention(module: nn.Module, base: str):
    if base == "sdpa":
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
        return ALL_ATTENTION_FUNCTIONS["sdpa"]
    # eager attention is not in the registry: every HF modeling file defines its own `eager_attention_forward`
    return sys.modules[type(module).__module__].eager_attention_forward


def rowwise_attention(module, query, key, value, attention_mask, *, base: str, **kwargs):
    """The base attention once per query row: row r sees the keys up to its own position, from the first key its
    mask shows (a sliding-window layer's one-token step holds only its window), and the mask a one-token step would
    get (sdpa: none, unless a sliding window is full; eager: always its additive row)."""
    attend = _base_attention(module, base)
    rows, total = query.shape[2], key.shape[2]
    if rows == 1 and attention_mask is None:  # a one-token pass that sees every key: nothing to do
        return attend(module, query, key, value, None, **kwargs)
    outputs = []
    for row, (start, end, mask) in enumerate(_row_views(module, attention_mask, rows, total, base)):
        output, _ = attend(module, query[:, :, row:row + 1], key[:, :, start:end], value[:, :, start:end], mask,
                           **kwargs)
        outputs.append(output)
    return torch.cat(outputs, dim=1), None


def _row_views(module, attention_mask, rows: int, total: int, base: str) -> list[tuple]:
    """(first key, end, mask) per query row; row r's last key is the pass's key total - rows + r. The mask's
    visibility is read once for all rows (a few small ops per row would cost more than the attention itself)."""
    ends = [total - rows + row + 1 for row in range(rows)]
    if attention_mask is None:
        return [(0, end, None) for end in ends]
    rows_mask = attention_mask[..., -rows:, :total]
    visible = rows_mask if rows_mask.dtype == torch.bool else rows_mask == 0
    visible = visible.reshape(-1, rows, total).all(dim=0)  # batch 1: [rows, keys]
    window = getattr(module, "sliding_window", None)
    # a sliding-window layer's step holds its window, from the first visible key; a full layer every key
    starts = visible.int().argmax(dim=-1).tolist() if window else [0] * rows
    shown = visible.sum(dim=-1).tolist()  # keys a row sees: all of [start, end) exactly when it is end - start
    views = []
    for row, (start, end) in enumerate(zip(starts, ends)):
        # HF's sdpa mask is skipped for one query that sees every key, unless a sliding window is full; eager's never
        keep = base != "sdpa" or shown[row] != end - start or (window is not None and end - start >= window)
        views.append((start, end, rows_mask[..., row:row + 1, start:end] if keep else None))
    return views


@functools.cache
def register() -> None:
    """The row-wise attention functions and their masks, under PREFIX + base, once per process. Called by ExactRows,
    not at import: transformers' attention registry lives in modeling_utils, which `import river_hf` should not load
    (import river_hf 4.85 -> 4.59 s without it, Intel Xeon AVX512)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    for base in BASES:
        AttentionInterface.register(PREFIX + base, functools.partial(rowwise_attention, base=base))
        ALL_MASK_ATTENTION_FUNCTIONS.register(PREFIX + base, ALL_MASK_ATTENTION_FUNCTIONS[base])


_BATCH_INVARIANT: dict[tuple, bool] = {}
# Outputs a probe compares before it calls a kernel batch-invariant, and the most probes (random inputs) per shape. A
# kernel that sums in another order for several rows differs from one-row calls only where the fp32 difference moves
# a bf16 rounding: on an AMD EPYC with AVX-512-BF16 (no AMX), SmolLM2's 1536 -> 576 linear at 5 rows differed in ~1 of
# 8000 outputs, so one random input (2880 outputs) said "invariant" and greedy lossless decoding drifted
# (benchmarks/zen4.md#lossless-mode).
PROBE_OUTPUTS = 1 << 18
MAX_PROBES = 64


def probed_shapes() -> int:
    """How many (shape, dtype, device, bias, rows, threads) keys this process has probed."""
    return len(_BATCH_INVARIANT)


def forget_probes() -> None:
    """Drop this process's probe results: the next `batch_invariant` call at each key probes again."""
    _BATCH_INVARIANT.clear()


def batch_invariant(linear: nn.Linear, rows: int) -> bool:
    """Does `linear` give a `rows`-row input the same bits as `rows` one-row inputs on this machine? Probed once per
    shape, dtype, device, bias, row count and thread count (the kernel a matmul takes depends on these, not on the
    values) with random inputs until PROBE_OUTPUTS outputs were compared (at most MAX_PROBES inputs), or one
    differed."""
    weight = linear.weight
    key = (tuple(weight.shape), weight.dtype, weight.device, linear.bias is not None, rows, torch.get_num_threads())
    if key not in _BATCH_INVARIANT:
        generator = torch.Generator().manual_seed(0)
        probes = min(MAX_PROBES, -(-PROBE_OUTPUTS // (rows * weight.shape[0])))
        _BATCH_INVARIANT[key] = all(_rows_agree(linear, rows, generator) for _ in range(probes))
    return _BATCH_INVARIANT[key]


@torch.no_grad()
def _rows_agree(linear: nn.Linear, rows: int, generator: torch.Generator) -> bool:
    """One random `rows`-row input: the batched matmul equals the one-row matmuls bit for bit."""
    weight = linear.weight
    probe = torch.randn(1, rows, weight.shape[1], generator=generator).to(weight.device, weight.dtype)
    whole = F.linear(probe, weight, linear.bias)
    apart = torch.cat([F.linear(probe[:, r:r + 1], weight, linear.bias) for r in range(rows)], dim=1)
    return torch.equal(whole, apart)


def _rowwise_forward(forward):
    """`forward` (a linear's, hooks included) applied one row at a time along dim -2."""
    def rows_apart(x, *args, **kwargs):
        if x.dim() < 2 or x.shape[-2] == 1:
            return forward(x, *args, **kwargs)
        return torch.cat([forward(x[..., r:r + 1, :], *args, **kwargs) for r in range(x.shape[-2])], dim=-2)
    return rows_apart


class ExactRows:
    """A model's passes made row-exact: `with exact.rows(k + 1): model(...)` computes each of the pass's rows as a
    one-token step would. Built once per lossless call: it finds the attention configs and the linears once."""

    def __init__(self, model: nn.Module):
        register()
        self.configs = _attention_configs(model)
        self.linears = [m for m in model.modules() if isinstance(m, nn.Linear) and m.weight.is_floating_point()]
        self._apart: dict[int, list[nn.Linear]] = {}
        # a one-token pass differs from plain generate's step only where a sliding-window layer sees more keys
        self.one_row_differs = any(getattr(m, "sliding_window", None) for m in model.modules())

    def linears_apart(self, rows: int) -> list[nn.Linear]:
        """The linears whose kernel rounds a `rows`-row input differently from one row at a time."""
        if rows not in self._apart:
            self._apart[rows] = [m for m in self.linears if rows > 1 and not batch_invariant(m, rows)]
        return self._apart[rows]

    def rows(self, rows: int):
        return self._rows(rows) if rows > 1 or self.one_row_differs else nullcontext()

    @contextmanager
    def _rows(self, rows: int):
        before = [config._attn_implementation for config in self.configs]
        own_forward = [(m, m.__dict__.get("forward")) for m in self.linears_apart(rows)]  # accelerate hooks live there
        try:
            for config, implementation in zip(self.configs, before):
                config._attn_implementation = PREFIX + implementation
            for module, _ in own_forward:
                module.forward = _rowwise_forward(module.forward)
            yield
        finally:
            for config, implementation in zip(self.configs, before):
                config._attn_implementation = implementation
            for module, forward in own_forward:
                if forward is None:
                    del module.forward
                else:
                    module.forward = forward


def _attention_configs(model: nn.Module) -> list[PretrainedConfig]:
    """The configs whose attention implementation can be run row by row (sdpa, eager)."""
    configs = {id(m.config): m.config for m in model.modules() if isinstance(getattr(m, "config", None),
                                                                          PretrainedConfig)}
    return [c for c in configs.values() if c._attn_implementation in BASES]
