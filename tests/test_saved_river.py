"""Saved rivers (river_hf.saving.twin_files): `save_pretrained(..., save_twins=True)` stores the twins' HQQ codes, and
loading the folder packs them again without HQQ; the loaded river generates exactly what the saved one did. Twins that
no longer fit (other weights, other config) are rebuilt with a warning; a corrupted file is refused, nothing half
done."""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

import river_hf
from river_hf import RiverQuantConfig
from river_hf.kernels import quantize
from river_hf.offload.backbone import offloaded_layers
from river_hf.saving.twin_files import TWINS_FILE, StoredTwinsError, TwinsMismatchWarning

from conftest import NUM_LAYERS, generate, mixed_tau, tiny_model

START = 2
IDS = torch.tensor([[5, 9, 33, 70, 12, 41, 7]])
# every field the twins depend on spelled out: the tests must not follow the library's defaults
BASE = dict(backend="auto", nbits=4, group_size=64, start_layer=START, quantize_lm_head=False)
MIXED_SCHEDULE = dict(nbits=[8, 4, 3, 4], start_layer=START, quantize_lm_head=True, lm_head_nbits=8)


def without_hqq(load, *args, **kwargs):
    """`load(*args, **kwargs)` with HQQ made to fail: nothing may be quantized from scratch."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(quantize, "hqq_quantize", lambda *a, **k: pytest.fail("HQQ ran: a twin was built from scratch"))
        return load(*args, **kwargs)


def saved_backbone(tmp_path, arch: str = "llama", **overrides) -> str:
    folder = str(tmp_path / f"{arch}-backbone")
    tiny_model(arch, **overrides).save_pretrained(folder)
    return folder


def loaded_river(folder, **quant):
    quant = {**BASE, **quant}
    return AutoModelForCausalLM.from_pretrained(folder, quantization_config=RiverQuantConfig(**quant))


def saved_river(tmp_path, arch: str = "llama", **quant):
    """A river loaded with quantization_config and saved (twins by default): (model, folder)."""
    model = loaded_river(saved_backbone(tmp_path, arch), **quant)
    folder = str(tmp_path / f"{arch}-river")
    model.save_pretrained(folder)
    return model, folder


def twin_weights(model) -> dict[str, torch.Tensor]:
    """Every twin linear's dequantized weight (and the quantized head's), by name."""
    weights = {f"{layer.layer_idx}.{name}": module.dequantized_weight()
               for layer in river_hf.river_layers(model) if layer.twin is not None
               for name, module in layer.twin.named_modules() if isinstance(module, quantize.RiverQuantLinear)}
    head = river_hf.core.lm_head.river_lm_head(model)
    if head is not None:
        weights["lm_head"] = head.quantized_head.dequantized_weight()
    return weights


def assert_same_river(loaded, saved):
    expected, actual = twin_weights(saved), twin_weights(loaded)
    assert actual.keys() == expected.keys() and all(torch.equal(actual[k], expected[k]) for k in expected)
    tau = mixed_tau(saved, IDS, start_layer=START)
    for settings in (dict(tau=-1), dict(tau=tau), dict(tau=0.0, exit_signal="random", exit_rate=0.5, seed=1)):
        reference = generate(saved, IDS, **settings)
        out = generate(loaded, IDS, **settings)
        assert torch.equal(out.sequences, reference.sequences), settings
        assert torch.equal(out.cache.exit_depth, reference.cache.exit_depth), settings


def edit_config(folder, **fields):
    path = os.path.join(folder, "config.json")
    with open(path) as file:
        config = json.load(file)
    config["quantization_config"].update(fields)
    with open(path, "w") as file:
        json.dump(config, file)


# ---------------------------------------------------------------- the round trip


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])  # qwen2: biased q/k/v; gemma3: sliding layers
def test_saved_river_loads_without_hqq_and_generates_the_same(arch, tmp_path):
    model, folder = saved_river(tmp_path, arch, **MIXED_SCHEDULE)
    assert os.path.isfile(os.path.join(folder, TWINS_FILE))
    loaded = without_hqq(AutoModelForCausalLM.from_pretrained, folder)  # config.json carries the RiverQuantConfig
    assert loaded.config.quantization_config.nbits == MIXED_SCHEDULE["nbits"]
    assert [layer.twin is not None for layer in river_hf.river_layers(loaded)] == [False] * START + [True] * 4
    assert_same_river(loaded, model)


def test_stored_twins_are_portable_codes_not_a_kernel_layout(tmp_path):
    model, folder = saved_river(tmp_path, **MIXED_SCHEDULE)
    stored = load_file(os.path.join(folder, TWINS_FILE))
    assert not any(name.endswith(("qweight", "scales_and_zeros", "kernel_scale")) for name in stored)
    layers = river_hf.river_layers(model)
    q8, q4 = layers[2].twin.self_attn.q_proj, layers[3].twin.self_attn.q_proj  # the schedule's 8 and 4 bits
    assert stored["layers.2.self_attn.q_proj.codes"].shape == (q8.out_features, q8.in_features)
    assert stored["layers.3.self_attn.q_proj.codes"].shape == (q4.out_features, q4.in_features // 2)  # 2 per byte
    assert torch.equal(stored["layers.3.self_attn.q_proj.scale"], q4.scale)
    assert "lm_head.codes" in stored


def test_twins_are_packed_again_for_the_backend_asked(tmp_path):
    model, folder = saved_river(tmp_path)  # int4pack_cpu twins
    edit_config(folder, backend="hqq")  # the backend is not part of the stored twins: their codes are repacked
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # 'hqq' is the slow reference: it warns
        loaded = without_hqq(AutoModelForCausalLM.from_pretrained, folder)
    assert river_hf.river_layers(loaded)[3].twin.mlp.up_proj.backend == "hqq"
    expected, actual = twin_weights(model), twin_weights(loaded)
    assert all(torch.equal(actual[k], expected[k]) for k in expected)


# ---------------------------------------------------------------- what is saved by default


def test_build_river_saves_the_plain_backbone_by_default_and_twins_on_request(tmp_path):
    model = river_hf.build_river(tiny_model("llama"), RiverQuantConfig(**{**BASE, "start_layer": 3}), progress=False)
    model.save_pretrained(tmp_path / "plain")
    assert not os.path.exists(tmp_path / "plain" / TWINS_FILE)
    assert not river_hf.is_river(AutoModelForCausalLM.from_pretrained(tmp_path / "plain"))
    model.save_pretrained(tmp_path / "river", save_twins=True)
    assert not hasattr(model.config, "quantization_config")  # written into config.json, not left on the model
    loaded = without_hqq(AutoModelForCausalLM.from_pretrained, tmp_path / "river")
    assert loaded.config.quantization_config.start_layer == 3
    assert_same_river(loaded, model)


def test_a_river_saved_without_twins_loads_by_quantizing_and_old_twins_are_removed(tmp_path, hqq_calls):
    model, folder = saved_river(tmp_path)  # with twins: the default for a model loaded with quantization_config
    model.save_pretrained(folder, save_twins=False)
    assert not os.path.exists(os.path.join(folder, TWINS_FILE))  # a stale file would outlive the save otherwise
    hqq_calls[0] = 0
    loaded = AutoModelForCausalLM.from_pretrained(folder)
    assert hqq_calls[0] == 7 * (NUM_LAYERS - START)  # every twin linear quantized again
    assert_same_river(loaded, model)
    with pytest.raises(ValueError, match="`save_twins`"):
        model.save_pretrained(folder, save_twins="yes")


def test_remove_river_after_a_saved_load_restores_the_backbone(tmp_path):
    _, folder = saved_river(tmp_path, **MIXED_SCHEDULE)
    loaded = river_hf.remove_river(without_hqq(AutoModelForCausalLM.from_pretrained, folder))
    plain = AutoModelForCausalLM.from_pretrained(str(tmp_path / "llama-backbone"))
    expected, actual = plain.state_dict(), loaded.state_dict()
    assert actual.keys() == expected.keys() and all(torch.equal(actual[k], expected[k]) for k in expected)
    assert torch.equal(loaded(IDS).logits, plain(IDS).logits)


def test_a_saved_river_offloads_as_configured(tmp_path):
    layers = [3, 4, 5]
    model, folder = saved_river(tmp_path, offload="disk", offload_layers=layers,
                                offload_folder=str(tmp_path / "offload"))
    loaded = without_hqq(AutoModelForCausalLM.from_pretrained, folder)
    assert offloaded_layers(loaded) == layers
    settings = dict(tau=0.0, exit_signal="random", exit_rate=0.5, seed=3)
    assert torch.equal(generate(loaded, IDS, **settings).sequences, generate(model, IDS, **settings).sequences)
    river_hf.reload_backbone(loaded)
    assert_same_river(loaded, model)


# ---------------------------------------------------------------- twins that no longer fit


def change_saved_weight(folder, name: str) -> None:
    path = os.path.join(folder, "model.safetensors")
    weights = load_file(path)
    weights[name] = weights[name].clone()
    weights[name][0, 0] += 0.5
    save_file(weights, path, metadata={"format": "pt"})


def test_changed_backbone_weights_rebuild_only_their_layer_with_a_warning(tmp_path, hqq_calls):
    model, folder = saved_river(tmp_path)
    change_saved_weight(folder, "model.layers.3.mlp.down_proj.weight")
    hqq_calls[0] = 0
    with pytest.warns(TwinsMismatchWarning, match=r"layer 3: the backbone weights differ .*layers\.3\.mlp\.down_proj"):
        loaded = AutoModelForCausalLM.from_pretrained(folder)
    assert hqq_calls[0] == 7  # layer 3's linears; the other layers came from the file
    layer = river_hf.river_layers(loaded)[3]
    fresh = quantize.RiverQuantLinear.from_linear(layer.base_layer.mlp.down_proj, nbits=4, group_size=64)
    assert torch.equal(layer.twin.mlp.down_proj.dequantized_weight(), fresh.dequantized_weight())
    expected, actual = twin_weights(model), twin_weights(loaded)
    assert all(torch.equal(actual[k], expected[k]) for k in expected if not k.startswith("3."))
    with warnings.catch_warnings():
        warnings.simplefilter("error", TwinsMismatchWarning)  # the strict reading: refuse instead of rebuilding
        with pytest.raises(TwinsMismatchWarning, match="layer 3"):
            AutoModelForCausalLM.from_pretrained(folder)


def test_a_changed_lm_head_is_quantized_again(tmp_path, hqq_calls):
    model, folder = saved_river(tmp_path, quantize_lm_head=True)
    change_saved_weight(folder, "lm_head.weight")
    hqq_calls[0] = 0
    with pytest.warns(TwinsMismatchWarning, match="LM head: the backbone weights differ"):
        loaded = AutoModelForCausalLM.from_pretrained(folder)
    assert hqq_calls[0] == 1 and river_hf.core.lm_head.river_lm_head(loaded) is not None


@pytest.mark.parametrize("fields, message, rebuilt", [
    (dict(nbits=8), r"layers 2-5: `nbits`: 4 stored, 8 asked", 4),
    (dict(group_size=32), r"layers 2-5: `group_size`: 64 stored, 32 asked", 4),
    (dict(start_layer=1), r"layer 1: no twin stored .*`start_layer` 2 stored, 1 asked", 1),
    (dict(skip_modules=["down_proj"]), r"layers 2-5: other linears are quantized .*`skip_modules` differs", 4),
])
def test_a_changed_config_rebuilds_the_layers_it_changes_with_a_warning(fields, message, rebuilt, tmp_path,
                                                                        hqq_calls):
    _, folder = saved_river(tmp_path)
    edit_config(folder, **fields)
    hqq_calls[0] = 0
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*group_size.* is ignored")  # 8 bits on CPU: per row
        with pytest.warns(TwinsMismatchWarning, match=message):
            loaded = AutoModelForCausalLM.from_pretrained(folder)
    linears = 6 if "skip_modules" in fields else 7
    assert hqq_calls[0] == rebuilt * linears
    assert loaded.config.quantization_config.to_dict().items() >= fields.items()
    assert generate(loaded, IDS, tau=-1).sequences.shape == (1, IDS.shape[1] + 12)


def test_a_later_start_layer_loads_its_layers_from_the_file(tmp_path):
    model, folder = saved_river(tmp_path)
    edit_config(folder, start_layer=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error", TwinsMismatchWarning)
        loaded = without_hqq(AutoModelForCausalLM.from_pretrained, folder)
    assert [layer.twin is not None for layer in river_hf.river_layers(loaded)] == [False] * 4 + [True] * 2
    expected, actual = twin_weights(model), twin_weights(loaded)
    assert actual.keys() and all(torch.equal(actual[k], expected[k]) for k in actual)


def test_build_river_reads_stored_twins_and_checks_them_against_its_config(tmp_path, hqq_calls):
    model, folder = saved_river(tmp_path)
    plain = AutoModelForCausalLM.from_pretrained(str(tmp_path / "llama-backbone"))
    hqq_calls[0] = 0
    loaded = river_hf.build_river(plain, RiverQuantConfig(**BASE), progress=False,
                                  stored_twins=folder)
    assert hqq_calls[0] == 0
    assert_same_river(loaded, model)
    other = AutoModelForCausalLM.from_pretrained(str(tmp_path / "llama-backbone"))
    with pytest.warns(TwinsMismatchWarning, match="`nbits`: 4 stored, 2 asked"):
        river_hf.build_river(other, RiverQuantConfig(**{**BASE, "nbits": 2}), progress=False,
                             stored_twins=os.path.join(folder, TWINS_FILE))


def test_a_quantization_config_passed_for_a_saved_river_gives_way_to_the_saved_one(tmp_path):
    _, folder = saved_river(tmp_path)
    # transformers' rule for pre-quantized folders: the folder's quantization_config is used, with its own warning
    with pytest.warns(UserWarning, match="quantization_config.* from the model will be used"):
        loaded = without_hqq(AutoModelForCausalLM.from_pretrained, folder,
                             quantization_config=RiverQuantConfig(**{**BASE, "nbits": 8}))
    assert loaded.config.quantization_config.nbits == 4


# ---------------------------------------------------------------- corrupted files


def corrupt(path: str, how: str) -> None:
    with open(path, "rb") as file:
        data = bytearray(file.read())
    if how == "truncated":
        data = data[: len(data) // 2]
    elif how == "flipped":
        data[-3] ^= 0x10  # inside the last tensor's bytes
    else:  # "header"
        data[10:20] = b"#" * 10
    with open(path, "wb") as file:
        file.write(data)


@pytest.mark.parametrize("how", ["truncated", "flipped", "header"])
def test_a_corrupted_twins_file_is_refused_naming_the_file(how, tmp_path, monkeypatch):
    # a cache folder of its own: where this machine keeps the twins packed, a flipped byte in the file's tensors is
    # never read (tests/test_packed_twins.py)
    monkeypatch.setenv("RIVER_HF_CACHE", str(tmp_path / "cache"))
    _, folder = saved_river(tmp_path)
    path = os.path.join(folder, TWINS_FILE)
    corrupt(path, how)
    with pytest.raises(StoredTwinsError, match=f"{path}.*Nothing was loaded from it"):
        AutoModelForCausalLM.from_pretrained(folder)
    plain = tiny_model("llama")
    layers = list(plain.model.layers)
    with pytest.raises(StoredTwinsError, match=path):
        river_hf.build_river(plain, RiverQuantConfig(**BASE), stored_twins=path)
    assert not river_hf.is_river(plain) and list(plain.model.layers) == layers  # nothing half built


def test_a_safetensors_file_without_river_metadata_is_refused(tmp_path):
    path = str(tmp_path / TWINS_FILE)
    save_file({"x": torch.zeros(2)}, path)
    with pytest.raises(StoredTwinsError, match="cannot be read as a river_hf twins file"):
        river_hf.saving.twin_loading.StoredTwins.read(path)


def test_twins_are_read_outside_the_loaders_meta_device_context(tmp_path, monkeypatch):
    """from_pretrained reads the twins inside transformers' meta-device mode: the read sets it aside (speed: no
    torch function mode on the 600+ checksums of a real model), and the tensors it returns are real CPU tensors."""
    _, folder = saved_river(tmp_path)
    modes = []
    real_checksum = river_hf.saving.twin_loading.checksum
    monkeypatch.setattr(river_hf.saving.twin_loading, "checksum", lambda tensor: modes.append(
        torch._C._is_torch_function_mode_enabled()) or real_checksum(tensor))
    with torch.device("meta"):
        assert torch.empty(1).is_meta and torch._C._is_torch_function_mode_enabled()
        stored = river_hf.saving.twin_loading.StoredTwins.read(folder)
    assert modes and not any(modes)
    assert all(tensor.device.type == "cpu" for tensor in stored.tensors.values())


# ---------------------------------------------------------------- the real model


@pytest.mark.slow
def test_smollm2_saved_river_loads_without_hqq(tmp_path):
    from river_hf.loading.models import load_model_and_tokenizer

    model, _ = load_model_and_tokenizer(None)
    quant = RiverQuantConfig(**{**BASE, "start_layer": 24, "quantize_lm_head": True})
    river_hf.build_river(model, quant, progress=False)
    model.save_pretrained(tmp_path / "river", save_twins=True)
    loaded = without_hqq(AutoModelForCausalLM.from_pretrained, tmp_path / "river", dtype=torch.bfloat16)
    expected, actual = twin_weights(model), twin_weights(loaded)
    assert actual.keys() == expected.keys() and all(torch.equal(actual[k], expected[k]) for k in expected)
    ids = torch.tensor([[1, 504, 3458, 282, 4649, 314]])
    assert torch.equal(generate(loaded, ids, tau=-1, max_new_tokens=16).sequences,
                       generate(model, ids, tau=-1, max_new_tokens=16).sequences)


@pytest.mark.slow  # seven fresh processes, each importing torch and transformers
def test_load_time_example_times_every_load(saved_tiny_model, tmp_path, capsys):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "scripts" / "load_time.py"
    spec = importlib.util.spec_from_file_location("load_time", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    table = example.main(["--model", str(saved_tiny_model), "--repeats", "1"])
    assert set(table) == set(example.systems(str(tmp_path)))
    assert table["plain model"]["seconds"]["vs_plain"] == 1.0  # a row per system, load and load + a first pass:
    assert all(0 < row["seconds"]["median_s"] <= row["with_first_pass_seconds"]["median_s"] for row in table.values())
    assert "| saved river (auto) |" in capsys.readouterr().out
