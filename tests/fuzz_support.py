"""What the fuzz tests share (test_fuzz_configs.py, test_fuzz_build.py, test_fuzz_generate.py): hypothesis'
settings, hostile values and the verdict helpers that check a refusal names its field, the small models of each
architecture, a model's snapshot (a refused call must leave it as it was) and the per-module case counter check."""

from __future__ import annotations

import numbers
from collections import Counter
from collections.abc import Mapping

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings, strategies as st

import river_hf

from conftest import tiny_model


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matrices: on a busy 2-core machine a second OpenMP thread makes a build ~40x slower (conftest's
    one_thread, per module: hypothesis runs many cases per test function)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def fuzz(max_examples: int):
    return settings(max_examples=max_examples, deadline=None, derandomize=True, database=None, print_blob=False,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                           HealthCheck.function_scoped_fixture])


# ---------------------------------------------------------------- hostile values

NAMES = ("auto", "Auto", "fastest", "river", "none", "None", "sequence", "batch_min", "confidence", "cosine",
         "cosine_first", "update_norm", "random", "recompute", "mask", "disk", "cpu", "cuda", "int8", "dense", "hqq",
         "int4pack_cpu", "int8pack_cpu", "tinygemm_cuda", "heuristic", "full_precision", "merged", "q_proj",
         "down_proj", "", " ", "4", "-1", "0.5", "nan", "True")
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-3, 300), st.integers(-2**70, 2**70),
                    st.floats(allow_nan=True, allow_infinity=True), st.floats(-2, 2), st.sampled_from(NAMES),
                    st.text(alphabet="abcxyz_-.0123456789 ", max_size=6), st.binary(max_size=3))
# numbers that equal a valid value without being a plain int/float: numpy scalars, 0-d tensors, integral floats
LOOKALIKES = st.one_of(st.integers(-1, 300).map(np.int64), st.integers(0, 300).map(float),
                       st.floats(-2, 300, allow_nan=False).map(np.float64), st.integers(-1, 300).map(torch.tensor),
                       st.sampled_from([np.float32(0.5), np.bool_(True), torch.tensor(0.5)]))
ARRAYS = st.lists(st.integers(1, 8), min_size=2, max_size=3).flatmap(
    lambda xs: st.sampled_from([np.array(xs), torch.tensor(xs)]))
HOSTILE = st.one_of(SCALARS, LOOKALIKES, ARRAYS, st.lists(st.one_of(SCALARS, LOOKALIKES), max_size=4),
                    st.tuples(SCALARS), st.dictionaries(st.one_of(st.sampled_from(NAMES), st.integers(-2, 6)),
                                                        st.one_of(SCALARS, LOOKALIKES), max_size=3),
                    st.frozensets(st.one_of(st.integers(0, 8), st.sampled_from(NAMES)), max_size=3),
                    st.builds(object))


def valid_or_hostile(valid):
    """Half the draws from a field's valid values (in a flat one_of they would be one branch of HOSTILE's nine)."""
    return st.booleans().flatmap(lambda pick_valid: valid if pick_valid else HOSTILE)


VALID, INVALID, EITHER = "valid", "invalid", "either"  # EITHER: a lookalike or a cross-field value: accepted or named


def plain_int(value) -> bool:
    return type(value) is int


def integral(value) -> bool:
    """An integer that is not a plain int: numpy's (river_hf's is_int accepts them)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, int))


def numeric_lookalike(value) -> bool:
    if isinstance(value, (bool, np.bool_)) or plain_int(value):
        return False
    if isinstance(value, torch.Tensor):
        return value.dim() == 0 and value.dtype != torch.bool
    return isinstance(value, (numbers.Real, np.generic))


def looks_like_one_of(value, choices) -> bool:
    return numeric_lookalike(value) and any(float(value) == c for c in choices if c is not None)


def is_array(value) -> bool:
    return isinstance(value, (np.ndarray, torch.Tensor)) and value.ndim > 0


def iterable(value) -> bool:
    try:
        iter(value)
        return True
    except TypeError:
        return False


def histogram_depth(key) -> int | None:
    """An exit depth as a histogram key may give it: an int, or its string ("string keys are fine")."""
    if plain_int(key):
        return key
    return int(key) if isinstance(key, str) and key.strip().isdigit() else None


def valid_histogram(value, num_layers: int = 4) -> bool:
    """{exit depth 1..num_layers: decoded tokens (an int >= 0)}, some tokens in all."""
    if not isinstance(value, Mapping) or not value:
        return False
    depths = [histogram_depth(key) for key in value]
    return (all(depth is not None and 1 <= depth <= num_layers for depth in depths)
            and all(plain_int(n) and n >= 0 for n in value.values()) and sum(value.values()) > 0)


def attempt(make):
    """(result, None) or (None, the exception) of make()."""
    try:
        return make(), None
    except Exception as error:  # noqa: BLE001 - the fuzzer checks which one
        return None, error


def names_field(error: BaseException, field: str) -> bool:
    return any(form in str(error) for form in (f"`{field}`", f"`{field}=", f"'{field}'"))


def check_outcome(field: str, value, verdict: str, error: BaseException | None) -> None:
    if verdict == VALID:
        assert error is None, f"{field}={value!r} is valid, but was refused: {error!r}"
    elif verdict == INVALID:
        assert error is not None, f"{field}={value!r} is invalid, but was accepted"
    if error is not None:
        assert isinstance(error, (ValueError, TypeError)), f"{field}={value!r}: {type(error).__name__}: {error}"
        assert names_field(error, field), f"{field}={value!r}: the message does not name `{field}`: {error}"


# ---------------------------------------------------------------- small models

LAYERS = 4
SMALL = dict(num_hidden_layers=LAYERS, hidden_size=64, intermediate_size=128, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16)
ARCHS = ("llama", "mistral", "qwen2", "qwen3", "gemma3", "phi3")


def small_model(arch: str, seed: int = 0, **overrides):
    sizes = {**SMALL, **overrides}
    if arch == "gemma3":  # hybrid: sliding-window layers interleaved with full attention
        overrides["layer_types"] = (["sliding_attention", "full_attention"] * 8)[:sizes["num_hidden_layers"]]
    return tiny_model(arch, seed=seed, **{**sizes, **overrides})


def snapshot(model):
    """What a failed call must leave as it was: the class, the module tree, every tensor of the state_dict."""
    return (type(model), [(name, type(module)) for name, module in model.named_modules()],
            {key: tensor.clone() for key, tensor in model.state_dict().items()})


def assert_unchanged(model, before) -> None:
    cls, modules, state = before
    assert type(model) is cls and not river_hf.is_river(model)
    assert [(name, type(module)) for name, module in model.named_modules()] == modules
    now = model.state_dict()
    assert now.keys() == state.keys()
    assert all(torch.equal(now[key], state[key]) for key in state)


def check_cases_ran(module: str, cases: Counter, minimum: dict[str, int]) -> None:
    """Each fuzz module's last test: every test of `module` passed at least its `minimum` of generated cases (counted
    in `cases` by test name; "name:detail" keys are details). Skips when only part of the module ran (-k, a rerun)."""
    ran = {name: count for name, count in cases.items() if count and ":" not in name}
    if set(ran) != set(minimum):
        pytest.skip(f"only part of {module} ran: {sorted(ran)}")
    short = {name: count for name, count in ran.items() if count < minimum[name]}
    assert not short, f"{module}: fewer passing generated cases than expected: {short}"
    print(f"{module}: {sum(ran.values())} generated cases passed: {dict(cases)}")
