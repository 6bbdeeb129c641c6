"""What the subcommands share: argument groups (model, twins, river, prompts, output), argument types, and loading
a model or its inputs with errors the user can act on.

The river flags derive from `RiverSettings`: name, default and help of each come from its field, the choices from the
registries (`signal_names()`, `strategy_names()`), so a new field or signal reaches the CLI without an edit here.
Every user error is a `CLIError`; `cli.main` prints it after the subcommand's usage and exits with status 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from contextlib import contextmanager
from dataclasses import fields
from pathlib import Path

import torch
from transformers import GenerationConfig

from ...kernels import backbone_dtype, choice as kernel_choice, machine
from ...checks import install_hint
from ...core.config import AS_TWINS, AUTO_NBITS, RiverQuantConfig, bits_label
from ...core.generation import RiverConfig
from ...loading.models import load_model_and_tokenizer
from ..stored_twins import build_river_cached, has_kept_twins
from ...core.settings import AUTO_TAU, PREFILL_EXITS, RiverSettings, river_field_help
from ...core.signals import signal_names
from ...core.kv_strategies import strategy_names



class CLIError(Exception):
    """A user-facing error: main prints it after the subcommand's name and exits with status 2, like argparse."""


@contextmanager
def user_errors(prefix: str = ""):
    """ValueErrors raised inside (the library's errors on user input, naming the field) become CLIErrors."""
    try:
        yield
    except ValueError as error:
        raise CLIError(f"{prefix}{error}") from error


# ---- argument types ---------------------------------------------------------------------------------------------


def bench_plots():
    """river_hf.bench.plots, or None with a note on stderr when matplotlib is missing (the `bench` extra): a bench
    has written its record by then, and the record stays."""
    try:
        from ...bench import plots
    except ModuleNotFoundError as error:
        if error.name != "matplotlib":
            raise
        print(f"plots skipped: drawing them {install_hint('matplotlib', 'bench')}; the record is complete without "
              f"them.",
              file=sys.stderr)
        return None
    return plots


def int_at_least(minimum: int, text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
    return value


def positive_int(text: str) -> int:
    return int_at_least(1, text)


def non_negative_int(text: str) -> int:
    return int_at_least(0, text)


def probability(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be a probability between 0 and 1, got {text}")
    return value


def auto_or(auto: str, convert, what: str):
    """An argparse type: `auto` (any case) -> `auto`, else `convert(text)`, else an error saying `what` it wanted."""
    def parse(text: str):
        if text.strip().lower() == auto:
            return auto
        try:
            return convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid {what}: {text!r} (give a number, or {auto!r})") from None
    return parse


tau_arg = auto_or(AUTO_TAU, float, "float value")
head_nbits_arg = auto_or(AUTO_NBITS, int, "number of bits")  # --lm-head-nbits


def prefill_exit_arg(text: str) -> str | int:
    if text in PREFILL_EXITS:
        return text
    try:
        return positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(PREFILL_EXITS)} or a number of layers >= 1; "
                                         f"got {text!r}") from None


def nbits_arg(text: str) -> int | list[int] | str:
    """'auto' -> 'auto'; '4' -> 4; '8*2,4*3' or '8,8,4,4,4' -> [8, 8, 4, 4, 4]."""
    if text.strip().lower() == AUTO_NBITS:
        return AUTO_NBITS
    try:
        if "," not in text and "*" not in text:
            return int(text)
        schedule = []
        for part in text.split(","):
            bits, _, count = part.partition("*")
            schedule += [int(bits)] * (int(count) if count else 1)
        return schedule
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected bits (e.g. 4) or a schedule (e.g. 8*8,4*21); got {text!r}")


def group_size_arg(text: str) -> int | None:
    return None if text.strip().lower() == "none" else positive_int(text)


# ---- the model --------------------------------------------------------------------------------------------------
DTYPE_ENV = "RIVER_HF_DTYPE"  # the --dtype default (the test suite pins bfloat16: same models in every process)
DTYPES = ("auto", *backbone_dtype.CANDIDATES)


def add_model_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("model")
    group.add_argument("--model", default=None, metavar="ID_OR_PATH",
                       help="Hub id, local folder or .gguf file (default: the packaged SmolLM2-135M-Instruct GGUF, "
                            "dequantized).")
    group.add_argument("--gguf-file", default=None, metavar="NAME",
                       help="GGUF file inside --model (a folder or hub id).")
    group.add_argument("--device", default="cpu", help="Torch device to run on (default: %(default)s).")
    group.add_argument("--dtype", default=os.environ.get(DTYPE_ENV, "auto"), choices=DTYPES,
                       help="The backbone's dtype. 'auto': the one whose batch-1 GEMV at the model's MLP shape times "
                            "faster on this machine, bf16 unless fp32 wins by 10%% (measured once per machine and "
                            f"shape, then remembered; shown after loading). Default: ${DTYPE_ENV} if set, else "
                            "'auto'.")


def load(args: argparse.Namespace):
    """(model, tokenizer) of --model/--gguf-file on --device, in --dtype ('auto': `backbone_dtype.choose`, timed on
    the loaded bf16 model's shape; fp32 is then an exact upcast of the bf16 weights)."""
    _check_dtype(args)
    try:
        dtype = torch.bfloat16 if args.dtype == "auto" else backbone_dtype.CANDIDATES[args.dtype]
        model, tokenizer = load_model_and_tokenizer(args.model, args.gguf_file, dtype=dtype, device=args.device)
    except (OSError, ValueError, ModuleNotFoundError) as error:  # missing files, bad paths, offline hub ids
        raise CLIError(f"could not load the model: {error}") from error
    return (model.to(measured_dtype(model.config, args.device)) if args.dtype == "auto" else model), tokenizer


def _check_dtype(args: argparse.Namespace) -> None:
    if args.dtype not in DTYPES:  # only a bad $RIVER_HF_DTYPE gets here: argparse checks --dtype
        raise CLIError(f"${DTYPE_ENV}={args.dtype!r} is not a dtype the command line loads; use one of {DTYPES}, or "
                       f"unset it.")


def random_model_dtype(args: argparse.Namespace) -> torch.dtype:
    """--dtype for --random-model's shape, before the model is made: as asked, or measured for its config."""
    from ...bench.shapes import shape_config

    _check_dtype(args)
    if args.dtype != "auto":
        return backbone_dtype.CANDIDATES[args.dtype]
    with user_errors():  # an unknown shape name
        config = shape_config(args.random_model)
    return measured_dtype(config, args.device)


def measured_dtype(config, device: str) -> torch.dtype:
    """`backbone_dtype`'s choice for a model of `config` on this machine, said on stderr (bf16 where no shape)."""
    if torch.device(device).type != "cpu":
        return backbone_dtype.fastest_dtype(config, device)  # not timed on a GPU
    try:
        choice = backbone_dtype.choose(backbone_dtype.mlp_shape(config))
    except ValueError as error:  # a config without hidden_size: nothing to time, bf16 stays
        print(f"backbone dtype: bfloat16, not measured ({error})", file=sys.stderr)
        return torch.bfloat16
    print(f"backbone dtype, measured ({machine.cpu_description()['cpu_capability']}): {choice.describe()}",
          file=sys.stderr)
    return choice.torch_dtype


def model_id(args: argparse.Namespace) -> str:
    """The stable name calibrations are kept under (see `bench.calibrate.model_id`)."""
    from ...bench.calibrate import model_id as calibration_model_id

    try:
        return calibration_model_id(args.model, args.gguf_file)
    except (OSError, ValueError) as error:
        raise CLIError(f"could not load the model: {error}") from error


def num_layers(model) -> int:
    return model.config.get_text_config(decoder=True).num_hidden_layers


# ---- the twins --------------------------------------------------------------------------------------------------
def add_twin_args(parser: argparse.ArgumentParser, head_nbits_note: str | None = None) -> None:
    """The twin options. `head_nbits_note`: `--lm-head-nbits` defaults to None, which the command resolves, and
    its help ends with this note instead of the default (bench: 8 bits under --random-model)."""
    from ...kernels.backends import BACKENDS

    group = parser.add_argument_group("twins")
    defaults = RiverQuantConfig()
    group.add_argument("--nbits", type=nbits_arg, default=defaults.nbits, metavar="auto|N|SCHEDULE",
                       help="Bits per twin weight: 'auto' (the default: 4 for the first quarter of the river layers, "
                            "8 after), one number, or a schedule with one entry per river layer (layers "
                            "start_layer..L-1), where B*K repeats B K times: e.g. 8*8,4*21 for SmolLM2's 29 river "
                            "layers.")
    group.add_argument("--quantize-lm-head", action=argparse.BooleanOptionalAction,
                       default=defaults.quantize_lm_head,
                       help="Steps that exited also use a quantized copy of the LM head (the backbone keeps its own; "
                            "default: on).")
    group.add_argument("--lm-head-nbits", type=head_nbits_arg, metavar="N",
                       default=defaults.lm_head_nbits if head_nbits_note is None else None,
                       help="Bits of the quantized LM head, or 'auto': 4 bits with its top logits recomputed "
                            "exactly, 8 where it runs on int8 activations "
                            f"({head_nbits_note or 'default: %(default)s'}).")
    group.add_argument("--group-size", type=group_size_arg, default=64, metavar="N",
                       help="HQQ quantization group size, or 'none' for one group per row (default: %(default)s).")
    group.add_argument("--start-layer", type=positive_int, default=1, metavar="L",
                       help="First decoder layer with a twin (default: %(default)s).")
    group.add_argument("--backend", default=defaults.backend, choices=BACKENDS,
                       help="Twin kernel: 'fastest' times the kernels that can run each layer shape on this machine "
                            "and takes the fastest (shown after the build); 'auto' takes the device's preferred "
                            "kernel without measuring (default: %(default)s).")
    group.add_argument("--activations", choices=["int8"], default=None,
                       help="Let 8-bit twins and the 8-bit LM head (unless --lm-head-activations says otherwise) "
                            "run on fbgemm's dynamic int8 linear, which also rounds each token's activations to int8 "
                            "(w8a8_cpu): faster on AVX2 CPUs, less faithful (default: weight-only kernels).")
    group.add_argument("--lm-head-activations", choices=["int8", "none"], default=None,
                       help="What the quantized LM head's kernel may do to activations, apart from the twins: 'int8' "
                            "lets the 8-bit head run on W8A8 while the twins stay weight-only (the largest single "
                            "GEMV of a 1B model's exited step), 'none' keeps it weight-only (default: as "
                            "--activations says).")
    group.add_argument("--lm-head-exact-top-k", type=non_negative_int, default=defaults.lm_head_exact_top_k,
                       metavar="K", help="Recompute the quantized LM head's K highest logits of each exited step "
                                         "from the original head's rows; 0: none (default: %(default)s).")


def twin_config(args: argparse.Namespace) -> RiverQuantConfig:
    """The RiverQuantConfig of the twin options (an `--lm-head-nbits` left to the command, None: the default)."""
    head_nbits = RiverQuantConfig().lm_head_nbits if args.lm_head_nbits is None else args.lm_head_nbits
    with user_errors():
        return RiverQuantConfig(nbits=args.nbits, group_size=args.group_size, start_layer=args.start_layer,
                                backend=args.backend, quantize_lm_head=args.quantize_lm_head,
                                lm_head_nbits=head_nbits, activations=args.activations,
                                lm_head_activations=_head_activations(args.lm_head_activations),
                                lm_head_exact_top_k=args.lm_head_exact_top_k)


def _head_activations(choice: str | None) -> str | None:
    """--lm-head-activations: not given -> as the twins; 'none' -> weight-only (None); 'int8'."""
    return AS_TWINS if choice is None else (None if choice == "none" else choice)


def build(model, quant_config: RiverQuantConfig):
    """`build_river`, announced on stderr (quantizing takes a while)."""
    layers = max(num_layers(model) - quant_config.start_layer, 0)
    bits = bits_label(quant_config.resolved_nbits(num_layers(model)))
    how = "reading the twins an earlier run kept for" if has_kept_twins(model, quant_config) else "quantizing"
    print(f"building river: {how} {layers} layers ({bits}-bit twins, group "
          f"{quant_config.group_size})...", file=sys.stderr, flush=True)
    with user_errors():  # e.g. --start-layer beyond the model's depth
        model = build_river_cached(model, quant_config)  # the twins of an earlier run, when they fit
    for choice in kernel_choice.measured_choices():
        where = (torch.cuda.get_device_name() if choice.device == "cuda"
                 else machine.cpu_description()["cpu_capability"])
        print(f"  kernel, measured ({where}): {choice.describe()}", file=sys.stderr)
    return model


# ---- the river: flags derived from RiverSettings ----------------------------------------------------------------
# How each field's flag parses; its name, default and help come from the field itself.
RIVER_FLAG_TYPES = {
    "tau": lambda: {"type": tau_arg, "metavar": "TAU"},
    "exit_signal": lambda: {"choices": [name for name in signal_names() if name != "random"]},  # random: bench only
    "kv_strategy": lambda: {"choices": strategy_names()},
    "prefill_exit": lambda: {"type": prefill_exit_arg, "metavar": "|".join(PREFILL_EXITS) + "|K"},
    "min_exit_layer": lambda: {"type": positive_int, "metavar": "D"},
    "signal_layer": lambda: {"type": positive_int, "metavar": "D"},
}
RIVER_FLAGS = ("tau", "exit_signal", "kv_strategy")
CLI_HELP = {"tau": " On the command line 'auto' first takes the tau `river-hf calibrate` saved for this model and "
                   "twins, if any (README 'Choosing tau')."}


def add_river_args(parser: argparse.ArgumentParser, names: tuple[str, ...] = RIVER_FLAGS) -> None:
    """--no-river, a flag per RiverSettings field in `names` (--exit-signal for exit_signal), and the twin flags."""
    group = parser.add_argument_group("river")
    defaults = {f.name: f.default for f in fields(RiverSettings)}
    for name in names:
        help_text = (river_field_help(name) + CLI_HELP.get(name, "")).replace("%", "%%")
        help_text += "" if defaults[name] is None else " (default: %(default)s)"
        group.add_argument("--" + name.replace("_", "-"), default=defaults[name], **RIVER_FLAG_TYPES[name](),
                           help=help_text)
    group.add_argument("--no-river", action="store_true", help="Run the plain backbone: no twins, no exits.")
    parser.set_defaults(river_flags=names)
    add_twin_args(parser)  # the same twin options as bench/calibrate, so `--tau auto` finds their calibrations


def river_settings(args: argparse.Namespace) -> dict:
    """The river fields the command's flags set (not --tau, which may be 'auto'): RiverConfig keyword arguments."""
    return {name: getattr(args, name) for name in args.river_flags if name != "tau"}


def river_configs(args: argparse.Namespace, **generation_kwargs):
    """(RiverQuantConfig or None, generation config), validated before the model loads so typos fail fast."""
    if args.no_river:
        with user_errors():
            return None, GenerationConfig(**generation_kwargs)
    quant_config = twin_config(args)
    args.tau = resolve_tau(args, quant_config)  # `--tau auto` becomes the calibrated value
    with user_errors():
        return quant_config, RiverConfig(tau=args.tau, **river_settings(args), **generation_kwargs)


def resolve_tau(args: argparse.Namespace, quant_config: RiverQuantConfig):
    """`args.tau`; for 'auto' (the default) the tau `river-hf calibrate` saved for this model, twins and device, and
    without one the library's tau='auto' (the signal's measured default where exiting pays on this machine)."""
    if args.tau != AUTO_TAU:
        return args.tau
    from ...bench import calibrate

    if args.exit_signal != calibrate.SIGNAL:  # calibrations are of the paper's cosine
        print(f"tau auto: the {args.exit_signal} signal's measured default where exiting pays on this machine",
              file=sys.stderr)
        return AUTO_TAU
    try:
        key = calibrate.calibration_key(model_id(args), quant_config, args.device)
    except CLIError:  # a model that cannot be found: its load reports that, after the other arguments are checked
        return AUTO_TAU
    entry = calibrate.lookup_calibration(key)
    if entry is None:
        print(f"tau auto: no `river-hf calibrate` result saved for [{key}]; taking the {args.exit_signal} signal's "
              f"measured default where exiting pays on this machine", file=sys.stderr)
        return AUTO_TAU
    print(f"tau auto: {entry['tau']:g} (calibrated for match >= {entry['target_match']:g}: measured "
          f"{entry['match']:.1%}, KL {entry['kl']:.4f}, on {entry['prompts']['count']} prompts)", file=sys.stderr)
    return float(entry["tau"])


# ---- prompts and outputs ----------------------------------------------------------------------------------------
def add_prompt_args(parser: argparse.ArgumentParser, split: str) -> None:
    group = parser.add_argument_group("prompts")
    group.add_argument("--data", default=None, metavar="PATH",
                       help=f"A local JSONL file with a 'question' or 'prompt' field per line (default: GSM8K {split} "
                            f"questions from $RIVER_HF_DATA/gsm8k, else the subset shipped in river_hf/data/gsm8k).")
    group.add_argument("--dataset", default=None, metavar="HUB_ID[:CONFIG]",
                       help="A hub dataset instead, e.g. openai/gsm8k:main (needs the `datasets` package).")
    group.add_argument("--split", default=split, help="Split of GSM8K / --dataset (default: %(default)s).")


def load_prompts(args: argparse.Namespace, count: int):
    from ...bench.data import load_prompts as load

    with user_errors():
        return load(count, data=args.data, dataset=args.dataset, split=args.split)


def output_path(args: argparse.Namespace, name: str) -> Path:
    """--output checked before anything loads: a folder gets `name` inside it; an unwritable place fails now."""
    from ...bench.records import resolve_output

    with user_errors():
        return resolve_output(args.output, name, flag="--output")


def arguments(args: argparse.Namespace) -> dict:
    """The parsed arguments, for the JSON record."""
    return {key: value for key, value in vars(args).items() if key not in ("run", "subparser", "river_flags")}
