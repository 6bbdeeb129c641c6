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

from .config import RiverQuantConfig
from .generation import DEFAULT_TAU, RiverConfig
from .models import build_chat_inputs, load_model_and_tokenizer
from .patching import build_river



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
    group.add_argument("--tau", type=float, default=DEFAULT_TAU,
                       help="Exit threshold on cos(h_in, h_out) of a backbone layer: > 1 never exits, -1 exits as "
                            "early as allowed (default: %(default)s; see README 'Choosing tau').")
    group.add_argument("--nbits", type=int, default=4, metavar="N", help="Bits per twin weight (default: %(default)s).")
    group.add_argument("--group-size", type=_positive_int, default=64, metavar="N",
                       help="HQQ quantization group size of the twins (default: %(default)s).")
    group.add_argument("--start-layer", type=_positive_int, default=1, metavar="L",
                       help="First decoder layer with a twin: every token runs at least this many backbone layers "
                            "(default: %(default)s).")
    group.add_argument("--no-river", action="store_true", help="Run the plain backbone: no twins, no exits.")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _river_configs(args: argparse.Namespace, **generation_kwargs):
    """(RiverQuantConfig or None, generation config), validated before the model loads so typos fail fast."""
    try:
        if args.no_river:
            return None, GenerationConfig(**generation_kwargs)
        quant_config = RiverQuantConfig(nbits=args.nbits, group_size=args.group_size, start_layer=args.start_layer)
        return quant_config, RiverConfig(tau=args.tau, **generation_kwargs)
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
          f"({quant_config.nbits}-bit twins, group {quant_config.group_size})...", file=sys.stderr, flush=True)
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
        f"tau {args.tau:g}, {quant_config.nbits}-bit twins, group {quant_config.group_size}, "
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
