"""Hostile input, found by a fuzzer (issue 33, item 3): generate and offloading, on the small random models of every
supported architecture. Random valid combinations of twins (RiverQuantConfig) and exits (RiverConfig) generate, keep
every KV slot, give the backbone's tokens where they must (tau > 1, lossless greedy), and `remove_river` restores the
state_dict bit for bit; invalid river fields passed to `generate` and invalid `offload_backbone` arguments raise a
ValueError or TypeError naming the field and leave the model as it was, still usable.

Derandomized hypothesis, as test_fuzz_configs.py (whose value strategies and verdicts this module shares).
"""

from __future__ import annotations

import os
import warnings
from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import assume, given, strategies as st

import river_hf
from river_hf import (RiverCache, RiverConfig, RiverQuantConfig, RiverStaticCache, build_river, offload_backbone,
                      offloaded_layers, reload_backbone, remove_river)

from fuzz_support import (ARCHS, EITHER, HOSTILE, INVALID, LAYERS, VALID, assert_unchanged, attempt, check_cases_ran,
                          check_outcome, fuzz, integral, names_field, one_thread, plain_int, small_model, snapshot,
                          valid_histogram, valid_or_hostile)
from test_fuzz_configs import AUTO_TAU_SIGNALS, NBITS, RIVER_BASE, SIGNALS, STRATEGIES, VALID_RIVER, river_verdict

CASES: Counter = Counter()
MIN_CASES = {"generate_invalid": 140, "lookalikes": 35, "valid": 140, "offload": 75}
RIVER_CACHES = (RiverCache, RiverStaticCache)  # what records exits: dynamic (lossless too) and static
SLIDING = ("gemma3",)  # hybrid sliding-window cache: recompute and mask refuse it (by design, named)
assert one_thread  # the module-scoped autouse fixture, imported to apply here too


def prompt(batch: int = 1, length: int = 5, seed: int = 3) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, 256, (batch, length), generator=generator)


def quiet(call):
    """`call()` with river_hf's expected warnings silenced (slow hqq kernel, tau='auto' falling back, offloading)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return call()


def state_of(model) -> dict:
    return {key: tensor.clone() for key, tensor in model.state_dict().items()}


def same_state(model, state: dict) -> bool:
    now = model.state_dict()
    return now.keys() == state.keys() and all(torch.equal(now[key], state[key]) for key in state)


# ---------------------------------------------------------------- generate: invalid river fields

class Held(tuple):
    """A module fixture's values, with a short repr in hypothesis' reports (not a state_dict's 189 kB)."""

    def __repr__(self):
        return f"<{type(self[0]).__name__} and its reference state>"


@pytest.fixture(scope="module")
def river():
    """A small Llama river, its state, generation_config and the tokens of a reference call."""
    model = build_river(small_model("llama"), RiverQuantConfig(start_layer=1, nbits=4, backend="auto"), progress=False)
    reference = dict(tau=0.5, exit_signal="cosine", max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
    out = model.generate(prompt(), **reference)
    return Held((model, state_of(model), model.generation_config.to_json_string(), reference, out))


def assert_still_the_same_river(river) -> None:
    model, state, generation_config, reference, out = river
    assert river_hf.is_river(model) and same_state(model, state)
    assert model.generation_config.to_json_string() == generation_config
    again = model.generate(prompt(), **reference)
    assert torch.equal(again.sequences, out.sequences) and torch.equal(again.cache.exit_depth, out.cache.exit_depth)


def generate_verdict(field: str, value) -> str:
    verdict = river_verdict(field, value)
    if field == "min_exit_layer" and verdict != INVALID and value is not None and value >= LAYERS:
        return INVALID  # leaves nothing to exit on a 4-layer model: refused at generate, naming it
    return verdict


@fuzz(150)
@given(case=st.sampled_from(tuple(VALID_RIVER)).flatmap(
    lambda field: st.tuples(st.just(field), valid_or_hostile(VALID_RIVER[field]))),
    how=st.sampled_from(["keyword", "config set after validation"]))
def test_generate_refuses_invalid_river_fields_and_leaves_the_model_usable(river, case, how):
    field, value = case
    model, *_ = river
    verdict = generate_verdict(field, value)
    base = {"tau": 0.5, "exit_signal": "cosine", **RIVER_BASE.get(field, {})}
    call = dict(max_new_tokens=2, do_sample=False, return_dict_in_generate=True)
    if how == "keyword":
        out, error = attempt(lambda: quiet(lambda: model.generate(prompt(), **call, **{**base, field: value})))
    else:  # a RiverConfig changed after its own validation: generate validates again
        config = RiverConfig(**{**base, "exit_rate": 0.5} if field == "exit_rate" else base, **call)
        setattr(config, field, value)
        out, error = attempt(lambda: quiet(lambda: model.generate(prompt(), generation_config=config)))
    check_outcome(field, value, verdict, error)
    if error is None:
        assert out.sequences.shape[0] == 1 and 5 < out.sequences.shape[1] <= 7
        ran_plain = field == "tau" and value == "auto"  # where exiting does not pay here: the backbone runs
        assert isinstance(out.cache, RiverCache) or ran_plain, type(out.cache)
        if isinstance(out.cache, RiverCache):
            out.cache.check_kv_integrity()
    assert_still_the_same_river(river)
    CASES["generate_invalid"] += 1
    CASES[f"generate_invalid:{'refused' if error else 'generated'}"] += 1


# ---------------------------------------------------------------- generate: numbers that equal a valid value

LOOKALIKE_FIELDS = {  # field: (its plain values, the settings it needs)
    "tau": (st.sampled_from([-1, 0.25, 0.5, 0.75, 1.5, 2]), {"exit_signal": "cosine"}),
    "prefill_exit": (st.integers(1, LAYERS), {"tau": 0.5, "exit_signal": "cosine"}),
    "min_exit_layer": (st.integers(1, LAYERS - 1), {"tau": -1}),
    "signal_layer": (st.integers(1, LAYERS), {"tau": 0.5, "exit_signal": "cosine_first"}),
    "exit_rate": (st.sampled_from([0, 0.25, 0.5, 1]), {"tau": 0.5, "exit_signal": "random", "seed": 1}),
    "seed": (st.integers(0, 99), {"tau": 0.5, "exit_signal": "random", "exit_rate": 0.5}),
    "num_draft_tokens": (st.integers(1, 4), {"tau": -1, "lossless": True}),
}
WRAPPERS = {"numpy int64": np.int64, "numpy float64": np.float64, "numpy float32": np.float32, "float": float}


@fuzz(40)
@given(case=st.sampled_from(tuple(LOOKALIKE_FIELDS)).flatmap(lambda field: st.tuples(
    st.just(field), LOOKALIKE_FIELDS[field][0], st.sampled_from(tuple(WRAPPERS)))), batch=st.integers(1, 2))
def test_a_number_equal_to_a_valid_value_is_refused_naming_it_or_acts_as_that_value(river, case, batch):
    field, plain, wrapper = case
    assume(WRAPPERS[wrapper](plain) == plain)  # numpy int64(0.25) is 0: no lookalike of 0.25
    model, *_ = river
    settings_ = {**LOOKALIKE_FIELDS[field][1], "max_new_tokens": 3, "do_sample": False, "return_dict_in_generate": True}
    batch = 1 if settings_.get("lossless") else batch
    expected = quiet(lambda: model.generate(prompt(batch), **settings_, **{field: plain}))
    out, error = attempt(lambda: quiet(lambda: model.generate(prompt(batch), **settings_,
                                                              **{field: WRAPPERS[wrapper](plain)})))
    same = error is None and torch.equal(out.sequences, expected.sequences) and torch.equal(
        out.cache.exit_depth, expected.cache.exit_depth)
    if error is not None:
        assert isinstance(error, (ValueError, TypeError)) and names_field(error, field), repr(error)
    else:
        assert same, f"{field}={wrapper}({plain}) does not act as {plain}"
    assert_still_the_same_river(river)
    CASES["lookalikes"] += 1


# ---------------------------------------------------------------- valid combinations on every architecture

@st.composite
def river_quant(draw) -> dict:
    start = draw(st.integers(1, LAYERS - 1))
    nbits = draw(st.one_of(st.sampled_from([*NBITS, "auto"]),
                           st.lists(st.sampled_from(NBITS), min_size=LAYERS - start, max_size=LAYERS - start)))
    kwargs = {"start_layer": start, "nbits": nbits, "group_size": draw(st.sampled_from([32, 64, None])),
              "activations": draw(st.sampled_from([None, None, "int8"])), "quantize_lm_head": draw(st.booleans()),
              "lm_head_nbits": draw(st.sampled_from(NBITS)),
              "skip_modules": draw(st.lists(st.sampled_from(["q_proj", "down_proj", "mlp.up_proj", "qkv_proj"]),
                                            max_size=2, unique=True)),
              "backend": draw(st.sampled_from(["auto", "auto", "fastest", "dense", "hqq", "int4pack_cpu",
                                               "int8pack_cpu", "int8pack_fp32_cpu", "w8a8_cpu"]))}
    if attempt(lambda: RiverQuantConfig(**kwargs))[1] is not None:
        kwargs["backend"] = "auto"  # an explicit kernel that cannot run these widths (its refusal: test_fuzz_configs)
    return kwargs


@st.composite
def river_call(draw, arch: str) -> dict:
    """RiverConfig fields and generate arguments that every architecture must take."""
    lossless = draw(st.sampled_from([False, False, False, True]))
    strategies = ("river",) if lossless else tuple(s for s in STRATEGIES
                                                   if arch not in SLIDING or s not in ("recompute", "mask"))
    signal = draw(st.sampled_from(SIGNALS))
    # tau="auto" is the measured default of confidence and cosine (and -1 in lossless mode); with another signal
    # RiverSettings refuses it
    auto = ["auto"] if lossless or signal in AUTO_TAU_SIGNALS else []
    call = {"tau": draw(st.one_of(st.sampled_from([-1.0, 1.5, *auto]), st.floats(0, 1))),
            "exit_signal": signal, "kv_strategy": draw(st.sampled_from(strategies)),
            "prefill_exit": draw(st.one_of(st.sampled_from(["auto", "sequence", "none"]), st.integers(1, LAYERS))),
            "min_exit_layer": draw(st.one_of(st.none(), st.integers(1, LAYERS - 1))),
            "max_new_tokens": draw(st.integers(1, 5)), "do_sample": draw(st.booleans()), "lossless": lossless}
    if call["exit_signal"] == "random":
        call.update(exit_rate=draw(st.floats(0, 1)), seed=draw(st.integers(0, 99)))
    if call["exit_signal"] == "cosine_first":
        call["signal_layer"] = draw(st.one_of(st.none(), st.integers(1, LAYERS)))
    if lossless:
        call.update(num_draft_tokens=draw(st.one_of(st.just("heuristic"), st.integers(1, 4))),
                    exact_verify=draw(st.booleans()), draft_fallback=draw(st.booleans()))
    beams_ok = not lossless and call["kv_strategy"] != "recompute" and not call["do_sample"]
    call["num_beams"] = draw(st.sampled_from([1, 2])) if beams_ok else 1
    static_ok = not lossless and call["kv_strategy"] == "river" and call["num_beams"] == 1
    if static_ok and draw(st.integers(0, 4)) == 0:
        call["cache_implementation"] = "static"
    return call


def backbone_tokens(model, ids, mask, call: dict) -> torch.Tensor:
    plain = {key: call[key] for key in ("max_new_tokens", "num_beams")}
    return model.generate(ids, attention_mask=mask, do_sample=False, **plain)


@fuzz(150)
@given(data=st.data(), arch=st.sampled_from(ARCHS), quant=river_quant(), batch=st.integers(1, 2),
       padded=st.booleans(), seed=st.integers(0, 3))
def test_valid_combinations_generate_keep_every_kv_slot_and_remove_river_restores_the_model(
        data, arch, quant, batch, padded, seed):
    call = data.draw(river_call(arch))
    batch = 1 if call["lossless"] else batch
    model = small_model(arch, seed=seed)
    ids = prompt(batch, length=6, seed=seed)
    mask = torch.ones_like(ids)
    if padded and batch == 2:
        ids[1, :2], mask[1, :2] = 0, 0  # left padding (pad id 0)
    before = snapshot(model)
    backbone = backbone_tokens(model, ids, mask, call)
    quiet(lambda: build_river(model, RiverQuantConfig(**quant), progress=False))
    torch.manual_seed(seed)  # sampling: reproducible
    out = quiet(lambda: model.generate(ids, attention_mask=mask, generation_config=RiverConfig(
        **call, return_dict_in_generate=True)))
    assert out.sequences.shape[0] == batch and ids.shape[1] < out.sequences.shape[1] <= ids.shape[1] + call[
        "max_new_tokens"]
    never_exits = call["tau"] == 1.5 and call["exit_signal"] != "random"  # random routing ignores tau, by design
    if not isinstance(out.cache, RIVER_CACHES):  # tau="auto" where exiting does not pay here: the plain backbone ran
        assert call["tau"] == "auto" and not call["lossless"], type(out.cache)
    else:
        cache = out.cache
        cache.check_kv_integrity()
        depth = cache.exit_depth  # [rows, positions]: beam search keeps one row per beam
        assert depth.shape[0] == batch * call["num_beams"] and (depth >= quant["start_layer"]).all(), depth
        assert (depth <= LAYERS).all(), depth
        if never_exits:  # no token exits; a prompt only where prefill_exit says where
            assert (depth[:, cache.prompt_length:] == LAYERS).all()
            assert (depth == LAYERS).all() or isinstance(call["prefill_exit"], int)
    prompt_exits = isinstance(call["prefill_exit"], int) and call["prefill_exit"] < LAYERS and call[
        "kv_strategy"] == "river"
    if (never_exits and not prompt_exits or call["lossless"]) and not call["do_sample"]:
        assert torch.equal(out.sequences, backbone), f"{arch} {quant} {call}: not the backbone's tokens"
    remove_river(model)
    assert_unchanged(model, before)
    assert torch.equal(backbone_tokens(model, ids, mask, call), backbone)
    CASES["valid"] += 1
    for feature in (arch, call["kv_strategy"], call["exit_signal"], "lossless" * call["lossless"],
                    "beams" * (call["num_beams"] > 1), call.get("cache_implementation"), "sampled" * call["do_sample"]):
        if feature:
            CASES[f"valid:{feature}"] += 1


# ---------------------------------------------------------------- offload_backbone arguments

OFFLOAD_BASE = {"layers": {"to": "disk"}, "to": {"layers": [2]}, "folder": {"layers": [2]},
                "max_share": {"layers": "auto", "histogram": {2: 1, 4: 99}}, "histogram": {"layers": "auto"},
                "inputs": {"layers": "auto", "generation_config": RiverConfig(tau=0.5, exit_signal="cosine",
                                                                              max_new_tokens=2)},
                "generation_config": {"layers": "auto", "inputs": [prompt()]},
                "unknown": {"layers": [2]}}
VALID_OFFLOAD = {
    "layers": st.one_of(st.lists(st.integers(1, LAYERS - 1), min_size=1, max_size=3), st.just(range(1, LAYERS))),
    "to": st.just("disk"), "folder": st.sampled_from(["a", "b/c"]), "max_share": st.floats(0, 1, exclude_min=True),
    "histogram": st.dictionaries(st.integers(1, LAYERS), st.integers(0, 50), min_size=1).filter(
        lambda h: sum(h.values()) > 0),
    "inputs": st.sampled_from([[prompt()], [prompt(2)], [{"input_ids": prompt()}], (prompt(), prompt(seed=4))]),
    "generation_config": st.just(RiverConfig(tau=0.5, exit_signal="cosine", max_new_tokens=2)),
    "unknown": st.nothing(),
}


def offload_verdict(field: str, value) -> str:
    if field == "layers":
        ok = isinstance(value, (list, tuple, range)) and len(value) > 0 and all(
            plain_int(i) and 1 <= i < LAYERS for i in value)
        return VALID if ok else EITHER if isinstance(value, (list, tuple)) and value and all(
            (plain_int(i) or integral(i)) and 1 <= i < LAYERS for i in value) else INVALID
    if field == "to":
        return VALID if isinstance(value, str) and value == "disk" else INVALID  # "cpu": the model is on the CPU
    if field == "folder":
        return VALID if isinstance(value, str) and value in ("a", "b/c") else INVALID  # else: not a path, or a file's
    if field == "max_share":
        return VALID if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value <= 1 else INVALID
    if field == "histogram":
        return VALID if valid_histogram(value, LAYERS) else INVALID
    if field == "inputs":
        ok = isinstance(value, (list, tuple)) and value and all(
            isinstance(item, torch.Tensor) and item.dim() == 2 or isinstance(item, dict) and "input_ids" in item
            for item in value)
        return VALID if ok else INVALID
    if field == "generation_config":
        return VALID if isinstance(value, RiverConfig) else INVALID
    return INVALID  # an unknown keyword


@pytest.fixture(scope="module")
def offload_river(tmp_path_factory):
    model = build_river(small_model("llama", seed=1), RiverQuantConfig(start_layer=1, nbits=4, backend="auto"),
                        progress=False)
    settings_ = dict(tau=-1, max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
    return Held((model, state_of(model), settings_, model.generate(prompt(), **settings_).sequences,
                 tmp_path_factory))


def files_under(folder) -> list[str]:
    return [os.path.join(root, name) for root, _, names in os.walk(folder) for name in names]


@fuzz(80)
@given(case=st.sampled_from(tuple(OFFLOAD_BASE)).flatmap(lambda field: st.tuples(
    st.just(field), valid_or_hostile(VALID_OFFLOAD[field]) if field != "unknown" else st.tuples(
        st.sampled_from(["hist", "max_shares", "input", "device", "generation"]), HOSTILE))))
def test_offload_backbone_refuses_invalid_arguments_naming_them_and_offloads_valid_ones(offload_river, case):
    field, value = case
    model, state, settings_, tokens, tmp_path_factory = offload_river
    root = str(tmp_path_factory.mktemp("offload"))
    kwargs = {"folder": root, **OFFLOAD_BASE[field]}
    if field == "unknown":
        (field, value), verdict = value, INVALID
    else:
        verdict = offload_verdict(field, value)
    kwargs[field] = value
    if field == "folder" and verdict == VALID:
        kwargs[field] = os.path.join(root, value)
    elif field == "folder" and isinstance(value, (str, bytes)):  # a path under a file: not writable (and never cwd)
        open(os.path.join(root, "a-file"), "w").close()
        under = os.path.join(root, "a-file")
        kwargs[field] = os.path.join(under, value.lstrip("/")) if isinstance(value, str) else os.path.join(
            under.encode(), value.lstrip(b"/"))
    _, error = attempt(lambda: quiet(lambda: offload_backbone(model, progress=False, **kwargs)))
    check_outcome(field, value, verdict, error)
    if error is None:
        layers = offloaded_layers(model)
        if not isinstance(kwargs["layers"], str):
            assert layers == sorted(set(kwargs["layers"]))
        assert all(1 <= idx < LAYERS for idx in layers)
        assert torch.equal(model.generate(prompt(), **settings_).sequences, tokens)  # the resident river's tokens
        reload_backbone(model)
    assert offloaded_layers(model) == [] and getattr(model, "hf_device_map", None) is None
    assert not any(hasattr(module, "_hf_hook") for module in model.modules())
    assert same_state(model, state)
    assert [f for f in files_under(root) if not f.endswith("a-file")] == []  # nothing left behind
    CASES["offload"] += 1
    CASES[f"offload:{'refused' if error else 'offloaded'}"] += 1


def test_every_fuzz_test_ran_its_cases():
    check_cases_ran("test_fuzz_generate", CASES, MIN_CASES)
    every = (*ARCHS, *STRATEGIES, *SIGNALS, "lossless", "beams", "static", "sampled")
    assert all(CASES[f"valid:{feature}"] for feature in every), dict(CASES)  # each ran in some valid combination
