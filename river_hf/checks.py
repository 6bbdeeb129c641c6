"""Checks every user-facing config shares: one wording for every `ValueError` that names a field."""

from __future__ import annotations

import numbers
from collections.abc import Mapping


def is_int(value) -> bool:
    """An integer, and not a bool (bool is an int subclass: `nbits=True` must not pass as 1)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def install_hint(packages: str, extra: str | None = None) -> str:
    """The one wording of "this needs an optional package": which packages, and the pip command that installs them
    (river-hf's extra where one declares them)."""
    command = f"pip install river-hf[{extra}]" if extra else f"pip install {packages}"
    return f"needs {packages}, which is not installed here: `{command}`"


def is_text(value, text: str) -> bool:
    """`value` is the string `text` (never asks an array or tensor whether it equals a string)."""
    return isinstance(value, str) and value == text


def plain_int(name: str, value) -> int:
    """`value` as a Python int (numpy integers included, so configs stay JSON-serialisable); else a ValueError naming
    the field. A bool, a float such as 64.0, a tensor or an array is no int here."""
    if not is_int(value):
        raise ValueError(f"`{name}` must be an integer; got {value!r}.")
    return int(value)


def checked_histogram(name: str, histogram, num_layers: int | None = None) -> dict[int, int]:
    """A measured {exit depth: decoded tokens} as plain ints: depths >= 1 (at most `num_layers` when known; digit
    strings count, as JSON records keep keys), counts integers >= 0 with at least one token; else a ValueError naming
    the field."""
    if not isinstance(histogram, Mapping):
        raise ValueError(f"`{name}` must map exit depths to decoded-token counts; got {histogram!r}.")
    counts = {}
    for depth, count in histogram.items():
        depth = int(depth) if isinstance(depth, str) and depth.isdigit() else depth
        if not is_int(depth) or depth < 1 or num_layers is not None and depth > num_layers:
            deepest = f" .. {num_layers}" if num_layers is not None else ""
            raise ValueError(f"`{name}`: exit depth {depth!r} is not one (1{deepest}, a number of backbone layers).")
        if not is_int(count) or count < 0:
            raise ValueError(f"`{name}`: the count of depth {depth} must be an integer >= 0; got {count!r}.")
        counts[int(depth)] = int(count)
    if sum(counts.values()) <= 0:
        raise ValueError(f"`{name}` holds no decoded token: {histogram!r}.")
    return counts


def check_choice(name: str, value, choices):
    """`value` if it is one of `choices`, as the plain Python choice (a numpy integer gives its int); else a
    ValueError naming the field. Types count: True is not 1, 64.0 is not 64, and an array is never a choice."""
    for choice in tuple(choices):
        if (choice is None and value is None or isinstance(choice, str) and is_text(value, choice)
                or is_int(choice) and is_int(value) and int(value) == choice):
            return choice
    raise ValueError(f"`{name}`={value!r} is not supported; choose one of {tuple(choices)}.")
