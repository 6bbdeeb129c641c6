"""The measurement scripts in benchmarks/scripts run as written (on a tiny local model or shape, in seconds)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from conftest import load_module

SCRIPTS = Path(__file__).resolve().parent.parent / "benchmarks" / "scripts"


def load_script(name: str):
    return load_module(SCRIPTS / f"{name}.py")


def test_backbone_dtype_example_times_both_dtypes(saved_tiny_model, capsys):
    results = load_script("backbone_dtype").main(["--model", str(saved_tiny_model), "--prompts", "1", "--rounds",
                                                   "1", "--max-new-tokens", "3"])
    assert set(results) == {"bfloat16", "float32", "fastest_dtype"}
    assert all(results[name]["decode_tokens_per_s"] > 0 and results[name]["prefill_s"] > 0
               for name in ("bfloat16", "float32"))
    out = capsys.readouterr().out
    assert "| bfloat16 |" in out and f"fastest_dtype chooses {results['fastest_dtype']} (µs per GEMV at" in out


def test_prefill_time_example_times_the_prompts_of_backbone_and_rivers(saved_tiny_model, capsys):
    results = load_script("prefill_time").main(["--model", str(saved_tiny_model), "--prompts", "1", "--rounds", "1"])
    assert set(results) == {"backbone", "river, tau=-1 (full quantization)", "river, the defaults"}
    assert all(seconds > 0 for seconds in results.values())
    assert "| backbone |" in capsys.readouterr().out


@pytest.mark.slow  # torch.compile takes ~10-20 s on 2 cores
def test_compile_example_times_eager_and_compiled_layer_parts(saved_tiny_model):
    import torch

    example = load_script("compile_twins")
    results = example.main(["--model", str(saved_tiny_model), "--parts", "norms", "--rounds", "1",
                            "--max-new-tokens", "2"])
    assert set(results) == {"backbone eager", "backbone compiled", "full-quant eager", "full-quant compiled"}
    assert all(r["ms_per_token"] > 0 for r in results.values())
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # something was really compiled


@pytest.mark.slow  # one graph per layer and per whole step: ~30 s on 2 cores
def test_compile_example_times_whole_layers_one_graph_each_and_the_whole_step(saved_tiny_model):
    import torch

    example = load_script("compile_twins")
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    results = example.main(["--model", str(saved_tiny_model), "--parts", "layer", "--whole-step", "--rounds", "1",
                            "--max-new-tokens", "2"])
    assert set(results) == {"backbone eager", "backbone compiled", "full-quant eager", "full-quant compiled",
                            "backbone whole step compiled", "full-quant whole step compiled"}
    assert all(r["ms_per_token"] > 0 for r in results.values())
    # a graph of its own for every backbone layer and every twin (from layer 1), and the two whole steps
    from transformers import AutoConfig

    layers = AutoConfig.from_pretrained(saved_tiny_model).num_hidden_layers
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= layers + (layers - 1) + 2


@pytest.mark.slow
def test_start_time_example_loads_both_ways(capsys):
    table = load_script("start_time").main(["--rounds", "1"])
    assert set(table) == {"from the GGUF", "from the cache"}
    assert all(row["load_s"] > 0 for row in table.values())
    assert "| from the cache |" in capsys.readouterr().out


def test_load_phases_example_times_the_phases_and_puts_everything_back(saved_tiny_model, tmp_path, capsys,
                                                                     monkeypatch):
    import torch
    from transformers import AutoModelForCausalLM

    from river_hf import RiverQuantConfig
    from river_hf.kernels import registry as kernels
    from river_hf.saving import twin_files as twin_store
    from river_hf.saving import twin_loading

    river = AutoModelForCausalLM.from_pretrained(saved_tiny_model, dtype=torch.bfloat16,
                                                 quantization_config=RiverQuantConfig(backend="auto"))
    river.save_pretrained(tmp_path / "river")  # twins stored (loaded with a RiverQuantConfig)
    before = (twin_store.digest, twin_loading.StoredTwins.__dict__["read"], dict(kernels.KERNELS))
    monkeypatch.setenv("RIVER_HF_CACHE", str(tmp_path / "cache"))  # nothing packed yet: the load packs and keeps
    [load] = load_script("load_phases").main([str(tmp_path / "river"), "--loads", "1"])
    assert {"read", "checksum", "sampled_digest", "sampled_fingerprint", "from_codes", "make_twin", "read_packed",
            "write_packed"} <= load["phases"].keys()
    assert any(label.startswith("pack ") for label in load["phases"])
    assert 0 < load["phases"]["read"][0] < load["total_s"]
    assert (twin_store.digest, twin_loading.StoredTwins.__dict__["read"], dict(kernels.KERNELS)) == before
    assert "load 1: " in capsys.readouterr().out


def test_verify_rows_example_shows_the_exact_pass_equals_one_token_steps(saved_tiny_model, capsys):
    results = load_script("verify_rows").main(["--model", str(saved_tiny_model), "--dtype", "float32",
                                               "--rows", "4", "--repeats", "1"])
    assert results["one-token steps"]["logits_differing"] == 0
    exact = results["one pass, river_hf.lossless.exact_rows"]
    assert exact["logits_differing"] == 0 and exact["kv_differing"] == 0
    assert "| one pass, batched |" in capsys.readouterr().out


def test_verify_rows_example_checks_real_text_at_several_offsets(saved_tiny_model, capsys):
    results = load_script("verify_rows").main(["--model", str(saved_tiny_model), "--dtype", "float32", "--rows",
                                               "3", "--gsm8k", "2", "--offsets", "0,2"])
    assert len(results) == 2 and list(results)[1] - list(results)[0] == 2  # context lengths, 2 tokens apart
    assert all(r["exact_rows"]["logits_differing"] == 0 and r["exact_rows"]["kv_differing"] == 0
               for r in results.values())
    assert "| context tokens |" in capsys.readouterr().out


def test_load_ab_compares_two_checkouts_in_fresh_processes(tmp_path):
    """The same checkout as both sides: three systems, one load time each, each load in a child that imported
    river_hf from the checkout it was given (a saved load that ran HQQ would fail)."""
    import torch
    from transformers import AutoModelForCausalLM

    from conftest import tiny_model
    from river_hf import RiverQuantConfig
    load_ab = load_script("load_ab")
    plain, river = str(tmp_path / "plain"), str(tmp_path / "river")
    tiny_model("llama").to(torch.bfloat16).save_pretrained(plain)  # the child loads in bf16: twins must fit it
    AutoModelForCausalLM.from_pretrained(plain, dtype=torch.bfloat16, quantization_config=RiverQuantConfig(
        backend="auto", nbits=4, group_size=64, start_layer=2, quantize_lm_head=False)).save_pretrained(river)
    seconds = load_ab.main([plain, river, load_ab.HERE, river, "--loads", "1"])
    assert (list(seconds) == ["plain", "old code", "this code"]
            and all(len(v) == 1 and v[0] > 0 for v in seconds.values()))


def test_inference_mode_example_times_every_system_in_both_modes(saved_tiny_model, capsys):
    record = load_script("inference_mode").main(["--model", str(saved_tiny_model), "--prompts", "1", "--rounds", "1",
                                                  "--max-new-tokens", "3"])
    rates = record["decode_tokens_per_s"]
    assert set(rates) == {"backbone", "defaults", "lossless k=8"}
    assert all(len(values) == 1 and values[0] > 0 for by_mode in rates.values() for values in by_mode.values())
    assert "| lossless k=8 |" in capsys.readouterr().out
    import river_hf.core.generation
    assert river_hf.core.generation.GENERATE_IN_INFERENCE_MODE  # switched back on after every call


def test_module_precision_example_measures_every_mix(saved_tiny_model, capsys):
    record = load_script("module_precision").main(["--model", str(saved_tiny_model), "--prompts", "1", "--tokens",
                                                    "3"])
    mixes = record["mixes"]
    assert len(mixes) == 3 + 2 * 7
    assert all(0 <= mix["match"] <= 1 and mix["positions"] == 3 for mix in mixes.values())
    limits = {name: mix["byte_limit"] for name, mix in mixes.items()}
    assert limits["all 4-bit"] > limits["8-bit, up 4-bit"] > limits["all 8-bit"] > 1  # fewer bits, fewer bytes
    assert "| all 8-bit |" in capsys.readouterr().out


def test_shared_inputs_example_times_grouped_and_ungrouped_twins(capsys):
    pytest.importorskip("onnxruntime")
    result = load_script("shared_inputs").main(["--random-model", "tiny-test", "--backend", "matmulnbits_cpu",
                                                 "--rounds", "1", "--max-new-tokens", "3"])
    assert result["members"] == 5  # the one twin layer: q, k, v and gate, up
    assert set(result["ms_per_token"]) == {"backbone", "full-quant, groups fused", "full-quant, one call per linear"}
    assert all(ms > 0 for ms in result["ms_per_token"].values())
    assert "groups fused" in capsys.readouterr().out


def test_shared_inputs_example_can_group_what_the_build_left_apart():
    pytest.importorskip("onnxruntime")
    # 'auto' builds int4pack twins and groups nothing: --group-everything times them grouped
    result = load_script("shared_inputs").main(["--random-model", "tiny-test", "--backend", "auto", "--rounds", "1",
                                                 "--max-new-tokens", "3", "--group-everything"])
    assert result["forced_sets"] == 2 and "full-quant, every set grouped" in result["ms_per_token"]


def test_stacked_siblings_script_times_the_river_stacked_and_not(capsys):
    result = load_script("stacked_siblings").main(["--random-model", "tiny-test", "--prompts", "1", "--rounds", "1",
                                                   "--max-new-tokens", "3"])
    assert result["members"] == 5  # the one twin layer: q, k, v and gate, up
    assert len(result["tokens_per_s"]) == 5 and all(rate > 0 for rate in result["tokens_per_s"].values())
    assert result["same_tokens"] == {"river (tau 0.3), unstacked": 1.0, "full quantization, unstacked": 1.0}
    assert "the compiled backbone" in capsys.readouterr().out


def test_stacked_gemv_script_times_every_case():
    medians = load_script("stacked_gemv").main(["--hidden", "128", "--outputs", "128,64,64", "--mlp", "128",
                                                "--copies", "1", "--rounds", "2", "--warmup", "1"])
    assert len(medians) == 8 and all(micros > 0 for micros in medians.values())


def test_context_length_script_times_matches_and_weighs_both_systems(saved_tiny_model, tmp_path, capsys):
    record = load_script("context_length").main(["--model", str(saved_tiny_model), "--lengths", "16", "48",
                                                 "--new-tokens", "4", "--rounds", "1", "--tau", "-1",
                                                 "--output", str(tmp_path / "record.json")])
    assert set(record["speed"]) == {16, 48}
    for row in record["speed"].values():
        assert row["backbone_tokens_per_s"] > 0 and row["river_tokens_per_s"] > 0 and 0 <= row["match"] <= 1
        assert row["mean_exit_depth"] < 6  # tau=-1: every decoded token left the backbone at the start layer
    memory = record["memory"]
    assert memory["backbone"]["peak_bytes"] > 0 and memory["river"]["twin_bytes"] > 0
    assert memory["river"]["kv_bytes"] > 0 and memory["river_peak_vs_backbone_plus_twins"] > 0
    assert memory["backbone"]["peak_anon_bytes"] >= memory["backbone"]["anon_before_bytes"] > 0
    assert memory["river_anon_vs_backbone_plus_twins"] > 0
    checks = record["checks"]
    assert checks["length"] == 48 and checks["tau_above_1_is_backbone"] and checks["lossless_is_backbone"]
    assert checks["kv_integrity_errors"] == [] and len(set(checks["decoded_exit_depths"])) >= 2
    assert (tmp_path / "record.json").is_file() and "| 48 |" in capsys.readouterr().out


def test_context_length_script_cuts_prompts_to_the_models_positions(capsys):
    fitted_lengths = load_script("context_length").fitted_lengths
    config = SimpleNamespace(max_position_embeddings=8192)
    assert fitted_lengths([128, 8192], config, 32) == [128, 8160]  # 8160 prompt + 32 new tokens = 8192 positions
    assert "cut to [128, 8160]" in capsys.readouterr().out
    assert fitted_lengths([128, 2048], config, 32) == [128, 2048]
    assert fitted_lengths([9000], SimpleNamespace(), 32) == [9000]  # a model that names no limit keeps its lengths


def test_captured_decode_teacher_forced_match_is_one_where_the_river_never_exits(prompt_ids):
    """The script's teacher-forced match: a river that never exits (tau > 1) matches the backbone at every position
    and runs no twin; one that exits everything runs the twins at every decoded step; the plain backbone's
    GenerationConfig gets no match (it is the reference)."""
    from transformers import GenerationConfig

    from conftest import count_twin_calls, river_of, tiny_model
    from river_hf import RiverConfig
    script = load_script("captured_decode")
    model = river_of(tiny_model("llama"), nbits=4)
    twin_calls = count_twin_calls(model)
    fixed = dict(max_new_tokens=6, do_sample=False)
    prompt = prompt_ids[:1]
    prompts = [{"input_ids": prompt, "attention_mask": torch.ones_like(prompt)}]
    never = {"backbone": GenerationConfig(**fixed), "never exits": RiverConfig(tau=2.0, **fixed)}
    assert script.teacher_forced_match(model, prompts, never, tokens=6) == {"never exits": 1.0}
    assert twin_calls[0] == 0
    always = script.teacher_forced_match(model, prompts, {"always exits": RiverConfig(tau=-1.0, **fixed)}, tokens=6)
    assert 0.0 <= always["always exits"] <= 1.0
    assert twin_calls[0] > 0
    assert script.teacher_forced_match(model, prompts, never, tokens=0) == {}


def test_captured_decode_skip_module_guards_reaches_every_compiled_system():
    """--skip-module-guards and --cpp-wrapper give the compiled backbone and the captured rivers the same options (a
    fair comparison), and the eager systems no compile config."""
    script = load_script("captured_decode")
    args = SimpleNamespace(mode=None, max_new_tokens=4, tau=0.3, skip_module_guards=True, cpp_wrapper=False)
    configs = script.systems(args)
    compiled = {name: c.compile_config for name, c in configs.items() if c.cache_implementation == "static"}
    assert set(compiled) == {"backbone compiled", "river captured", "full quantization captured"}
    assert all(c.options["guard_filter_fn"] is torch.compiler.skip_guard_on_all_nn_modules_unsafe
               for c in compiled.values())
    plain = script.systems(SimpleNamespace(**{**vars(args), "skip_module_guards": False}))
    assert plain["backbone compiled"].compile_config.options is None
    wrapped = script.systems(SimpleNamespace(**{**vars(args), "skip_module_guards": False, "cpp_wrapper": True}))
    assert all(c.compile_config.options == {"cpp_wrapper": True}
               for name, c in wrapped.items() if c.cache_implementation == "static")


def test_captured_decode_step_split_adds_up_and_finds_matmuls_and_attention(prompt_ids):
    """The script's per-token split, for the backbone and a river on its twins: the matmul and attention ops are found
    in a profiled generate (time > 0: their names are recognised), and the split's parts add up to its total. (Not
    the sign of each part of the split: a difference of two timings, which a busy CI machine once made negative.)"""
    from transformers import GenerationConfig

    from conftest import river_of, tiny_model
    from river_hf import RiverConfig
    script = load_script("captured_decode")
    model = river_of(tiny_model("llama"), nbits=4)
    prompt = prompt_ids[:1]
    inputs = {"input_ids": prompt, "attention_mask": torch.ones_like(prompt)}
    for config in (GenerationConfig(do_sample=False), RiverConfig(tau=-1.0, do_sample=False)):
        profiled = script.profiled_generate(model, inputs, config, new_tokens=32)
        assert profiled["matmuls"] > 0 and profiled["attention"] > 0
        split = script.step_split(model, inputs, config, tokens=32)
        assert set(split) == {"matmuls", "attention", "rest", "total"}
        assert split["matmuls"] + split["attention"] + split["rest"] == pytest.approx(split["total"])


def test_interleaved_rates_sets_each_system_up_before_each_of_its_runs(prompt_ids):
    """The helper exact_top_k.py and head_activations.py time with: a system's setup runs right before each of its
    generate calls (so a swapped head is the one timed), round 0 is left out of the medians."""
    from transformers import GenerationConfig

    from conftest import tiny_model
    script = load_script("captured_decode")
    model = tiny_model("llama")
    inputs = [{"input_ids": ids[None], "attention_mask": torch.ones_like(ids[None])} for ids in prompt_ids]
    config = GenerationConfig(max_new_tokens=4, min_new_tokens=4, do_sample=False)
    order = []
    systems = {name: (config, lambda name=name: order.append(name)) for name in ("a", "b")}
    rates = script.interleaved_rates(model, systems, inputs, rounds=2)
    assert order == ["a", "b"] * (len(inputs) * 3)
    assert set(rates) == {"a", "b"} and all(rate > 0 for rate in rates.values())


def test_cuda_kernels_example_times_every_candidate_against_its_byte_limit(tmp_path, capsys, monkeypatch):
    """The GPU kernel table's code, run on CPU at the tiny shape: every candidate of both widths, every layer."""
    monkeypatch.setenv("RIVER_HF_CACHE", "off")
    record = load_script("cuda_kernels").main(["--shape", "tiny-test", "--device", "cpu", "--output",
                                               str(tmp_path / "kernels.json")])
    rows = record["shapes"]["tiny-test"]
    assert {r["layer"] for r in rows} == {"q_proj / o_proj", "k_proj / v_proj", "gate_proj / up_proj", "down_proj",
                                          "lm_head"}
    assert {(r["nbits"], r["kernel"]) for r in rows} >= {(4, "int4pack_cpu"), (8, "int8pack_cpu"), (4, "dense")}
    assert all(r["microseconds"] > 0 and 0 < r["byte_limit_share"] for r in rows)
    dense = [r for r in rows if r["kernel"] == "dense"]
    assert all(r["speedup_vs_dense"] == 1.0 for r in dense)
    assert (tmp_path / "kernels.json").exists() and "| lm_head | 256x64 | 8 | int8pack_cpu |" in capsys.readouterr().out


def test_head_bits_variants_are_each_head_at_each_k_and_swap_into_the_river(monkeypatch):
    """head_bits.py's heads: the 8-bit (and W8A8) and 4-bit copies of the original head at each k, each one what
    the river's head then runs (its exited logits equal the variant's own recomputation)."""
    import river_hf
    from conftest import tiny_model
    from river_hf import RiverQuantConfig
    from river_hf.core.lm_head import RiverLMHead, river_lm_head
    monkeypatch.syspath_prepend(str(SCRIPTS))  # it imports its sibling scripts, as when run from their folder
    script = load_script("head_bits")
    model = river_hf.build_river(tiny_model("llama"), RiverQuantConfig(start_layer=1, backend="auto"), progress=False)
    head = river_lm_head(model)
    variants = script.head_variants(head, [4, 64], w8a8=True)
    assert list(variants) == [f"{name}, k={k}" for k in (4, 64) for name in ("8-bit", "8-bit W8A8", "4-bit")]
    assert {name: (quantized.nbits, quantized.backend == "w8a8_cpu", k) for name, (quantized, k) in variants.items()
            } == {f"{name}, k={k}": (bits, w8a8, k) for k in (4, 64)
                  for name, bits, w8a8 in (("8-bit", 8, False), ("8-bit W8A8", 8, True), ("4-bit", 4, False))}
    hidden = torch.randn(1, 1, model.config.hidden_size)
    for quantized, k in variants.values():
        load_script("head_activations").use(head, (quantized, k))
        alone = RiverLMHead(head.base_head, quantized, k)
        with torch.no_grad():
            assert torch.equal(head.exited_logits(hidden), alone.exited_logits(hidden))
