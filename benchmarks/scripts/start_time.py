"""How long does loading the packaged SmolLM2-135M GGUF take, converted from the GGUF each time vs read from the
cached conversion (river_hf.loading.gguf)? Each load runs in a fresh Python process, the two kinds alternating, and the
table gives medians: the import of river_hf (torch, transformers) and the load itself.

    python benchmarks/scripts/start_time.py              # 3 rounds
    python benchmarks/scripts/start_time.py --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

import torch

# What one fresh process measures: importing river_hf, then loading the model and tokenizer.
_ONE_LOAD = """
import json, time
started = time.perf_counter()
from river_hf.loading.models import load_model_and_tokenizer
imported = time.perf_counter()
load_model_and_tokenizer()
print(json.dumps({"import_s": imported - started, "load_s": time.perf_counter() - imported}))
"""


def one_load(cache: str) -> dict:
    env = {**os.environ, "RIVER_HF_CACHE": cache, "TQDM_DISABLE": "1"}
    done = subprocess.run([sys.executable, "-c", _ONE_LOAD], env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="river_hf_start_") as cache:
        one_load(cache)  # the first start: converts and fills the cache (not timed: it also writes the folder)
        runs = {"from the GGUF": [], "from the cache": []}
        for _ in range(args.rounds):
            runs["from the GGUF"].append(one_load("off"))
            runs["from the cache"].append(one_load(cache))
    table = {kind: {key: statistics.median(run[key] for run in measured) for key in ("import_s", "load_s")}
             for kind, measured in runs.items()}
    print(f"CPU capability {torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads, "
          f"{args.rounds} rounds (medians)")
    print("| load | import river_hf | load model + tokenizer |\n|---|---|---|")
    for kind, row in table.items():
        print(f"| {kind} | {row['import_s']:.2f} s | {row['load_s']:.2f} s |")
    return table


if __name__ == "__main__":
    main()
