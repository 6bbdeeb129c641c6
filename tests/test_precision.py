"""Twin precision: per-layer bit schedules and the optional quantized LM head for exited steps (issue 5)."""

from __future__ import annotations

import warnings

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import river_hf
from river_hf import RiverQuantConfig
from river_hf.core.lm_head import RiverLMHead, original_lm_head
from river_hf.kernels.quantize import RiverQuantLinear

from conftest import count_calls, generate, plain_copy_with_twins, river_of, tiny_model, with_exited_head

IDS = torch.tensor([[5, 9, 33, 70, 12], [7, 101, 44, 3, 250]])
RUN = dict(max_new_tokens=8, output_logits=True)  # what every generate here runs: 8 tokens, with their logits


def twin_kernels(model) -> dict[int, set[tuple]]:
    """{layer_idx: {(nbits, group_size, backend) of its twin's quantized linears}} for the layers with a twin."""
    return {layer.layer_idx: {(m.nbits, m.group_size, m.backend) for m in layer.twin.modules()
                              if isinstance(m, RiverQuantLinear)}
            for layer in river_hf.river_layers(model) if layer.twin is not None}


def with_head(reference, name: str):
    """`reference` (a plain copy of a river model) with its RiverLMHead replaced by its `name` head."""
    reference.set_output_embeddings(getattr(reference.get_output_embeddings(), name))
    return reference


# ---------------------------------------------------------------- per-layer bit schedule


def test_schedule_builds_each_twin_with_its_layers_bits_and_kernel():
    config = RiverQuantConfig(nbits=[8, 8, 4, 4, 2], group_size=64, start_layer=1, backend="auto")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = river_hf.build_river(tiny_model("llama"), config, progress=False)
    assert not [w for w in caught if "RiverQuantLinear" in str(w.message)]  # per-row 8-bit is the schedule's rule
    assert twin_kernels(model) == {
        1: {(8, None, "int8pack_cpu")}, 2: {(8, None, "int8pack_cpu")},
        3: {(4, 64, "int4pack_cpu")}, 4: {(4, 64, "int4pack_cpu")}, 5: {(2, 64, "int4pack_cpu")},
    }
    assert [config.nbits_for(idx) for idx in range(1, 6)] == [8, 8, 4, 4, 2]
    assert [config.group_size_for(idx) for idx in range(1, 6)] == [None, None, 64, 64, 64]


def test_schedule_runs_and_tau_minus_one_equals_the_scheduled_full_quantization():
    model = river_hf.build_river(tiny_model("qwen3"), RiverQuantConfig.schedule(num_layers=6, first_layers=2,
                                                                                start_layer=2), progress=False)
    assert {idx: {bits for bits, *_ in kernels} for idx, kernels in twin_kernels(model).items()} == {
        2: {8}, 3: {8}, 4: {4}, 5: {4}}
    out = generate(model, IDS, **RUN, tau=-1, prefill_exit="sequence")  # named: "auto" follows the machine's timing
    assert (out.cache.exit_depth == 2).all()
    assert torch.equal(out.sequences, generate(plain_copy_with_twins(model), IDS, **RUN).sequences)
    out.cache.check_kv_integrity()


def test_schedule_constructor():
    assert RiverQuantConfig.schedule(num_layers=6, first_layers=2) == RiverQuantConfig(nbits=[8, 8, 4, 4, 4])
    assert RiverQuantConfig.schedule(6, 1, first_bits=4, rest_bits=2, start_layer=3, group_size=32) == (
        RiverQuantConfig(nbits=[4, 2, 2], start_layer=3, group_size=32))
    with pytest.raises(ValueError, match="`first_layers` must be an integer between 0 and 5"):
        RiverQuantConfig.schedule(num_layers=6, first_layers=6)
    with pytest.raises(ValueError, match="`num_layers`=2 leaves no river layer"):
        RiverQuantConfig.schedule(num_layers=2, first_layers=0, start_layer=2)


@pytest.mark.parametrize("nbits", [[4, 4, 4], [8] * 6])
def test_schedule_length_must_equal_the_number_of_river_layers(nbits):
    config = RiverQuantConfig(nbits=nbits, start_layer=1)
    with pytest.raises(ValueError, match=rf"`nbits` has {len(nbits)} entries, but this model has 5 river layers "
                                         r"\(decoder layers 1..5: num_layers 6 - start_layer 1\)"):
        river_hf.build_river(tiny_model(), config, progress=False)


def test_nbits_for_names_layers_without_a_twin():
    config = RiverQuantConfig(nbits=[8, 4], start_layer=2)
    assert (config.nbits_for(2), config.nbits_for(3)) == (8, 4)
    with pytest.raises(ValueError, match="layer 1 has no twin"):
        config.nbits_for(1)
    with pytest.raises(ValueError, match="past the `nbits` schedule, which covers layers 2..3"):
        config.nbits_for(4)
    assert RiverQuantConfig(nbits=3).nbits_for(17) == 3  # one int: every twin


def test_single_nbits_8_keeps_its_one_warning_about_group_size():
    """Unchanged for an int: nbits=8 with a group size still says the int8 kernel ignores it (once per message)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = river_hf.build_river(tiny_model(),
                                     RiverQuantConfig(nbits=8, group_size=64, start_layer=4, backend="auto"),
                                     progress=False)
    assert {str(w.message) for w in caught if "one group per output row" in str(w.message)} != set()
    assert twin_kernels(model) == {4: {(8, None, "int8pack_cpu")}, 5: {(8, None, "int8pack_cpu")}}


def test_schedule_survives_save_and_from_pretrained(saved_tiny_model, tmp_path):
    quant = RiverQuantConfig(nbits=[8, 4, 4, 8], start_layer=2, group_size=32, backend="auto")
    model = AutoModelForCausalLM.from_pretrained(saved_tiny_model, quantization_config=quant)
    expected = {2: {(8, None, "int8pack_cpu")}, 3: {(4, 32, "int4pack_cpu")}, 4: {(4, 32, "int4pack_cpu")},
                5: {(8, None, "int8pack_cpu")}}
    assert twin_kernels(model) == expected
    model.save_pretrained(tmp_path / "river")
    assert '"nbits": [\n      8,\n      4,' in (tmp_path / "river" / "config.json").read_text()
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "river")
    assert reloaded.config.quantization_config.nbits == [8, 4, 4, 8]
    assert twin_kernels(reloaded) == expected


# ---------------------------------------------------------------- quantized LM head


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_quantized_head_is_unused_unless_a_step_exits(arch):
    model = tiny_model(arch, tie_word_embeddings=True)
    expected = generate(model, IDS, **RUN)
    river_of(model, quantize_lm_head=True)
    calls = count_calls(model.lm_head.quantized_head)
    out = generate(model, IDS, **RUN, tau=1.5)
    assert torch.equal(out.sequences, expected.sequences)
    assert all(torch.equal(a, b) for a, b in zip(out.logits, expected.logits))
    assert torch.equal(generate(model, IDS, **RUN).sequences, expected.sequences)  # plain generate, river model
    assert torch.equal(model(IDS).logits, tiny_model(arch, tie_word_embeddings=True)(IDS).logits)  # plain forward
    assert calls[0] == 0


@pytest.mark.parametrize("arch, head_bits, backend", [("llama", 8, "int8pack_cpu"), ("llama", 4, "int4pack_cpu"),
                                                      ("gemma3", 8, "int8pack_cpu")])
def test_exited_steps_use_the_quantized_head(arch, head_bits, backend):
    model = river_hf.build_river(tiny_model(arch, tie_word_embeddings=True),
                                 RiverQuantConfig(start_layer=2, quantize_lm_head=True, lm_head_nbits=head_bits,
                                                  backend="auto"),
                                 progress=False)
    head = model.get_output_embeddings()
    assert isinstance(head, RiverLMHead)
    assert (head.quantized_head.nbits, head.quantized_head.backend) == (head_bits, backend)
    assert head.quantized_head.group_size == (None if head_bits == 8 else 64)
    out = generate(model, IDS, **RUN, tau=-1, prefill_exit="sequence")  # named: "auto" follows the machine's timing
    assert (out.cache.exit_depth == 2).all()
    twins_only = generate(with_head(plain_copy_with_twins(model), "base_head"), IDS, **RUN)  # full quant., full head
    assert not all(torch.equal(a, b) for a, b in zip(out.logits, twins_only.logits))
    reference = generate(with_exited_head(plain_copy_with_twins(model)), IDS, **RUN)  # ... an exited step's head
    assert torch.equal(out.sequences, reference.sequences)
    assert all(torch.equal(a, b) for a, b in zip(out.logits, reference.logits))


def test_with_mixed_exits_only_the_exited_steps_use_the_quantized_head():
    model = tiny_model("llama", tie_word_embeddings=True)
    with torch.no_grad():
        states = model(IDS, output_hidden_states=True).hidden_states
    # the highest mean similarity of the eligible layers: on this model some steps exit there, others never
    tau = max(torch.nn.functional.cosine_similarity(states[l], states[l + 1], dim=-1).mean().item()
              for l in range(1, 5))
    river_of(model, quantize_lm_head=True)
    calls = count_calls(model.lm_head.quantized_head)
    out = generate(model, IDS, tau=tau, max_new_tokens=16)
    prompt_length = out.cache.prompt_length
    step_depths = [out.cache.exit_depth[0, 0].item(), *out.cache.exit_depth[0, prompt_length:].tolist()]
    exited = sum(depth < 6 for depth in step_depths)
    assert 0 < exited < len(step_depths)
    assert calls[0] == exited


def test_remove_river_restores_the_original_head_object_and_weights():
    model = tiny_model("llama", tie_word_embeddings=True)
    original_head = model.lm_head
    state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    logits = model(IDS).logits
    river_hf.build_river(model, RiverQuantConfig(quantize_lm_head=True), progress=False)
    assert model.lm_head is not original_head and model.lm_head.base_head is original_head
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied, read through the wrapper
    river_hf.remove_river(model)
    assert model.lm_head is original_head and model.get_output_embeddings() is original_head
    assert model.lm_head.weight is model.model.embed_tokens.weight
    restored = model.state_dict()
    assert restored.keys() == state.keys() and all(torch.equal(restored[k], v) for k, v in state.items())
    assert torch.equal(model(IDS).logits, logits)


def test_tie_weights_on_a_river_model_ties_the_original_head():
    model = river_hf.build_river(tiny_model("llama", tie_word_embeddings=True),
                                 RiverQuantConfig(quantize_lm_head=True), progress=False)
    names = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    model.tie_weights()
    assert {name for name, _ in model.named_parameters(remove_duplicate=False)} == names
    assert "weight" not in model.lm_head._parameters
    assert model.lm_head.base_head.weight is model.model.embed_tokens.weight


def test_original_lm_head_swaps_the_head_back_for_a_block():
    model = river_hf.build_river(tiny_model(), RiverQuantConfig(quantize_lm_head=True), progress=False)
    wrapper = model.lm_head
    with original_lm_head(model):
        assert model.lm_head is wrapper.base_head
    assert model.lm_head is wrapper
    plain = tiny_model()
    with original_lm_head(plain):  # no RiverLMHead: nothing to do
        assert isinstance(plain.lm_head, torch.nn.Linear)


def test_save_pretrained_with_a_quantized_head_writes_the_plain_checkpoint(tmp_path):
    model = tiny_model("llama", tie_word_embeddings=True)
    model.save_pretrained(tmp_path / "plain")
    river_of(model, quantize_lm_head=True)
    model.save_pretrained(tmp_path / "river")
    assert isinstance(model.lm_head, RiverLMHead)  # back after saving
    original = load_file(tmp_path / "plain" / "model.safetensors")
    saved = load_file(tmp_path / "river" / "model.safetensors")
    assert saved.keys() == original.keys() and all(torch.equal(saved[k], original[k]) for k in original)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "river")
    assert not river_hf.is_river(reloaded)
    assert reloaded.lm_head.weight is reloaded.model.embed_tokens.weight  # tied weights stay tied


def test_quantized_head_survives_save_and_from_pretrained(tmp_path):
    tiny_model("llama", tie_word_embeddings=True).save_pretrained(tmp_path / "tiny")
    quant = RiverQuantConfig(nbits=[8, 4, 4, 4], start_layer=2, quantize_lm_head=True, lm_head_nbits=4)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "tiny", quantization_config=quant)
    assert isinstance(model.lm_head, RiverLMHead) and model.lm_head.weight is model.model.embed_tokens.weight
    model.save_pretrained(tmp_path / "river")
    original = load_file(tmp_path / "tiny" / "model.safetensors")
    saved = load_file(tmp_path / "river" / "model.safetensors")
    assert saved.keys() == original.keys() and all(torch.equal(saved[k], original[k]) for k in original)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "river")
    assert reloaded.config.quantization_config == quant
    assert isinstance(reloaded.lm_head, RiverLMHead) and reloaded.lm_head.quantized_head.nbits == 4
    assert reloaded.lm_head.weight is reloaded.model.embed_tokens.weight
    assert torch.equal(generate(reloaded, IDS, tau=-1).sequences, generate(model, IDS, tau=-1).sequences)


def test_quantize_lm_head_needs_an_output_embedding():
    from transformers import LlamaModel

    base = LlamaModel(tiny_model().config)  # decoder layers, but no LM head
    with pytest.raises(river_hf.UnsupportedModelError, match="`quantize_lm_head=True`: LlamaModel has no output"):
        river_hf.build_river(base, RiverQuantConfig(quantize_lm_head=True), progress=False)
    assert not river_hf.is_river(base)


# ---------------------------------------------------------------- the exited head's top logits, recomputed


def exited_logits_at(k: int, head_bits: int = 4):
    """(exited logits at `exact_top_k`=k, the quantized head's, the original head's) on random hidden states of a
    tiny llama's RiverLMHead (a 4-bit head by default: coarse enough that its ranking differs from the original's)."""
    model = river_hf.build_river(tiny_model("llama"), RiverQuantConfig(start_layer=2, lm_head_nbits=head_bits,
                                                                       lm_head_exact_top_k=k, backend="auto"),
                                 progress=False)
    head = model.get_output_embeddings()
    hidden = torch.randn(3, 5, model.config.hidden_size, generator=torch.Generator().manual_seed(0))  # [B, T, H]
    with torch.no_grad():
        return head.exited_logits(hidden), head.quantized_head(hidden), head.base_head(hidden)


@pytest.mark.parametrize("k", [1, 4, 16])
def test_an_exited_step_gets_its_top_k_logits_from_the_original_head(k):
    exited, quantized, original = exited_logits_at(k)
    top = quantized.topk(k, dim=-1).indices
    assert torch.allclose(exited.gather(-1, top), original.gather(-1, top), atol=1e-5)
    rest = torch.ones_like(exited, dtype=torch.bool).scatter(-1, top, False)
    # the other logits stay the quantized head's, kept strictly below the lowest recomputed one
    floor = exited.gather(-1, top).min(-1, keepdim=True).values.expand_as(exited)
    assert (exited[rest] < floor[rest]).all()
    assert torch.equal(exited[rest & (quantized < floor)], quantized[rest & (quantized < floor)])
    assert (exited[rest] < quantized[rest]).any() or k > 1  # k=1 on a 4-bit head: the clamp is needed here
    # wherever the quantized head ranks the original head's token among its top k, the greedy token is the original's
    ranked = (top == original.argmax(-1, keepdim=True)).any(-1)
    assert ranked.any() and torch.equal(exited.argmax(-1)[ranked], original.argmax(-1)[ranked])


def test_the_recomputed_top_keeps_its_rank_compiled_in_bfloat16():
    """inductor computes bf16 pointwise ops in float32 and rounds back: the other logits must still end strictly below
    the recomputed ones (argmax breaks ties by index)."""
    model = river_hf.build_river(tiny_model("llama").to(torch.bfloat16),
                                 RiverQuantConfig(start_layer=2, lm_head_nbits=4, lm_head_exact_top_k=1,
                                                  backend="auto"), progress=False)
    head = model.get_output_embeddings()
    hidden = torch.randn(3, 5, model.config.hidden_size, generator=torch.Generator().manual_seed(0)).bfloat16()
    with torch.no_grad():
        compiled = torch.compile(head.exited_logits, backend="inductor", fullgraph=True)(hidden)
        eager, quantized = head.exited_logits(hidden), head.quantized_head(hidden)
    for logits in (eager, compiled):
        top = quantized.argmax(-1, keepdim=True)
        assert torch.equal(logits.argmax(-1, keepdim=True), top)  # the recomputed logit stays the greedy one
        rest = torch.ones_like(logits, dtype=torch.bool).scatter(-1, top, False)
        assert (logits.masked_fill(~rest, float("-inf")).amax(-1, keepdim=True) < logits.gather(-1, top)).all()


def test_exact_top_k_zero_keeps_the_quantized_logits():
    exited, quantized, original = exited_logits_at(0)
    assert torch.equal(exited, quantized)
    assert not torch.equal(exited.argmax(-1), original.argmax(-1))  # what the recomputation is for


def test_exact_top_k_is_checked_and_a_loading_setting():
    assert RiverQuantConfig().lm_head_exact_top_k == 64
    for bad in (-1, 2.5, True, "4"):
        with pytest.raises(ValueError, match="`lm_head_exact_top_k` must be an integer >= 0"):
            RiverQuantConfig(lm_head_exact_top_k=bad)
    assert "lm_head_exact_top_k" in RiverQuantConfig(lm_head_exact_top_k=0).get_loading_attributes()
    assert "top 64 logits recomputed" in repr(river_of(tiny_model(), quantize_lm_head=True).lm_head)
