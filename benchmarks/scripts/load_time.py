"""How long loading takes: the plain model, today's re-quantizing river load, and a saved river (twins stored).

    python benchmarks/scripts/load_time.py [--repeats 5] [--folder DIR] [--model PATH | --random-model NAME]
                                          [--saved-only]

The packaged SmolLM2-135M-Instruct is saved once as a plain safetensors folder (like for like: every system reads
the same bf16 checkpoint), and once as a river with its twins (`save_pretrained`, twins stored by default for a
model loaded with `quantization_config`). Then each load runs in a fresh subprocess (nothing cached in memory
between loads; imports not counted, transformers' modeling code for the model included), the systems interleaved
round after round, and the median per system is reported with its ratio to the plain load. The saved loads run with
HQQ disabled, so they prove they quantize nothing. Both kernel choices are shown: `backend="fastest"` (the default:
times the kernels per layer shape at load, once per machine: later loads read the remembered choices; the first load
on a machine is shown apart) and
`backend="auto"` (the device's preferred kernel, no timing).

Each child then times one forward pass over a 32-token prompt, the first thing generate does: a plain load maps the
checkpoint and touches none of its weights (their pages fault in during that first pass), while a saved river's
load reads every backbone weight it fingerprints, so "load + first pass" compares what a user waits for before the
first token. `--saved-only` leaves out the re-quantizing loads (about 20 s each).
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from river_hf.cache_folder import CACHE_ENV

BACKENDS = ("fastest", "auto")
TWIN_FIELDS = ("nbits", "group_size", "start_layer", "quantize_lm_head", "lm_head_nbits")


def systems(folder: str) -> dict[str, list[str]]:
    """name -> the child's arguments (kind, folder, backend)."""
    plain = os.path.join(folder, "plain")
    entries = {"plain model": ["plain", plain, "-"]}
    for backend in BACKENDS:
        entries[f"re-quantizing river ({backend})"] = ["quantize", plain, backend]
        entries[f"saved river ({backend})"] = ["saved", os.path.join(folder, f"river-{backend}"), backend]
    # The kernel choices `fastest` measured are remembered per machine (river_hf.kernels.choice): every load above
    # after the first reads them. A machine's first load times them, as this one does (nothing remembered).
    entries["saved river (fastest), first load on a machine"] = ["saved-first", os.path.join(folder, "river-fastest"),
                                                                 "fastest"]
    # The kernels' packed layout is kept per machine too (river_hf.saving.packed_cache): the loads above after the
    # first of each backend map it. This one finds the kernel choices but no packed layout: it packs, and keeps it.
    entries["saved river (fastest), nothing packed yet"] = ["saved-unpacked", os.path.join(folder, "river-fastest"),
                                                            "fastest"]
    return entries


def prepare(folder: str, model_path: str | None, random_shape: str | None = None) -> dict:
    """The plain folder and one saved river per backend (the same twins; only config.json's backend differs)."""
    import torch
    from transformers import AutoModelForCausalLM

    from river_hf import RiverQuantConfig
    from river_hf.loading.models import load_model_and_tokenizer

    if random_shape is not None:  # random weights of a public shape (river_hf.bench.shapes), saved like a checkpoint
        from river_hf.bench.shapes import random_model

        model = random_model(random_shape)
    else:
        model, _ = load_model_and_tokenizer(model_path, dtype=torch.bfloat16)
    model.save_pretrained(os.path.join(folder, "plain"))
    del model
    plain = os.path.join(folder, "plain")
    river = AutoModelForCausalLM.from_pretrained(plain, dtype=torch.bfloat16,
                                                 quantization_config=RiverQuantConfig(backend=BACKENDS[0]))
    started = time.perf_counter()
    river.save_pretrained(os.path.join(folder, f"river-{BACKENDS[0]}"))  # twins stored by default here
    save_seconds = time.perf_counter() - started
    for backend in BACKENDS[1:]:
        target = os.path.join(folder, f"river-{backend}")
        shutil.copytree(os.path.join(folder, f"river-{BACKENDS[0]}"), target, dirs_exist_ok=True)  # a rerun in DIR
        config_path = os.path.join(target, "config.json")
        with open(config_path) as file:
            config = json.load(file)
        config["quantization_config"]["backend"] = backend
        with open(config_path, "w") as file:
            json.dump(config, file, indent=2)
    twins = os.path.getsize(os.path.join(folder, f"river-{BACKENDS[0]}", "river_twins.safetensors"))
    weights = os.path.getsize(os.path.join(plain, "model.safetensors"))
    return {"save_with_twins_s": save_seconds, "twins_file_mib": twins / 2**20, "weights_file_mib": weights / 2**20}


def child(kind: str, folder: str, backend: str) -> None:
    """One load, timed after the imports; prints {"seconds": ...}."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    import river_hf
    from river_hf import RiverQuantConfig
    from river_hf.kernels import quantize

    kwargs = {"dtype": torch.bfloat16}
    if kind == "saved-first":
        kind = "saved"
        os.environ[CACHE_ENV] = "off"  # remember nothing, read nothing: time the kernels as on a new machine
    if kind == "saved-unpacked":
        kind = "saved"
        own = tempfile.mkdtemp(prefix="river-load-time-cache-")  # the run's cache less its packed twins
        atexit.register(shutil.rmtree, own, ignore_errors=True)
        shutil.copytree(os.environ[CACHE_ENV], own, dirs_exist_ok=True, ignore=shutil.ignore_patterns("packed_twins"))
        os.environ[CACHE_ENV] = own
    if kind == "quantize":
        kwargs["quantization_config"] = RiverQuantConfig(backend=backend)
    if kind == "saved":
        def refuse(*args, **kw):
            raise RuntimeError("HQQ ran during a saved river's load")
        quantize.hqq_quantize = refuse
    # transformers imports a model's modeling code (most of it modeling_utils, ~0.5 s) on the first from_pretrained of
    # a process: imported here, before the clock, for every kind alike, so that only the load's own work is timed
    # (whatever `import river_hf` happens to import)
    AutoModelForCausalLM._model_mapping[type(AutoConfig.from_pretrained(folder))]
    started = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(folder, **kwargs)
    seconds = time.perf_counter() - started
    assert river_hf.is_river(model) == (kind != "plain")
    with torch.no_grad():  # no RiverCache: every layer runs its backbone layer, as a prompt's pass does
        model(input_ids=torch.arange(100, 132)[None])
    print(json.dumps({"seconds": seconds, "with_first_pass_seconds": time.perf_counter() - started,
                      "river_hf": os.path.abspath(river_hf.__file__)}))


def run_child(arguments: list[str], code: str | None = None) -> float:
    """One child load's seconds. `code`: a river_hf checkout to import instead of the installed one (load_ab.py)."""
    return child_reply(arguments, code)["seconds"]


def child_reply(arguments: list[str], code: str | None = None) -> dict:
    """One child load: {"seconds": the load, "with_first_pass_seconds": the load and one forward pass, ...}."""
    env = {**os.environ, "TQDM_DISABLE": "1"}
    if code is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.abspath(code), env.get("PYTHONPATH")]))
    result = subprocess.run([sys.executable, __file__, "--child", *arguments], capture_output=True, text=True,
                            env=env, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"load {arguments} failed:\n{result.stderr[-3000:]}")
    reply = json.loads(result.stdout.strip().splitlines()[-1])
    if code is not None and not reply["river_hf"].startswith(os.path.abspath(code)):
        raise RuntimeError(f"the child imported {reply['river_hf']}, not the checkout {code}")
    return reply


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--model", default=None, help="A hub id or local path (default: the packaged SmolLM2).")
    parser.add_argument("--random-model", default=None, help="A random model of this shape (river_hf.bench.shapes), "
                        "e.g. llama-3.2-1b, instead of --model.")
    parser.add_argument("--folder", default=None, help="work folder (default: a temporary one, removed after)")
    parser.add_argument("--saved-only", action="store_true", help="leave out the re-quantizing loads")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(*args.child)
        return {}
    import torch

    from river_hf.kernels.machine import cpu_description

    folder = args.folder or tempfile.mkdtemp(prefix="river-load-time-")
    user_cache = os.environ.get(CACHE_ENV)
    os.environ[CACHE_ENV] = os.path.join(folder, "cache")  # the remembered kernel choices of this run only
    try:
        info = prepare(folder, args.model, args.random_model)
        entries = systems(folder)
        if args.saved_only:
            entries = {name: entry for name, entry in entries.items() if entry[0] != "quantize"}
        run_child(entries["plain model"])  # warm-up: the page cache holds the files for every system alike
        replies: dict[str, list[dict]] = {name: [] for name in entries}
        for round_ in range(args.repeats):
            names = list(entries)
            for name in names[round_ % len(names):] + names[:round_ % len(names)]:  # rotate: no fixed first slot
                replies[name].append(child_reply(entries[name]))
    finally:
        if user_cache is None:
            os.environ.pop(CACHE_ENV)
        else:
            os.environ[CACHE_ENV] = user_cache
        if args.folder is None:
            shutil.rmtree(folder, ignore_errors=True)
    print(f"cpu capability: {torch.backends.cpu.get_cpu_capability()}  {json.dumps(cpu_description())}")
    from river_hf import RiverQuantConfig

    twins = {k: v for k, v in RiverQuantConfig().to_dict().items() if k in TWIN_FIELDS}
    model = f"random {args.random_model}" if args.random_model else args.model or "SmolLM2-135M-Instruct"
    print(f"torch {torch.__version__}; {model} bf16; RiverQuantConfig() defaults "
          f"{twins}; {args.repeats} loads per system, each in its own process")
    print(f"save_pretrained with twins: {info['save_with_twins_s']:.1f} s; model.safetensors "
          f"{info['weights_file_mib']:.0f} MiB, river_twins.safetensors {info['twins_file_mib']:.0f} MiB\n")
    table = {}
    for field, what in (("seconds", "load"), ("with_first_pass_seconds", "load + first forward pass (32 tokens)")):
        times = {name: [reply[field] for reply in values] for name, values in replies.items()}
        plain = statistics.median(times["plain model"])
        print(f"| {what} | median s | min-max s | vs plain |\n|---|---:|---:|---:|")
        for name, values in times.items():
            row = table.setdefault(name, {})
            row[field] = {"median_s": statistics.median(values), "vs_plain": statistics.median(values) / plain}
            print(f"| {name} | {row[field]['median_s']:.2f} | {min(values):.2f}-{max(values):.2f} | "
                  f"{row[field]['vs_plain']:.2f}x |")
        print()
    return table


if __name__ == "__main__":
    main()
