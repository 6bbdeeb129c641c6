"""RiverQuantConfig and RiverConfig: validation names the field; both survive serialisation."""

from __future__ import annotations

import json
import math

import pytest
from transformers import GenerationConfig

from river_hf import RiverConfig, RiverQuantConfig


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"nbits": 5}, "nbits"),
        ({"nbits": True}, "nbits"),
        ({"group_size": 48}, "group_size"),
        ({"group_size": 0}, "group_size"),
        ({"axis": 2}, "axis"),
        ({"backend": "turbo"}, "backend"),
        ({"start_layer": 0}, "start_layer"),
        ({"start_layer": 1.5}, "start_layer"),
        ({"skip_modules": "down_proj"}, "skip_modules"),
        ({"nbits": []}, "nbits"),
        ({"quantize_lm_head": 1}, "quantize_lm_head"),
        ({"lm_head_nbits": 6}, "lm_head_nbits"),
        ({"lm_head_nbits": True}, "lm_head_nbits"),
    ],
)
def test_quant_config_rejects_bad_values_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"`{field}`"):
        RiverQuantConfig(**kwargs)


def test_quant_config_round_trips_through_dict_and_json(tmp_path):
    config = RiverQuantConfig(nbits=8, group_size=None, start_layer=3, skip_modules=["down_proj"])
    assert RiverQuantConfig.from_dict(config.to_dict()) == config
    path = tmp_path / "quant.json"
    config.to_json_file(path)
    assert '"quant_method": "river"' in path.read_text()


@pytest.mark.parametrize("nbits, index, value", [([4, 5], 1, "5"), ([8, 4, True], 2, "True"), ((6,), 0, "6")])
def test_schedule_entries_are_validated_naming_the_index_and_the_choices(nbits, index, value):
    with pytest.raises(ValueError, match=rf"`nbits`\[{index}\]={value} is not supported; choose one of \(2, 3, 4, 8\)"):
        RiverQuantConfig(nbits=nbits)


def test_an_explicit_backend_must_run_every_width_asked_of_it():
    with pytest.raises(ValueError, match="`backend`='int4pack_cpu' runs only 2/3/4-bit weights, but `nbits` asks for"):
        RiverQuantConfig(nbits=[8, 4], backend="int4pack_cpu")
    with pytest.raises(ValueError, match="`backend`='int8pack_cpu'.*`lm_head_nbits` asks for 4"):
        RiverQuantConfig(nbits=8, backend="int8pack_cpu", quantize_lm_head=True, lm_head_nbits=4)
    RiverQuantConfig(nbits=8, backend="int8pack_cpu", quantize_lm_head=False, lm_head_nbits=4)  # no head to run
    RiverQuantConfig(nbits=[8, 4, 2], backend="hqq", quantize_lm_head=True)


def test_schedule_and_lm_head_round_trip_through_dict_and_json(tmp_path):
    config = RiverQuantConfig(nbits=(8, 8, 4), start_layer=2, quantize_lm_head=True, lm_head_nbits=4)
    assert config.nbits == [8, 8, 4] and config.is_schedule  # a tuple is stored as a list (JSON has no tuples)
    as_dict = config.to_dict()
    as_dict["nbits"].append(2)  # the dict is a copy
    assert config.nbits == [8, 8, 4]
    assert RiverQuantConfig.from_dict(config.to_dict()) == config
    path = tmp_path / "quant.json"
    config.to_json_file(path)
    loaded = json.loads(path.read_text())
    assert loaded["nbits"] == [8, 8, 4] and loaded["quantize_lm_head"] is True and loaded["lm_head_nbits"] == 4
    assert RiverQuantConfig.from_dict(loaded) == config
    assert RiverQuantConfig().quantize_lm_head and RiverQuantConfig().lm_head_nbits == "auto"  # defaults
    assert RiverQuantConfig.from_dict(RiverQuantConfig().to_dict()).lm_head_nbits == "auto"  # saved as asked


@pytest.mark.parametrize("tau", ["abc", None, True, math.nan, [0.5]])
def test_tau_must_be_a_real_number(tau):
    with pytest.raises(ValueError, match="`tau` must be a real number"):
        RiverConfig(tau=tau)


@pytest.mark.parametrize("kwargs, field", [({"prefill_exit": "all"}, "prefill_exit"),
                                           ({"prefill_exit": 0}, "prefill_exit"),
                                           ({"exit_policy": "batch_mean"}, "exit_policy")])
def test_other_river_fields_are_validated(kwargs, field):
    with pytest.raises(ValueError, match=f"`{field}`"):
        RiverConfig(tau=0.9, **kwargs)


def test_river_config_is_a_generation_config_that_survives_save_and_load(tmp_path):
    config = RiverConfig(tau=0.93, prefill_exit=5, max_new_tokens=17, do_sample=True, temperature=0.7)
    assert isinstance(config, GenerationConfig)
    config.save_pretrained(tmp_path)
    loaded = RiverConfig.from_pretrained(tmp_path)
    assert isinstance(loaded, RiverConfig)
    assert (loaded.tau, loaded.prefill_exit, loaded.max_new_tokens, loaded.temperature) == (0.93, 5, 17, 0.7)
    plain = GenerationConfig.from_pretrained(tmp_path)  # a plain load keeps the river fields as extra attributes
    assert plain.tau == 0.93


def test_setting_tau_later_is_validated():
    config = RiverConfig(tau=0.9)
    with pytest.raises(ValueError, match="`tau`"):
        config.update(tau="high")
