"""How long to draft, and whether drafting pays: the lossless mode's measurements and its fallback rule.

One `DraftControl` lives for one lossless `generate` call. It times every decode step with its clock (injectable:
tests pass a fake one) and keeps the call's `DraftRecord`.

The fallback rule (docs/lossless.md): the first `PROBE_STEPS` decode steps run on the plain backbone, and their
median time is the backbone's cost per token, t_plain (later calls of the same setting reuse a paying call's t_plain:
`FallbackMemory`). Then the call drafts: each round costs its draft passes plus one verification pass and yields the
kept drafts plus one backbone token. After at least `MIN_ROUNDS` rounds, drafting stops for the rest of the call
(plain backbone steps) as soon as either test fails:
- the machine: the rounds so far, had every draft been kept, would cost more than t_plain (+ TOLERANCE) per token.
  Draft and verification passes take about the same time each round, so this needs no more evidence than the first
  rounds give: where a draft pass costs about a plain step (45 against 46 ms on the AVX2 EPYC, docs/lossless.md),
  the mode stops after two rounds whatever the backbone kept;
- the text: what the rounds so far actually yielded costs more than t_plain * (1 + acceptance_margin(rounds)) per
  token. A round keeps anywhere from 0 to k drafts, so its cost per token is noisy (relative spread 0.1-0.87 per
  round on SmolLM2, `benchmarks/scripts/lossless_rounds.py`); with no margin, two or three unlucky rounds at the start
  of a text where drafting pays overall ended drafting for the whole call. The margin narrows as 1/sqrt(rounds).
After the fallback every step is a plain backbone step, whose output is the backbone's by construction.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field

from ..core.settings import DRAFT_HEURISTIC

PROBE_STEPS = 3  # plain backbone steps that measure t_plain before the first draft
MIN_ROUNDS = 2  # draft rounds measured before the fallback may engage
TOLERANCE = 0.05  # drafting within 5% of a plain step per token keeps going: inside the mode's 5% bound
# acceptance_margin: one round's relative spread of cost per token, the largest measured on SmolLM2 (0.87: 4-bit twins,
# k=8, docs/lossless.md#the-fallback); the margin is that over sqrt(rounds), about one standard error of their pool
ROUND_SPREAD = 0.9
MAX_SKIPPED_CALLS = 16  # after repeated fallbacks, at most this many calls in a row skip drafting before a probe
REUSES_OF_T_PLAIN = 7  # calls that reuse a paying call's t_plain before one times it again: its ~3% over 8 calls
HEURISTIC_START, HEURISTIC_MAX = 4, 16
BACKBONE_CHOSE = -1  # DraftRecord.draft_depth of a token the backbone chose itself


@dataclass
class DraftRound:
    """One draft-and-verify round."""

    drafted: int  # tokens the river drafted
    accepted: int  # of them, kept by the backbone
    committed: int  # tokens appended (kept drafts + the backbone's own, fewer where a stopping criterion ended it)
    draft_seconds: float
    verify_seconds: float


@dataclass
class DraftRecord:
    """What a lossless call did. `draft_depth[i]` for the i-th generated token: the exit depth of the river pass
    that drafted it when the backbone kept the draft (num_layers: that pass never left the backbone), or -1 when the
    backbone chose the token itself (the prompt's first token, plain steps, the token after each verification).
    Every cached position holds the backbone's K/V, so the cache's own exit record says num_layers everywhere."""

    num_layers: int
    draft_depth: list[int] = field(default_factory=list)
    rounds: list[DraftRound] = field(default_factory=list)
    plain_steps: int = 0
    plain_seconds: float = 0.0
    fell_back_at: int | None = None  # generated tokens when the fallback engaged; None: it never did
    fallback_remembered: bool = False  # earlier calls fell back (FallbackMemory): this one decoded plainly throughout
    plain_step_remembered: bool = False  # t_plain came from an earlier call (FallbackMemory): no probe steps here

    @property
    def drafted(self) -> int:
        return sum(r.drafted for r in self.rounds)

    @property
    def accepted(self) -> int:
        return sum(r.accepted for r in self.rounds)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else float("nan")

    @property
    def backbone_passes(self) -> int:
        """Forward passes that ran the whole backbone: the prefill, plain steps and verifications."""
        return 1 + self.plain_steps + len(self.rounds)

    @property
    def tokens_per_backbone_pass(self) -> float:
        return len(self.draft_depth) / self.backbone_passes  # 1.0 for plain decoding

    def summary(self) -> dict:
        """Counts, rates and the split of the decode time (seconds): drafting, verification, plain steps."""
        draft_s = sum(r.draft_seconds for r in self.rounds)
        # drafts the backbone threw away, priced at the mean draft pass of their round
        rejected_s = sum(r.draft_seconds * (r.drafted - r.accepted) / r.drafted for r in self.rounds if r.drafted)
        return {"new_tokens": len(self.draft_depth), "rounds": len(self.rounds), "drafted": self.drafted,
                "accepted": self.accepted, "acceptance_rate": self.acceptance_rate,
                "backbone_passes": self.backbone_passes, "tokens_per_backbone_pass": self.tokens_per_backbone_pass,
                "plain_steps": self.plain_steps, "fell_back_at": self.fell_back_at,
                "fallback_remembered": self.fallback_remembered,
                "plain_step_remembered": self.plain_step_remembered, "draft_seconds": draft_s,
                "verify_seconds": sum(r.verify_seconds for r in self.rounds), "rejected_draft_seconds": rejected_s,
                "plain_seconds": self.plain_seconds}


@dataclass
class FallbackMemory:
    """The fallback's verdicts across calls, for one river and one setting (signal, tau, draft length).

    A call that fell back measured that drafting does not pay on this machine; probing again costs the next call its
    PROBE_STEPS + MIN_ROUNDS measured steps (about 14 tokens of SmolLM2 on AVX2: most of the lossless mode's 4.5%
    loss there). So after a call falls back, the next 1, 2, 4, ... (at most MAX_SKIPPED_CALLS) calls in a row decode
    on the plain backbone from their first step, and then one call probes again (acceptance depends on the text, so
    no verdict is final). A call whose drafting paid resets it.

    It also keeps t_plain, the plain step time a call measured with its PROBE_STEPS steps, while drafting pays: the
    next calls with the same setting draft from their first step against it (the probe steps cost ~3% of a 128-token
    call on the AMX Xeon, benchmarks/avx512.md#the-fallbacks-margin). A fallback forgets it, so the call that probes
    again times the backbone afresh, and so does every REUSES_OF_T_PLAIN-th call: a t_plain timed while the machine was
    busy would otherwise make drafting look cheap, and no fallback would ever come to correct it."""

    fallbacks_in_a_row: int = 0
    calls_to_skip: int = 0
    plain_step_seconds: float | None = None
    reuses_left: int = 0  # calls that may still reuse plain_step_seconds

    def skips_next_call(self) -> bool:
        if self.calls_to_skip <= 0:
            return False
        self.calls_to_skip -= 1
        return True

    def remembered_plain_step(self) -> float | None:
        """t_plain for the next call to reuse (None: it probes), counting the reuse."""
        if self.plain_step_seconds is None or self.reuses_left <= 0:
            return None
        self.reuses_left -= 1
        return self.plain_step_seconds

    def call_done(self, record: DraftRecord, measured_plain_step: float | None) -> None:
        """`measured_plain_step`: the t_plain this call timed itself (None: it used the remembered one)."""
        if record.fell_back_at is None:
            self.fallbacks_in_a_row = self.calls_to_skip = 0
            if measured_plain_step is not None:
                self.plain_step_seconds, self.reuses_left = measured_plain_step, REUSES_OF_T_PLAIN
        else:
            self.fallbacks_in_a_row += 1
            self.calls_to_skip = min(2 ** (self.fallbacks_in_a_row - 1), MAX_SKIPPED_CALLS)
            self.plain_step_seconds = None


class DraftControl:
    """The draft length of the next round (0: a plain backbone step) and the fallback rule, from timed steps.
    `memory`: the verdicts of earlier calls with the same setting; when they say to skip this call, it decodes on
    the plain backbone from its first step (`DraftRecord.fallback_remembered`)."""

    def __init__(self, num_draft_tokens, fallback: bool, record: DraftRecord, clock=time.perf_counter,
                 memory: FallbackMemory | None = None):
        self.heuristic = num_draft_tokens == DRAFT_HEURISTIC
        self.length = HEURISTIC_START if self.heuristic else int(num_draft_tokens)
        self.fallback = fallback
        self.record = record
        self.clock = clock
        self.plain_times: list[float] = []  # seconds of each plain step
        self.memory = memory if fallback else None
        self.remembered_plain_step = None if self.memory is None else self.memory.remembered_plain_step()
        record.plain_step_remembered = self.remembered_plain_step is not None
        if self.memory is not None and self.memory.skips_next_call():
            record.fell_back_at, record.fallback_remembered = 0, True

    def call_done(self) -> None:
        """Tell the memory what this call measured (a call that only obeyed it measured nothing)."""
        if self.memory is not None and not self.record.fallback_remembered:
            measured = self.t_plain() if self.remembered_plain_step is None and self.plain_times else None
            self.memory.call_done(self.record, measured)

    def t_plain(self) -> float | None:
        """A plain backbone step's seconds: remembered from an earlier call, else the median of this call's probe."""
        if self.remembered_plain_step is not None:
            return self.remembered_plain_step
        return statistics.median(self.plain_times[:PROBE_STEPS]) if self.plain_times else None

    def draft_length(self, budget: int) -> int:
        """Tokens to draft next, given that at most `budget` tokens may still be generated (a round appends up to
        drafts + 1); 0 = take a plain backbone step."""
        probing = self.fallback and self.remembered_plain_step is None and len(self.plain_times) < PROBE_STEPS
        if probing or self.record.fell_back_at is not None:
            return 0
        return max(0, min(self.length, budget - 1))

    def plain_step_done(self, seconds: float) -> None:
        self.plain_times.append(seconds)
        self.record.plain_steps += 1
        self.record.plain_seconds += seconds

    def round_done(self, draft_round: DraftRound) -> None:
        self.record.rounds.append(draft_round)
        if self.heuristic:  # transformers' schedule: longer after a full accept, shorter after a rejection
            full = draft_round.accepted == draft_round.drafted
            self.length = min(self.length + 2, HEURISTIC_MAX) if full else max(self.length - 1, 1)
        if self.fallback and self.record.fell_back_at is None and not self.drafting_pays():
            self.record.fell_back_at = len(self.record.draft_depth)

    def drafting_pays(self) -> bool:
        """The fallback rule (module docstring): after MIN_ROUNDS rounds, drafting pays while the machine could make
        it pay (every draft kept) and this text's rounds cost at most t_plain per token, give or take the margin."""
        rounds, t_plain = self.record.rounds, self.t_plain()
        if len(rounds) < MIN_ROUNDS or t_plain is None:
            return True
        seconds = sum(r.draft_seconds + r.verify_seconds for r in rounds)
        every_draft_kept = seconds / sum(r.drafted + 1 for r in rounds)
        yielded = seconds / max(sum(r.committed for r in rounds), 1)
        margin = acceptance_margin(len(rounds))
        return every_draft_kept <= t_plain * (1 + TOLERANCE) and yielded <= t_plain * (1 + margin)


def acceptance_margin(rounds: int) -> float:
    """How much dearer per token than a plain step `rounds` draft rounds may look, through the luck of what the
    backbone kept, before drafting stops."""
    return max(TOLERANCE, ROUND_SPREAD / math.sqrt(rounds))
