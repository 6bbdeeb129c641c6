"""The lossless fallback remembers its verdicts across calls (river_hf.lossless.draft_control.FallbackMemory): after a
call that fell back, the next 1, 2, 4, ... calls with the same settings decode on the plain backbone from their first
step (no probing), then one probes again; output stays the backbone's throughout."""

from __future__ import annotations

import pytest
import torch

from river_hf import RiverConfig
from river_hf.lossless.draft_control import (BACKBONE_CHOSE, MAX_SKIPPED_CALLS, PROBE_STEPS, REUSES_OF_T_PLAIN,
    DraftRecord, FallbackMemory)

from conftest import cheap_drafts_clock, generate, river_of, slow_drafts_clock, tiny_model

NEW = 24


@pytest.fixture
def prompt():
    torch.manual_seed(1)
    return torch.randint(3, 256, (1, 9))


def timed_call(model, ids, clock, k=4, fallback=True):
    config = RiverConfig(tau=-1.0, exit_signal="cosine", lossless=True, num_draft_tokens=k, draft_fallback=fallback,
                         max_new_tokens=NEW, do_sample=False, return_dict_in_generate=True)
    return model.generate(ids, generation_config=config, draft_clock=clock)


def test_after_a_fallback_the_next_calls_skip_drafting_then_probe_again(prompt):
    backbone = tiny_model("llama")
    reference = generate(backbone, prompt, max_new_tokens=NEW).sequences
    model = river_of(backbone)
    clock = slow_drafts_clock(model)
    remembered = []
    for _ in range(7):
        out = timed_call(model, prompt, clock)
        record = out.cache.drafts
        assert torch.equal(out.sequences, reference)
        remembered.append(record.fallback_remembered)
        if record.fallback_remembered:
            assert record.rounds == [] and record.fell_back_at == 0 and record.tokens_per_backbone_pass == 1.0
        else:
            assert record.fell_back_at is not None and record.rounds  # it probed, drafted, and fell back
    assert remembered == [False, True, False, True, True, False, True]  # skips 1, then 2, then 4 calls


def test_a_call_whose_drafting_pays_is_never_skipped(prompt):
    model = river_of(tiny_model("llama"))
    clock = cheap_drafts_clock(model)
    for _ in range(3):
        record = timed_call(model, prompt, clock).cache.drafts
        assert not record.fallback_remembered and record.fell_back_at is None


def test_the_memory_is_per_setting_and_only_with_the_fallback(prompt):
    model = river_of(tiny_model("llama"))
    clock = slow_drafts_clock(model)
    assert timed_call(model, prompt, clock, k=4).cache.drafts.fell_back_at is not None
    assert not timed_call(model, prompt, clock, k=2).cache.drafts.fallback_remembered  # another setting probes
    record = timed_call(model, prompt, clock, k=4, fallback=False).cache.drafts
    assert not record.fallback_remembered and record.fell_back_at is None  # no fallback asked: it drafts throughout
    assert timed_call(model, prompt, clock, k=4).cache.drafts.fallback_remembered


def test_skips_grow_to_a_bound_and_reset_when_drafting_pays():
    memory, fell_back, paid = FallbackMemory(), DraftRecord(num_layers=4, fell_back_at=3), DraftRecord(num_layers=4)
    skipped = []
    for _ in range(8):
        memory.call_done(fell_back, 0.5)
        skipped.append(memory.calls_to_skip)
        while memory.skips_next_call():
            pass
    assert skipped == [1, 2, 4, 8, 16, 16, 16, 16] and MAX_SKIPPED_CALLS == 16
    assert memory.plain_step_seconds is None  # a call that fell back leaves no t_plain to reuse
    memory.call_done(paid, 0.5)
    assert not memory.skips_next_call() and memory.fallbacks_in_a_row == 0 and memory.plain_step_seconds == 0.5
    memory.call_done(paid, None)  # a call that reused it measured none: the remembered one stays
    assert memory.plain_step_seconds == 0.5


def test_after_a_call_whose_drafting_paid_the_next_drafts_from_its_first_step(prompt):
    """t_plain is remembered with the verdict: the second call takes no probe steps, and its output is still the
    backbone's; a call with another setting probes for itself."""
    backbone = tiny_model("llama")
    reference = generate(backbone, prompt, max_new_tokens=NEW).sequences
    model = river_of(backbone)
    clock = cheap_drafts_clock(model)
    first, second = (timed_call(model, prompt, clock) for _ in range(2))
    assert first.cache.drafts.plain_steps == PROBE_STEPS and not first.cache.drafts.plain_step_remembered
    record = second.cache.drafts
    assert record.plain_step_remembered and record.rounds and record.fell_back_at is None
    assert record.draft_depth[1] != BACKBONE_CHOSE  # the token after the prompt's was drafted, not a probe step
    assert torch.equal(first.sequences, reference) and torch.equal(second.sequences, reference)
    assert not timed_call(model, prompt, clock, k=2).cache.drafts.plain_step_remembered


def test_a_fallback_forgets_t_plain_so_the_next_probe_times_the_backbone_again(prompt):
    model = river_of(tiny_model("llama"))
    timed_call(model, prompt, cheap_drafts_clock(model))  # drafting pays: t_plain remembered
    slow = slow_drafts_clock(model)
    record = timed_call(model, prompt, slow).cache.drafts  # now it does not: falls back
    assert record.plain_step_remembered and record.fell_back_at is not None
    assert timed_call(model, prompt, slow).cache.drafts.fallback_remembered  # the next call obeys the verdict
    record = timed_call(model, prompt, slow).cache.drafts  # then one probes again, timing the backbone afresh
    assert not record.plain_step_remembered and record.plain_steps >= PROBE_STEPS


def test_t_plain_is_timed_again_after_a_bounded_number_of_reuses():
    """A t_plain timed while the machine was busy would make drafting look cheap for good (no fallback would come to
    correct it): it is reused REUSES_OF_T_PLAIN times, then a call times the backbone again."""
    memory, paid = FallbackMemory(), DraftRecord(num_layers=4)
    memory.call_done(paid, 0.5)
    reused = [memory.remembered_plain_step() for _ in range(REUSES_OF_T_PLAIN + 1)]
    assert reused == [0.5] * REUSES_OF_T_PLAIN + [None]
    memory.call_done(paid, 0.7)  # the call that probed again
    assert memory.remembered_plain_step() == 0.7


def test_forget_fallbacks_makes_the_next_call_probe_afresh(prompt):
    from river_hf.lossless.decode import forget_fallbacks

    model = river_of(tiny_model("llama"))
    clock = slow_drafts_clock(model)
    timed_call(model, prompt, clock)  # falls back: the next call would obey the verdict
    forget_fallbacks(model)
    record = timed_call(model, prompt, clock).cache.drafts
    assert not record.fallback_remembered and record.plain_steps >= PROBE_STEPS and record.rounds
