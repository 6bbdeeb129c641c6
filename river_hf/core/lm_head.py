"""`RiverLMHead`: the LM head of a river model, with a quantized copy for the steps that left the backbone.

With `RiverQuantConfig(quantize_lm_head=True)`, `build_river` replaces the model's output embedding (`lm_head`) by a
`RiverLMHead` holding the original head, untouched, and a `RiverQuantLinear` copy of it. Per forward pass it uses:
- the quantized head when the pass is a river step that exited (its router's `exited`): the token already ran
  its last layers on the twins, so its logits come from the cheap head too, except the few it ranks highest
  (`lm_head_exact_top_k`, 64 by default), which the original head's rows recompute: the quantized head's rounding
  (4 bits by default, `lm_head_nbits="auto"`) then cannot change a greedy token the original head would have picked
  from the same hidden state unless it ranks that token below its top k, for k rows read;
- the original head, exactly, otherwise: steps that never exited (so tau > 1 still equals the backbone token for
  token), plain `generate` and plain forward calls.

The original head module is kept as is: a head tied to the input embeddings stays tied (the wrapper reads and writes
`weight` through to it), `remove_river` puts the same object back, and `original_lm_head(model)` swaps it back for
the length of a block (for `save_pretrained`, which then writes exactly the backbone's checkpoint).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from .architectures import output_embedding
from .current_pass import active_router
from ..kernels.quantize import RiverQuantLinear

# What transformers' tie_weights sets on an output embedding; it belongs on the original head.
_DELEGATED = ("weight", "bias", "in_features", "out_features")


class RiverLMHead(nn.Module):
    """Dispatches the LM head to the original head or its quantized copy, as the pass's `ExitRouter` decided (the
    pass running in this thread: `river_hf.core.current_pass.active_router`)."""

    def __init__(self, base_head: nn.Module, quantized_head: nn.Module, exact_top_k: int = 0):
        super().__init__()
        self.base_head = base_head
        self.quantized_head = quantized_head
        self.exact_top_k = exact_top_k  # RiverQuantConfig.lm_head_exact_top_k: 0 keeps the quantized logits as they are
        # A captured step cannot read the context variable of the pass (dynamo does not trace ContextVar.get): its
        # runner (river_hf.core.captured_decode) sets this flag for the step's length, under its lock, so captured steps
        # of two threads take turns.
        self.captured_exit = False

    @classmethod
    def from_head(cls, head: nn.Module, nbits: int = 8, group_size: int | None = None, axis: int = 1,
                  backend: str = "auto", activations: str | None = None, exact_top_k: int = 0) -> "RiverLMHead":
        """Quantize `head` (an nn.Linear, [vocab, hidden]; left untouched) with `RiverQuantLinear.from_linear`."""
        if not isinstance(head, nn.Linear):
            raise ValueError(f"`quantize_lm_head`: the model's output embedding must be an nn.Linear to quantize; "
                             f"got {type(head).__name__}.")
        quantized = RiverQuantLinear.from_linear(head, nbits=nbits, group_size=group_size, axis=axis, backend=backend,
                                                 activations=activations)
        return cls(head, quantized, exact_top_k)

    def uses_quantized_head(self) -> bool:
        """True while the pass running now is a river step that left the backbone."""
        # traced: a constant of the captured graph (set by river_hf.core.captured_decode)
        if torch.compiler.is_compiling():
            return self.captured_exit
        router = active_router()
        return router is not None and router.exited

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:  # hidden_states: [..., H] -> logits [..., V]
        return self.exited_logits(hidden_states) if self.uses_quantized_head() else self.base_head(hidden_states)

    def exited_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The logits of a step that exited: the quantized head's, with their `exact_top_k` highest entries
        recomputed from the original head's rows (k x hidden weights read, against vocab x hidden for the whole
        head), and the others kept below the lowest recomputed one (the quantized head ranked them lower), so the
        greedy token is the original head's whenever the quantized head ranks it among its top k."""
        logits = self.quantized_head(hidden_states)
        if not self.exact_top_k:
            return logits
        top = logits.topk(min(self.exact_top_k, logits.shape[-1]), dim=-1).indices  # [..., k]
        rows = self.base_head.weight[top]                                              # [..., k, H]
        hidden = hidden_states.to(rows.device, rows.dtype).unsqueeze(-1)               # [..., H, 1]
        exact = torch.matmul(rows, hidden).squeeze(-1)                                 # [..., k]
        if self.base_head.bias is not None:
            exact = exact + self.base_head.bias[top]
        exact = exact.to(logits.device, logits.dtype)
        lowest = exact.min(dim=-1, keepdim=True).values
        # Strictly below (argmax breaks ties by index), so a rounding of the quantized head cannot outrank a recomputed
        # logit: 2^-6 of the value is at least two steps of bf16 (8 significant bits), also where a compiler computes
        # in float32 and rounds back (torch.nextafter's one step would round away there).
        under = lowest - (lowest.abs() + 1) * 2 ** -6
        return torch.where(logits < lowest, logits, under).scatter(-1, top, exact)

    def __getattr__(self, name: str):
        # Code that inspects the output embedding (tie_weights, resize, generation utilities) sees the original head.
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("base_head"), name)

    def __setattr__(self, name: str, value) -> None:
        # transformers' tie_weights sets `lm_head.weight = embed_tokens.weight` (and adjusts bias/out_features).
        if name in _DELEGATED and "base_head" in self._modules:
            setattr(self._modules["base_head"], name, value)
        else:
            super().__setattr__(name, value)

    def extra_repr(self) -> str:
        exact = f" (its top {self.exact_top_k} logits recomputed by base_head)" if self.exact_top_k else ""
        return f"exited steps: quantized_head{exact}, others: base_head"


def install_lm_head(model: nn.Module, head: RiverLMHead) -> None:
    """Make `head` the model's output embedding (its base head must be the current one)."""
    if model.get_output_embeddings() is not head.base_head:
        raise ValueError("RiverLMHead: its base head is not the model's current output embedding.")
    model.set_output_embeddings(head)


def river_lm_head(model: nn.Module) -> RiverLMHead | None:
    """The model's RiverLMHead, or None when its head is not quantized."""
    head = output_embedding(model)
    return head if isinstance(head, RiverLMHead) else None


def remove_lm_head(model: nn.Module) -> None:
    """Put the original head back (the same object), if the model has a RiverLMHead."""
    head = river_lm_head(model)
    if head is not None:
        model.set_output_embeddings(head.base_head)


@contextmanager
def original_lm_head(model: nn.Module):
    """Inside the block the model's output embedding is the original head again (the RiverLMHead returns after
    it): for saving exactly the original checkpoint. A no-op for a model without a RiverLMHead."""
    head = river_lm_head(model)
    if head is None:
        yield model
        return
    model.set_output_embeddings(head.base_head)
    try:
        yield model
    finally:
        model.set_output_embeddings(head)
