"""Hostile input, found by a fuzzer (issue 33, item 3): configs. Every invalid value of a `RiverQuantConfig` field, a
`RiverConfig` river field or `RiverQuantConfig.schedule`'s arguments raises a ValueError or TypeError naming the field;
every valid one is accepted and survives JSON. (build_river: test_fuzz_build.py; generate and offload_backbone:
test_fuzz_generate.py. The value strategies, verdict helpers and small models all three use are in fuzz_support.py;
the other two also take this module's field tables.)

Property-based (hypothesis), derandomized: every run tests the same cases. The 13 bugs the fuzzer found when it was
written (arrays and numpy/torch lookalikes in config fields, unchecked offload arguments, tau='auto' without a default,
a twins record without a digest, ...) are fixed; a new finding fails its test with the minimal input hypothesis shrank.
"""

from __future__ import annotations

import dataclasses
import json
import numbers
import os
from collections import Counter

import numpy as np
import torch
from hypothesis import given, strategies as st

from river_hf import RiverConfig, RiverQuantConfig, RiverSettings

from fuzz_support import (EITHER, HOSTILE, INVALID, VALID, attempt, check_cases_ran, check_outcome, fuzz, integral,
                          iterable, looks_like_one_of, names_field, numeric_lookalike, one_thread, plain_int,
                          valid_histogram, valid_or_hostile)  # noqa: F401 (one_thread: an autouse fixture)

CASES: Counter = Counter()  # passing generated cases per test (test_every_fuzz_test_ran_its_cases reads it)
MIN_CASES = {"quant_config": 380, "river_config": 280, "river_config_pairs": 140, "schedule": 90}


# ---------------------------------------------------------------- RiverQuantConfig, one field at a time

BACKENDS = ("auto", "fastest", "int4pack_cpu", "int8pack_cpu", "int8pack_fp32_cpu", "w8a8_cpu", "matmulnbits_cpu",
            "dense", "tinygemm_cuda", "hqq")
NBITS = (2, 3, 4, 8)
QUANT_BASE = {"offload": {"offload_layers": [1]},
              "offload_layers": {"offload": "disk", "offload_exit_histogram": {4: 10}},
              "offload_folder": {"offload": "disk", "offload_layers": [1]},
              "offload_max_share": {"offload": "disk", "offload_layers": [1]},
              "offload_exit_histogram": {"offload": "disk", "offload_layers": "auto"}}
VALID_QUANT = {
    "nbits": st.one_of(st.sampled_from([*NBITS, "auto"]), st.lists(st.sampled_from(NBITS), min_size=1, max_size=5)),
    "group_size": st.sampled_from([32, 64, 128, 256, None]), "axis": st.just(1), "start_layer": st.integers(1, 99),
    "skip_modules": st.lists(st.sampled_from(["q_proj", "down_proj", "mlp.up_proj", "qkv_proj"]), max_size=3),
    "backend": st.sampled_from(BACKENDS), "activations": st.sampled_from([None, "int8"]),
    "lm_head_activations": st.sampled_from(["as_twins", None, "int8"]),
    "lora_twins": st.sampled_from(["full_precision", "merged"]), "quantize_lm_head": st.booleans(),
    "lm_head_nbits": st.sampled_from(NBITS), "offload": st.sampled_from([None, "disk", "cpu"]),
    "offload_layers": st.one_of(st.just("auto"), st.lists(st.integers(0, 9), max_size=3)),
    "offload_folder": st.one_of(st.none(), st.text(alphabet="abc/_", max_size=6)),
    "offload_max_share": st.floats(0, 1, exclude_min=True), "quant_method": st.just("river"),
    "offload_exit_histogram": st.dictionaries(st.integers(1, 4), st.integers(1, 50), min_size=1),
}


def quant_verdict(field: str, value) -> str:
    choices = {"nbits": NBITS, "lm_head_nbits": NBITS, "group_size": (32, 64, 128, 256), "axis": (1,)}.get(field)
    if field == "nbits" and isinstance(value, str) and value == "auto":
        return VALID
    if field == "nbits" and isinstance(value, (list, tuple)) and value:
        entries = [quant_verdict("lm_head_nbits", bits) for bits in value]
        return INVALID if INVALID in entries else EITHER if EITHER in entries else VALID
    if choices is not None:
        if (field == "group_size" and value is None) or (plain_int(value) and value in choices):
            return VALID
        return EITHER if looks_like_one_of(value, choices) else INVALID
    if field == "start_layer":
        return VALID if plain_int(value) and value >= 1 else EITHER if integral(value) and value >= 1 else INVALID
    if field == "skip_modules":
        if isinstance(value, (list, tuple)) and all(isinstance(name, str) for name in value):
            return VALID
        return EITHER if (not isinstance(value, str) and iterable(value) and not isinstance(value, torch.Tensor)
                          and all(isinstance(name, str) for name in value)) else INVALID
    if field == "backend":
        if isinstance(value, str) and value in BACKENDS:
            return VALID if value in ("auto", "fastest", "dense", "hqq") else EITHER  # others: widths, activations
        return INVALID
    if field == "offload_layers":
        if isinstance(value, str) and value == "auto" or (
                isinstance(value, (list, tuple)) and all(plain_int(i) for i in value)):
            return VALID
        return EITHER if isinstance(value, (list, tuple)) and all(integral(i) for i in value) else INVALID
    if field == "offload_folder":
        return VALID if value is None or isinstance(value, (str, os.PathLike)) else INVALID
    if field == "offload_max_share":
        if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value <= 1:
            return VALID
        return EITHER if numeric_lookalike(value) and 0 < float(value) <= 1 else INVALID
    if field == "offload_exit_histogram":
        return VALID if valid_histogram(value) else INVALID
    allowed = {"activations": (None, "int8"), "lm_head_activations": ("as_twins", None, "int8"),
               "lora_twins": ("full_precision", "merged"), "quant_method": ("river",),
               "offload": (None, "disk", "cpu"), "quantize_lm_head": (True, False)}[field]
    same_type = [choice for choice in allowed if type(choice) is type(value)]
    return VALID if any(value == choice for choice in same_type) else INVALID


quant_cases = st.sampled_from(tuple(VALID_QUANT)).flatmap(
    lambda field: st.tuples(st.just(field), valid_or_hostile(VALID_QUANT[field])))


def json_round_trip_error(config, from_dict, settings_of):
    """None when `config` goes through JSON and comes back equal; else the exception or a description."""
    try:
        again = from_dict(json.loads(config.to_json_string()))
    except Exception as error:  # noqa: BLE001
        return error
    return None if settings_of(again) == settings_of(config) else AssertionError("changed through JSON")


def as_json(config) -> dict:
    return json.loads(config.to_json_string())  # a histogram's int keys come back as strings, which it reads


@fuzz(400)
@given(case=quant_cases)
def test_quant_config_refuses_every_invalid_value_naming_the_field(case):
    field, value = case
    verdict = quant_verdict(field, value)
    config, error = attempt(lambda: RiverQuantConfig(**{"nbits": 4, **QUANT_BASE.get(field, {}), field: value}))
    json_error = None if error else json_round_trip_error(config, RiverQuantConfig.from_dict, as_json)
    check_outcome(field, value, verdict, error)
    assert json_error is None, f"{field}={value!r} was accepted but does not survive JSON: {json_error!r}"
    CASES["quant_config"] += 1
    CASES[f"quant_config:{'refused' if error else 'accepted'}"] += 1


# ---------------------------------------------------------------- RiverConfig (RiverSettings), one field at a time

SIGNALS = ("confidence", "cosine", "cosine_first", "update_norm", "random")
STRATEGIES = ("river", "recompute", "state_propagation", "mask", "mono_decreasing")
RIVER_BASE = {"exit_rate": {"exit_signal": "random"}, "seed": {"exit_signal": "random", "exit_rate": 0.5},
              "num_draft_tokens": {"lossless": True}, "draft_fallback": {"lossless": True},
              "exact_verify": {"lossless": True}}
VALID_RIVER = {
    "tau": st.one_of(st.just("auto"), st.floats(allow_nan=False), st.integers(-5, 5)),
    "prefill_exit": st.one_of(st.sampled_from(["auto", "sequence", "none"]), st.integers(1, 99)),
    "exit_policy": st.just("batch_min"), "kv_strategy": st.sampled_from(STRATEGIES),
    "min_exit_layer": st.one_of(st.none(), st.integers(1, 99)), "exit_signal": st.sampled_from(SIGNALS),
    "exit_rate": st.floats(0, 1), "seed": st.one_of(st.none(), st.integers(-2**70, 2**70)),
    "signal_layer": st.one_of(st.none(), st.integers(1, 99)), "lossless": st.booleans(),
    "num_draft_tokens": st.one_of(st.just("heuristic"), st.integers(1, 99)), "draft_fallback": st.booleans(),
    "exact_verify": st.booleans(),
}
assert set(VALID_RIVER) == {f.name for f in dataclasses.fields(RiverSettings)}  # a new field needs its strategy


def river_verdict(field: str, value) -> str:
    if field == "tau":
        if isinstance(value, str):
            return VALID if value == "auto" else INVALID
        real = isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))
        return VALID if real and value == value else INVALID  # NaN is not
    if field in ("prefill_exit", "min_exit_layer", "signal_layer", "num_draft_tokens", "seed"):
        words = {"prefill_exit": ("auto", "sequence", "none"), "num_draft_tokens": ("heuristic",)}.get(field, ())
        if isinstance(value, str) and value in words or (value is None and field in ("min_exit_layer", "signal_layer",
                                                                                     "seed")):
            return VALID
        low = None if field == "seed" else 1
        if plain_int(value) and (low is None or value >= low):
            return VALID
        return EITHER if integral(value) and (low is None or value >= low) else INVALID
    if field == "exit_rate":
        real = isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))
        return VALID if real and 0 <= value <= 1 else INVALID
    if field in ("lossless", "draft_fallback", "exact_verify"):
        return VALID if isinstance(value, bool) else INVALID
    if field == "exit_signal" and isinstance(value, str) and value == "random":
        return EITHER  # needs exit_rate, which the base does not give: refused naming it
    allowed = {"exit_policy": ("batch_min",), "kv_strategy": STRATEGIES, "exit_signal": SIGNALS}[field]
    return VALID if isinstance(value, str) and value in allowed else INVALID


river_cases = st.sampled_from(tuple(VALID_RIVER)).flatmap(
    lambda field: st.tuples(st.just(field), valid_or_hostile(VALID_RIVER[field])))


@fuzz(300)
@given(case=river_cases)
def test_river_config_refuses_every_invalid_value_naming_the_field(case):
    field, value = case
    verdict = river_verdict(field, value)
    base = {"tau": 0.5, "exit_signal": "cosine", **RIVER_BASE.get(field, {})}
    config, error = attempt(lambda: RiverConfig(**{**base, field: value}))
    json_error = None if error else json_round_trip_error(config, RiverConfig.from_dict, RiverConfig.river_settings)
    check_outcome(field, value, verdict, error)
    assert json_error is None, f"{field}={value!r} was accepted but does not survive JSON: {json_error!r}"
    if error is None:  # the settings generate uses hold what was given
        assert getattr(config.river_settings(), field) == value or field == "tau" and value == float(value)
    CASES["river_config"] += 1
    CASES[f"river_config:{'refused' if error else 'accepted'}"] += 1


AUTO_TAU_SIGNALS = ("confidence", "cosine", "random")  # docs: tau="auto" is confidence's or cosine's measured default;
# random routing reads no tau


@fuzz(150)
@given(tau=st.one_of(st.just("auto"), st.floats(-1, 2)), exit_signal=st.sampled_from(SIGNALS),
       exit_rate=st.sampled_from([None, 0.5]), kv_strategy=st.sampled_from(STRATEGIES), lossless=st.booleans())
def test_river_config_refuses_fields_that_do_not_go_together_naming_them(tau, exit_signal, exit_rate, kv_strategy,
                                                                           lossless):
    fields = dict(tau=tau, exit_signal=exit_signal, exit_rate=exit_rate, kv_strategy=kv_strategy, lossless=lossless)
    clashes = []
    if exit_signal == "random" and exit_rate is None:
        clashes.append({"exit_signal", "exit_rate"})
    if lossless and kv_strategy != "river":
        clashes.append({"lossless", "kv_strategy"})
    no_default = tau == "auto" and not lossless and exit_signal not in AUTO_TAU_SIGNALS
    _, error = attempt(lambda: RiverConfig(**fields))
    if no_default:
        clashes.append({"tau", "exit_signal"})
    if not clashes:
        assert error is None, f"{fields}: {error!r}"
    else:
        assert isinstance(error, ValueError), f"{fields}: accepted"
        assert any(all(names_field(error, name) for name in clash) for clash in clashes), f"{fields}: {error}"
    CASES["river_config_pairs"] += 1


# ---------------------------------------------------------------- RiverQuantConfig.schedule

SCHEDULE_ARGS = {"num_layers": st.integers(-2, 40), "first_layers": st.integers(-2, 40),
                 "first_bits": st.sampled_from(NBITS), "rest_bits": st.sampled_from(NBITS),
                 "start_layer": st.integers(-1, 40)}


def schedule_verdict(args: dict) -> str:
    counts = [args[name] for name in ("num_layers", "first_layers", "start_layer")]
    if not all(map(plain_int, counts)):
        return EITHER if all(plain_int(v) or integral(v) for v in counts) else INVALID
    num_layers, first_layers, start_layer = counts
    river = num_layers - start_layer
    if river < 1 or start_layer < 1 or not 0 <= first_layers <= river:
        return INVALID
    verdict = VALID
    for name, used in (("first_bits", first_layers > 0), ("rest_bits", river > first_layers)):
        bits = args[name]
        if not (plain_int(bits) and bits in NBITS):
            if used and not looks_like_one_of(bits, NBITS):
                return INVALID
            verdict = EITHER  # a lookalike, or a bad width no layer gets
    return verdict


@fuzz(100)
@given(args=st.fixed_dictionaries(SCHEDULE_ARGS), hostile=st.one_of(st.none(), st.tuples(
    st.sampled_from(tuple(SCHEDULE_ARGS)), HOSTILE.filter(lambda v: not (isinstance(v, int) and abs(v) > 10**4)))))
def test_a_schedule_is_built_or_refused_naming_the_argument(args, hostile):
    if hostile is not None:
        args[hostile[0]] = hostile[1]
    verdict = schedule_verdict(args)
    config, error = attempt(lambda: RiverQuantConfig.schedule(**args))
    if error is not None:
        assert verdict != VALID, f"{args}: refused: {error!r}"
        assert isinstance(error, (ValueError, TypeError)), f"{args}: {error!r}"
        # a bad bit width is named as the schedule entry it became (`nbits`[i]), the rest by their own name
        assert any(names_field(error, name) for name in (*SCHEDULE_ARGS, "nbits")), f"{args}: {error}"
    else:
        assert verdict != INVALID, f"{args}: accepted: nbits={config.nbits}"
        num_layers, first_layers, start_layer = (int(args[n]) for n in ("num_layers", "first_layers", "start_layer"))
        assert config.nbits == [int(args["first_bits"])] * first_layers + [int(args["rest_bits"])] * (
            num_layers - start_layer - first_layers) and config.start_layer == start_layer
        config.check_model_depth(num_layers)  # the schedule fits the model it was made for
    CASES["schedule"] += 1


def test_every_fuzz_test_ran_its_cases():
    check_cases_ran("test_fuzz_configs", CASES, MIN_CASES)
