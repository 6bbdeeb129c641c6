"""`RiverCache` / `RiverStaticCache`: the KV slots (HF's `DynamicCache` / `StaticCache`) plus the per-position exit
record (`ExitRecord`, one implementation shared by both), and `RiverRun`: what one generate call decided before its
first step (the exit router, the KV strategy, whether to profile), handed to the cache when the call starts.

Backbone layer l and its twin share cache slot l, so every layer writes K/V for every position whatever the exit
pattern: the cache stays complete. The exit record says, per position, how many backbone layers ran
(`num_layers` when it never exited). It follows every batch operation the cache gets (beam reordering,
repeat/select, crop), so `exit_depth[b, t]` always describes the K/V at `[b, :, t]`.
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager

import torch
from transformers import DynamicCache, StaticCache

from .exit_decision import ExitRouter
from .kv_strategies import KVStrategy


class KVIntegrityError(AssertionError):
    """A layer of the cache is missing positions: early exit left a hole ("KV cache absence")."""


@dataclasses.dataclass(frozen=True)
class RiverRun:
    """One river call's decisions, made once before its first step (`core.generation.new_river_cache`) and read by
    every layer through the cache: `router` decides each step's exit depth (None: every layer runs its backbone
    layer, a plain pass), `strategy` what a skipped layer does, `profile` whether layers add their wall time to the
    cache's `seconds` (a clock read per layer, decode steps only)."""

    router: ExitRouter | None = None
    strategy: KVStrategy | None = None
    profile: bool = False


class ExitRecord:
    """What makes a HF cache a river's: the call's `RiverRun` and each position's exit depth.

    Mixed in front of a HF cache class (`RiverCache`, `RiverStaticCache`); `_init_exit_record` sets it up."""

    def _init_exit_record(self, run: RiverRun | None, num_layers: int | None, profile: bool) -> None:
        self.run = run if run is not None else RiverRun(profile=profile)
        router = self.run.router
        self.num_layers = num_layers if num_layers is not None else getattr(router, "num_layers", None)
        self._depth_chunks: list[torch.Tensor] = []  # each [B, T_step]; concatenated lazily
        self._recorded = 0  # their total length: read by every layer of every step, so kept, not summed
        self.prompt_length = 0  # positions written by the first (prefill) step
        self.seconds: dict[str, float] = {"backbone": 0.0, "skipped": 0.0}
        # A captured decode step's exit depth, fixed before the step starts (river_hf.core.captured_decode); None in
        # eager steps. The RiverLayers read it inside the compiled graph, where dynamo specialises on it: one graph per
        # depth.
        self.planned_depth: int | None = None
        # position -> seconds of each captured decode step that compiled its graph first (its depth's first step):
        # a step's speed without compilation leaves them out (the CLI's summary line)
        self.compiling_steps: dict[int, float] = {}

    def start_run(self, run: RiverRun) -> None:
        """Hand this cache the run of the call about to use it (a cache the caller or transformers made); a cache
        made to profile (`RiverCache(profile=True)`) keeps profiling."""
        self.run = dataclasses.replace(run, profile=run.profile or self.run.profile)
        self.num_layers = run.router.num_layers

    @contextmanager
    def backbone_pass(self):
        """Inside the block, passes over this cache are plain backbone passes (no router): lossless verification."""
        run = self.run
        self.run = dataclasses.replace(run, router=None)
        try:
            yield
        finally:
            self.run = run

    @property
    def router(self) -> ExitRouter | None:
        return self.run.router

    @property
    def strategy(self) -> KVStrategy | None:
        return self.run.strategy

    @property
    def profile(self) -> bool:
        return self.run.profile

    def add_time(self, part: str, seconds: float) -> None:
        """Wall time of one layer call, by part: "backbone" (incl. recompute's catch-up) or "skipped" (twin/K-V)."""
        self.seconds[part] = self.seconds.get(part, 0.0) + seconds

    # ---- the exit record -------------------------------------------------------------------------------------
    def record_step(self, depth: int, batch_size: int, num_tokens: int, device: torch.device) -> None:
        """Record that the `num_tokens` new positions of every row ran `depth` backbone layers."""
        if not self._depth_chunks:
            self.prompt_length = num_tokens
        self._depth_chunks.append(torch.full((batch_size, num_tokens), depth, dtype=torch.long, device=device))
        self._recorded += num_tokens

    @property
    def exit_depth(self) -> torch.Tensor:
        """LongTensor [batch, seq_len]: backbone layers each cached position ran (== num_layers: never exited)."""
        if not self._depth_chunks:
            return torch.zeros(0, 0, dtype=torch.long)
        if len(self._depth_chunks) > 1:
            self._depth_chunks = [torch.cat(self._depth_chunks, dim=1)]
        return self._depth_chunks[0]

    @property
    def recorded_length(self) -> int:
        return self._recorded

    def mean_exit_depth(self, decoded_only: bool = True) -> float:
        """Mean backbone depth over the decoded positions (or all positions). NaN when there are none."""
        depth = self.exit_depth
        if decoded_only:
            depth = depth[:, self.prompt_length:]
        return depth.float().mean().item() if depth.numel() else float("nan")

    def exit_share(self, decoded_only: bool = True) -> float:
        """Share of (decoded) positions that left the backbone before its last layer."""
        depth = self.exit_depth
        if decoded_only:
            depth = depth[:, self.prompt_length:]
        return (depth < self.num_layers).float().mean().item() if depth.numel() else float("nan")

    # ---- KV integrity ----------------------------------------------------------------------------------------
    def kv_integrity_errors(self) -> list[str]:
        """Every layer must hold K/V for every recorded position; returns what is wrong (empty when all is well)."""
        errors = []
        if self.num_layers is not None and len(self.layers) != self.num_layers:
            errors.append(f"cache has {len(self.layers)} layers, model has {self.num_layers}")
        for idx, layer in enumerate(self.layers):
            errors.extend(_layer_errors(idx, layer, self.expected_positions(idx), self.exit_depth.shape[0]))
        return errors

    def expected_positions(self, layer_idx: int) -> int:
        """Positions layer `layer_idx` must hold: all of them, except what the KV strategy leaves out by design
        (mono_decreasing: positions that exited before it; recompute: tokens still waiting to run it)."""
        if self.strategy is None:
            return self.recorded_length
        return self.strategy.expected_positions(layer_idx, self)

    def flush_pending(self) -> None:
        """Complete the K/V that the strategy left for later (recompute's waiting tokens); a no-op for the others."""
        flush = getattr(self.strategy, "flush", None)
        if flush is not None:
            flush(self)

    def check_kv_integrity(self) -> None:
        """Raise `KVIntegrityError` naming each layer that is missing positions."""
        errors = self.kv_integrity_errors()
        if errors:
            raise KVIntegrityError("KV cache is incomplete: " + "; ".join(errors))

    # ---- batch operations follow into the exit record ---------------------------------------------------------
    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        self._map_record(lambda depth: depth.index_select(0, beam_idx.to(depth.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        self._map_record(lambda depth: depth.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        self._map_record(lambda depth: depth[indices])

    def crop(self, tokens_to_remove: int) -> None:
        super().crop(tokens_to_remove)  # transformers only takes tokens_to_remove <= 0
        keep = self.recorded_length + min(tokens_to_remove, 0)
        self._map_record(lambda depth: depth[:, :keep])

    def reset(self) -> None:
        super().reset()
        self._depth_chunks = []
        self._recorded = 0
        self.prompt_length = 0

    def _map_record(self, fn) -> None:
        if self.strategy is not None:
            self.strategy.before_batch_change()
        if self._depth_chunks:
            self._depth_chunks = [fn(self.exit_depth)]
            self._recorded = self._depth_chunks[0].shape[1]


class RiverCache(ExitRecord, DynamicCache):
    """A `DynamicCache` that carries the exit router of one `generate` call and records each position's exit depth."""

    def __init__(self, config=None, run: RiverRun | None = None, num_layers: int | None = None,
                 profile: bool = False, **kwargs):
        super().__init__(config=config, **kwargs)
        self._init_exit_record(run, num_layers, profile)


class RiverStaticCache(ExitRecord, StaticCache):
    """A `StaticCache` (preallocated K/V of `max_cache_len` positions, what `torch.compile` and CUDA graphs need) with
    the exit record. `generate(..., cache_implementation="static")` on a river makes one (sized by transformers);
    backbone layer l and its twin write slot l at the same running position, so the slots stay aligned."""

    def __init__(self, config, max_cache_len: int, run: RiverRun | None = None, num_layers: int | None = None,
                 profile: bool = False, **kwargs):
        super().__init__(config=config, max_cache_len=max_cache_len, **kwargs)
        self._init_exit_record(run, num_layers, profile)
        self.max_cache_len = max_cache_len


def _layer_errors(idx: int, layer, expected: int, batch_size: int) -> list[str]:
    if not getattr(layer, "is_initialized", False):
        return [f"layer {idx} was never written"] if expected else []
    errors = []
    seen = int(layer.get_seq_length())  # sliding layers report every position seen, not only the window kept
    if seen != expected:
        errors.append(f"layer {idx} holds {seen} positions, expected {expected}")
    sliding = getattr(layer, "is_sliding", False)
    kept = min(expected, layer.get_max_length()) if sliding else expected
    # A static layer is preallocated and writes each update at its own running count (`get_seq_length`, checked
    # above), so a layer that skipped a step holds fewer positions; what it holds sits in its first slots.
    static = getattr(layer, "is_compileable", False)
    for name in ("keys", "values"):
        tensor = getattr(layer, name)
        if static and tensor.shape[-2] < kept:
            errors.append(f"layer {idx} {name} has {tensor.shape[-2]} slots, expected at least {kept}")
        elif static:
            tensor = tensor[:, :, :kept]
        elif tensor.shape[-2] < kept - 1 or (not sliding and tensor.shape[-2] != kept):
            errors.append(f"layer {idx} {name} has {tensor.shape[-2]} positions, expected {kept}")
        if tensor.shape[0] != batch_size:
            errors.append(f"layer {idx} {name} has batch {tensor.shape[0]}, exit record has {batch_size}")
        if not torch.isfinite(tensor).all():
            errors.append(f"layer {idx} {name} holds non-finite values")
    return errors
