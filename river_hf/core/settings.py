"""`RiverSettings`: the per-call exit settings, declared and validated once.

Everything that decides how one `generate` call exits lives here: `RiverConfig` (a `GenerationConfig`) takes exactly
these fields, `generate(..., tau=0.98)` accepts exactly these keyword arguments, and `river-hf` derives its river
flags from them. Each field's `metadata["help"]` is its documentation everywhere (docstring, `--help`).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import MISSING, dataclass, field, fields

from ..checks import check_choice, is_int, is_text
from .signals import EXIT_POLICIES, reads_tau, signal_names
from .kv_strategies import strategy_names

AUTO_TAU = "auto"  # tau's default: the signal's entry below where exiting pays on this machine (river_hf.core.auto_tau)
# The default tau of each signal, measured on the packaged SmolLM2-135M with the default twins (4-bit for the first
# quarter of the river layers, 8-bit after, 8-bit LM head), GSM8K and chat prompts (benchmarks/README.md, "Defaults").
# confidence's tau is a probability, so it means the same on any model; a cosine's depends on the model (the
# paper's 0.5-0.9 suits Llama-3; on SmolLM2 it exits nearly every token after 2 layers).
DEFAULT_TAUS = {"confidence": 0.3, "cosine": 0.975}
DEFAULT_TAU = DEFAULT_TAUS["cosine"]  # the paper's signal's default, for the bench's cosine sweeps
# tau="auto" in lossless mode: every draft leaves at the start layer. The verification keeps only what the backbone
# agrees with, so a draft's last layers need not be the backbone's: same-run benches on the AMX Xeon, k=8, ran
# 1.41x / 1.35x (GSM8K) and 1.21x / 1.15x (chat) against confidence 0.3 (docs/lossless.md#the-drafts-exit).
# Where drafting does not pay on a machine, the fallback ends it (no exit-gain check is needed first).
LOSSLESS_AUTO_TAU = -1.0
PREFILL_EXITS = ("auto", "sequence", "none")
DRAFT_HEURISTIC = "heuristic"  # num_draft_tokens: adapt the draft length to the acceptance


@dataclass(frozen=True)
class RiverSettings:
    """How one `generate` call exits. Bad values raise `ValueError` naming the field."""

    tau: float | str = field(default=AUTO_TAU, metadata={"help": (
        "Exit threshold of the exit signal (confidence: the previous token's top-1 probability; the paper's cosine: "
        "cos(h_in, h_out) of a backbone layer). A value above 1 never exits (the output equals the backbone's token "
        "for token); -1 exits as early as allowed, at `start_layer` (the paper's full quantization). 'auto': the "
        "signal's measured default (confidence 0.3, cosine 0.975) where exiting pays on this machine; where a step "
        "on the twins is not faster than a backbone step (measured once per river), nothing exits and generate "
        "runs the plain backbone, with a warning. In lossless mode 'auto' is -1: every draft exits at `start_layer` "
        "(the verification keeps the output exact; the fallback handles machines where drafting does not pay).")})
    prefill_exit: str | int = field(default="auto", metadata={"help": (
        "How the prompt exits: 'sequence' = one switch layer for all prompt tokens, from their mean score (the "
        "paper's); 'none' = the full backbone; an int k = switch after k backbone layers; 'auto' = 'sequence' where "
        "the twins' kernels ran a prompt-shaped matmul faster than the backbone's when the river was built "
        "(backend='fastest' measures it), else 'none', so a river never makes a prompt slower.")})
    exit_policy: str = field(default="batch_min", metadata={"help": (
        "How the rows of a batch agree: 'batch_min' = the batch exits once every row passes (the paper's).")})
    kv_strategy: str = field(default="river", metadata={"help": (
        "What the layers an exited token skips do about its K/V: 'river' = its KV-sharing twins (the paper); "
        "'recompute', 'state_propagation', 'mask', 'mono_decreasing' are the known baselines, for comparison.")})
    min_exit_layer: int | None = field(default=None, metadata={"help": (
        "No token exits before this many backbone layers (default: the river's start layer; half the layers for "
        "'mask').")})
    exit_signal: str = field(default="confidence", metadata={"help": (
        "What decides an exit: 'confidence' (the previous token's top-1 probability, decided once: the most faithful "
        "at a given speed in our measurements), 'cosine' (the paper's), 'cosine_first' (decided once, at "
        "`signal_layer`), 'update_norm' (1 - |h_out - h_in| / |h_in|) or 'random' (the honest baseline; needs "
        "`exit_rate`).")})
    exit_rate: float | None = field(default=None, metadata={"help": (
        "exit_signal='random' only: the probability that a decoded token exits.")})
    seed: int | None = field(default=None, metadata={"help": "exit_signal='random' only: its generator's seed."})
    signal_layer: int | None = field(default=None, metadata={"help": (
        "exit_signal='cosine_first' only: the depth (backbone layers run) of its one decision; default: the first "
        "eligible depth.")})
    lossless: bool = field(default=False, metadata={"help": (
        "Lossless mode (docs/lossless.md): the river, with its exit signal, drafts up to `num_draft_tokens` tokens, "
        "the backbone verifies them in one forward pass and keeps the longest agreeing prefix plus its own next "
        "token, in the one RiverCache. Greedy output equals the backbone's bit for bit (see `exact_verify`); "
        "sampling follows the backbone's distribution (speculative sampling). Batch size 1, kv_strategy 'river'.")})
    num_draft_tokens: int | str = field(default=8, metadata={"help": (
        "lossless only: tokens the river drafts per verification, an int >= 1, or 'heuristic' (start at 4; +2 after "
        "a fully accepted draft, -1 otherwise, as transformers' num_assistant_tokens_schedule='heuristic'). Default "
        "8: faster than 4 in most runs where drafting paid (docs/lossless.md#the-draft-length).")})
    draft_fallback: bool = field(default=True, metadata={"help": (
        "lossless only: measure drafting's cost per token during the call and decode on the plain backbone for the "
        "rest of it once drafting is slower than the backbone's own steps (docs/lossless.md, 'The fallback').")})
    exact_verify: bool = field(default=True, metadata={"help": (
        "lossless only: the verification pass computes each drafted position as a one-token step does (attention "
        "per query row; linears per row where this machine's kernel rounds a multi-row matmul differently), so "
        "greedy output and cache are the plain model's bit for bit in any dtype. False: one multi-row pass, equal "
        "up to rounding (a near-tie argmax can flip), cheaper where multi-row linears are not batch-invariant.")})

    def __post_init__(self):
        _check_tau(self.tau)
        if not is_text(self.tau, AUTO_TAU):
            self._set("tau", float(self.tau))
        prefill = self.prefill_exit
        if not (isinstance(prefill, str) and prefill in PREFILL_EXITS or is_int(prefill) and prefill >= 1):
            raise ValueError(f"`prefill_exit`={prefill!r} is not supported; use one of {PREFILL_EXITS} or "
                             f"an int >= 1 (the number of backbone layers every prompt token runs).")
        self._set("prefill_exit", prefill if isinstance(prefill, str) else int(prefill))
        self._set("exit_policy", check_choice("exit_policy", self.exit_policy, EXIT_POLICIES))
        self._set("kv_strategy", check_choice("kv_strategy", self.kv_strategy, strategy_names()))
        self._set("exit_signal", check_choice("exit_signal", self.exit_signal, signal_names()))
        for name in ("min_exit_layer", "signal_layer"):
            value = getattr(self, name)
            if value is not None and not (is_int(value) and value >= 1):
                raise ValueError(f"`{name}` must be None or an int >= 1 (a number of backbone layers); got {value!r}.")
            self._set(name, None if value is None else int(value))
        self._check_random_fields()
        self._check_lossless_fields()
        self._check_auto_tau_has_a_default()

    def _set(self, name: str, value) -> None:
        """Store a checked value in its plain Python form (the dataclass is frozen: per-call settings never change)."""
        object.__setattr__(self, name, value)

    def _check_auto_tau_has_a_default(self) -> None:
        """tau='auto' needs the signal's measured default; refused here, not only on machines where exiting pays."""
        if (is_text(self.tau, AUTO_TAU) and not self.lossless and reads_tau(self.exit_signal)
                and self.exit_signal not in DEFAULT_TAUS):
            raise ValueError(f"`tau`='auto' has no measured default for `exit_signal`={self.exit_signal!r} (defaults "
                             f"exist for {sorted(DEFAULT_TAUS)}); give `tau` a number.")

    def _check_lossless_fields(self) -> None:
        for name in ("lossless", "draft_fallback", "exact_verify"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"`{name}` must be True or False; got {getattr(self, name)!r}.")
        draft = self.num_draft_tokens
        if not (is_text(draft, DRAFT_HEURISTIC) or (is_int(draft) and draft >= 1)):
            raise ValueError(f"`num_draft_tokens` must be an int >= 1 or {DRAFT_HEURISTIC!r}; got {draft!r}.")
        self._set("num_draft_tokens", draft if isinstance(draft, str) else int(draft))
        if self.lossless and self.kv_strategy != "river":
            raise ValueError(f"`lossless`=True drafts with the river's twins and crops the cache back, so it needs "
                             f"`kv_strategy`='river'; got {self.kv_strategy!r}.")

    def _check_random_fields(self) -> None:
        if self.exit_signal == "random" and self.exit_rate is None:
            raise ValueError("`exit_signal`='random' needs `exit_rate`: the probability (0 to 1) that a token exits.")
        rate = self.exit_rate
        if rate is not None and (isinstance(rate, bool) or not isinstance(rate, numbers.Real) or not 0 <= rate <= 1):
            raise ValueError(f"`exit_rate` must be a probability between 0 and 1; got {rate!r}.")
        if self.seed is not None and not is_int(self.seed):
            raise ValueError(f"`seed` must be None or an int; got {self.seed!r}.")
        self._set("seed", None if self.seed is None else int(self.seed))
        self._set("exit_rate", None if rate is None else float(rate))

    @classmethod
    def from_object(cls, source, **overrides) -> RiverSettings:
        """The settings an object carries as attributes (a RiverConfig, a loaded GenerationConfig), then overrides."""
        values = {name: getattr(source, name) for name in RIVER_FIELDS if hasattr(source, name)}
        return cls(**{**values, **overrides})


RIVER_FIELDS = tuple(f.name for f in fields(RiverSettings))


def river_field_defaults() -> dict:
    """name -> default of every river field."""
    return {f.name: f.default for f in fields(RiverSettings) if f.default is not MISSING}


def river_field_help(name: str) -> str:
    return RiverSettings.__dataclass_fields__[name].metadata["help"]


def river_fields_doc(indent: str = "    ") -> str:
    """The fields as a docstring's Args section (for RiverConfig)."""
    return "\n".join(f"{indent}{f.name} (default {f.default!r}): {f.metadata['help']}" for f in fields(RiverSettings))


def _check_tau(tau) -> None:
    if is_text(tau, AUTO_TAU):
        return
    if isinstance(tau, bool) or not isinstance(tau, numbers.Real) or math.isnan(tau):
        raise ValueError(f"`tau` must be a real number (the exit threshold: > 1 never exits, -1 exits as early as "
                         f"allowed) or {AUTO_TAU!r} (the measured default); got {tau!r}.")
