"""`river-hf` on the command line: assembles the subcommands of `river_hf.cli.commands` (one module each).

    river-hf generate "What is 2+3?"              # the packaged SmolLM2-135M-Instruct, river at its defaults
                                                  # (tau "auto")
    river-hf generate "What is 2+3?" --no-river   # the plain backbone, for comparison
    river-hf bench | eval gsm8k | calibrate --target-match 0.98 | plot RECORD.json ... --output PNG
"""

from __future__ import annotations

import argparse

from .commands import COMMANDS
from .commands.common import CLIError


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except CLIError as error:
        args.subparser.error(str(error))  # prints usage and exits 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="river-hf", description="Seamless token-level early exit (River-LLM) for HuggingFace decoder-only LLMs.")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.add_parser(subparsers)
    return parser
