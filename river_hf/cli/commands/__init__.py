"""The `river-hf` subcommands, one module each: `add_parser(subparsers)` declares its arguments, `run(args) -> int`
does the command by calling the library (`river_hf.bench.*`, `river_hf.cli.display`). Shared argument groups live in
`common.py`; `river_hf.cli.main` only assembles them."""

from . import bench, calibrate, eval, generate, plot

COMMANDS = (generate, eval, bench, plot, calibrate)  # in the order `river-hf --help` lists them
