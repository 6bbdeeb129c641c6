"""`river-hf calibrate`: the command-line face of `river_hf.bench.calibrate.calibrate` (saves what it finds)."""

from __future__ import annotations

import argparse
import sys

from . import common
from .common import CLIError


def add_parser(subparsers) -> None:
    from ...bench import calibrate

    parser = subparsers.add_parser(
        "calibrate", help="Find the fastest tau whose measured next-token match meets a target (for --tau auto).",
        description="Bisect tau on measured teacher-forced next-token match against the backbone (along its own "
                    "greedy continuations of calibration prompts: GSM8K train questions by default), and keep, of "
                    "the taus that meet --target-match, the one with the lowest mean exit depth (the fastest). "
                    "Saves it under the model and twin configuration in $RIVER_HF_CACHE/calibration.json (default "
                    "~/.cache/river_hf/), where `river-hf generate --tau auto` finds it.")
    parser.add_argument("--target-match", type=float, required=True, metavar="F",
                        help="Least next-token match with the backbone, a share in (0, 1], e.g. 0.98.")
    parser.add_argument("--prompts", type=common.positive_int, default=4, metavar="N",
                        help="Calibration prompts (default: %(default)s).")
    parser.add_argument("--tokens", type=common.positive_int, default=64, metavar="N",
                        help="Backbone tokens per prompt that match is measured along (default: %(default)s).")
    parser.add_argument("--tau-range", type=float, nargs=2, default=list(calibrate.DEFAULT_TAU_RANGE),
                        metavar=("LO", "HI"), help="Search interval (default: %(default)s).")
    parser.add_argument("--tolerance", type=float, default=calibrate.DEFAULT_TOLERANCE, metavar="T",
                        help="Stop bisecting when the interval is this narrow (default: %(default)s).")
    parser.add_argument("--max-steps", type=common.positive_int, default=calibrate.DEFAULT_MAX_STEPS, metavar="N",
                        help="Most bisection steps after the two ends (default: %(default)s).")
    common.add_prompt_args(parser, split="train")
    common.add_model_args(parser)
    common.add_twin_args(parser)
    parser.set_defaults(run=run, subparser=parser)


def run(args: argparse.Namespace) -> int:
    from ...bench import calibrate
    from ...bench.systems import twin_description, twin_label

    with common.user_errors():
        calibrate.check_target(args.target_match)
        calibrate.check_tau_range(*args.tau_range)
    quant_config = common.twin_config(args)
    prompt_set = common.load_prompts(args, args.prompts)
    key = calibrate.calibration_key(common.model_id(args), quant_config, args.device)
    model, tokenizer = common.load(args)
    model = common.build(model, quant_config)
    print(twin_label(twin_description(model)), file=sys.stderr)
    try:
        found = calibrate.calibrate(model, tokenizer, prompt_set.prompts, args.target_match, args.tokens,
                                    tuple(args.tau_range), args.tolerance, args.max_steps, prompt_set.source,
                                    progress=_print_probe)
    except calibrate.CalibrationError as error:
        raise CLIError(str(error)) from error
    path = calibrate.save_calibration(key, found.entry())
    chosen, twins, prompts = found.chosen, found.twins, found.prompts
    print(f"tau {chosen.tau:.4f}: match {chosen.match:.2%} (target {args.target_match:g}), KL {chosen.kl:.4f}, "
          f"mean exit depth {chosen.mean_exit_depth:.1f} of {twins['num_layers']}; {len(found.probes)} taus measured "
          f"on {prompts['count']} prompts x {args.tokens} tokens ({prompt_set.source})")
    print(twin_label(twins))
    print(f"saved to {path} under [{key}]; use it with `river-hf generate ... --tau auto`")
    return 0


def _print_probe(probe) -> None:
    print(f"  tau {probe.tau:.4f}: match {probe.match:.2%}, KL {probe.kl:.4f}, mean exit depth "
          f"{probe.mean_exit_depth:.1f}", file=sys.stderr, flush=True)
