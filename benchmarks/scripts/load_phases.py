"""Where a saved river's load spends its time: each phase timed with perf_counter wrappers inside from_pretrained.

    python benchmarks/scripts/load_time.py --folder DIR        # keeps DIR/plain, DIR/river-auto, DIR/river-fastest
    python benchmarks/scripts/load_phases.py DIR/river-auto [--loads 3]

Loads the saved river `--loads` times in this one process, with the model's modeling code imported before the
first (as load_time.py does: the first load is the one a user's fresh process pays; the later ones show the steady
cost without first-touch effects) and prints, per load, the total and the time in each phase: reading and checking
the twins file (`read`, of which `load_file` and the stored tensors' `checksum`s), fingerprinting the backbone
weights (`sampled_fingerprint` by default, `fingerprint` with verify_twins="full", of which their `digest`s), the
twins' module copies (`make_twin`), unpacking the stored 4-bit codes, `from_codes` (of which each kernel's `pack`),
and the packed layout kept per machine (`read_packed`, `write_packed`: the first load packs and writes it, the later
ones map it). Phases nest, so they do not add up. Time it on a quiet machine.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import os
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from river_hf.kernels import quantize, registry as kernels
from river_hf.saving import twin_files as twin_store
try:
    from river_hf.saving import twin_loading
except ImportError:  # an older river_hf (PYTHONPATH=OLD_CHECKOUT) loads in twin_files
    twin_loading = twin_store

SPENT: collections.Counter = collections.Counter()
CALLS: collections.Counter = collections.Counter()


def timed(function, label: str):
    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        started = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            SPENT[label] += time.perf_counter() - started
            CALLS[label] += 1
    return wrapper


@contextlib.contextmanager
def phase_timers():
    """Inside the block river_hf's load phases count into SPENT / CALLS; everything is put back after it."""
    # hasattr: an older river_hf (PYTHONPATH=OLD_CHECKOUT, to time it the same way) may lack a phase
    patched = [(module, name, getattr(module, name))
               for module, names in ((twin_loading, ("fingerprint", "sampled_fingerprint", "checksum", "make_twin",
                                                     "_unpack_codes", "unpack_codes", "load_file", "read_packed",
                                                     "write_packed")),
                                     (twin_store, ("digest", "sampled_digest")))
               for name in names if hasattr(module, name)]
    patched += [(twin_loading.StoredTwins, "read", twin_loading.StoredTwins.__dict__["read"]),
                (quantize.RiverQuantLinear, "from_codes", quantize.RiverQuantLinear.__dict__["from_codes"])]
    kernels_before = dict(kernels.KERNELS)
    try:
        for owner, name, original in patched:
            if isinstance(original, classmethod):
                setattr(owner, name, classmethod(timed(original.__func__, name)))
            else:
                setattr(owner, name, timed(original, name))
        for name, kernel in kernels_before.items():
            kernels.KERNELS[name] = kernel._replace(pack=timed(kernel.pack, f"pack {name}"))
        yield
    finally:
        for owner, name, original in patched:
            setattr(owner, name, original)
        kernels.KERNELS.update(kernels_before)


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", help="a saved river (save_pretrained with its twins)")
    parser.add_argument("--loads", type=int, default=3)
    args = parser.parse_args(argv)
    for name in os.listdir(args.folder):  # the page cache holds the files, as for the loads load_time.py compares
        with open(os.path.join(args.folder, name), "rb") as file:
            file.read()
    print(f"cpu capability: {torch.backends.cpu.get_cpu_capability()}; threads {torch.get_num_threads()}")
    AutoModelForCausalLM._model_mapping[type(AutoConfig.from_pretrained(args.folder))]  # its modeling code
    loads = []
    with phase_timers():
        for index in range(args.loads):
            loads.append(timed_load(args.folder, index))
    return loads


def timed_load(folder: str, index: int) -> dict:
    SPENT.clear(), CALLS.clear()
    started = time.perf_counter()
    AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    total = time.perf_counter() - started
    phases = {label: (SPENT[label], CALLS[label]) for label, _ in SPENT.most_common()}
    print(f"load {index + 1}: {total:.3f} s; " + ", ".join(
        f"{label} {seconds * 1e3:.0f} ms / {calls}" for label, (seconds, calls) in phases.items()))
    return {"total_s": total, "phases": phases}


if __name__ == "__main__":
    main()
