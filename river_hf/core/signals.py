"""Exit signals: what decides, after a backbone layer, that a step may leave the backbone for the twins.

The `ExitRouter` owns the rules every signal shares: no exit before `min_depth` backbone layers nor at the last
layer, the forced exit at `depth_cap` (a KV strategy's), and `prefill_exit="none"` / int for the prompt. Inside
those rules it asks its signal, after each eligible backbone layer (in order, until the step exits):
`decide(depth, h_in, h_out, mask) -> bool`, where `depth` is the number of backbone layers run, `h_*` are that
layer's input and output hidden states [B, T, D] and `mask` is the prompt's attention mask on a prefill step
(None on a decode step). `begin_step(is_prefill, min_depth)` opens each forward pass.

`RiverConfig(exit_signal=...)` picks the signal by its registered name (`make_signal` builds it from the call's
`RiverSettings`; `register_signal` adds one, e.g. a test's scripted signal):

- "cosine" (default, the paper's): exit after the first eligible layer where s = cos(h_in, h_out) > tau.
- "cosine_first" (the paper's other reading): one decision, at depth `signal_layer` (default: the first eligible
  depth, `min_depth`; a smaller value is lifted to it): exit there if s > tau, else the step never exits. No
  similarity is computed at any other layer.
- "update_norm": the relative size of the layer's update, scored as 1 - |h_out - h_in| / |h_in| (higher = more
  similar, so it exits when score > tau, the same direction as the cosine); checked after every eligible layer.
- "confidence": the previous token's top-1 probability > tau, decided once at the first eligible depth (the signal
  keeps it from each river pass's logits, `observe_logits`; a prompt never exits). One softmax per token.
- "random": no signal at all, the honest baseline. Each step exits with probability `exit_rate`, at a depth drawn
  uniformly among the eligible depths [min_depth, num_layers - 1], from a generator seeded with `seed` (one per
  router, so per `generate` call: a fixed seed repeats the same exits; None is nondeterministic). Every step draws
  the same two numbers whether it exits or not, so with one seed a higher rate exits a superset of the steps, at
  the same depths. It reads no hidden state and ignores tau.

Batch: the similarity signals take each row's score and exit only when every row passes (`exit_policy`
"batch_min", `batch_passes`); "random" draws once per step for the whole batch.

Prefill (a forward pass with several new tokens per row, `prefill_exit="sequence"`): the similarity signals score
each row by the mean of their per-token score over its real (unpadded) prompt tokens, then decide as above (the
cosine at every eligible layer, cosine_first at its one depth). "random" draws once for the prefill step, with the
same rate and depth range as a decode step.

tau extremes, for the similarity signals: tau > 1 never exits and computes no score (neither score exceeds 1, so
this is exact: the output is the backbone's); tau <= -1 exits at the first depth the signal may exit at, again
without computing a score (for "update_norm", whose score can fall below -1, this is a definition).

Scores are computed in float32: bf16 resolves cosines near 1 only to ~0.004, coarser than the taus that matter.
The cosine path runs after every layer of every decoded token, so a decode decision is three tensor ops and one host
read (`min_token_cosine`).
"""

from __future__ import annotations

import math
import random

import torch
import torch.nn.functional as F

from ..checks import check_choice

EXIT_POLICIES = ("batch_min",)
COSINE_EPS = 1e-8  # torch.nn.functional.cosine_similarity's default: a zero vector scores 0, not NaN


# ---- scores ([B, T, D] hidden states -> [B, T] per position, or [B] per row; float32) ---------------------------
def cosine_score(h_in: torch.Tensor, h_out: torch.Tensor) -> torch.Tensor:
    """cos(h_in, h_out) per position. h_*: [B, T, D] -> [B, T] (float32)."""
    return F.cosine_similarity(h_in.float(), h_out.float(), dim=-1)


def token_similarity(h_in: torch.Tensor, h_out: torch.Tensor) -> torch.Tensor:
    """cos(h_in, h_out) of each row's last position. h_*: [B, T, D] -> [B] (float32)."""
    if h_in.shape[1] != 1:  # decode steps have T == 1: skip the slicing ops, this runs after every layer
        h_in, h_out = h_in[:, -1:], h_out[:, -1:]
    return cosine_score(h_in, h_out).view(-1)


def min_token_cosine(h_in: torch.Tensor, h_out: torch.Tensor) -> float:
    """min over the batch of `token_similarity`, as a Python float, in three tensor ops and one host read: this runs
    after every eligible layer of every decoded token, where each ATen op costs microseconds of dispatch, and
    `token_similarity(...).min().item()` takes about twice as many. The [B, 2, 2] Gram matrix of each row's two
    vectors gives both norms and the dot product; the division runs on the host."""
    if h_in.shape[1] != 1:
        h_in, h_out = h_in[:, -1:], h_out[:, -1:]
    pair = torch.cat((h_in, h_out), dim=1).float()  # [B, 2, D]
    gram = torch.bmm(pair, pair.transpose(1, 2)).view(-1, 4).tolist()
    return min(dot / max(math.sqrt(in_sq * out_sq), COSINE_EPS) for in_sq, dot, _, out_sq in gram)


def sequence_similarity(h_in: torch.Tensor, h_out: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Mean over each row's real positions of cos(h_in, h_out). h_*: [B, T, D], mask: [B, T] (1 = token) -> [B]."""
    return mean_over_tokens(cosine_score(h_in, h_out), mask)


def update_norm_score(h_in: torch.Tensor, h_out: torch.Tensor) -> torch.Tensor:
    """1 - |h_out - h_in| / |h_in| per position (float32): 1 = no update, 0 = an update as large as h_in. [B, T]."""
    h_in = h_in.float()
    update = torch.linalg.vector_norm(h_out.float() - h_in, dim=-1)
    return 1.0 - update / torch.linalg.vector_norm(h_in, dim=-1).clamp(min=torch.finfo(torch.float32).tiny)


def token_update_norm(h_in: torch.Tensor, h_out: torch.Tensor) -> torch.Tensor:
    """`update_norm_score` of each row's last position -> [B]."""
    if h_in.shape[1] != 1:
        h_in, h_out = h_in[:, -1:], h_out[:, -1:]
    return update_norm_score(h_in, h_out).view(-1)


def sequence_update_norm(h_in: torch.Tensor, h_out: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Mean over each row's real positions of `update_norm_score` -> [B]."""
    return mean_over_tokens(update_norm_score(h_in, h_out), mask)


def mean_over_tokens(scores: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Mean of per-position scores [B, T] over each row's real positions (mask [B, T], 1 = token) -> [B]."""
    if mask is None:
        return scores.mean(dim=-1)
    weights = mask.to(scores.dtype)
    return (scores * weights).sum(dim=-1) / weights.sum(dim=-1).clamp(min=1.0)


def batch_passes(similarity: torch.Tensor, tau: float, policy: str = "batch_min") -> bool:
    """The paper's batch policy: the batch exits only when every row's similarity exceeds tau."""
    check_choice("exit_policy", policy, EXIT_POLICIES)
    return similarity.min().item() > tau  # .item(): one host read instead of a tensor comparison, then bool()


# ---- signals -----------------------------------------------------------------------------------------------------
class ExitSignal:
    """Decides, after an eligible backbone layer, whether the step leaves for the twins. One per router, so per
    `generate` call: any state it keeps is that call's alone.

    A subclass sets `name` and registers with `@register_signal`; `from_settings(settings, num_layers)` builds it
    from the call's `RiverSettings` (by default: `cls(settings.tau, settings.exit_policy)`).
    """

    name = ""
    needs_logits = False  # True: the model hands it every river pass's logits (`observe_logits`)
    plans_decode_steps = False  # True: `planned_depth` knows a decode step's exit depth before the step runs
    reads_tau = True  # False: it ignores tau (then tau 'auto' needs no measured default, and exits are not guarded)

    @classmethod
    def from_settings(cls, settings, num_layers: int) -> ExitSignal:
        return cls(settings.tau, settings.exit_policy)

    def observe_logits(self, logits: torch.Tensor) -> None:
        """The logits [B, T, V] of the river pass that just ended (only when `needs_logits`)."""

    def begin_step(self, is_prefill: bool, min_depth: int) -> None:
        """A forward pass starts: a prefill (several tokens per row) or a decode step; no exit before min_depth."""

    def decide(self, depth: int, h_in: torch.Tensor, h_out: torch.Tensor, mask: torch.Tensor | None) -> bool:
        """After `depth` backbone layers: exit now? Called only at eligible depths, in order, until it says yes."""
        raise NotImplementedError

    def planned_depth(self, min_depth: int, num_layers: int) -> int | None:
        """A decode step's exit depth known before the step runs (`num_layers`: it stays on the backbone), for
        signals that read nothing of the step itself; None (the default) when the decision needs the step's hidden
        states (then `plans_decode_steps` is False). A planned step runs as one captured graph per depth
        (river_hf.core.captured_decode)."""
        return None


class ThresholdSignal(ExitSignal):
    """A per-row score above tau in every row of the batch, checked after every eligible layer."""

    token_score = staticmethod(token_similarity)  # decode: [B, T, D] x2 -> [B]
    sequence_score = staticmethod(sequence_similarity)  # prefill: the mean over the real prompt tokens

    @staticmethod
    def min_token_score(h_in: torch.Tensor, h_out: torch.Tensor) -> float:
        """The batch minimum of `token_score` (what "batch_min" compares with tau); subclasses may compute it
        more cheaply."""
        return token_similarity(h_in, h_out).min().item()

    def __init__(self, tau: float, policy: str = "batch_min"):
        self.tau = tau
        self.policy = policy
        self.is_prefill = False

    def begin_step(self, is_prefill: bool, min_depth: int) -> None:
        self.is_prefill = is_prefill

    def decide(self, depth, h_in, h_out, mask) -> bool:
        if self.tau > 1.0:  # no score exceeds 1: never exits, and computes nothing
            return False
        if self.tau <= -1.0:  # exit as early as allowed
            return True
        if self.is_prefill:
            return batch_passes(self.sequence_score(h_in, h_out, mask), self.tau, self.policy)
        return self.min_token_score(h_in, h_out) > self.tau  # "batch_min", the one policy (checked in settings)

    @property
    def plans_decode_steps(self) -> bool:
        return self.tau > 1.0 or self.tau <= -1.0  # the extremes read no score: known before the step

    def planned_depth(self, min_depth: int, num_layers: int) -> int | None:
        if not self.plans_decode_steps:
            return None
        return num_layers if self.tau > 1.0 else self._first_decision_depth(min_depth)

    def _first_decision_depth(self, min_depth: int) -> int:
        return min_depth


SIGNALS: dict[str, type[ExitSignal]] = {}  # name -> class; `register_signal` adds to it


def reads_tau(name: str) -> bool:
    """Whether signal `name` compares a score with tau (random routing, a scripted test signal: no)."""
    return SIGNALS[name].reads_tau if name in SIGNALS else True


def register_signal(cls: type[ExitSignal]) -> type[ExitSignal]:
    """Make `cls` available as `RiverConfig(exit_signal=cls.name)` (a class decorator)."""
    if not isinstance(cls, type) or not issubclass(cls, ExitSignal) or not cls.name:
        raise ValueError(f"register_signal: {cls!r} must be an ExitSignal subclass with a `name`.")
    SIGNALS[cls.name] = cls
    return cls


def unregister_signal(name: str) -> None:
    """Take a registered signal away again (e.g. a test's); the built-in ones are refused."""
    if name in _BUILT_IN:
        raise ValueError(f"`exit_signal`={name!r} is built in and cannot be unregistered.")
    SIGNALS.pop(name, None)


def signal_names() -> tuple[str, ...]:
    return tuple(SIGNALS)


def make_signal(settings, num_layers: int) -> ExitSignal:
    """The exit signal `settings.exit_signal` names (settings: a `RiverSettings`), for `num_layers` decoder layers."""
    check_choice("exit_signal", settings.exit_signal, signal_names())
    return SIGNALS[settings.exit_signal].from_settings(settings, num_layers)


@register_signal
class Cosine(ThresholdSignal):
    """The paper's signal: cos(h_in, h_out) > tau after every eligible layer."""

    name = "cosine"
    min_token_score = staticmethod(min_token_cosine)


@register_signal
class CosineAtOneLayer(Cosine):
    """cos(h_in, h_out) > tau checked once, at depth `signal_layer` (None: the first eligible depth); a step that
    fails there stays on the backbone to the end."""

    name = "cosine_first"

    def __init__(self, tau: float, policy: str = "batch_min", signal_layer: int | None = None):
        super().__init__(tau, policy)
        self.signal_layer = signal_layer
        self.decision_depth = signal_layer

    @classmethod
    def from_settings(cls, settings, num_layers: int) -> CosineAtOneLayer:
        return cls(settings.tau, settings.exit_policy, settings.signal_layer)

    def begin_step(self, is_prefill: bool, min_depth: int) -> None:
        self.is_prefill = is_prefill
        self.decision_depth = min_depth if self.signal_layer is None else max(self.signal_layer, min_depth)

    def decide(self, depth, h_in, h_out, mask) -> bool:
        return depth == self.decision_depth and super().decide(depth, h_in, h_out, mask)

    def _first_decision_depth(self, min_depth: int) -> int:
        return self.decision_depth  # set by begin_step, which plan_step calls first


@register_signal
class UpdateNorm(ThresholdSignal):
    """1 - |h_out - h_in| / |h_in| > tau after every eligible layer: the layer barely changed the hidden state."""

    name = "update_norm"
    token_score = staticmethod(token_update_norm)
    sequence_score = staticmethod(sequence_update_norm)

    @staticmethod
    def min_token_score(h_in: torch.Tensor, h_out: torch.Tensor) -> float:
        return token_update_norm(h_in, h_out).min().item()


@register_signal
class PreviousConfidence(ExitSignal):
    """The previous token's top-1 probability > tau, decided once, at the first eligible depth: a model that was
    sure of its last token is likely sure of this one, and a sure prediction survives the twins' small errors (the
    match metric is argmax agreement). It reads a number the last pass already produced: no extra layer, no LM head
    at intermediate layers (CALM's confidence costs a head per check). A prompt never exits: it has no previous
    token."""

    name = "confidence"
    needs_logits = True
    plans_decode_steps = True

    def __init__(self, tau: float, policy: str = "batch_min"):
        self.tau = tau
        self.policy = policy
        self.last_confidence: torch.Tensor | None = None  # [B] of this call's previous pass; None before the first
        self.is_prefill, self.min_depth = False, 1

    def observe_logits(self, logits: torch.Tensor) -> None:
        self.last_confidence = top1_probability(logits)

    def begin_step(self, is_prefill: bool, min_depth: int) -> None:
        self.is_prefill, self.min_depth = is_prefill, min_depth

    def decide(self, depth, h_in, h_out, mask) -> bool:
        if self.is_prefill or depth != self.min_depth or self.tau > 1.0:  # a probability never exceeds 1
            return False
        if self.tau <= -1.0:
            return True
        return self.last_confidence is not None and batch_passes(self.last_confidence, self.tau, self.policy)

    def planned_depth(self, min_depth: int, num_layers: int) -> int | None:
        # the one decision reads the previous pass's logits: known before the step, at the same depth `decide` uses
        return min_depth if self.decide(min_depth, None, None, None) else num_layers


@register_signal
class RandomExit(ExitSignal):
    """No signal: each step exits with probability `exit_rate`, at a uniformly drawn eligible depth."""

    name = "random"
    reads_tau = False
    plans_decode_steps = True

    def __init__(self, exit_rate: float, num_layers: int, seed: int | None = None):
        self.exit_rate = float(exit_rate)
        self.num_layers = num_layers
        self.rng = random.Random(seed)  # private: generate's own sampling (torch's RNG) is left alone
        self.drawn_depth: int | None = None  # this step's exit depth; None: it stays on the backbone

    @classmethod
    def from_settings(cls, settings, num_layers: int) -> RandomExit:
        if settings.exit_rate is None:
            raise ValueError("`exit_signal`='random' needs `exit_rate`: the probability (0 to 1) that a token exits.")
        return cls(settings.exit_rate, num_layers, settings.seed)

    def begin_step(self, is_prefill: bool, min_depth: int) -> None:
        exits = self.rng.random() < self.exit_rate
        low = max(min_depth, 1)
        depth = self.rng.randint(low, self.num_layers - 1) if low < self.num_layers else None
        self.drawn_depth = depth if exits else None

    def decide(self, depth, h_in, h_out, mask) -> bool:
        return self.drawn_depth is not None and depth >= self.drawn_depth

    def planned_depth(self, min_depth: int, num_layers: int) -> int | None:
        return num_layers if self.drawn_depth is None else max(self.drawn_depth, min_depth)


_BUILT_IN = frozenset(SIGNALS)  # everything registered above


def top1_probability(logits: torch.Tensor) -> torch.Tensor:
    """Each row's top-1 probability at its last position. logits: [B, T, V] -> [B] float32."""
    return F.softmax(logits[:, -1].float(), dim=-1).amax(dim=-1)
