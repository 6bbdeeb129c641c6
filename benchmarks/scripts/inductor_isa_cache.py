"""Does inductor's FX graph cache mix up CPU capabilities? One compiled toy function (a gather and a bf16 reduction,
like the river's exact top-k rows) runs in three fresh processes: under this machine's own dispatch, then under
ATEN_CPU_CAPABILITY=avx2 in the same cache folder, then under avx2 in a folder of its own. Each prints the largest
difference from eager (bf16 rounding: below ~1).

    python benchmarks/scripts/inductor_isa_cache.py

On an AVX-512 machine with torch 2.13 the second run reuses the AVX-512 graph built with AVX2 flags (wrong values or
a crash), the third is right: why an AVX2-dispatch run needs its own TORCHINDUCTOR_CACHE_DIR (docs/static-cache.md).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

TOY = """
import torch
@torch.compile
def rows_dot(weight, rows, x):
    return (weight[rows].float() * x.float()).sum(-1).to(torch.bfloat16)
torch.manual_seed(0)
weight, x = torch.randn(4096, 576).bfloat16(), torch.randn(576).bfloat16()
rows = torch.randint(0, 4096, (64,))
eager = (weight[rows].float() * x.float()).sum(-1)
print(torch.backends.cpu.get_cpu_capability(), (rows_dot(weight, rows, x).float() - eager).abs().max().item())
"""


def run(capability: str | None, cache_dir: str) -> str:
    env = {key: value for key, value in os.environ.items() if key != "ATEN_CPU_CAPABILITY"}
    env["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    if capability:
        env["ATEN_CPU_CAPABILITY"] = capability
    done = subprocess.run([sys.executable, "-c", TOY], env=env, capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else f"crashed (exit status {done.returncode})"


def main() -> None:
    with tempfile.TemporaryDirectory() as shared, tempfile.TemporaryDirectory() as own:
        print("this machine's dispatch, a fresh cache folder:   ", run(None, shared))
        print("ATEN_CPU_CAPABILITY=avx2, the same cache folder:  ", run("avx2", shared))
        print("ATEN_CPU_CAPABILITY=avx2, a cache folder its own: ", run("avx2", own))


if __name__ == "__main__":
    main()
