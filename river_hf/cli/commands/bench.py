"""`river-hf bench`: the command-line face of `river_hf.bench.run.bench` (options, table, record, plots)."""

from __future__ import annotations

import argparse
import math

from ...core.signals import signal_names
from ...core.kv_strategies import strategy_names
from . import common
from .common import CLIError
from .bench_offload import add_offload_args, run_offload
from .generate import draft_length_arg


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "bench", help="Speed, exit depth, memory and fidelity of backbone, full quantization and river taus.",
        description="In one process, on the same prompts: the backbone, full quantization (the river at tau=-1), "
                    "a static full-quantization model (the twins as plain layers, no router) and the river at each "
                    "tau. Speed runs are interleaved after a warm-up (decode tok/s, median; prefill ms; exit-depth "
                    "histogram); fidelity is teacher-forced next-token match and KL(backbone || system) along the "
                    "backbone's own greedy continuations. Writes a JSON record with every raw timing, two PNG plots "
                    "beside it, and prints a markdown table.")
    parser.add_argument("--taus", type=float, nargs="+", default=None, metavar="T",
                        help="The river's taus (default: 0.95-0.995 for the packaged SmolLM2, see "
                             "river_hf.bench.systems.SMOLLM2_TAUS; for other models, quantiles of their own layer "
                             "similarities). Full quantization (tau=-1) always runs.")
    parser.add_argument("--quick", action="store_true",
                        help="A smoke run: 2 prompts x 1 round x 64 tokens, 3 taus, fidelity on 3 prompts x 32 tokens "
                             "(explicit options still win). About 2 minutes for SmolLM2 on 2 CPU cores.")
    parser.add_argument("--prompts", type=common.positive_int, default=None, metavar="N", help="Speed prompts (3).")
    parser.add_argument("--rounds", type=common.positive_int, default=None, metavar="N", help="Speed rounds (2).")
    parser.add_argument("--max-new-tokens", type=common.positive_int, default=None, metavar="N",
                        help="Tokens every speed run generates (128).")
    parser.add_argument("--fidelity-prompts", type=common.positive_int, default=None, metavar="N", help="(6)")
    parser.add_argument("--fidelity-tokens", type=common.positive_int, default=None, metavar="N",
                        help="Length of each backbone continuation fidelity is measured along (64).")
    parser.add_argument("--output", default=None, metavar="PATH",
                        help="JSON file, or a folder to write bench-<timestamp>.json in (default: "
                             "runs/bench-<timestamp>.json); the plots go beside it.")
    parser.add_argument("--no-plots", action="store_true", help="Skip the PNG plots.")
    parser.add_argument("--compiled", action=argparse.BooleanOptionalAction, default=None,
                        help="Also run transformers' compiled static-cache backbone (`cache_implementation='static'` "
                             "with its compile config: what a user who knows HF's switches has) and the river's "
                             "captured decode steps: full quantization and the defaults (with --random-model: full "
                             "quantization and random routing); ratios against the compiled backbone get their own "
                             "column. Default: on with --device cuda, off on CPU (inductor takes minutes there).")
    _add_random_model_args(parser)
    _add_sweep_args(parser)
    add_offload_args(parser)
    _add_lossless_args(parser)
    common.add_prompt_args(parser, split="test")
    common.add_model_args(parser)
    common.add_twin_args(parser, head_nbits_note="default: auto; with --random-model 8, its full quantization being "
                                                  "4-bit twins + an 8-bit head")
    parser.set_defaults(run=run, subparser=parser)


def _add_random_model_args(parser: argparse.ArgumentParser) -> None:
    from ...bench.shapes import PROMPT_LENGTH, SHAPES

    group = parser.add_argument_group("random-initialised Llama shapes (speed vs parameters, no download)")
    group.add_argument("--random-model", choices=list(SHAPES),
                       default=None, metavar="NAME",
                       help=f"Instead of --model: a Llama of this shape ({', '.join(SHAPES)}) with random bf16 "
                            "weights. Speed, memory and weight bytes only (fidelity is not measured on random "
                            "weights): the backbone, full quantization with 4-bit and with 8-bit twins, each with "
                            "and without the quantized LM head (8-bit unless --lm-head-nbits says otherwise), and "
                            "random routing (--exit-rates, default 0.5 0.9), in one "
                            "process. Two rivers are built one after the other, and HQQ quantization takes a while: "
                            "seconds for the 135M shape, minutes for the 1B and 3B shapes on 2 CPU cores (a progress "
                            "bar shows it). --nbits and --quantize-lm-head are fixed by this mode; the plot "
                            "is <record>-scaling.svg (combine records with `river-hf plot --scaling`).")
    group.add_argument("--prompt-length", type=common.positive_int, default=PROMPT_LENGTH, metavar="T",
                       help="Random token ids per prompt with --random-model (default: %(default)s).")
    group.add_argument("--twin-bits", type=int, nargs="+", choices=(4, 8), default=[8, 4], metavar="BITS",
                       help="The river builds of --random-model (default: both, 8 then 4); `--twin-bits 4` builds "
                            "only the 4-bit twins with the quantized head, where two builds do not fit in memory; "
                            "`--twin-bits 8` only the 8-bit twins, with the 8-bit head (with --activations int8: W8A8 "
                            "twins).")


def _add_sweep_args(parser: argparse.ArgumentParser) -> None:
    signals = parser.add_argument_group("exit signals and the random-routing baseline")
    signals.add_argument("--signals", nargs="+", default=[], metavar="NAME",
                         choices=[name for name in signal_names() if name not in ("cosine", "random")],
                         help="Exit signals to sweep besides the paper's cosine, each at quantiles of its own "
                              "scores (or --signal-taus).")
    signals.add_argument("--signal-taus", type=float, nargs="+", default=None, metavar="T",
                         help="The taus of every signal in --signals (default: quantiles of its scores).")
    signals.add_argument("--signal-layer", type=common.positive_int, default=None, metavar="D",
                         help="cosine_first: the depth at which it decides (default: the first eligible one).")
    signals.add_argument("--exit-rates", type=common.probability, nargs="*", default=None, metavar="P",
                         help="Random routing (each decoded token exits with probability P at a random layer) at "
                              "these rates, drawn as the baseline curve; none given: no baseline (default: "
                              "0.2 0.4 0.6 0.8 1.0; --quick: 0.3 0.6 1.0).")
    signals.add_argument("--seed", type=int, default=0, help="Seed of the random routing (default: %(default)s).")
    strategies = parser.add_argument_group("KV strategies (the paper's Fig. 3)")
    strategies.add_argument("--strategies", nargs="+", default=None, metavar="NAME",
                            choices=["all", *strategy_names()],
                            help="Instead of the tau sweep: the backbone and each KV strategy ('all': "
                                 f"{', '.join(strategy_names())}) at two thresholds, with where the decode time goes.")
    strategies.add_argument("--strategy-taus", type=float, nargs=2, default=None, metavar=("RELAXED", "STRICT"),
                            help="The two thresholds (default: 0.97 0.985 for the packaged SmolLM2, else the 25%% "
                                 "and 75%% quantiles of the model's layer similarities).")


def _add_lossless_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("lossless mode (docs/lossless.md)")
    group.add_argument("--lossless", nargs="+", type=draft_length_arg, default=None, metavar="K",
                       help="Instead of the tau sweep: the backbone and the lossless mode drafting K tokens per "
                            "verification (an int, or 'heuristic'), with and without its fallback, for each exit "
                            "signal in --signals at each of --signal-taus (else cosine at --taus; with neither, the "
                            "mode's default drafts: tau=-1, every draft from the start layer). Reports speed ratio, "
                            "match with the backbone, acceptance, tokens per backbone pass, fallbacks and the time "
                            "split.")


def lossless_signal_taus(args: argparse.Namespace) -> list[tuple[str, float]]:
    from ...core.settings import LOSSLESS_AUTO_TAU, RiverSettings

    if args.signals:
        if not args.signal_taus:
            raise CLIError("--lossless with --signals needs --signal-taus (the taus of those signals).")
        return [(signal, tau) for signal in args.signals for tau in args.signal_taus]
    if args.taus:
        return [("cosine", tau) for tau in args.taus]
    return [(RiverSettings().exit_signal, LOSSLESS_AUTO_TAU)]  # what RiverConfig(lossless=True) drafts with


def _run_lossless(args: argparse.Namespace, quant_config, settings, output) -> int:
    from ...bench import records
    from ...bench.lossless import bench_lossless, lossless_systems, markdown_table
    from ...bench.run import dtype_name, environment

    if args.random_model is not None or args.strategies:
        raise CLIError("--lossless runs its own systems: no --random-model or --strategies with it.")
    signal_taus = lossless_signal_taus(args)
    prompt_set = common.load_prompts(args, settings.prompts)
    model_id, started = common.model_id(args), environment()
    model, tokenizer = common.load(args)
    model = common.build(model, quant_config)
    systems = lossless_systems(args.lossless, signal_taus, settings.max_new_tokens)
    record = bench_lossless(model, tokenizer, prompt_set.prompts[:settings.prompts], systems, settings.rounds)
    record.update(model={"id": model_id, "device": str(model.device), "dtype": dtype_name(model)},
                  prompts={"source": prompt_set.source, "texts": prompt_set.prompts[:settings.prompts]},
                  environment={**started, "load_average_after": environment()["load_average"]},
                  arguments=common.arguments(args))
    output = records.write_record(record, output)
    print(markdown_table(record))
    print(f"\nrecord: {output}")
    return 0


def run(args: argparse.Namespace) -> int:
    from ...bench import records, report
    from ...bench.run import FULL, QUICK, bench, environment
    from ...bench.scaling import RANDOM_MODEL_HEAD_NBITS
    from ...bench.systems import Sweep

    if args.taus is not None and not all(math.isfinite(tau) for tau in args.taus):
        raise CLIError(f"--taus must be real numbers; got {args.taus}.")
    if args.compiled and (args.strategies or args.lossless is not None or args.offload is not None):
        raise CLIError("--compiled adds captured systems to the tau sweep or --random-model; --strategies, --lossless "
                       "and --offload cannot run on a static cache (other KV strategies, cropped caches, offload "
                       "hooks): leave out --compiled.")
    if args.lm_head_nbits is None and args.random_model is not None:
        args.lm_head_nbits = RANDOM_MODEL_HEAD_NBITS  # what their records and the commands in docs/ define
    quant_config = common.twin_config(args)
    output = common.output_path(args, records.default_name("bench"))
    settings = (QUICK if args.quick else FULL).with_overrides(**vars(args))
    if args.lossless is not None:
        return _run_lossless(args, quant_config, settings, output)
    if args.offload is not None:
        return run_offload(args, quant_config, settings, output)
    if args.random_model is not None:
        return _run_random_model(args, quant_config, settings, output)
    prompt_set = common.load_prompts(args, settings.prompts_used)
    model_id, started = common.model_id(args), environment()
    model, tokenizer = common.load(args)
    model = common.build(model, quant_config)
    sweep = Sweep(taus=args.taus, signals=args.signals, signal_taus=args.signal_taus, signal_layer=args.signal_layer,
                  exit_rates=args.exit_rates, seed=args.seed, strategies=args.strategies,
                  strategy_taus=args.strategy_taus, packaged=args.model is None and args.gguf_file is None,
                  quick=args.quick, compiled=args.compiled)
    record = bench(model, tokenizer, prompt_set.prompts, settings, sweep, model_id=model_id,
                   prompt_source=prompt_set.source, arguments=common.arguments(args), started=started)
    output = records.write_record(record, output)
    print(report.strategy_table(record) if args.strategies else report.markdown_table(record))
    print(f"\nrecord: {output}")
    plots = None if args.no_plots else common.bench_plots()
    if plots is not None:
        print("plots: " + ", ".join(map(str, plots.write_plots(record, output))))
    return 0


def _run_random_model(args: argparse.Namespace, quant_config, settings, output) -> int:
    from ...bench import records, report
    from ...bench.scaling import SCALING_EXIT_RATES, bench_random_model

    if args.model is not None or args.gguf_file is not None or args.strategies:
        raise CLIError("--random-model replaces --model/--gguf-file and runs its own systems (no --strategies).")
    exit_rates = SCALING_EXIT_RATES if args.exit_rates is None else args.exit_rates
    record = bench_random_model(args.random_model, settings, quant_config, device=args.device, exit_rates=exit_rates,
                                seed=args.seed, prompt_length=args.prompt_length, build=common.build,
                                arguments=common.arguments(args), twin_bits=tuple(args.twin_bits),
                                dtype=common.random_model_dtype(args), compiled=args.compiled)
    output = records.write_record(record, output)
    print(report.markdown_table(record))
    print(f"\nrecord: {output}")
    plots = None if args.no_plots else common.bench_plots()
    if plots is not None:
        path = output.with_name(output.stem + "-scaling" + plots.FIGURE_SUFFIX)
        plots.save(plots.scaling_figure([record]), path)
        print(f"plot: {path}")
    return 0
