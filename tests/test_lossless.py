"""Lossless mode (river_hf.lossless.decode): the river drafts, the backbone verifies, in one cache.

Its invariants: greedy output equals the backbone's token for token for any exit pattern; after generation the
cache equals the backbone's own cache of the same tokens (every position verified, KV complete); sampling follows
the backbone's distribution (the acceptance rule, checked statistically); the fallback keeps the output exact."""

from __future__ import annotations

import pytest
import torch
from transformers import StoppingCriteria, StoppingCriteriaList, TextStreamer

from river_hf import RiverConfig, RiverSettings
from river_hf.core.twins import get_river
from river_hf.lossless import exact_rows
from river_hf.lossless.acceptance import greedy_accept, speculative_accept
from river_hf.lossless.draft_control import BACKBONE_CHOSE, MIN_ROUNDS, PROBE_STEPS

from conftest import (ARCHITECTURES, NUM_LAYERS, cheap_drafts_clock, count_calls, generate, river_of, slow_drafts_clock,
                      tiny_model)

START = 2  # river_of's default start layer
NEW = 14


@pytest.fixture
def prompt():
    torch.manual_seed(1)
    return torch.randint(3, 256, (1, 9))


def backbone_and_river(arch="llama", prompt=None, new_tokens=NEW, **model_overrides):
    """(river model, the backbone's greedy output with its cache) for one tiny model."""
    model = tiny_model(arch, **model_overrides)
    reference = generate(model, prompt, max_new_tokens=new_tokens)
    return river_of(model), reference


def lossless(model, ids, k=4, fallback=False, **config):
    config.setdefault("max_new_tokens", NEW)
    return generate(model, ids, lossless=True, num_draft_tokens=k, draft_fallback=fallback, **config)


def assert_backbone_cache(cache, reference_cache, length):
    """The lossless cache holds the backbone's K/V at every position: the backbone's own cache of the same tokens."""
    cache.check_kv_integrity()
    assert cache.recorded_length == length and (cache.exit_depth == NUM_LAYERS).all()
    for idx, (ours, theirs) in enumerate(zip(cache.layers, reference_cache.layers, strict=True)):
        assert ours.get_seq_length() == theirs.get_seq_length() == length, idx
        kept = theirs.keys.shape[-2]  # sliding-window layers keep only their window
        for name in ("keys", "values"):  # bit for bit (river_hf.lossless.exact_rows)
            assert torch.equal(getattr(ours, name)[..., -kept:, :], getattr(theirs, name)), f"layer {idx} {name}"


# ---- greedy: the backbone's output, the backbone's cache --------------------------------------------------------
@pytest.mark.parametrize("arch", list(ARCHITECTURES))
@pytest.mark.parametrize("tau, k", [(-1.0, 1), (-1.0, 4), (2.0, 3)])
def test_greedy_equals_backbone_and_its_cache(arch, tau, k, prompt):
    model, reference = backbone_and_river(arch, prompt)
    out = lossless(model, prompt, k=k, tau=tau)
    assert torch.equal(out.sequences, reference.sequences)
    assert_backbone_cache(out.cache, reference.cache, out.sequences.shape[1] - 1)
    record = out.cache.drafts
    assert len(record.draft_depth) == NEW and record.rounds and record.drafted >= record.accepted
    if tau > 1:  # the drafts ran the whole backbone: every one is kept
        assert record.acceptance_rate == 1.0


@pytest.mark.parametrize("settings", [
    dict(exit_signal="random", exit_rate=0.6, seed=3, k=2),
    dict(exit_signal="random", exit_rate=1.0, seed=0, k="heuristic"),
    dict(exit_signal="confidence", tau=0.0, k=3),
    dict(exit_signal="cosine", tau=0.3, k=5),
])
def test_greedy_equals_backbone_for_other_exit_patterns(settings, prompt):
    model, reference = backbone_and_river("llama", prompt, new_tokens=20)
    out = lossless(model, prompt, max_new_tokens=20, **settings)
    assert torch.equal(out.sequences, reference.sequences)
    assert_backbone_cache(out.cache, reference.cache, out.sequences.shape[1] - 1)


def test_scripted_exits_and_the_draft_record(prompt, scripted_exits):
    plan = [2, 4, 6, 3, 2, 5] * 6  # per draft pass (backbone passes run without the router)
    model, reference = backbone_and_river("qwen2", prompt, new_tokens=20)
    out = lossless(model, prompt, k=3, max_new_tokens=20, exit_signal=scripted_exits(plan), tau=0.5)
    assert torch.equal(out.sequences, reference.sequences)
    record = out.cache.drafts
    drafted_depths = [depth for depth in record.draft_depth if depth != BACKBONE_CHOSE]
    assert len(drafted_depths) == record.accepted
    assert set(drafted_depths) <= {2, 3, 4, 5, NUM_LAYERS}  # 6 layers: a depth of 6 never exits
    # one token per backbone pass is the backbone's own (nothing stopped a round early here)
    assert record.draft_depth.count(BACKBONE_CHOSE) == record.backbone_passes
    summary = record.summary()
    assert summary["tokens_per_backbone_pass"] == 20 / record.backbone_passes
    assert summary["draft_seconds"] > 0 and summary["verify_seconds"] > 0


def test_auto_tau_drafts_every_token_from_the_start_layer(prompt):
    model, reference = backbone_and_river("llama", prompt, new_tokens=20)
    out = lossless(model, prompt, k=3, max_new_tokens=20)  # tau left at "auto"
    assert torch.equal(out.sequences, reference.sequences)
    kept_drafts = [depth for depth in out.cache.drafts.draft_depth if depth != BACKBONE_CHOSE]
    assert kept_drafts and set(kept_drafts) == {START}  # the explicit tau=-1, not a measured signal default
    assert get_river(model).exit_gain is None  # no exit-gain timing first


@pytest.mark.parametrize("new_tokens", [1, 2, 3, 6, 7])
def test_max_new_tokens_ending_mid_draft(new_tokens, prompt):
    model, reference = backbone_and_river("llama", prompt, new_tokens=new_tokens)
    out = lossless(model, prompt, k=4, tau=2.0, max_new_tokens=new_tokens)
    assert torch.equal(out.sequences, reference.sequences)
    assert_backbone_cache(out.cache, reference.cache, out.sequences.shape[1] - 1)


def test_eos_inside_a_draft(prompt):
    model = tiny_model()
    varied = dict(max_new_tokens=NEW, repetition_penalty=1.3)  # without it, this tiny model repeats two tokens
    plain = generate(model, prompt, **varied).sequences[0, prompt.shape[1]:].tolist()
    # the 4th new token is an EOS: with k=4 and drafts that never exit, it is the third draft of the first round
    eos = plain[3]
    assert eos not in plain[:3]
    stop = plain.index(eos)
    reference = generate(model, prompt, eos_token_id=eos, **varied)
    river_of(model)
    out = lossless(model, prompt, k=4, tau=2.0, eos_token_id=eos, **varied)
    assert torch.equal(out.sequences, reference.sequences)
    assert out.sequences.shape[1] == prompt.shape[1] + stop + 1
    record = out.cache.drafts
    assert record.draft_depth[-1] == NUM_LAYERS, "the EOS was a kept draft"
    assert record.rounds[-1].committed < record.rounds[-1].drafted + 1  # the round ended at the EOS
    assert_backbone_cache(out.cache, reference.cache, out.sequences.shape[1] - 1)


class StopAtLength(StoppingCriteria):
    def __init__(self, length):
        self.length = length

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.length, dtype=torch.bool)


def test_stopping_criteria_and_streamer_see_every_token(prompt):
    class Collect(TextStreamer):
        def __init__(self):
            self.tokens, self.ended = [], False

        def put(self, value):
            self.tokens.extend(value.flatten().tolist())

        def end(self):
            self.ended = True

    model = river_of(tiny_model())
    length = prompt.shape[1] + 7  # stops in the middle of the second round
    streamer = Collect()
    config = RiverConfig(tau=2.0, lossless=True, num_draft_tokens=5, draft_fallback=False, max_new_tokens=NEW,
                         do_sample=False)
    out = model.generate(prompt, generation_config=config, streamer=streamer,
                         stopping_criteria=StoppingCriteriaList([StopAtLength(length)]))
    plain = model.generate(prompt, max_new_tokens=NEW, do_sample=False,
                           stopping_criteria=StoppingCriteriaList([StopAtLength(length)]))
    assert torch.equal(out, plain) and out.shape[1] == length
    assert streamer.tokens == out[0].tolist() and streamer.ended  # the prompt, then each new token


def test_scores_and_logits_are_the_backbones(prompt):
    model = tiny_model()
    reference = generate(model, prompt, max_new_tokens=NEW, output_logits=True, output_scores=True,
                         repetition_penalty=1.3)
    river_of(model)
    out = lossless(model, prompt, k=3, tau=-1.0, output_logits=True, output_scores=True, repetition_penalty=1.3)
    assert torch.equal(out.sequences, reference.sequences)
    for ours, theirs in ((out.logits, reference.logits), (out.scores, reference.scores)):
        assert len(ours) == len(theirs) == NEW
        torch.testing.assert_close(torch.cat(ours), torch.cat(theirs), atol=1e-4, rtol=1e-4)


def test_confidence_signal_reads_the_logits_of_the_last_kept_token(prompt):
    model = river_of(tiny_model())
    out = lossless(model, prompt, k=4, tau=-1.0, max_new_tokens=11, exit_signal="confidence", output_logits=True)
    last = out.cache.drafts.rounds[-1]
    assert last.committed < last.drafted + 1, "the last round must reject a draft for this test to mean anything"
    expected = torch.softmax(out.logits[-1].float(), dim=-1).amax(dim=-1)
    torch.testing.assert_close(out.cache.router.signal.last_confidence, expected)


# ---- the fallback rule ------------------------------------------------------------------------------------------
def timed_lossless(model, ids, clock):
    """k=4, tau=-1, 24 tokens, with the fallback, timed by `clock` (generate's `draft_clock`)."""
    config = RiverConfig(tau=-1.0, exit_signal="cosine", lossless=True, num_draft_tokens=4, max_new_tokens=24,
                         do_sample=False, return_dict_in_generate=True)
    return model.generate(ids, generation_config=config, draft_clock=clock)


def test_fallback_engages_when_drafting_costs_more_and_output_stays_exact(prompt):
    model, reference = backbone_and_river("llama", prompt, new_tokens=24)
    out = timed_lossless(model, prompt, slow_drafts_clock(model))
    record = out.cache.drafts
    assert torch.equal(out.sequences, reference.sequences)
    assert record.plain_steps >= PROBE_STEPS and len(record.rounds) == MIN_ROUNDS
    assert record.fell_back_at == 1 + PROBE_STEPS + sum(r.committed for r in record.rounds)
    assert record.plain_steps == 24 - record.fell_back_at + PROBE_STEPS
    assert_backbone_cache(out.cache, reference.cache, out.sequences.shape[1] - 1)


def test_no_fallback_while_drafting_pays(prompt):
    model, reference = backbone_and_river("llama", prompt, new_tokens=24)
    out = timed_lossless(model, prompt, cheap_drafts_clock(model))
    record = out.cache.drafts
    assert torch.equal(out.sequences, reference.sequences)
    assert record.fell_back_at is None and record.plain_steps == PROBE_STEPS and len(record.rounds) > MIN_ROUNDS


def test_the_row_probe_is_not_priced_into_a_round(prompt, monkeypatch):
    """Which linears must run row by row is probed once per row count (exact_rows.batch_invariant, 35-71 ms on
    SmolLM2). Timed inside a verification it made new draft lengths look slow, and the fallback ended drafting on a
    machine where it pays: each probe here costs 1000 clock units, and no round may carry them."""
    model, reference = backbone_and_river("llama", prompt, new_tokens=24)
    passes, probes = count_calls(model), [0]
    probe = exact_rows.batch_invariant

    def costly_probe(linear, rows):
        probes[0] += 1000
        return probe(linear, rows)
    monkeypatch.setattr(exact_rows, "batch_invariant", costly_probe)
    exact_rows.forget_probes()  # probe again, as a fresh process does
    out = timed_lossless(model, prompt, lambda: passes[0] + probes[0])
    assert torch.equal(out.sequences, reference.sequences)
    assert probes[0] > 0 and out.cache.drafts.rounds
    assert all(r.verify_seconds < 1000 and r.draft_seconds < 1000 for r in out.cache.drafts.rounds)


# ---- sampling: the acceptance rule ------------------------------------------------------------------------------
P = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.1, 0.2, 0.3, 0.4], [0.25, 0.25, 0.25, 0.25]])  # target, per position
Q = torch.tensor([[0.1, 0.6, 0.2, 0.1], [0.4, 0.3, 0.2, 0.1]])  # draft, per position


def sample_rounds(trials, generator):
    """Many rounds of speculative_accept with drafts sampled from Q: (first tokens, second tokens | first kept, n)."""
    first, second, kept = torch.zeros(4), torch.zeros(4), 0
    for _ in range(trials):
        drafts = torch.stack([torch.multinomial(row, 1, generator=generator)[0] for row in Q])
        n, tokens = speculative_accept(drafts, Q, P, generator=generator)
        first[tokens[0]] += 1
        if n >= 1:
            second[tokens[1]] += 1
        kept += n
    return first / trials, second / second.sum(), kept


def test_speculative_acceptance_follows_the_target_distribution():
    generator = torch.Generator().manual_seed(0)
    trials = 20000
    first, second, kept = sample_rounds(trials, generator)
    # each appended token follows the backbone's p, whatever the draft (3 sigma of a frequency: < 0.011)
    torch.testing.assert_close(first, P[0], atol=0.011, rtol=0)
    torch.testing.assert_close(second, P[1], atol=0.02, rtol=0)
    assert (first - Q[0]).abs().max() > 0.3  # the draft's own distribution would fail the check above
    # the first draft is kept with probability sum(min(p, q)) = 0.55
    accept_first = torch.minimum(P[0], Q[0]).sum().item()
    assert abs(kept / trials - accept_first * (1 + torch.minimum(P[1], Q[1]).sum().item())) < 0.02


def test_greedy_acceptance_keeps_the_agreeing_prefix():
    scores = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 1.0], [0.0, 0.0, 9.0]])  # argmax: 1, 0, 2
    assert [x.tolist() if hasattr(x, "tolist") else x for x in greedy_accept(torch.tensor([1, 0]), scores)] == \
        [2, [1, 0, 2]]
    n, tokens = greedy_accept(torch.tensor([1, 2]), scores)
    assert n == 1 and tokens.tolist() == [1, 0]
    n, tokens = greedy_accept(torch.tensor([2, 0]), scores)
    assert n == 0 and tokens.tolist() == [1]


def test_sampling_end_to_end_follows_the_backbone(prompt):
    """The second new token (the first one a draft round decides) over many seeded calls, against the backbone's
    own distribution for it given the first; 2-bit twins and a low temperature make the draft's differ."""
    model = river_of(tiny_model(vocab_size=8, eos_token_id=None), nbits=2, group_size=32)
    ids = prompt % 5 + 3
    runs, temperature = 200, 0.15
    sequences = []
    for seed in range(runs):
        torch.manual_seed(seed)
        sequences.append(lossless(model, ids, k=1, tau=-1.0, max_new_tokens=2, do_sample=True,
                                  temperature=temperature, top_k=0).sequences[0])
    sequences = torch.stack(sequences)  # [runs, P + 2]
    counts = torch.bincount(sequences[:, -1], minlength=8) / runs
    with torch.no_grad():  # the distributions of the second token given each run's first: backbone, then draft
        expected = torch.softmax(model(sequences[:, :-1]).logits[:, -1] / temperature, dim=-1).mean(0)
        draft_logits = model(sequences[:, :-1], cache=_river_cache(model)).logits[:, -1]
        draft = torch.softmax(draft_logits / temperature, dim=-1).mean(0)
    assert (counts - expected).abs().max() < 0.11  # about 3 sigma of a frequency at 200 runs
    assert (draft - expected).abs().max() > 0.3, "the draft must differ for this test to mean anything"


def _river_cache(model):
    from river_hf.core.generation import new_river_cache

    return new_river_cache(model, RiverSettings(tau=-1.0, exit_signal="cosine"))


# ---- bad input ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fields, message", [
    (dict(num_draft_tokens=0), "`num_draft_tokens` must be an int >= 1"),
    (dict(num_draft_tokens="often"), "`num_draft_tokens` must be an int >= 1"),
    (dict(lossless="yes"), "`lossless` must be True or False"),
    (dict(lossless=True, kv_strategy="mask"), "needs `kv_strategy`='river'"),
])
def test_bad_settings_name_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        RiverSettings(**fields)


def test_bad_calls_name_the_field(prompt):
    model = river_of(tiny_model())
    with pytest.raises(ValueError, match="`input_ids`: lossless mode supports batch size 1 only"):
        lossless(model, prompt.repeat(2, 1))
    with pytest.raises(ValueError, match="`num_beams`=2"):
        lossless(model, prompt, num_beams=2)
    with pytest.raises(ValueError, match="`output_attentions`"):
        lossless(model, prompt, output_attentions=True)
    from river_hf import RiverCache

    config = RiverConfig(lossless=True, max_new_tokens=3)
    with pytest.raises(ValueError, match="`cache`: lossless mode runs on the LosslessCache"):
        model.generate(prompt, generation_config=config, cache=RiverCache(config=model.config))


# ---- the command line ---------------------------------------------------------------------------------------------
def test_generate_and_bench_take_lossless(tmp_path, capsys):
    import json

    from river_hf.cli import main

    from conftest import save_tiny_model

    model_dir = save_tiny_model(tmp_path / "tiny")
    assert main(["generate", "what is two plus three?", "--model", model_dir, "--max-new-tokens", "6",
                 "--lossless", "2", "--tau", "-1", "--backend", "auto"]) == 0
    assert "lossless: " in capsys.readouterr().out
    data = tmp_path / "q.jsonl"
    data.write_text(json.dumps({"question": "what is two plus three?"}) + "\n")
    output = tmp_path / "lossless.json"
    assert main(["bench", "--model", model_dir, "--data", str(data), "--lossless", "2", "heuristic", "--taus", "-1",
                 "--prompts", "1", "--rounds", "1", "--max-new-tokens", "8", "--backend", "auto",
                 "--output", str(output)]) == 0
    record = json.loads(output.read_text())
    names = [system["name"] for system in record["systems"]]
    variants = ("", " (no fallback)", " (no fallback, batched verify)")
    assert names == ["backbone"] + [f"lossless k={k} cosine tau=-1{suffix}" for k in (2, "heuristic")
                                    for suffix in variants]
    for system in record["systems"]:
        assert system["summary"]["match"] == 1.0
    no_fallback = record["systems"][2]["summary"]
    assert no_fallback["runs_fell_back"] == 0 and no_fallback["tokens_per_backbone_pass"] >= 1.0
    assert "| lossless k=2 cosine tau=-1 |" in capsys.readouterr().out


def test_generate_refuses_lossless_without_the_river(capsys):
    from river_hf.cli import main

    with pytest.raises(SystemExit):
        main(["generate", "hi", "--lossless", "0"])
    assert "--lossless: expected an int >= 1" in capsys.readouterr().err


@pytest.mark.parametrize("arguments, expected", [
    ([], [("confidence", -1.0)]),  # the mode's own default drafts
    (["--taus", "0.9"], [("cosine", 0.9)]),
    (["--signals", "confidence", "--signal-taus", "0.3", "-1"], [("confidence", 0.3), ("confidence", -1.0)]),
])
def test_bench_lossless_benches_the_default_drafts_unless_told(arguments, expected):
    from river_hf.cli import build_parser
    from river_hf.cli.commands.bench import lossless_signal_taus

    args = build_parser().parse_args(["bench", "--lossless", "8", *arguments])
    assert lossless_signal_taus(args) == expected
