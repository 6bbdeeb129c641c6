"""Saved-river load time of two river_hf checkouts, compared in one run: fresh processes, alternating, medians.

    git worktree add /tmp/old <commit>          # the code to compare against
    python benchmarks/scripts/load_time.py --folder DIR    # DIR/plain and DIR/river-fastest (twins in this checkout's
                                                           # format)
    python benchmarks/scripts/load_ab.py DIR/plain DIR/river-fastest /tmp/old OLD_FOLDER [--loads 9]

OLD_FOLDER: the same river saved in the format the old checkout reads (a copy of DIR/river-fastest re-saved by the
old code, or the same folder when the format did not change). Each round loads the plain model, the old checkout's
river and this checkout's river, each in its own process (load_time.py's child load: imports and the model's
modeling code before the clock, HQQ refused in a saved load), so both codes see the same machine state; a VM that
drifts between runs moves both.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from load_time import run_child  # noqa: E402  (the same child load, HQQ refused for saved rivers)

HERE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root


def load_seconds(folder: str, code: str) -> float:
    """One load of `folder` in a fresh process importing river_hf from the checkout `code`."""
    kind = "saved" if os.path.isfile(os.path.join(folder, "river_twins.safetensors")) else "plain"
    return run_child([kind, os.path.abspath(folder), "fastest"], code=code)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("plain", help="the plain model's folder")
    parser.add_argument("river", help="the saved river, for this checkout")
    parser.add_argument("old_code", help="the other checkout (its repository root)")
    parser.add_argument("old_river", help="the saved river, for the other checkout")
    parser.add_argument("--loads", type=int, default=9)
    args = parser.parse_args(argv)
    systems = {"plain": (args.plain, HERE), "old code": (args.old_river, args.old_code),
               "this code": (args.river, HERE)}
    seconds = {name: [] for name in systems}
    for _ in range(args.loads):
        for name, (folder, code) in systems.items():
            seconds[name].append(load_seconds(folder, code))
    plain = statistics.median(seconds["plain"])
    for name, values in seconds.items():
        print(f"{name}: median {statistics.median(values):.3f} s ({statistics.median(values) / plain:.2f}x plain); "
              + " ".join(f"{value:.2f}" for value in values))
    return seconds


if __name__ == "__main__":
    main()
