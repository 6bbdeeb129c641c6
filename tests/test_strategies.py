"""The five KV strategies under one API: each one's own invariant, on tiny random models."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import river_hf
from river_hf import RiverCache, RiverConfig
from river_hf.core import kv_strategies as strategies_module
from river_hf.core.generation import new_river_cache
from river_hf.core.kv_strategies import strategy_names

from conftest import ARCHITECTURES, NUM_LAYERS as LAYERS, count_calls, decoded_depths, generate, river_of, tiny_model

FULL_ATTENTION_ONLY = ("recompute", "mask")
QUANT = dict(start_layer=1, group_size=32)
# Any exit pattern, whatever the hidden states: decode steps exit at random eligible depths (the seeded "random"
# signal); the baselines' prompts stay on the backbone (their rule), the river's may exit too.
RANDOM_EXITS = dict(exit_signal="random", exit_rate=0.6, seed=0)

# one exit depth per decode step (6 = no exit); ends shallow, so tokens still wait for recompute at the end
SCRIPT = [2, 4, 1, 6, 3, 1, 5, 2, 2, 6, 1, 3, 4, 1, 2, 5, 3, 1, 2]


# ---------------------------------------------------------------- shared behaviour


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
@pytest.mark.parametrize("strategy", strategy_names())
def test_every_strategy_at_tau_above_one_equals_the_plain_model(arch, strategy, prompt_ids):
    model = tiny_model(arch)
    expected = generate(model, prompt_ids, max_new_tokens=16).sequences
    river_of(model, **QUANT)
    if arch == "gemma3" and strategy in FULL_ATTENTION_ONLY:
        with pytest.raises(ValueError, match="sliding-window"):
            generate(model, prompt_ids, tau=1.5, kv_strategy=strategy, max_new_tokens=16)
        return
    out = generate(model, prompt_ids, tau=1.5, kv_strategy=strategy, max_new_tokens=16)
    assert torch.equal(out.sequences, expected)
    assert (out.cache.exit_depth == LAYERS).all()
    out.cache.check_kv_integrity()


def test_bad_strategy_name_lists_the_valid_ones():
    with pytest.raises(ValueError, match="`kv_strategy`='skip'.*'river', 'recompute', 'state_propagation', 'mask'"):
        RiverConfig(kv_strategy="skip")


@pytest.mark.parametrize("strategy", ["recompute", "state_propagation", "mask", "mono_decreasing"])
def test_baselines_run_the_prompt_on_the_full_backbone(strategy, prompt_ids):
    model = river_of(tiny_model(), **QUANT)
    out = generate(model, prompt_ids, tau=-1, kv_strategy=strategy)
    assert (out.cache.exit_depth[:, :out.cache.prompt_length] == LAYERS).all()
    assert (decoded_depths(out.cache) < LAYERS).all()


def test_profile_splits_backbone_and_skipped_time(prompt_ids):
    model = river_of(tiny_model(), **QUANT)
    cache = RiverCache(config=model.config, profile=True)  # generate hands it its run and it keeps profiling
    model.generate(prompt_ids, max_new_tokens=8, do_sample=False, cache=cache, tau=-1, exit_signal="cosine")
    assert cache.run.router is not None and cache.profile
    assert cache.seconds["backbone"] > 0 and cache.seconds["skipped"] > 0


def test_a_cache_holds_one_run_and_a_backbone_pass_restores_it(prompt_ids):
    model = river_of(tiny_model(), **QUANT)
    cache = new_river_cache(model, RiverConfig(tau=-1, exit_signal="cosine").river_settings())
    run = cache.run
    assert (cache.router, cache.strategy, cache.profile) == (run.router, run.strategy, False)
    with cache.backbone_pass():
        assert cache.router is None and cache.strategy is run.strategy
    assert cache.run is run
    with pytest.raises(AttributeError):
        cache.router = None  # the run is the one place the call's decisions live


def test_min_exit_layer_too_deep_is_a_clear_error(prompt_ids):
    model = river_of(tiny_model(), **QUANT)
    with pytest.raises(ValueError, match="`min_exit_layer`=6"):
        generate(model, prompt_ids, tau=-1, min_exit_layer=6)


# ---------------------------------------------------------------- recompute


def plain_cache_of(model, sequences, mask) -> DynamicCache:
    """The backbone's own K/V for every position of `sequences` (one full forward)."""
    position_ids = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 1)  # as generate numbers left-padded rows
    with river_hf.core.twins.backbone_layers(model), torch.no_grad():
        return model(sequences, attention_mask=mask, position_ids=position_ids, cache=DynamicCache(),
                     use_cache=True).cache


@pytest.mark.parametrize("padded", [False, True])
def test_recompute_fills_every_hole_with_the_backbones_exact_kv(padded, prompt_ids, left_padded_batch,
                                                               scripted_exits):
    """Recompute only delays K/V: once the waiting tokens are flushed, the cache equals the backbone's own cache of
    the same tokens (the exited tokens' hidden states at their exit layer are exact, and so is every layer after)."""
    ids, mask = left_padded_batch if padded else (prompt_ids, torch.ones_like(prompt_ids))
    model = river_of(tiny_model(), **QUANT)
    out = generate(model, ids, mask, max_new_tokens=len(SCRIPT) + 1, kv_strategy="recompute",
                   exit_signal=scripted_exits(SCRIPT))  # decode step i exits at SCRIPT[i]; the prompt does not
    cache = out.cache
    assert decoded_depths(cache)[0].tolist() == SCRIPT
    holes = [cache.recorded_length - layer.get_seq_length() for layer in cache.layers]
    assert max(holes) > 0  # some tokens were still waiting for their deeper layers
    cache.check_kv_integrity()  # ... exactly where the strategy says they wait
    cache.flush_pending()
    assert all(layer.get_seq_length() == cache.recorded_length for layer in cache.layers)
    fed = out.sequences[:, :-1]  # the last generated token was never fed back
    full_mask = torch.cat([mask, torch.ones_like(fed[:, mask.shape[1]:])], dim=1)
    reference = plain_cache_of(model, fed, full_mask)
    real = full_mask.bool()  # padding K/V is never attended and may differ
    for idx, (layer, expected) in enumerate(zip(cache.layers, reference.layers)):
        for name in ("keys", "values"):
            got, want = getattr(layer, name).transpose(1, 2)[real], getattr(expected, name).transpose(1, 2)[real]
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4, msg=f"{name} of layer {idx}")


def test_recompute_refuses_beam_search_before_anything_runs(prompt_ids):
    model = river_of(tiny_model(), **QUANT)
    calls = count_calls(model)
    with pytest.raises(ValueError, match="`kv_strategy`='recompute'.*num_beams=2"):
        generate(model, prompt_ids, kv_strategy="recompute", **RANDOM_EXITS, num_beams=2, max_new_tokens=12)
    assert calls == [0]
    model.generation_config.num_beams = 2  # the model's own default counts too
    with pytest.raises(ValueError, match="num_beams=2"):
        generate(model, prompt_ids, kv_strategy="recompute", **RANDOM_EXITS, max_new_tokens=12)


# ---------------------------------------------------------------- state propagation


def test_state_propagation_writes_kv_of_the_exit_state_and_skips_attention_and_mlp(prompt_ids):
    model = river_of(tiny_model(), **QUANT)
    layers = river_hf.river_layers(model)
    exit_states, mlp_calls = [], [0] * LAYERS
    # the last layer's input is the state the token exited with (skipped layers pass it on unchanged)
    layers[-1].register_forward_pre_hook(lambda module, args, kwargs: exit_states.append(args[0]), with_kwargs=True)
    for idx, layer in enumerate(layers):
        layer.base_layer.mlp.register_forward_hook(lambda *_, idx=idx: mlp_calls.__setitem__(idx, mlp_calls[idx] + 1))
    out = generate(model, prompt_ids, kv_strategy="state_propagation", **RANDOM_EXITS, max_new_tokens=20)
    cache = out.cache
    cache.check_kv_integrity()
    steps = cache.exit_depth[0, cache.prompt_length - 1:]  # one depth per forward: the prompt's, then each token's
    depth_of_step = [LAYERS] + decoded_depths(cache)[0].tolist()
    assert depth_of_step[1:] == steps[1:].tolist() and min(depth_of_step) < LAYERS
    for idx in range(LAYERS):  # the MLP ran only for steps that reached the layer
        assert mlp_calls[idx] == sum(depth > idx for depth in depth_of_step)
    for step, depth in enumerate(depth_of_step[1:], start=1):
        position = cache.prompt_length + step - 1
        for idx in range(depth, LAYERS):  # V has no rotary embedding: V = v_proj(norm(h_exit)) exactly
            attn = layers[idx].base_layer
            expected = attn.self_attn.v_proj(attn.input_layernorm(exit_states[step]))
            got = cache.layers[idx].values[:, :, position].flatten(1)
            torch.testing.assert_close(got, expected[:, 0], atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- mask


def test_mask_never_attends_to_skipped_positions(prompt_ids, monkeypatch):
    """Whatever the placeholders of skipped positions hold, the output is the same: they are never attended (both
    runs exit at the same seeded random depths)."""
    model = river_of(tiny_model(), **QUANT)
    results = []
    for placeholder in (torch.zeros, lambda shape, **kw: torch.full(shape, 1e4, **kw)):
        monkeypatch.setattr(strategies_module, "placeholder_kv",
                            lambda shape, like, make=placeholder: make(shape, dtype=like.dtype, device=like.device))
        out = generate(model, prompt_ids, kv_strategy="mask", **RANDOM_EXITS, max_new_tokens=20, output_logits=True)
        out.cache.check_kv_integrity()
        results.append(out)
    depths = decoded_depths(results[0].cache)
    assert (depths < LAYERS).any()
    assert torch.equal(results[0].sequences, results[1].sequences)
    for zeros, garbage in zip(results[0].logits, results[1].logits):
        torch.testing.assert_close(zeros, garbage)


def test_mask_enforces_a_minimum_exit_layer(prompt_ids):
    model = river_of(tiny_model(), **QUANT)
    out = generate(model, prompt_ids, kv_strategy="mask", tau=-1)
    assert (decoded_depths(out.cache) == LAYERS // 2).all()
    out = generate(model, prompt_ids, kv_strategy="mask", tau=-1, min_exit_layer=2)
    assert (decoded_depths(out.cache) == 2).all()


# ---------------------------------------------------------------- mono-decreasing


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_mono_decreasing_depths_never_increase_and_deeper_kv_is_a_prefix(arch, prompt_ids):
    model = river_of(tiny_model(arch), **QUANT)
    out = generate(model, prompt_ids, kv_strategy="mono_decreasing", **RANDOM_EXITS, max_new_tokens=24)
    cache = out.cache
    depths = cache.exit_depth[0]
    assert (depths[1:] <= depths[:-1]).all() and depths[-1] < LAYERS
    cache.check_kv_integrity()
    if arch == "llama":
        for idx, layer in enumerate(cache.layers):
            assert layer.get_seq_length() == int((depths > idx).sum())


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
@pytest.mark.parametrize("strategy", strategy_names())
def test_every_strategy_keeps_its_kv_invariant_on_every_architecture(arch, strategy, prompt_ids):
    """Random exits (seeded): the cache holds what the strategy promises, and after a flush every position."""
    model = river_of(tiny_model(arch), **QUANT)
    config = dict(**RANDOM_EXITS, kv_strategy=strategy, max_new_tokens=12)
    if arch == "gemma3" and strategy in FULL_ATTENTION_ONLY:
        with pytest.raises(ValueError, match="needs full attention in every layer"):
            generate(model, prompt_ids, **config)
        return
    cache = generate(model, prompt_ids, **config).cache
    assert (decoded_depths(cache) < LAYERS).any()
    cache.check_kv_integrity()
    cache.flush_pending()
    cache.check_kv_integrity()
    if strategy != "mono_decreasing":  # the only strategy whose deeper layers stay short by design
        assert all(layer.get_seq_length() == cache.recorded_length for layer in cache.layers)
