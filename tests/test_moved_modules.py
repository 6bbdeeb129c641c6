"""The module paths from before the subpackages still import for one release: the same module object as the new
path, with a DeprecationWarning that names the new path (river_hf.MOVED_MODULES)."""

import json
import subprocess
import sys

import river_hf

SCRIPT = """
import importlib, json, sys, warnings
import river_hf
results = {}
for old, new in river_hf.MOVED_MODULES.items():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module("river_hf." + old)
    moved = [str(w.message) for w in caught
             if issubclass(w.category, DeprecationWarning) and "moved to" in str(w.message)]
    results[old] = {"same": module is importlib.import_module("river_hf." + new), "warning": moved[:1]}
print(json.dumps(results))
"""


def test_every_old_module_path_gives_the_new_module_with_a_warning():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]

    results = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(results) == set(river_hf.MOVED_MODULES) and len(results) >= 35
    for old, result in results.items():
        new = river_hf.MOVED_MODULES[old]
        assert result["same"], old
        assert result["warning"] and f"river_hf.{new}" in result["warning"][0], (old, result)


def test_an_old_path_in_a_from_import_and_a_moved_subpackage_module():
    script = ("import warnings, river_hf\n"
              "warnings.filterwarnings('error', message='.*moved to', category=DeprecationWarning)\n"
              "try:\n    from river_hf.commands.common import CLIError\nexcept DeprecationWarning as w:\n"
              "    print('warned', w)\n"
              "warnings.simplefilter('ignore')\n"
              "from river_hf.commands.common import CLIError\n"
              "from river_hf.cli.commands import common\n"
              "print(CLIError is common.CLIError)")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "warned `river_hf.commands` moved to `river_hf.cli.commands`" in done.stdout
    assert done.stdout.strip().endswith("True")  # one module, not a second copy loaded by the path finder


def test_the_old_single_module_names_import_from_the_subpackages_that_replaced_them():
    from river_hf.kernels import KERNELS, runs  # noqa: F401  (river_hf/kernels.py before)
    from river_hf.lossless import LosslessCache, forget_fallbacks  # noqa: F401
    from river_hf.offload import offload_backbone, weight_residency  # noqa: F401
    from river_hf.cli import build_parser, main  # noqa: F401
    assert LosslessCache is river_hf.LosslessCache and offload_backbone is river_hf.offload_backbone
