"""Exit signals (`river_hf.core.signals`): each signal's decision on hand-made hidden states, the router's rules around
them, and the signals end to end in `generate` on a tiny model."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

import river_hf
from river_hf import RiverQuantConfig, RiverSettings
from river_hf.core.river import River
from river_hf.core.twins import get_river
from river_hf.core.exit_decision import ExitRouter
from river_hf.core.signals import (Cosine, CosineAtOneLayer, PreviousConfidence, RandomExit, UpdateNorm, make_signal,
    signal_names, sequence_update_norm, token_update_norm)

from conftest import (
    confidence_tau,
    count_twin_calls,
    decoded_depths,
    generate,
    mixed_tau,
    river_of,
    run_step,
    states_with_cosines,
    step_confidences,
    tiny_model,
)

PASS, FAIL = states_with_cosines([0.99]), states_with_cosines([0.5])  # against tau = 0.9


def decode_step(signal, min_depth=1):
    signal.begin_step(is_prefill=False, min_depth=min_depth)
    return signal


# ---- cosine ------------------------------------------------------------------------------------------------------
def test_cosine_passes_strictly_above_tau():
    signal = decode_step(Cosine(0.9))
    assert signal.decide(1, *states_with_cosines([0.91]), None)
    assert not signal.decide(1, *states_with_cosines([0.89]), None)
    assert signal.decide(5, *PASS, None) and not signal.decide(5, *FAIL, None)  # at every depth


def test_cosine_takes_the_batch_min():
    signal = decode_step(Cosine(0.9))
    assert signal.decide(1, *states_with_cosines([0.95, 0.99]), None)
    assert not signal.decide(1, *states_with_cosines([0.95, 0.85]), None)


def test_cosine_prefill_uses_the_mean_over_real_tokens():
    h_in = torch.cat([states_with_cosines([0.0])[0]] * 3, dim=1)  # [1, 3, D]
    h_out = torch.cat([states_with_cosines([c])[1] for c in (-1.0, 0.5, 0.7)], dim=1)
    mask = torch.tensor([[0, 1, 1]])  # the padded position's -1 does not count: mean 0.6
    for tau, passes in ((0.55, True), (0.65, False)):
        signal = Cosine(tau)
        signal.begin_step(is_prefill=True, min_depth=1)
        assert signal.decide(1, h_in, h_out, mask) == passes


# ---- cosine_first ------------------------------------------------------------------------------------------------
def test_cosine_first_decides_only_at_signal_layer():
    signal = decode_step(CosineAtOneLayer(0.9, signal_layer=3), min_depth=1)
    # before and after depth 3 nothing is computed (None states would fail), and nothing exits
    assert not signal.decide(1, None, None, None) and not signal.decide(2, None, None, None)
    assert signal.decide(3, *PASS, None)
    assert not signal.decide(3, *FAIL, None)
    assert not signal.decide(4, None, None, None) and not signal.decide(5, None, None, None)


def test_cosine_first_defaults_to_the_first_eligible_depth_and_is_lifted_to_it():
    assert decode_step(CosineAtOneLayer(0.9), min_depth=2).decision_depth == 2
    assert decode_step(CosineAtOneLayer(0.9, signal_layer=1), min_depth=3).decision_depth == 3
    assert decode_step(CosineAtOneLayer(0.9, signal_layer=4), min_depth=3).decision_depth == 4


def test_cosine_first_in_the_router_never_exits_after_a_failed_check():
    router = ExitRouter(RiverSettings(tau=0.9, exit_signal="cosine_first"), start_layer=2, num_layers=6)
    assert run_step(router, [[0.1], [0.95], [0.1], [0.1], [0.1], [0.1]]) == 2
    assert run_step(router, [[0.1], [0.5], [0.99], [0.99], [0.99], [0.99]]) == 6  # failed at 2: no later exit
    at_four = ExitRouter(RiverSettings(tau=0.9, exit_signal="cosine_first", signal_layer=4), 2, 6)
    assert run_step(at_four, [[0.99]] * 6) == 4
    assert run_step(at_four, [[0.99], [0.99], [0.99], [0.5], [0.99], [0.99]]) == 6
    # the paper's, for contrast: exits at the next passing layer
    cosine = ExitRouter(RiverSettings(exit_signal="cosine", tau=0.9), 2, 6)
    assert run_step(cosine, [[0.1], [0.5], [0.99], [0.99], [0.99], [0.99]]) == 3


# ---- update_norm -------------------------------------------------------------------------------------------------
def states_with_updates(update_sizes: list[float], dim: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """h_in = (3, 4, 0, ...) (norm 5) and h_out = h_in + an orthogonal update of the given norm, per row: [B, 1, D]."""
    h_in = torch.zeros(len(update_sizes), 1, dim)
    h_in[:, 0, 0], h_in[:, 0, 1] = 3.0, 4.0
    h_out = h_in.clone()
    h_out[:, 0, 2] = torch.tensor(update_sizes)
    return h_in, h_out


def test_update_norm_score_is_exact():
    h_in, h_out = states_with_updates([0.0, 0.5, 2.5, 10.0])
    assert torch.allclose(token_update_norm(h_in, h_out), torch.tensor([1.0, 0.9, 0.5, -1.0]), atol=1e-6)
    # scaling h_in keeps the cosine at 1 but is a full-size update: update_norm sees it, the cosine does not
    assert torch.allclose(token_update_norm(h_in, 2 * h_in), torch.zeros(4), atol=1e-6)
    assert token_update_norm(h_in.bfloat16(), h_out.bfloat16()).dtype == torch.float32


def test_update_norm_decides_above_tau_with_the_batch_min():
    signal = decode_step(UpdateNorm(0.8))
    assert signal.decide(1, *states_with_updates([0.5]), None)  # 0.9 > 0.8
    assert not signal.decide(1, *states_with_updates([0.5, 2.5]), None)  # min 0.5
    assert not decode_step(UpdateNorm(0.95)).decide(1, *states_with_updates([0.5]), None)


def test_update_norm_prefill_uses_the_mean_over_real_tokens():
    rows = [states_with_updates([size]) for size in (25.0, 0.5, 1.5)]  # scores -4 (padding), 0.9, 0.7
    h_in, h_out = torch.cat([r[0] for r in rows], dim=1), torch.cat([r[1] for r in rows], dim=1)
    mask = torch.tensor([[0, 1, 1]])
    assert sequence_update_norm(h_in, h_out, mask).item() == pytest.approx(0.8, abs=1e-6)
    signal = UpdateNorm(0.75)
    signal.begin_step(is_prefill=True, min_depth=1)
    assert signal.decide(1, h_in, h_out, mask)
    signal.tau = 0.85
    assert not signal.decide(1, h_in, h_out, mask)


# ---- tau extremes ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("make", [Cosine, UpdateNorm, CosineAtOneLayer], ids=["cosine", "update_norm", "first"])
def test_tau_extremes_compute_no_score(make):
    """tau > 1 never exits and tau <= -1 always does, without touching the hidden states (None would fail)."""
    for is_prefill in (False, True):
        never, always = make(1.01), make(-1.0)
        never.begin_step(is_prefill, min_depth=2)
        always.begin_step(is_prefill, min_depth=2)
        assert not any(never.decide(depth, None, None, None) for depth in range(2, 6))
        assert always.decide(2, None, None, None)


# ---- random ------------------------------------------------------------------------------------------------------
def simulate_random(exit_rate, seed, steps=2000, min_depth=2, num_layers=10) -> list[int]:
    """Exit depth of each simulated decode step (num_layers: stayed on the backbone), as the router would call it."""
    signal = RandomExit(exit_rate, num_layers, seed)
    depths = []
    for _ in range(steps):
        signal.begin_step(is_prefill=False, min_depth=min_depth)
        depths.append(next((d for d in range(min_depth, num_layers) if signal.decide(d, None, None, None)),
                           num_layers))
    return depths


def test_random_exits_at_the_rate_over_the_eligible_depths_uniformly():
    depths = simulate_random(0.3, seed=0)
    exited = [d for d in depths if d < 10]
    assert len(exited) / len(depths) == pytest.approx(0.3, abs=0.04)
    counts = Counter(exited)
    assert set(counts) == set(range(2, 10))  # never below min_depth, never the last layer
    expected = len(exited) / 8
    assert all(0.6 * expected < count < 1.4 * expected for count in counts.values()), counts


def test_random_is_reproducible_by_seed():
    assert simulate_random(0.3, seed=1) == simulate_random(0.3, seed=1)
    assert simulate_random(0.3, seed=1) != simulate_random(0.3, seed=2)
    assert simulate_random(0.3, seed=None, steps=200) != simulate_random(0.3, seed=None, steps=200)


def test_random_rate_extremes_and_nesting():
    assert set(simulate_random(0.0, seed=0)) == {10}
    assert all(d < 10 for d in simulate_random(1.0, seed=0))
    low, high = simulate_random(0.2, seed=3), simulate_random(0.6, seed=3)
    assert all(h == l for l, h in zip(low, high) if l < 10)  # same seed: a higher rate exits a superset


def test_random_in_the_router_keeps_the_routers_rules():
    settings = RiverSettings(tau=0.975, exit_signal="random", exit_rate=1.0, seed=0)
    router = ExitRouter(settings, start_layer=2, num_layers=6)
    router.min_depth = 4  # a KV strategy raised it
    depths = []
    for _ in range(200):
        router.begin_step(1, is_first_step=False)
        for layer_idx in range(6):
            router.observe(layer_idx, None, None)  # it reads no hidden state
        depths.append(router.depth)
    assert set(depths) == {4, 5}
    never = ExitRouter(RiverSettings(tau=0.975, exit_signal="random", exit_rate=0.0, seed=0), 2, 6)
    never.begin_step(1, is_first_step=False)
    never.depth_cap = 3  # a KV strategy's cap still forces the exit
    for layer_idx in range(6):
        never.observe(layer_idx, None, None)
    assert never.depth == 3
    prefill = ExitRouter(RiverSettings(tau=0.975, exit_signal="random", exit_rate=1.0, prefill_exit="none"), 2, 6)
    prefill.begin_step(5, is_first_step=True)
    for layer_idx in range(6):
        prefill.observe(layer_idx, None, None)
    assert prefill.depth == 6


# ---- the factory -------------------------------------------------------------------------------------------------
def test_make_signal_builds_each_named_signal():
    kinds = {"cosine": Cosine, "cosine_first": CosineAtOneLayer, "update_norm": UpdateNorm, "random": RandomExit,
             "confidence": PreviousConfidence}
    assert set(kinds) == set(signal_names())
    for name, cls in kinds.items():
        assert type(make_signal(RiverSettings(tau=0.9, exit_signal=name, exit_rate=0.5), num_layers=6)) is cls
    assert make_signal(RiverSettings(tau=0.9, exit_signal="cosine_first", signal_layer=3), 6).signal_layer == 3
    with pytest.raises(ValueError, match="exit_rate"):
        make_signal(RiverSettings(tau=0.9, exit_signal="random"), 6)
    with pytest.raises(ValueError, match="exit_signal"):
        make_signal(RiverSettings(tau=0.9, exit_signal="entropy"), 6)


def test_a_registered_signal_is_asked_by_name_inside_the_routers_rules(scripted_exits):
    name = scripted_exits([1, 3, 6, 4])  # river_hf.register_signal, through the conftest fixture
    assert name in signal_names()
    router = ExitRouter(RiverSettings(tau=0.9, exit_signal=name, prefill_exit="sequence"), start_layer=2,
                        num_layers=6)
    assert run_step(router, [[0.0]] * 6, num_new_tokens=5, first=True) == 6  # its prompts never exit
    assert [run_step(router, [[0.0]] * 6) for _ in range(3)] == [2, 3, 6]  # depth 1 is lifted to the minimum
    router.min_depth = 5  # a KV strategy raised it
    assert run_step(router, [[0.0]] * 6) == 5
    with pytest.raises(ValueError, match="ExitSignal subclass with a `name`"):
        river_hf.register_signal(object)


def test_an_unregistered_signal_is_gone_and_built_ins_stay(scripted_exits):
    name = scripted_exits([2])
    river_hf.unregister_signal(name)
    assert name not in signal_names()
    with pytest.raises(ValueError, match="`exit_signal`"):
        RiverSettings(exit_signal=name)
    with pytest.raises(ValueError, match="built in"):
        river_hf.unregister_signal("cosine")
    assert "cosine" in signal_names()


# ---- end to end ------------------------------------------------------------------------------------------------
START = 2  # river_of's default start layer


def test_random_signal_end_to_end(prompt_ids):
    model = river_of(tiny_model(), start_layer=START)
    config = dict(exit_signal="random", exit_rate=0.5, seed=0, max_new_tokens=40)
    out = generate(model, prompt_ids, **config)
    cache = out.cache
    assert 0.3 <= cache.exit_share() <= 0.7
    out.cache.check_kv_integrity()
    # the record is exactly the seeded generator's draws: the prefill step's, then one per decode step
    simulated = RandomExit(0.5, num_layers=6, seed=0)
    steps = [cache.exit_depth[0, :cache.prompt_length]] + list(cache.exit_depth[0, cache.prompt_length:].split(1))
    for step, (depths, is_prefill) in enumerate(zip(steps, [True] + [False] * (len(steps) - 1))):
        simulated.begin_step(is_prefill, min_depth=START)
        expected = simulated.drawn_depth if simulated.drawn_depth is not None else 6
        assert (depths == expected).all(), f"step {step}"
    again = generate(model, prompt_ids, **config)
    assert torch.equal(again.sequences, out.sequences)
    assert torch.equal(again.cache.exit_depth, cache.exit_depth)
    other = generate(model, prompt_ids, **{**config, "seed": 1})
    assert not torch.equal(other.cache.exit_depth, cache.exit_depth)


@pytest.mark.parametrize("signal", [dict(exit_signal="cosine", tau=1.5), dict(exit_signal="cosine_first", tau=1.5),
                                    dict(exit_signal="update_norm", tau=1.5), dict(exit_signal="confidence", tau=1.5),
                                    dict(exit_signal="random", exit_rate=0.0, seed=0)],
                         ids=lambda signal: signal["exit_signal"])
def test_every_signal_that_never_exits_is_the_backbone(signal, prompt_ids):
    model = tiny_model()
    expected = generate(model, prompt_ids).sequences
    calls = count_twin_calls(river_of(model, start_layer=START))
    out = generate(model, prompt_ids, **signal)
    assert torch.equal(out.sequences, expected)
    assert calls[0] == 0 and (out.cache.exit_depth == 6).all()


def test_cosine_first_and_update_norm_end_to_end(prompt_ids):
    model = river_of(tiny_model(), start_layer=START)
    tau = mixed_tau(model, prompt_ids, start_layer=START)
    for signal_layer, allowed in ((None, {START, 6}), (4, {4, 6})):
        out = generate(model, prompt_ids, tau=tau, exit_signal="cosine_first", signal_layer=signal_layer,
                       max_new_tokens=24)
        assert set(decoded_depths(out.cache).unique().tolist()) <= allowed
        out.cache.check_kv_integrity()
    out = generate(model, prompt_ids, tau=0.0, exit_signal="update_norm", max_new_tokens=24)
    assert out.cache.exit_depth.min() >= START
    out.cache.check_kv_integrity()


# ---- confidence: the previous token's top-1 probability ------------------------------------------------------------
def test_confidence_decides_once_at_the_first_eligible_depth_from_the_last_pass():
    signal = PreviousConfidence(tau=0.6)
    signal.begin_step(is_prefill=False, min_depth=2)
    assert not signal.decide(2, None, None, None)  # no previous pass yet
    signal.observe_logits(torch.tensor([[0.9, 0.1], [0.7, 0.3]]).log()[:, None])  # [B, T, V]
    assert signal.decide(2, None, None, None) and not signal.decide(3, None, None, None)
    signal.last_confidence = torch.tensor([0.9, 0.5])  # batch min
    assert not signal.decide(2, None, None, None)
    signal.begin_step(is_prefill=True, min_depth=2)
    signal.last_confidence = torch.tensor([1.0, 1.0])
    assert not signal.decide(2, None, None, None)  # a prompt has no previous token


def test_confidence_end_to_end_exits_exactly_after_confident_steps(prompt_ids):
    """Step t exits (at the first eligible depth) iff every row's top-1 probability at step t-1 exceeded tau."""
    model = river_of(tiny_model(), start_layer=START)
    tau = confidence_tau(model, prompt_ids, max_new_tokens=16)  # the median of the backbone's confidences
    out = generate(model, prompt_ids, tau=tau, exit_signal="confidence", max_new_tokens=16, output_logits=True)
    seen = step_confidences(out.logits)
    depths = decoded_depths(out.cache)[0]
    assert depths.tolist() == [START if conf > tau else 6 for conf in seen[:-1].tolist()]
    assert {START, 6} <= set(depths.tolist())
    assert (out.cache.exit_depth[:, :out.cache.prompt_length] == 6).all()


def test_remove_river_removes_the_pass_hooks(prompt_ids):
    model = river_of(tiny_model(), start_layer=START)
    assert len(model._forward_pre_hooks) == 1 and len(model._forward_hooks) == 1
    assert len(get_river(model).pass_hooks) == 2
    river_hf.remove_river(model)
    assert len(model._forward_pre_hooks) == 0 and len(model._forward_hooks) == 0


def test_one_river_object_per_river_shared_by_its_layers_and_made_afresh_by_a_rebuild():
    """River-wide state lives in one `River` (core.river), not on a layer or the HF model: every RiverLayer of a
    river holds the same one; what it learned (ExitGain, lossless verdicts) goes with remove_river."""
    model = river_of(tiny_model(), start_layer=START)
    river = get_river(model)
    assert all(layer.river is river for layer in river_hf.river_layers(model))
    river.exit_gain = "measured"
    river_hf.remove_river(model)
    rebuilt = river_hf.build_river(model, RiverQuantConfig(start_layer=START, nbits=4, group_size=32),
                                   progress=False)
    assert get_river(rebuilt) is not river and get_river(rebuilt).exit_gain is None
    assert not any(isinstance(value, River) for value in vars(rebuilt).values())  # nothing hung on the HF model
