"""Checks every user-facing config shares: one wording for every `ValueError` that names a field."""

from __future__ import annotations

import numbers


def is_int(value) -> bool:
    """An integer, and not a bool (bool is an int subclass: `nbits=True` must not pass as 1)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def install_hint(packages: str, extra: str | None = None) -> str:
    """The one wording of "this needs an optional package": which packages, and the pip command that installs them
    (river-hf's extra where one declares them)."""
    command = f"pip install river-hf[{extra}]" if extra else f"pip install {packages}"
    return f"needs {packages}, which is not installed here: `{command}`"


def check_choice(name: str, value, choices) -> None:
    if isinstance(value, bool) or value not in tuple(choices):
        raise ValueError(f"`{name}`={value!r} is not supported; choose one of {tuple(choices)}.")
