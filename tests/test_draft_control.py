"""The lossless fallback rule (river_hf.lossless.draft_control.DraftControl.drafting_pays) on rounds with known costs:
it stops drafting where the machine cannot make it pay, and does not stop on a few unlucky rounds where it pays
overall."""

from __future__ import annotations

import pytest

from river_hf.lossless.draft_control import (MIN_ROUNDS, PROBE_STEPS, ROUND_SPREAD, TOLERANCE, DraftControl,
    DraftRecord, DraftRound, acceptance_margin)

T_PLAIN = 1.0  # seconds of a plain backbone step


def control(k: int = 4) -> DraftControl:
    """A call with the fallback on, past its probe steps (each T_PLAIN)."""
    ctl = DraftControl(k, fallback=True, record=DraftRecord(num_layers=4))
    for _ in range(PROBE_STEPS):
        ctl.plain_step_done(T_PLAIN)
    return ctl


def a_round(k: int, kept: int, draft_pass: float, verify: float) -> DraftRound:
    return DraftRound(drafted=k, accepted=kept, committed=kept + 1, draft_seconds=k * draft_pass,
                      verify_seconds=verify)


def rounds_until_fallback(ctl: DraftControl, rounds: list[DraftRound]) -> int | None:
    """Feed rounds in order; the number of rounds after which drafting stopped (None: it never did)."""
    for count, draft_round in enumerate(rounds, start=1):
        ctl.round_done(draft_round)
        if ctl.record.fell_back_at is not None:
            return count
    return None


def test_a_machine_where_drafts_cost_a_plain_step_stops_after_the_minimum_rounds():
    """AVX2-like: a draft pass costs what a plain step does, a verification 2.5 of them. Even with every draft
    kept ((4 x 1 + 2.5) / 5 = 1.3 per token) it cannot pay: stop as soon as the rule may speak."""
    rounds = [a_round(4, kept=4, draft_pass=T_PLAIN, verify=2.5 * T_PLAIN)] * 10
    assert rounds_until_fallback(control(), rounds) == MIN_ROUNDS


def test_unlucky_first_rounds_where_drafting_pays_do_not_stop_it():
    """Cheap drafts (0.4 of a plain step): the first two rounds keep nothing (2.6 per token), then the backbone keeps
    most (about 0.5 per token). The pooled cost recovers within the margin, and drafting goes on."""
    ctl = control(k=4)
    unlucky = [a_round(4, kept=1, draft_pass=0.4, verify=1.0)] * 2  # 2.6 / 2 = 1.3 per token
    lucky = [a_round(4, kept=4, draft_pass=0.4, verify=1.0)] * 20
    assert 1.3 <= T_PLAIN * (1 + acceptance_margin(2))  # the case this test is about: within the early margin
    assert rounds_until_fallback(ctl, unlucky + lucky) is None


def test_a_text_the_backbone_keeps_little_of_stops_once_the_evidence_is_in():
    """Cheap drafts, but the backbone keeps one of four: 2.6 / 2 = 1.3 per token, 30% dearer than plain. Early on
    that is within the luck of a few rounds; the margin narrows as rounds add up, and drafting stops at the first
    round whose margin is below 30% (the 10th: 0.9 / sqrt(10) = 0.28)."""
    rounds = [a_round(4, kept=1, draft_pass=0.4, verify=1.0)] * 40
    expected = next(n for n in range(MIN_ROUNDS, 41) if 1.3 > T_PLAIN * (1 + acceptance_margin(n)))
    assert expected > MIN_ROUNDS
    assert rounds_until_fallback(control(), rounds) == expected


def test_drafting_a_little_dearer_than_plain_goes_on_within_the_tolerance():
    """Every draft kept at 1.04 per token: within the 5% the mode may lose, not worth giving up the chance of more."""
    verify = 5 * 1.04 - 4 * 0.8  # (4 x 0.8 + verify) / 5 = 1.04
    rounds = [a_round(4, kept=4, draft_pass=0.8, verify=verify)] * 30
    assert rounds_until_fallback(control(), rounds) is None


@pytest.mark.parametrize("rounds", [1, 2, 4, 9, 100, 10_000])
def test_the_margin_narrows_to_the_tolerance(rounds):
    margin = acceptance_margin(rounds)
    assert margin == pytest.approx(max(TOLERANCE, ROUND_SPREAD / rounds ** 0.5))
    assert margin >= acceptance_margin(rounds + 1) >= TOLERANCE


def test_no_fallback_asked_never_stops():
    ctl = DraftControl(4, fallback=False, record=DraftRecord(num_layers=4))
    for _ in range(PROBE_STEPS):
        assert ctl.draft_length(100) == 4  # no probe steps either
    assert rounds_until_fallback(ctl, [a_round(4, kept=0, draft_pass=5.0, verify=5.0)] * 5) is None
