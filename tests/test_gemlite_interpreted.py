"""The gemlite CUDA twin kernels checked on a CPU, in Triton's interpreter (tests/gemlite_interpreted.py, one process
per check: it pretends a GPU for good). Skipped unless `triton` and `gemlite` import (`pip install --no-deps triton
gemlite`, ~1 GB: not in the test extras); tests/test_cuda_kernels.py runs the same kernels on a GPU."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

HARNESS = os.path.join(os.path.dirname(__file__), "gemlite_interpreted.py")
CHECKS = ("int8", "int4", "int2", "int8_zero", "river", "compiled")

pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(name) is None for name in ("triton", "gemlite")),
    reason="needs triton and gemlite importable (pip install --no-deps triton gemlite)")


@pytest.mark.parametrize("check", CHECKS)
def test_gemlite_kernel_in_the_interpreter(check):
    done = subprocess.run([sys.executable, HARNESS, check], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"{check}: holds" in done.stdout

