"""The exit decision: signal, policy, prefill vs decode. Pure tensor logic, unit-testable without a model.

One `ExitRouter` lives in a `RiverCache` for the length of one `generate` call. Each forward pass is a *step*:
the first decoder layer opens it (`begin_step`), every backbone layer reports its input and output hidden states
(`observe`), and once the router says `exited`, the remaining layers run on their twins. The step's exit depth
(how many backbone layers ran) is what the cache records for the step's positions.

- decode steps (one new token per row) use the paper's token-level exit: by default s = cos(h_in, h_out) of the
  last layer, and with `exit_policy="batch_min"` the whole batch exits once min over the batch of s > tau;
- prefill steps (several tokens per row) use a sequence-level exit: one switch layer for all prompt tokens,
  chosen from each row's mean similarity over its real (unpadded) tokens, again taking the batch minimum;
  or a fixed layer (`prefill_exit=int`), or none (`prefill_exit="none"`).

What decides is the router's `signal` (`exit_signal`: "cosine", "cosine_first", "update_norm", "confidence",
"random", or any registered one; see `river_hf.core.signals`). The router keeps the rules every signal obeys: no exit
before `min_depth` backbone layers nor at the last layer, a forced exit at `depth_cap`, and the fixed prefill exits.
"""

from __future__ import annotations

import torch

from .settings import RiverSettings
from .signals import ExitSignal, make_signal


class ExitRouter:
    """Decides, layer by layer, when the current step leaves the backbone for the twins."""

    def __init__(self, settings: RiverSettings, start_layer: int, num_layers: int):
        self.settings = settings
        self.start_layer = start_layer
        self.num_layers = num_layers
        self.prompt_mask: torch.Tensor | None = None  # [B, T] attention mask of the prompt, for sequence exits
        self.exited = False
        self.depth = num_layers
        # no exit before this many backbone layers (a KV strategy may raise it; the signal reads it at begin_step)
        self.min_depth = start_layer
        self.depth_cap: int | None = None  # exit no deeper than this (set per step by "mono_decreasing")
        self._sequence_level = False
        self.signal: ExitSignal = make_signal(settings, num_layers)  # what decides, inside the rules above

    def begin_step(self, num_new_tokens: int, is_first_step: bool) -> None:
        """Open a forward pass. Several new tokens per row (or the first pass) is a prefill: sequence-level exit."""
        self._sequence_level = is_first_step or num_new_tokens > 1
        self.exited = False
        self.depth = self.num_layers
        self.depth_cap = None
        self.signal.begin_step(self._sequence_level, self.min_depth)

    def plan_step(self, num_new_tokens: int, is_first_step: bool) -> int | None:
        """Open a decode step whose path is fixed before it runs: returns its exit depth (`num_layers`: backbone
        throughout) when the signal knows it now (`ExitSignal.planned_depth`), else None (the step must run layer by
        layer, observing). A prefill is never planned."""
        self.begin_step(num_new_tokens, is_first_step)
        if self._sequence_level:
            return None
        depth = self.signal.planned_depth(self.min_depth, self.num_layers)
        if depth is not None and self.min_depth <= depth < self.num_layers:
            self._exit_at(depth)
        return None if depth is None else self.depth

    @property
    def is_prefill(self) -> bool:
        return self._sequence_level

    def observe(self, layer_idx: int, h_in: torch.Tensor, h_out: torch.Tensor) -> None:
        """Called after backbone layer `layer_idx` ran. May switch the rest of the step onto the twins."""
        depth = layer_idx + 1  # backbone layers run so far
        if self.exited or not self.min_depth <= depth < self.num_layers:
            return
        if (self.depth_cap is not None and depth >= self.depth_cap) or self._should_exit(depth, h_in, h_out):
            self._exit_at(depth)

    def _should_exit(self, depth: int, h_in: torch.Tensor, h_out: torch.Tensor) -> bool:
        fixed = self._fixed_prefill_depth()
        if fixed is not None:
            return depth >= fixed
        return self.signal.decide(depth, h_in, h_out, self._mask_for(h_in) if self._sequence_level else None)

    def _fixed_prefill_depth(self) -> int | None:
        """The exit depth a prefill step is told to use, or None when the signal decides."""
        if not self._sequence_level:
            return None
        prefill_exit = self.settings.prefill_exit
        if prefill_exit == "none":
            return self.num_layers
        if isinstance(prefill_exit, int):
            return max(prefill_exit, self.start_layer)
        return None  # "sequence": decided by the signal

    def _mask_for(self, h_in: torch.Tensor) -> torch.Tensor | None:
        """The prompt mask, aligned with this step's rows and positions (beam search repeats each row)."""
        mask = self.prompt_mask
        if mask is None or mask.shape[-1] != h_in.shape[1]:
            return None
        if mask.shape[0] != h_in.shape[0]:
            mask = mask.repeat_interleave(h_in.shape[0] // mask.shape[0], dim=0)
        return mask.to(h_in.device)

    def _exit_at(self, depth: int) -> None:
        self.exited = True
        self.depth = depth
