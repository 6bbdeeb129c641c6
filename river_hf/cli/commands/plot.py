"""`river-hf plot`: several bench records (e.g. one per twin precision) on one speed-vs-match plot."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from . import common
from ...checks import install_hint
from .common import CLIError


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "plot", help="Overlay several bench records (e.g. one per twin precision) on one speed-vs-match plot.",
        description="Reads `river-hf bench` JSON records and draws each one's cosine tau sweep, full-quantization "
                    "point and random-routing curve on one plane. Ratios stay each run's own (to its backbone).")
    parser.add_argument("records", nargs="+", metavar="RECORD.json")
    parser.add_argument("--scaling", action="store_true",
                        help="Records of `river-hf bench --random-model`: speed ratio vs parameters (log x), one line "
                             "per system and panel per CPU capability, each system's byte limit dashed.")
    parser.add_argument("--output", required=True, metavar="FIGURE",
                        help="The figure file (SVG; PNG if it ends in .png), or a folder to write "
                             "plot-<timestamp>.svg in.")
    parser.set_defaults(run=run, subparser=parser)


def run(args: argparse.Namespace) -> int:
    try:
        from ...bench.plots import FIGURE_SUFFIX, precisions_figure, save, scaling_figure
    except ModuleNotFoundError as error:
        if error.name != "matplotlib":
            raise
        raise CLIError(f"`river-hf plot` {install_hint('matplotlib', 'bench')}.") from None
    from ...bench.records import default_name

    output = common.output_path(args, default_name("plot", FIGURE_SUFFIX))
    records = []
    for path in args.records:
        try:
            records.append(json.loads(Path(path).read_text()))
        except (OSError, ValueError) as error:
            raise CLIError(f"could not read bench record {path!r}: {error}") from error
    save(scaling_figure(records) if args.scaling else precisions_figure(records), output)
    print(f"plot: {output}")
    return 0
