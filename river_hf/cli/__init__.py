"""`river-hf` on the command line: `main.py` assembles the subcommands of `commands/` (one module each, argparse
only there); `display.py` is what `generate` shows; `stored_twins.py` keeps the command line's twins between runs."""

from .main import build_parser, main  # noqa: F401  (the console script is river_hf.cli:main)
