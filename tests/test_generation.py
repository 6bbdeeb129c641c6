"""End-to-end behaviour of model.generate with a river, on tiny random models of every supported architecture."""

from __future__ import annotations

import pytest
import torch
from transformers import TextStreamer

import river_hf
from river_hf import RiverConfig

from conftest import (
    ARCHITECTURES,
    count_twin_calls,
    decoded_depths,
    generate,
    mixed_tau,
    plain_copy_with_twins,
    river_of,
    tiny_model,
)

NEW_TOKENS = 12  # generate's default
START = 2  # river_of's default


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_tau_above_one_equals_backbone_and_runs_no_twin(arch, prompt_ids):
    model = tiny_model(arch)
    expected = generate(model, prompt_ids).sequences
    river_of(model)
    calls = count_twin_calls(model)
    out = generate(model, prompt_ids, tau=1.5)
    assert torch.equal(out.sequences, expected)
    assert calls[0] == 0
    assert (out.cache.exit_depth == 6).all()
    out.cache.check_kv_integrity()


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_tau_minus_one_exits_at_start_layer_and_equals_full_quantization(arch, prompt_ids):
    model = river_of(tiny_model(arch))
    full_quant = plain_copy_with_twins(model)
    out = generate(model, prompt_ids, tau=-1)
    assert (out.cache.exit_depth == START).all()
    assert torch.equal(out.sequences, generate(full_quant, prompt_ids).sequences)
    out.cache.check_kv_integrity()


def test_plain_generate_on_a_river_model_is_the_backbone(prompt_ids):
    model = tiny_model()
    expected = generate(model, prompt_ids).sequences
    river_of(model)
    calls = count_twin_calls(model)
    assert torch.equal(generate(model, prompt_ids).sequences, expected)
    assert torch.equal(model.generate(prompt_ids, max_new_tokens=NEW_TOKENS, do_sample=False), expected)
    assert calls[0] == 0


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_mixed_exits_keep_every_layer_complete(arch, prompt_ids):
    model = tiny_model(arch)
    tau = mixed_tau(model, prompt_ids)
    river_of(model)
    out = generate(model, prompt_ids, tau=tau, max_new_tokens=24)
    assert decoded_depths(out.cache).unique().numel() > 1, "threshold should give a mix of exit depths"
    assert out.cache.exit_depth.shape == (2, prompt_ids.shape[1] + 24 - 1)
    out.cache.check_kv_integrity()


def test_left_padded_batch(left_padded_batch):
    ids, mask = left_padded_batch
    model = tiny_model()
    expected = generate(model, ids, mask).sequences
    river_of(model)
    assert torch.equal(generate(model, ids, mask, tau=2.0).sequences, expected)
    out = generate(model, ids, mask, tau=mixed_tau(model, ids))
    out.cache.check_kv_integrity()
    assert out.cache.exit_depth.shape == (2, ids.shape[1] + NEW_TOKENS - 1)


def test_sampling(prompt_ids):
    model = tiny_model()
    torch.manual_seed(7)
    expected = generate(model, prompt_ids, do_sample=True, top_k=20).sequences
    river_of(model)
    torch.manual_seed(7)
    assert torch.equal(generate(model, prompt_ids, tau=1.1, do_sample=True, top_k=20).sequences, expected)
    out = generate(model, prompt_ids, tau=mixed_tau(model, prompt_ids), do_sample=True)
    out.cache.check_kv_integrity()


def test_beam_search(prompt_ids):
    model = tiny_model()
    expected = generate(model, prompt_ids, num_beams=3).sequences
    river_of(model)
    assert torch.equal(generate(model, prompt_ids, tau=1.1, num_beams=3).sequences, expected)
    out = generate(model, prompt_ids, tau=mixed_tau(model, prompt_ids), num_beams=3)
    assert out.cache.exit_depth.shape[0] == prompt_ids.shape[0] * 3
    out.cache.check_kv_integrity()


def test_streamer_sees_the_generated_tokens(prompt_ids):
    class Collect(TextStreamer):
        def __init__(self):
            self.tokens = []

        def put(self, value):
            self.tokens.extend(value.flatten().tolist())

        def end(self):
            pass

    model = river_of(tiny_model())
    streamer = Collect()
    out = model.generate(prompt_ids[:1], generation_config=RiverConfig(tau=0.8, exit_signal="cosine", max_new_tokens=6,
                                                                       do_sample=False),
                         streamer=streamer)
    assert streamer.tokens == out[0].tolist()  # the prompt, then each new token


def test_batch_exits_only_when_every_row_passes(prompt_ids):
    model = river_of(tiny_model())

    def first_decode_depth(ids, tau):
        out = generate(model, ids, tau=tau, prefill_exit="none", max_new_tokens=2)
        return out.cache.exit_depth[0, -1].item()

    differing = 0
    for tau in torch.linspace(0.7, 0.95, 11).tolist():
        alone = [first_decode_depth(prompt_ids[row:row + 1], tau) for row in range(2)]
        assert first_decode_depth(prompt_ids, tau) == max(alone)
        differing += alone[0] != alone[1]
    assert differing, "some threshold should separate the two rows"


def test_prefill_exit_options(prompt_ids):
    model = river_of(tiny_model())
    prompt_len = prompt_ids.shape[1]
    none = generate(model, prompt_ids, tau=-1, prefill_exit="none").cache.exit_depth
    assert (none[:, :prompt_len] == 6).all() and (none[:, prompt_len:] == START).all()
    fixed = generate(model, prompt_ids, tau=1.5, prefill_exit=4).cache.exit_depth
    assert (fixed[:, :prompt_len] == 4).all() and (fixed[:, prompt_len:] == 6).all()


def test_river_settings_as_generate_kwargs(prompt_ids):
    model = river_of(tiny_model())
    out = model.generate(prompt_ids, max_new_tokens=4, do_sample=False, tau=-1, exit_signal="cosine",
                         return_dict_in_generate=True)
    assert (out.cache.exit_depth == START).all()


def test_random_exit_patterns_keep_kv_complete(prompt_ids):
    """KV integrity for any exit pattern: steps exit at random eligible depths (the seeded "random" signal)."""
    for arch in ("llama", "gemma3"):
        model = river_of(tiny_model(arch), start_layer=1)
        out = generate(model, prompt_ids, exit_signal="random", exit_rate=0.8, seed=0, max_new_tokens=30)
        assert decoded_depths(out.cache).unique().numel() >= 4
        out.cache.check_kv_integrity()


def test_kv_integrity_check_detects_a_hole(prompt_ids):
    model = river_of(tiny_model())
    cache = generate(model, prompt_ids, tau=0.8).cache
    cache.layers[3].keys = cache.layers[3].keys[:, :, :-1]
    cache.layers[3].values = cache.layers[3].values[:, :, :-1]
    with pytest.raises(river_hf.KVIntegrityError, match="layer 3"):
        cache.check_kv_integrity()


def test_river_config_on_a_model_without_river_is_an_error(prompt_ids):
    with pytest.raises(ValueError, match="no river"):
        tiny_model().generate(prompt_ids, generation_config=RiverConfig(tau=0.9, max_new_tokens=2))


def test_a_non_river_cache_is_refused(prompt_ids):
    from transformers import DynamicCache

    model = river_of(tiny_model())
    with pytest.raises(ValueError, match="RiverCache"):
        model.generate(prompt_ids, generation_config=RiverConfig(tau=0.9, max_new_tokens=2), cache=DynamicCache())


def test_eos_stops_generation_and_the_record_matches(prompt_ids):
    model = river_of(tiny_model())
    free = generate(model, prompt_ids[:1], tau=-1).sequences[0, prompt_ids.shape[1]:]
    eos = free[3].item()  # make the 4th generated token the end of sequence
    stop_at = free.tolist().index(eos)
    out = generate(model, prompt_ids[:1], tau=-1, eos_token_id=eos)
    assert out.sequences.shape[1] == prompt_ids.shape[1] + stop_at + 1
    assert out.sequences[0, -1].item() == eos
    assert out.cache.exit_depth.shape[1] == out.sequences.shape[1] - 1  # the last token was never fed back
    out.cache.check_kv_integrity()


@pytest.mark.parametrize("river_call", [{"tau": -1}, {"tau": -1, "lossless": True}, {}],
                         ids=["river", "lossless", "plain"])
def test_generate_runs_in_inference_mode_and_returns_tensors_autograd_can_use(river_call, prompt_ids):
    model = river_of(tiny_model())
    seen = []
    handle = model.model.layers[0].register_forward_hook(lambda *_: seen.append(torch.is_inference_mode_enabled()))
    try:
        out = generate(model, prompt_ids[:1], output_logits=True, **river_call)
    finally:
        handle.remove()
    assert seen and all(seen)  # every forward pass of the call, river or plain
    assert not out.sequences.is_inference() and not any(logits.is_inference() for logits in out.logits)
    loss = model(out.sequences).logits.float().logsumexp(-1).mean() * out.logits[0].softmax(-1).max()
    loss.backward()  # an RL-style use of the generated tokens and their logits raises nothing
    assert model.get_input_embeddings().weight.grad is not None


def test_inference_mode_leaves_the_tokens_as_they_were(prompt_ids, monkeypatch):
    model = river_of(tiny_model())
    expected = {tau: generate(model, prompt_ids, tau=tau).sequences for tau in (1.5, 0.8, -1)}
    monkeypatch.setattr(river_hf.core.generation, "GENERATE_IN_INFERENCE_MODE", False)
    for tau, sequences in expected.items():
        assert torch.equal(generate(model, prompt_ids, tau=tau).sequences, sequences)
