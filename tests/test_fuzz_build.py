"""Hostile input, found by a fuzzer (issue 33, item 3): `build_river`. A config that does not fit the model is
refused naming the field before the model changes (one that fits builds, and remove_river restores the model bit for
bit). A truncated, bit-flipped, other-model or other-version twins file (`river_twins.safetensors`, from
`save_pretrained(folder, save_twins=True)`) gives a ValueError naming the file before the model changes, or a rebuild
warning (`TwinsMismatchWarning`) and the river HQQ would build: it is never used where it does not fit, never half used.

Each twins case builds a river from the damaged file (`build_river(model, config, stored_twins=path)`, some through
`from_pretrained(folder)`) on a fresh small Llama and compares it with the river built without the file, tensor by
tensor. Derandomized hypothesis, as test_fuzz_configs.py.
"""

from __future__ import annotations

import json
import os
import struct
import tempfile
import warnings
from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from river_hf import RiverQuantConfig, UnsupportedModelError, build_river, remove_river

from fuzz_support import (ARCHS, LAYERS, assert_unchanged, attempt, check_cases_ran, fuzz, names_field, one_thread,
                          small_model, snapshot)
from test_fuzz_configs import NBITS

CASES: Counter = Counter()
MIN_CASES = {"build": 55, "lookalikes": 20, "data_flip": 80, "header_flip": 140, "truncated": 50, "other_version": 50,
             "other_model": 25, "from_pretrained": 15}
TWINS_FILE = "river_twins.safetensors"  # docs/saved-rivers.md
CONFIG = dict(start_layer=1, nbits=4, group_size=32, backend="auto", quantize_lm_head=True)
assert one_thread  # the module-scoped autouse fixture, imported to apply here too


@pytest.fixture(scope="module", autouse=True)
def nothing_packed():
    """No packed twins kept: every load reads (and checks) the damaged file's tensors. Where this machine keeps a
    file's twins packed, a load reads none of them (tests/test_packed_twins.py covers that case)."""
    before = os.environ.get("RIVER_HF_CACHE")
    os.environ["RIVER_HF_CACHE"] = "off"
    yield
    if before is None:
        os.environ.pop("RIVER_HF_CACHE")
    else:
        os.environ["RIVER_HF_CACHE"] = before


# ---------------------------------------------------------------- a config that does not fit the model

def misfits(kwargs: dict) -> set[str]:
    """The fields of a valid config that do not fit a small model (hidden 64, MLP 128, 4 layers) on this CPU."""
    found = set()
    start, nbits, group = kwargs["start_layer"], kwargs["nbits"], kwargs["group_size"]
    if start >= LAYERS:
        return {"start_layer"}
    if isinstance(nbits, list) and len(nbits) != LAYERS - start:
        return {"nbits"}
    river = LAYERS - start
    bits = (nbits if isinstance(nbits, list) else [4] * int(river * 0.25) + [8] * (river - int(river * 0.25))
            if nbits == "auto" else [nbits] * river)
    schedule = isinstance(nbits, list) or nbits == "auto"
    grouped = [b for b in bits if not (schedule and b == 8)]
    if kwargs["quantize_lm_head"] and kwargs["lm_head_nbits"] != 8:
        grouped.append(kwargs["lm_head_nbits"])
    if group is not None and group > 64 and grouped:
        found.add("group_size")  # q/k/v/gate/up read 64 features
    if kwargs["backend"] == "tinygemm_cuda":
        found.add("backend")
    return found


@st.composite
def build_kwargs(draw) -> dict:
    """A RiverQuantConfig's fields, mostly fitting the small models, sometimes not (start layer, schedule length,
    group size, a CUDA kernel)."""
    start = draw(st.sampled_from([1, 2, 3, 1, 2, 3, 4, 5]))
    kind = draw(st.sampled_from(["int", "auto", "schedule", "schedule", "wrong length"]))
    river = max(LAYERS - start, 1)
    nbits = {"int": draw(st.sampled_from(NBITS)), "auto": "auto",
             "schedule": draw(st.lists(st.sampled_from(NBITS), min_size=river, max_size=river)),
             "wrong length": draw(st.lists(st.sampled_from(NBITS), min_size=1, max_size=6).filter(
                 lambda bits: len(bits) != river))}[kind]
    return {"start_layer": start, "nbits": nbits, "group_size": draw(st.sampled_from([32, 64, 32, 64, None, 128, 256])),
            "backend": draw(st.sampled_from(["auto", "auto", "auto", "dense", "hqq", "int4pack_cpu", "int8pack_cpu",
                                             "tinygemm_cuda"])),
            "quantize_lm_head": draw(st.booleans()), "lm_head_nbits": draw(st.sampled_from([4, 8]))}


@fuzz(60)
@given(arch=st.sampled_from(ARCHS), kwargs=build_kwargs())
def test_build_river_refuses_a_config_that_does_not_fit_before_touching_the_model(arch, kwargs):
    config, error = attempt(lambda: RiverQuantConfig(**kwargs))
    if error is not None:  # refused on its own: named (the field-by-field fuzz above covers which)
        assert isinstance(error, ValueError) and any(names_field(error, field) for field in kwargs), error
        CASES["build"] += 1
        return
    model = small_model(arch)
    before = snapshot(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # backend="hqq" is slow, 8-bit per-row kernels ignore group_size: both say so
        _, error = attempt(lambda: build_river(model, config, progress=False))
    expected = misfits(kwargs)
    CASES[f"build:{'misfit' if expected else 'fits'}"] += 1
    if error is None:
        assert not expected, f"{arch} {kwargs}: built although {expected} do not fit"
        remove_river(model)
    else:
        assert isinstance(error, (ValueError, TypeError, UnsupportedModelError)), f"{kwargs}: {error!r}"
        assert any(names_field(error, field) for field in (expected or kwargs)), f"{kwargs}: {error}"
        assert expected, f"{arch} {kwargs} fits, but was refused: {error}"
    assert_unchanged(model, before)  # refused: untouched; built and removed: bit for bit
    CASES["build"] += 1


# ---------------------------------------------------------------- numbers that equal a valid value

LOOKALIKES = {"float": float, "numpy float64": np.float64, "numpy int64": np.int64, "0-d tensor": torch.tensor}
PLAIN = {"nbits": st.sampled_from(NBITS), "group_size": st.sampled_from([32, 64]),
         "lm_head_nbits": st.sampled_from(NBITS), "start_layer": st.integers(1, LAYERS - 1)}


@fuzz(30)
@given(arch=st.sampled_from(ARCHS), case=st.sampled_from(tuple(PLAIN)).flatmap(lambda field: st.tuples(
    st.just(field), PLAIN[field], st.sampled_from(tuple(LOOKALIKES)))))
def test_a_number_equal_to_a_valid_value_builds_that_river_or_is_refused_naming_it(arch, case):
    field, plain, wrapper = case
    base = dict(start_layer=1, nbits=4, group_size=32, backend="auto", quantize_lm_head=True, lm_head_nbits=8)
    expected = small_model(arch)
    quiet(lambda: build_river(expected, RiverQuantConfig(**{**base, field: plain}), progress=False))
    model = small_model(arch)
    before = snapshot(model)
    config, error = attempt(lambda: RiverQuantConfig(**{**base, field: LOOKALIKES[wrapper](plain)}))
    if error is None:
        _, error = attempt(lambda: quiet(lambda: build_river(model, config, progress=False)))
    if error is not None:
        assert isinstance(error, (ValueError, TypeError)), repr(error)
        assert_unchanged(model, before)
    else:  # the river of the value it equals, bit for bit
        state, wanted = model.state_dict(), expected.state_dict()
        assert state.keys() == wanted.keys() and all(torch.equal(state[k], wanted[k]) for k in wanted)
    CASES["lookalikes"] += 1


# ---------------------------------------------------------------- damaged twins files

class Saved:
    """One saved river: its folder, the twins file's bytes, where its header and its record (the metadata JSON) lie,
    and the state_dict of the river built without any file (what every accepted file must give)."""

    def __init__(self, folder: str, reference: dict):
        self.folder, self.path, self.reference = folder, os.path.join(folder, TWINS_FILE), reference
        with open(self.path, "rb") as file:
            self.raw = file.read()
        self.header_end = 8 + struct.unpack("<Q", self.raw[:8])[0]
        header = self.raw[8:self.header_end]
        escaped = json.dumps(json.loads(header)["__metadata__"]["river_twins"]).encode()
        start = 8 + header.index(escaped)
        self.record_span = range(start, start + len(escaped))

    def __repr__(self):
        return f"<saved river: {len(self.raw)} bytes, header {self.header_end}>"


def save_river(folder: str, arch: str = "llama", seed: int = 0, layers: int | None = None, **config) -> None:
    model = small_model(arch, seed=seed, **({} if layers is None else {"num_hidden_layers": layers}))
    quiet(lambda: build_river(model, RiverQuantConfig(**{**CONFIG, **config}), progress=False))
    quiet(lambda: model.save_pretrained(folder, save_twins=True))


def quiet(call):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return call()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("saved"))
    save_river(folder)
    reference = small_model("llama")
    build_river(reference, RiverQuantConfig(**CONFIG), progress=False)
    saved = Saved(folder, {key: tensor.clone() for key, tensor in reference.state_dict().items()})
    outcome = load(saved, saved.raw)  # the intact file: the same river, no warning (else nothing below means much)
    assert outcome == ("loaded", None), outcome
    return saved


def load(saved: Saved, data: bytes) -> tuple[str, object]:
    """Build a river on a fresh small Llama from `data` as its twins file: ("refused", error), ("rebuilt", warning
    text) or ("loaded", None), after checking what each outcome promises; ("BUG", what) where it broke one."""
    path = os.path.join(tempfile.mkdtemp(dir=os.path.dirname(saved.folder)), TWINS_FILE)
    with open(path, "wb") as file:
        file.write(data)
    model = small_model("llama")
    before = snapshot(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, error = attempt(lambda: build_river(model, RiverQuantConfig(**CONFIG), progress=False, stored_twins=path))
    mismatch = [str(w.message) for w in caught if type(w.message).__name__ == "TwinsMismatchWarning"]
    if error is not None:
        assert_unchanged(model, before)  # refused: nothing of the model changed, nothing half built
        named = isinstance(error, ValueError) and path in str(error)
        return ("refused", error) if named else ("BUG", f"{type(error).__name__}: {error}")
    state = model.state_dict()
    same = state.keys() == saved.reference.keys() and all(torch.equal(state[k], saved.reference[k])
                                                          for k in saved.reference)
    if not same:  # used although it does not fit: other twins than HQQ's for this model
        return "BUG", f"built another river ({'with' if mismatch else 'without'} a warning)"
    if mismatch:
        assert all(path in text for text in mismatch), mismatch
        return "rebuilt", mismatch[0]
    return "loaded", None


def flipped(data: bytes, position: int, bit: int) -> bytes:
    damaged = bytearray(data)
    damaged[position] ^= 1 << bit
    return bytes(damaged)


# ---------------------------------------------------------------- damaged bytes

@fuzz(80)
@given(fraction=st.floats(0, 1, exclude_max=True), bit=st.integers(0, 7))
def test_a_flipped_bit_in_the_stored_tensors_is_refused_naming_the_file(saved, fraction, bit):
    position = saved.header_end + int(fraction * (len(saved.raw) - saved.header_end))
    outcome = load(saved, flipped(saved.raw, position, bit))
    assert outcome[0] == "refused", outcome
    CASES["data_flip"] += 1


@fuzz(150)
@given(fraction=st.floats(0, 1, exclude_max=True), bit=st.integers(0, 7), in_record=st.booleans())
def test_a_flipped_bit_in_the_header_is_refused_rebuilt_or_harmless(saved, fraction, bit, in_record):
    span = saved.record_span if in_record else range(0, saved.header_end)
    position = span[int(fraction * len(span))]
    outcome = load(saved, flipped(saved.raw, position, bit))
    assert outcome[0] in ("refused", "rebuilt", "loaded"), (position, bit, outcome)
    CASES["header_flip"] += 1
    CASES[f"header_flip:{outcome[0]}"] += 1


@fuzz(50)
@given(fraction=st.floats(0, 1, exclude_max=True))
def test_a_truncated_file_is_refused_naming_the_file(saved, fraction):
    outcome = load(saved, saved.raw[:int(fraction * len(saved.raw))])
    assert outcome[0] == "refused", outcome
    CASES["truncated"] += 1


# ---------------------------------------------------------------- other versions, other models

def rewritten(saved: Saved, change) -> bytes:
    """The file with its record changed by `change(record)` (tensors and their checksums as saved)."""
    with safe_open(saved.path, framework="pt") as handle:
        record = json.loads(handle.metadata()["river_twins"])
    change(record)
    path = os.path.join(tempfile.mkdtemp(dir=os.path.dirname(saved.folder)), TWINS_FILE)
    save_file(load_file(saved.path), path, metadata={"river_twins": json.dumps(record)})
    with open(path, "rb") as file:
        return file.read()


FORMATS = st.one_of(st.integers(-1, 9), st.sampled_from([None, "3", 3.5, [3], {"v": 3}, True, 2**64]))


@fuzz(50)
@given(version=FORMATS, dropped=st.one_of(st.none(), st.sampled_from(["layers", "lm_head", "config", "checksums"])))
def test_another_format_version_is_refused_naming_the_file(saved, version, dropped):
    def change(record):
        record["format"] = version
        if dropped is not None:
            del record[dropped]

    outcome = load(saved, rewritten(saved, change))
    if version == 3 and dropped in (None, "config"):  # the format this river_hf writes, nothing it reads removed
        assert outcome[0] == "loaded", outcome
    elif version == 3 and dropped == "lm_head":
        assert outcome[0] == "rebuilt" and "LM head" in outcome[1], outcome
    else:
        assert outcome[0] == "refused", outcome  # format 2 checks digests, which this file has none of
    CASES["other_version"] += 1


@fuzz(25)
@given(arch=st.sampled_from(ARCHS), seed=st.integers(0, 2), layers=st.sampled_from([3, 4, 4, 5]),
       stored=st.fixed_dictionaries({"start_layer": st.integers(1, 2), "nbits": st.sampled_from(NBITS),
                                     "group_size": st.sampled_from([32, 64]), "quantize_lm_head": st.booleans()}))
def test_another_models_twins_are_rebuilt_with_a_warning(saved, arch, seed, layers, stored):
    folder = tempfile.mkdtemp(dir=os.path.dirname(saved.folder))
    save_river(folder, arch, seed, layers, **stored)
    with open(os.path.join(folder, TWINS_FILE), "rb") as file:
        outcome = load(saved, file.read())
    same_model = (arch, seed, layers) == ("llama", 0, 4)
    if same_model and {**CONFIG, **stored} == CONFIG:
        assert outcome[0] == "loaded", outcome
    else:  # rebuilt, or loaded where the twins fit (load checked either gives HQQ's river for this model)
        assert outcome[0] in ("rebuilt", "loaded"), outcome
        assert outcome[0] == "rebuilt" or same_model or arch != "llama", outcome  # other weights: rebuilt
    CASES["other_model"] += 1


@fuzz(15)
@given(how=st.sampled_from(["truncated", "flipped"]), fraction=st.floats(0, 1, exclude_max=True))
def test_from_pretrained_refuses_a_damaged_twins_file_naming_it(saved, how, fraction, tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("load"))
    for name in os.listdir(saved.folder):
        with open(os.path.join(saved.folder, name), "rb") as src, open(os.path.join(folder, name), "wb") as dst:
            dst.write(src.read())
    position = saved.header_end + int(fraction * (len(saved.raw) - saved.header_end))
    data = saved.raw[:position] if how == "truncated" else flipped(saved.raw, position, 3)
    with open(os.path.join(folder, TWINS_FILE), "wb") as file:
        file.write(data)
    _, error = attempt(lambda: quiet(lambda: AutoModelForCausalLM.from_pretrained(folder)))
    assert isinstance(error, ValueError) and os.path.join(folder, TWINS_FILE) in str(error), repr(error)
    CASES["from_pretrained"] += 1


def test_every_fuzz_test_ran_its_cases():
    check_cases_ran("test_fuzz_build", CASES, MIN_CASES)


def record_edited(saved: Saved, old: str, new: str) -> bytes:
    """The saved bytes with the first `old` of the record replaced by `new` (same length: a flip of a bit or two)."""
    start = saved.record_span.start
    record = saved.raw[start:saved.record_span.stop].decode()
    assert len(old) == len(new) and old in record
    return saved.raw[:start] + record.replace(old, new, 1).encode() + saved.raw[saved.record_span.stop:]


@pytest.mark.parametrize("old, new", [
    ('layers.1.self_attn.q_proj\\"', 'layers.3.self_attn.q_proj\\"'),  # one bit: '1' -> '3' flips 0x02
    ('layers.1.self_attn.q_proj\\"', 'layers.1.self_attn.q_psoj\\"'),  # one bit: 'r' -> 's'
    ('\\"nbits\\": 4, \\"group_size\\": 32, \\"shape', '\\"nbits\\": 5, \\"group_size\\": 32, \\"shape'),
], ids=["key to another layer", "key to no tensor", "entry nbits"])
def test_a_flipped_bit_in_the_record_is_refused_naming_the_file(saved, old, new):
    """The fuzzer's find, pinned: tensor checksums did not cover the record that says which tensor is which twin, so
    a one-bit flip of a key loaded layer 3's codes into layer 1's twin, silently (format 3). Format 4 keeps a digest of
    the record: refused, naming the file."""
    outcome = load(saved, record_edited(saved, old, new))
    assert outcome[0] == "refused", outcome
