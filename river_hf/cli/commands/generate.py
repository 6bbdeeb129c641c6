"""`river-hf generate`: stream the answer to one prompt, then one summary line (speed, prefill, exit depth).

    river-hf generate "What is 2+3?"              # the packaged SmolLM2-135M-Instruct, the river at its defaults
    river-hf generate "What is 2+3?" --no-river   # the plain bf16 backbone, for comparison
    river-hf generate "What is 2+3?" --compile    # decode steps captured and compiled (static cache)
"""

from __future__ import annotations

import argparse
import os

from transformers import TextStreamer, set_seed

from ...bench.speed import TokenClock
from ...core.config import bits_label
from ..display import GenerationStats, render_exits, token_exit_depths
from ...loading.models import build_chat_inputs
from ...core.captured_decode import check_static_settings, compile_config_for
from ...core.kv_cache import ExitRecord
from ...core.settings import AUTO_TAU, DRAFT_HEURISTIC
from . import common
from .common import CLIError

# generate shows the river's own settings; the others (exit rate, seed, policy) belong to measurements
RIVER_FLAGS = ("tau", "exit_signal", "kv_strategy", "prefill_exit", "min_exit_layer", "signal_layer")


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "generate", help="Stream the answer to one prompt and report speed and exit depth.",
        description="Stream the model's answer to PROMPT (chat template, greedy unless --sample), then print one "
                    "summary line: decode speed in tokens/s (from the first new token to the last, so the prompt's "
                    "prefill is not counted; it is shown apart), and with the river the mean exit depth of the decode "
                    "steps (backbone layers run, of all) and the share of them that left the backbone early.")
    parser.add_argument("prompt", help="The user message.")
    parser.add_argument("--max-new-tokens", type=common.positive_int, default=128, metavar="N",
                        help="Most tokens to generate (default: %(default)s).")
    parser.add_argument("--sample", action="store_true", help="Sample instead of greedy decoding.")
    parser.add_argument("--seed", type=int, default=None, metavar="N",
                        help="Seed of the sampling (matters with --sample).")
    parser.add_argument("--show-exits", action="store_true",
                        help="Afterwards, print the answer again with each token coloured by its exit depth "
                             "(set NO_COLOR for plain text with the depth after each token).")
    parser.add_argument("--lossless", nargs="?", const=8, default=None, type=draft_length_arg, metavar="K",
                        help="Lossless mode: the river drafts K tokens (default 8; 'heuristic' adapts K), the "
                             "backbone verifies them, so the answer is the backbone's own; it falls back to plain "
                             "decoding where drafting does not pay (docs/lossless.md).")
    parser.add_argument("--compile", action="store_true",
                        help="Decode on transformers' static cache with each step captured and compiled "
                             "(`cache_implementation='static'` and a compile_config, on a CPU too): the river's "
                             "fastest decoding; the first step at each exit depth compiles (seconds to minutes, "
                             "shown), later steps and runs reuse it (docs/static-cache.md). With --no-river: "
                             "transformers' compiled backbone.")
    common.add_model_args(parser)
    common.add_river_args(parser, RIVER_FLAGS)
    parser.set_defaults(run=run, subparser=parser)


def draft_length_arg(text) -> int | str:
    """--lossless K: an int >= 1 or 'heuristic'."""
    if text == DRAFT_HEURISTIC or isinstance(text, int):
        return text
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an int >= 1 or {DRAFT_HEURISTIC!r}, got {text!r}")
    return value


def run(args: argparse.Namespace) -> int:
    if args.show_exits and args.no_river:
        raise CLIError("--show-exits needs the river: it has no exits to show with --no-river.")
    if args.lossless is not None and args.no_river:
        raise CLIError("--lossless drafts with the river: it cannot run with --no-river.")
    lossless = {} if args.lossless is None else {"lossless": True, "num_draft_tokens": args.lossless}
    captured = ({"cache_implementation": "static", "compile_config": compile_config_for(args.device)} if args.compile
                else {})
    quant_config, generation_config = common.river_configs(args, max_new_tokens=args.max_new_tokens,
                                                           do_sample=args.sample, return_dict_in_generate=True,
                                                           **lossless, **captured)
    if args.compile and quant_config is not None:
        with common.user_errors("--compile: "):  # before the model loads: what a static river cache cannot run
            check_static_settings(generation_config.river_settings())
    model, tokenizer = common.load(args)
    if quant_config is not None:
        model = common.build(model, quant_config)
    if args.seed is not None:
        set_seed(args.seed)
    inputs = build_chat_inputs(tokenizer, args.prompt, model.device)
    clock = TokenClock(then=TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True))
    out = model.generate(**inputs, generation_config=generation_config, streamer=clock)
    prompt_length = inputs["input_ids"].shape[1]
    new_ids = out.sequences[0, prompt_length:].tolist()
    # tau='auto' runs the plain backbone where exiting does not pay on this machine: then the cache has no exit record
    ran_river = quant_config is not None and isinstance(out.cache, ExitRecord)  # dynamic or static
    depths = token_exit_depths(out.cache, prompt_length, len(new_ids)) if ran_river else None
    compiled = compiling_steps(out.cache, prompt_length) if args.compile else ()
    stats = GenerationStats.collect(clock, common.num_layers(model), depths, compiled)
    print(stats.summary_line(None if quant_config is None else describe_river(args, quant_config, out.cache, model)))
    drafts = getattr(out.cache, "drafts", None)
    if drafts is not None:
        print(lossless_line(drafts.summary()))
    if args.show_exits and depths is None:
        print("--show-exits: nothing exited, the backbone ran every token.")
    elif args.show_exits:
        print(render_exits(tokenizer, new_ids, depths, quant_config.start_layer, stats.num_layers,
                           color=not os.environ.get("NO_COLOR")))
    return 0


def compiling_steps(cache, prompt_length: int) -> list[int]:
    """Indices of the new tokens whose decode step compiled its graph first (--compile): a river's cache notes them
    (the first step at each exit depth); transformers' compiled backbone compiles at its first decode step."""
    if isinstance(cache, ExitRecord):
        return sorted(position - prompt_length + 1 for position in cache.compiling_steps)
    return [1]


def describe_river(args: argparse.Namespace, quant_config, cache, model) -> str:
    """The river's settings for the summary line: the tau it used (and whether 'auto' chose it) and its twins."""
    if not isinstance(cache, ExitRecord):
        return "tau auto: exiting does not pay on this machine (see the warning above), so the backbone ran"
    auto = " (auto)" if args.tau == AUTO_TAU else ""
    bits = bits_label(quant_config.resolved_nbits(common.num_layers(model)))
    return (f"{args.exit_signal} tau {cache.router.settings.tau:g}{auto}, {bits}-bit twins, group "
            f"{quant_config.group_size}, from layer {quant_config.start_layer}")


def lossless_line(summary: dict) -> str:
    """One line on a lossless call: acceptance, tokens per backbone pass, whether it fell back."""
    fallback = ("drafting paid: no fallback" if summary["fell_back_at"] is None
                else f"fell back to plain decoding after {summary['fell_back_at']} tokens (drafting did not pay)")
    return (f"lossless: {summary['accepted']}/{summary['drafted']} drafts kept, "
            f"{summary['tokens_per_backbone_pass']:.2f} tokens per backbone pass, {fallback}")
