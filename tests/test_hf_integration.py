"""river_hf as part of transformers: pipeline, from_pretrained(quantization_config=...), saved generation configs."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

import river_hf
from river_hf import RiverConfig, RiverQuantConfig

from conftest import generate, plain_copy_with_twins

PROMPT = "w5 w9 w33 w70 w12"


def test_from_pretrained_with_quantization_config_builds_the_river(saved_tiny_model):
    model = AutoModelForCausalLM.from_pretrained(saved_tiny_model,
                                                 quantization_config=RiverQuantConfig(start_layer=3, backend="auto"))
    assert river_hf.is_river(model)
    layers = river_hf.river_layers(model)
    assert [layer.twin is not None for layer in layers] == [False] * 3 + [True] * 3
    ids = torch.tensor([[5, 9, 33, 70, 12]])
    out = generate(model, ids, tau=-1, max_new_tokens=5)
    assert (out.cache.exit_depth == 3).all()
    out.cache.check_kv_integrity()


def test_pipeline_runs_the_river(saved_tiny_model):
    tokenizer = AutoTokenizer.from_pretrained(saved_tiny_model)
    model = river_hf.build_river(AutoModelForCausalLM.from_pretrained(saved_tiny_model), progress=False)
    generator = pipeline("text-generation", model=model, tokenizer=tokenizer)
    config = RiverConfig(tau=-1, exit_signal="cosine", max_new_tokens=6, do_sample=False)
    token_ids = generator(PROMPT, generation_config=config, return_tensors=True)[0]["generated_token_ids"]
    # the same tokens as a plain model whose layers from start_layer on are the twins (full quantization)
    reference = plain_copy_with_twins(model)
    expected = reference.generate(**tokenizer(PROMPT, return_tensors="pt"), max_new_tokens=6, do_sample=False)
    assert list(token_ids) == expected[0].tolist()
    backbone = pipeline("text-generation", model=AutoModelForCausalLM.from_pretrained(saved_tiny_model),
                        tokenizer=tokenizer)
    assert generator(PROMPT, generation_config=RiverConfig(tau=2.0, max_new_tokens=6, do_sample=False)) == backbone(
        PROMPT, max_new_tokens=6, do_sample=False)


def test_model_generation_config_with_tau_makes_the_river_the_default(saved_tiny_model):
    model = river_hf.build_river(AutoModelForCausalLM.from_pretrained(saved_tiny_model), progress=False)
    # prefill_exit named: "auto" keeps prompts on the backbone where the twins measured slower at prompts (AMX CPUs)
    model.generation_config = RiverConfig(tau=-1, exit_signal="cosine", prefill_exit="sequence", max_new_tokens=4,
                                          do_sample=False)
    out = model.generate(torch.tensor([[5, 9, 33]]), return_dict_in_generate=True)
    assert (out.cache.exit_depth == 1).all()


def test_save_writes_the_backbone_and_reloading_rebuilds_the_river(saved_tiny_model, tmp_path):
    from safetensors.torch import load_file

    quant = RiverQuantConfig(start_layer=2)
    model = AutoModelForCausalLM.from_pretrained(saved_tiny_model, quantization_config=quant)
    model.save_pretrained(tmp_path / "river")
    assert river_hf.is_river(model) and len(river_hf.river_layers(model)) == 6  # the river is back after saving
    original = load_file(saved_tiny_model / "model.safetensors")
    saved = load_file(tmp_path / "river" / "model.safetensors")
    assert saved.keys() == original.keys() and all(torch.equal(saved[k], original[k]) for k in original)

    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "river")  # quantization_config came with config.json
    assert river_hf.is_river(reloaded)
    ids = torch.tensor([[5, 9, 33, 70]])
    config = RiverConfig(tau=-1, exit_signal="cosine", max_new_tokens=5, do_sample=False)
    assert torch.equal(reloaded.generate(ids, generation_config=config), model.generate(ids, generation_config=config))


def test_saving_a_built_river_writes_the_plain_backbone(saved_tiny_model, tmp_path):
    model = river_hf.build_river(AutoModelForCausalLM.from_pretrained(saved_tiny_model), progress=False)
    model.save_pretrained(tmp_path / "plain")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "plain")
    assert not river_hf.is_river(reloaded)
    ids = torch.tensor([[5, 9, 33, 70]])
    assert torch.equal(reloaded(ids).logits, AutoModelForCausalLM.from_pretrained(saved_tiny_model)(ids).logits)


def test_pipeline_runs_the_captured_river(saved_tiny_model):
    """A pipeline passes the static cache and compile config through: the river's steps are captured (dynamo's
    graphs, run as traced: inductor would take minutes on 2 cores) and give the eager pipeline's tokens."""
    from transformers import CompileConfig

    from river_hf import RiverStaticCache

    tokenizer = AutoTokenizer.from_pretrained(saved_tiny_model)
    model = river_hf.build_river(AutoModelForCausalLM.from_pretrained(saved_tiny_model), progress=False)
    generator = pipeline("text-generation", model=model, tokenizer=tokenizer)
    traced = CompileConfig(backend="eager", mode=None)
    traced._compile_all_devices = True  # what river_hf.compile_config_for("cpu") sets, with inductor
    settings = dict(tau=-1, max_new_tokens=6, do_sample=False)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    static = RiverConfig(**settings, cache_implementation="static", compile_config=traced)
    captured = generator(PROMPT, generation_config=static, return_tensors=True)[0]["generated_token_ids"]
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1
    eager = generator(PROMPT, generation_config=RiverConfig(**settings), return_tensors=True)[0]["generated_token_ids"]
    assert list(captured) == list(eager)
    # the same call outside the pipeline makes a RiverStaticCache with every position of every layer
    out = model.generate(**tokenizer(PROMPT, return_tensors="pt"), generation_config=static,
                         return_dict_in_generate=True)
    assert isinstance(out.cache, RiverStaticCache)
    out.cache.check_kv_integrity()
    torch._dynamo.reset()
