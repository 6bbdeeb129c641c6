"""Backbone offloading (river_hf.offload.backbone): an offloaded river computes exactly what the resident one does,
pages in only the layers a step runs, leaves the twins' shared tensors alone, undoes exactly, and refuses bad input
without leaving anything half-offloaded."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file

import river_hf
from river_hf import RiverConfig, RiverQuantConfig, offload_backbone, offloaded_layers, reload_backbone
from river_hf.offload.backbone import offload_stores, weight_residency
from river_hf.offload.choice import exit_depth_histogram, layer_shares, rarely_run_layers

from conftest import ARCHITECTURES, NUM_LAYERS, decoded_depths, generate, river_of, tiny_model

START = 2  # river_of's start_layer
RIVER_LAYERS = list(range(START, NUM_LAYERS))
MIXED = dict(tau=0.0, exit_signal="random", exit_rate=0.6, seed=3)  # tokens exit at random depths


def linear_weights(model) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in model.state_dict().items()}


def assert_resident(model, folder=None):
    """Nothing is offloaded: no offload hook, no meta tensor, no file left in `folder`."""
    assert offloaded_layers(model) == []
    assert all(p.device.type != "meta" for p in model.parameters())
    assert not any(hasattr(module, "_hf_hook") for module in model.modules())
    assert "hf_device_map" not in model.__dict__
    if folder is not None:
        assert not os.path.exists(folder) or os.listdir(folder) == []


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_offloaded_river_equals_resident_river(arch, prompt_ids, tmp_path):
    model = river_of(tiny_model(arch))
    mixed, backbone = generate(model, prompt_ids, **MIXED), generate(model, prompt_ids)
    offload_backbone(model, layers=RIVER_LAYERS, to="disk", folder=str(tmp_path))
    assert offloaded_layers(model) == RIVER_LAYERS
    offloaded = generate(model, prompt_ids, **MIXED)
    assert torch.equal(offloaded.sequences, mixed.sequences)
    assert torch.equal(offloaded.cache.exit_depth, mixed.cache.exit_depth)
    assert decoded_depths(offloaded.cache).unique().numel() > 1  # the exits really are mixed
    offloaded.cache.check_kv_integrity()
    everything = generate(model, prompt_ids, tau=2.0)  # tau > 1: every layer pages in; equals the backbone
    assert torch.equal(everything.sequences, backbone.sequences)
    assert (everything.cache.exit_depth == NUM_LAYERS).all()
    everything.cache.check_kv_integrity()


def test_pages_in_only_the_layers_a_step_runs(scripted_exits, prompt_ids, tmp_path):
    plan = [2, 6, 3, 6, 4, 2, 5, 2]
    model = river_of(tiny_model("llama"))
    offload_backbone(model, layers=[4, 5], to="disk", folder=str(tmp_path))
    stats = offload_stores(model)[0].stats
    stats.reset()
    out = generate(model, prompt_ids, max_new_tokens=len(plan) + 1, tau=0.5, exit_signal=scripted_exits(plan))
    assert decoded_depths(out.cache)[0].tolist() == plan
    linears_per_layer = 7  # q, k, v, o, gate, up, down
    runs = 1 + sum(depth > 4 for depth in plan) + 1 + sum(depth > 5 for depth in plan)  # prefill runs every layer
    assert stats.loads == runs * linears_per_layer
    assert stats.seconds > 0


def test_twin_keeps_its_shared_tensors_and_its_output(prompt_ids, tmp_path):
    model = river_of(tiny_model("qwen3"), skip_modules=["down_proj"])  # qwen3: q/k norms too; down_proj shared
    layer = river_hf.river_layers(model)[3]
    shared = {name: param for name, param in layer.twin.named_parameters()}
    full_quant = generate(model, prompt_ids, tau=-1.0)
    offload_backbone(model, layers=[3, 4], to="disk", folder=str(tmp_path))
    for name, param in layer.base_layer.named_parameters():
        if name in shared and param is shared[name]:
            assert param.device.type == "cpu"  # shared: untouched, still resident
    assert layer.base_layer.mlp.down_proj.weight is layer.twin.mlp.down_proj.weight  # a skipped linear stays
    assert layer.base_layer.input_layernorm.weight is layer.twin.input_layernorm.weight
    assert layer.base_layer.self_attn.q_norm.weight is layer.twin.self_attn.q_norm.weight
    assert layer.base_layer.mlp.up_proj.weight.device.type == "meta"
    assert torch.equal(generate(model, prompt_ids, tau=-1.0).sequences, full_quant.sequences)
    reload_backbone(model)
    assert layer.base_layer.input_layernorm.weight is layer.twin.input_layernorm.weight


def test_reload_and_remove_river_give_back_the_exact_weights(prompt_ids, tmp_path):
    plain = tiny_model("llama")
    original = linear_weights(plain)
    model = river_of(plain)
    offload_backbone(model, layers=RIVER_LAYERS, folder=str(tmp_path))
    generate(model, prompt_ids, tau=2.0)  # weights paged in and out again
    reload_backbone(model)
    assert_resident(model, tmp_path)
    assert all(torch.equal(original[k], v) for k, v in model.base_model.state_dict(prefix="model.").items()
               if k in original)
    offload_backbone(model, layers=[2, 5], folder=str(tmp_path))
    river_hf.remove_river(model)  # reloads first
    assert_resident(model, tmp_path)
    restored = model.state_dict()
    assert restored.keys() == original.keys()
    assert all(torch.equal(original[k], restored[k]) for k in original)


def test_writing_the_files_shows_a_progress_bar_unless_asked_not_to(tmp_path, capsys):
    model = river_of(tiny_model("llama"))
    offload_backbone(model, layers=RIVER_LAYERS, folder=str(tmp_path))
    bar = capsys.readouterr().err
    assert "river: offloading backbone layers" in bar and f"{len(RIVER_LAYERS)}/{len(RIVER_LAYERS)}" in bar
    reload_backbone(model)
    offload_backbone(model, layers=RIVER_LAYERS, folder=str(tmp_path), progress=False)
    assert "offloading" not in capsys.readouterr().err


def test_save_pretrained_reads_the_offloaded_weights(tmp_path):
    plain = tiny_model("llama")
    original = linear_weights(plain)
    model = river_of(plain)
    offload_backbone(model, layers=RIVER_LAYERS, folder=str(tmp_path / "offload"))
    model.save_pretrained(tmp_path / "saved")
    saved = load_file(tmp_path / "saved" / "model.safetensors")
    assert saved.keys() <= original.keys() and "model.layers.4.mlp.up_proj.weight" in saved
    assert all(torch.equal(saved[k], original[k]) for k in saved)
    assert offloaded_layers(model) == RIVER_LAYERS  # saving did not reload


def test_from_pretrained_offloads_as_configured(saved_tiny_model, prompt_ids, tmp_path):
    from transformers import AutoModelForCausalLM

    quant = dict(start_layer=START, backend="auto")
    resident = AutoModelForCausalLM.from_pretrained(saved_tiny_model, quantization_config=RiverQuantConfig(**quant))
    config = RiverQuantConfig(**quant, offload="disk", offload_layers="auto", offload_folder=str(tmp_path),
                              offload_exit_histogram={"2": 95, "6": 5}, offload_max_share=0.1)
    model = AutoModelForCausalLM.from_pretrained(saved_tiny_model, quantization_config=config)
    assert offloaded_layers(model) == RIVER_LAYERS  # every river layer runs for 5% < 10% of tokens
    expected = generate(resident, prompt_ids, **MIXED)
    assert torch.equal(generate(model, prompt_ids, **MIXED).sequences, expected.sequences)
    model.save_pretrained(tmp_path / "saved")
    saved = load_file(tmp_path / "saved" / "model.safetensors")
    assert all(torch.equal(saved[k], v) for k, v in load_file(f"{saved_tiny_model}/model.safetensors").items())


def test_disk_weights_are_memory_mapped_while_a_step_runs(tmp_path):
    model = river_of(tiny_model("llama"))
    offload_backbone(model, layers=[3], folder=str(tmp_path))
    linear = river_hf.river_layers(model)[3].base_layer.mlp.up_proj
    x = torch.randn(1, 1, linear.in_features)
    linear._hf_hook.pre_forward(linear, x)
    pointer = linear.weight.data_ptr()
    maps = [line.split() for line in open("/proc/self/maps") if "layer-0003.safetensors" in line]
    assert any(int(r.split("-")[0], 16) <= pointer < int(r.split("-")[1], 16) for r, *_ in maps)
    linear._hf_hook.post_forward(linear, None)
    assert linear.weight.device.type == "meta"


def test_cpu_store_logic_on_cpu(monkeypatch, prompt_ids):
    """to='cpu' is for CUDA models; with its device check lifted, its store (CPU tensors behind the same hooks)
    runs here: exact outputs and an exact undo. (The CUDA path itself never ran in these tests.)"""
    monkeypatch.setattr(river_hf.offload.backbone, "check_destination", lambda to, device: None)
    model = river_of(tiny_model("llama"))
    expected, original = generate(model, prompt_ids, **MIXED), linear_weights(model)
    offload_backbone(model, layers=RIVER_LAYERS, to="cpu")
    assert model.hf_device_map["model.layers.3.mlp.up_proj"] == "cpu"
    assert torch.equal(generate(model, prompt_ids, **MIXED).sequences, expected.sequences)
    reload_backbone(model)
    assert_resident(model)
    assert all(torch.equal(original[k], v) for k, v in model.state_dict().items())


def test_weight_residency_moves_the_offloaded_bytes(tmp_path):
    model = river_of(tiny_model("llama"))
    before = weight_residency(model)["bytes_by_device"]["cpu"]
    offload_backbone(model, layers=RIVER_LAYERS, folder=str(tmp_path))
    after = weight_residency(model)
    assert after["offloaded_bytes"] == after["bytes_by_device"]["meta"] > 0
    assert after["bytes_by_device"]["cpu"] + after["offloaded_bytes"] == before
    assert after["offloaded_to"] == ["disk"]


# ---------------------------------------------------------------- "auto"


def test_layer_shares_and_rarely_run_layers():
    histogram = {"2": 60, "4": 30, "6": 10}  # 6 = never exited
    assert layer_shares(histogram, 6) == [1.0, 1.0, 0.4, 0.4, 0.1, 0.1]
    assert rarely_run_layers(histogram, 6, start_layer=2, max_share=0.2) == [4, 5]
    assert rarely_run_layers(histogram, 6, start_layer=2, max_share=0.5) == [2, 3, 4, 5]
    assert rarely_run_layers({2: 100}, 6, start_layer=2) == [2, 3, 4, 5]


def test_auto_measures_the_histogram(scripted_exits, prompt_ids, tmp_path):
    model = river_of(tiny_model("llama"))
    config = RiverConfig(tau=0.5, exit_signal=scripted_exits([2, 4, 2, 2, 2, 6, 2, 2, 2, 2, 2]), max_new_tokens=12,
                         do_sample=False)
    histogram = exit_depth_histogram(model, [prompt_ids[:1]], config)
    assert histogram == {2: 9, 4: 1, 6: 1}  # the 11 decode steps of 12 new tokens, as scripted
    # layers 2-3 run for 2 of 11 tokens (18%), layers 4-5 for 1 (9%)
    offload_backbone(model, layers="auto", folder=str(tmp_path), inputs=[prompt_ids[:1]], generation_config=config,
                     max_share=0.15)
    assert offloaded_layers(model) == [4, 5]


def test_auto_without_a_measurement_is_refused(tmp_path):
    model = river_of(tiny_model("llama"))
    with pytest.raises(ValueError, match="`layers`='auto' needs"):
        offload_backbone(model, folder=str(tmp_path))
    with pytest.warns(UserWarning, match="nothing was offloaded"):
        offload_backbone(model, histogram={6: 10}, folder=str(tmp_path))
    assert_resident(model, tmp_path)


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize("kwargs, field", [
    (dict(layers=[1, 2]), "`layers`: decoder layer 1 has no twin"),
    (dict(layers=[2, 9]), "`layers`: 9 is out of range"),
    (dict(layers=[2.5]), "`layers` must be"),
    (dict(layers=[]), "`layers` is empty"),
    (dict(layers="all"), "`layers`='all' is not supported"),
    (dict(layers=[2], to="gpu"), "`to`='gpu' is not supported"),
    (dict(layers=[2], to="cpu"), "`to`='cpu': the model runs on cpu"),
    (dict(histogram={2: 5}, max_share=1.5), "`max_share`"),
    (dict(histogram={}), "`histogram` holds no decoded token"),
])
def test_bad_input_names_the_field_and_leaves_nothing(kwargs, field, tmp_path):
    model = river_of(tiny_model("llama"))
    with pytest.raises(ValueError, match=field):
        offload_backbone(model, folder=str(tmp_path), **kwargs)
    assert_resident(model, tmp_path)


def test_model_without_river_and_unwritable_folder(tmp_path):
    with pytest.raises(ValueError, match="no river"):
        offload_backbone(tiny_model("llama"), layers=[2])
    model = river_of(tiny_model("llama"))
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(ValueError, match="`folder`=.* is not writable"):
        offload_backbone(model, layers=[2], folder=str(blocker / "offload"))
    assert_resident(model)
    offload_backbone(model, layers=[2], folder=str(tmp_path / "ok"))
    with pytest.raises(ValueError, match="already has offloaded backbone layers"):
        offload_backbone(model, layers=[3], folder=str(tmp_path / "ok"))


@pytest.mark.parametrize("fail_at", ["write", "hook"])
def test_a_failure_midway_leaves_nothing_offloaded(fail_at, monkeypatch, tmp_path):
    model = river_of(tiny_model("llama"))
    original = linear_weights(model)
    calls = []
    target = "save_file" if fail_at == "write" else "add_hook_to_module"
    real = getattr(river_hf.offload.backbone, target)

    def fail_on_third(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        return real(*args, **kwargs)

    monkeypatch.setattr(river_hf.offload.backbone, target, fail_on_third)
    with pytest.raises(OSError):
        offload_backbone(model, layers=RIVER_LAYERS, folder=str(tmp_path))
    assert_resident(model, tmp_path)
    assert all(torch.equal(original[k], v) for k, v in model.state_dict().items())


def test_config_checks_the_offload_fields():
    with pytest.raises(ValueError, match="`offload`='gpu'"):
        RiverQuantConfig(offload="gpu")
    with pytest.raises(ValueError, match="`offload_layers`='auto' needs `offload_exit_histogram`"):
        RiverQuantConfig(offload="disk")
    with pytest.raises(ValueError, match="`offload_layers` must be"):
        RiverQuantConfig(offload="disk", offload_layers=3)
    with pytest.raises(ValueError, match="`offload_max_share`"):
        RiverQuantConfig(offload="disk", offload_layers=[2], offload_max_share=0)
    config = RiverQuantConfig(offload="disk", offload_exit_histogram={"1": 3})
    assert RiverQuantConfig.from_dict(config.to_dict()).offload_exit_histogram == {1: 3}  # JSON keys read back


_RSS_CHILD = """
import json, sys, tempfile
import torch, transformers
import river_hf
from river_hf.bench.memory import proc_status
from river_hf.offload.backbone import weight_residency
from river_hf.kernels.quantize import plain_rounding

config = transformers.LlamaConfig(hidden_size=512, intermediate_size=2048, num_hidden_layers=8, num_attention_heads=8,
                                  num_key_value_heads=4, vocab_size=256)
torch.manual_seed(0)
model = transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()
with plain_rounding():
    river_hf.build_river(model, river_hf.RiverQuantConfig(start_layer=2, nbits=4, backend="auto",
                                                          quantize_lm_head=False), progress=False)
before = proc_status()["RssAnon"]
river_hf.offload_backbone(model, layers=list(range(2, 8)), to="disk", folder=tempfile.mkdtemp(), progress=False)
after = proc_status()["RssAnon"]
print(json.dumps({"before": before, "after": after, "offloaded": weight_residency(model)["offloaded_bytes"]}))
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads RssAnon from /proc (Linux)")
def test_offloading_hands_the_memory_back_right_away():
    """RssAnon falls by at least 40% of the offloaded weights' bytes right after `offload_backbone` (issue 33's
    target), in a process of its own so that nothing else moves its memory."""
    import json
    import subprocess
    import sys

    child = subprocess.run([sys.executable, "-c", _RSS_CHILD], capture_output=True, text=True, check=True)
    memory = json.loads(child.stdout.strip().splitlines()[-1])
    assert memory["offloaded"] > 40 * 2**20  # six layers of ~8.4 MB each
    assert memory["before"] - memory["after"] >= 0.4 * memory["offloaded"], memory
