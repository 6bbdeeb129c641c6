"""Sweep tau on a model: now `river-hf bench`; this script only forwards its arguments there.

    python examples/tau_sweep.py                          # = river-hf bench (packaged SmolLM2-135M, GSM8K)
    python examples/tau_sweep.py --quick                  # a ~2-minute smoke run
    python examples/tau_sweep.py --taus -1 0.97 0.98 0.99 --nbits 4 --prompts 3 --max-new-tokens 128

Every option of the old script (--model, --taus, --nbits, --group-size, --prompts, --fidelity-prompts,
--max-new-tokens, --rounds, --data) is a `river-hf bench` option with the same default; see `river-hf bench --help`.
"""

import sys

from river_hf.cli import main as river_hf_main


def main(argv=None):
    return river_hf_main(["bench", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
