"""backend='fastest' remembers its measured kernel choices per machine: a later process on the same machine reads
them instead of timing again; another machine, a stale or unreadable entry, or RIVER_HF_CACHE=off time again."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from river_hf.kernels import choice as kernel_choice
from river_hf import cache_folder as user_cache

SHAPE = (4, 64, 128, 256)  # nbits, group_size, out_features, in_features


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """An empty cache folder and an empty per-process memo; `timings` counts the timing runs."""
    monkeypatch.setenv(user_cache.CACHE_ENV, str(tmp_path / "cache"))
    kernel_choice.forget(machine=False)
    timings = []
    real = kernel_choice.time_candidates

    def counted(*args, **kwargs):
        timings.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(kernel_choice, "time_candidates", counted)
    return timings


def store_file() -> str:
    return kernel_choice.store_path(torch.device("cpu"))


def test_a_choice_is_timed_once_and_then_read_back(fresh, monkeypatch):
    measured = kernel_choice.fastest_backend(*SHAPE, "cpu")
    assert fresh and not measured.remembered and os.path.isfile(store_file())
    kernel_choice.forget(machine=False)  # as in a new process
    fresh.clear()
    remembered = kernel_choice.fastest_backend(*SHAPE, "cpu")
    assert fresh == [] and remembered.remembered
    assert (remembered.backend, remembered.microseconds, remembered.prefill_microseconds) == \
        (measured.backend, measured.microseconds, measured.prefill_microseconds)
    assert "measured earlier on this machine" in remembered.describe()
    assert "measured earlier" not in measured.describe()


def test_another_process_reads_the_choice(fresh):
    measured = kernel_choice.fastest_backend(*SHAPE, "cpu")
    code = textwrap.dedent(f"""
        import torch
        from river_hf.kernels import choice as kernel_choice
        torch.set_num_threads({torch.get_num_threads()})
        def refuse(*args, **kwargs):
            raise SystemExit("timed again")
        kernel_choice.time_candidates = refuse
        choice = kernel_choice.fastest_backend(*{SHAPE}, "cpu")
        print(choice.remembered, choice.backend)
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=os.environ.copy())
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["True", measured.backend]


def test_another_machine_or_thread_count_times_again(fresh, monkeypatch):
    kernel_choice.fastest_backend(*SHAPE, "cpu")
    real_identity = kernel_choice.machine_identity
    monkeypatch.setattr(kernel_choice, "machine_identity",
                        lambda device: {**real_identity(device), "cpu_capability": "AVX512_BF16"})
    kernel_choice.forget(machine=False)
    fresh.clear()
    assert not kernel_choice.fastest_backend(*SHAPE, "cpu").remembered and fresh
    monkeypatch.setattr(kernel_choice, "machine_identity", real_identity)
    kernel_choice.forget(machine=False)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        fresh.clear()
        assert not kernel_choice.fastest_backend(*SHAPE, "cpu").remembered and fresh
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("damage", ["garbage", "stale backend", "missing field"])
def test_an_unusable_entry_is_timed_again_and_rewritten(fresh, monkeypatch, damage):
    kernel_choice.fastest_backend(*SHAPE, "cpu")
    path = store_file()
    with open(path) as file:
        content = json.load(file)
    (entry,) = content["choices"].values()
    if damage == "garbage":
        text = "{not json"
    else:
        if damage == "stale backend":
            entry["backend"] = "a_kernel_that_is_gone"
        else:
            del entry["microseconds"]
        text = json.dumps(content)
    with open(path, "w") as file:
        file.write(text)
    kernel_choice.forget(machine=False)
    fresh.clear()
    choice = kernel_choice.fastest_backend(*SHAPE, "cpu")
    assert not choice.remembered and fresh
    with open(path) as file:
        (entry,) = json.load(file)["choices"].values()
    assert entry["backend"] == choice.backend and entry["microseconds"] == choice.microseconds


def test_cache_off_remembers_nothing(fresh, monkeypatch, tmp_path):
    monkeypatch.setenv(user_cache.CACHE_ENV, "off")
    kernel_choice.fastest_backend(*SHAPE, "cpu")
    kernel_choice.forget(machine=False)
    fresh.clear()
    assert not kernel_choice.fastest_backend(*SHAPE, "cpu").remembered and fresh
    assert not (tmp_path / "cache").exists()


def test_an_unwritable_cache_warns_and_the_choice_still_holds(fresh, monkeypatch, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    monkeypatch.setenv(user_cache.CACHE_ENV, str(blocker / "cache"))
    with pytest.warns(UserWarning, match="could not remember the measured kernel choices"):
        choice = kernel_choice.fastest_backend(*SHAPE, "cpu")
    assert choice.backend in kernel_choice.candidates(*SHAPE, torch.device("cpu"))


def test_forget_times_again(fresh):
    kernel_choice.fastest_backend(*SHAPE, "cpu")
    kernel_choice.forget()
    assert not os.path.exists(store_file()) and kernel_choice.measured_choices() == []
    fresh.clear()
    assert not kernel_choice.fastest_backend(*SHAPE, "cpu").remembered and fresh
