"""`river-hf bench --offload disk|cpu`: the options and the run of the offload bench (river_hf.bench.offload)."""

from __future__ import annotations

import contextlib

import argparse
from dataclasses import replace

from ...core.config import DEFAULT_OFFLOAD_MAX_SHARE, OFFLOAD_DESTINATIONS
from ...kernels.quantize import plain_rounding
from . import common
from .common import CLIError


def offload_layers_arg(text: str) -> str | int:
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 'auto' or a decoder-layer index, got {text!r}") from None


def add_offload_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("backbone offloading (docs/offload.md)")
    group.add_argument("--offload", choices=OFFLOAD_DESTINATIONS, default=None,
                       help="Instead of the tau sweep: the backbone, static full quantization, one river and the same "
                            "river with its rarely run backbone layers offloaded ('disk': memory-mapped safetensors; "
                            "'cpu': CUDA models). The river: the first of --signals at the first of --signal-taus, "
                            "else the cosine at --taus. Speed and fidelity interleaved in one process; the page-in "
                            "cost per backbone step that fetched weights; each system's memory (RssAnon, RSS, weight "
                            "bytes on the device) in a fresh subprocess.")
    group.add_argument("--offload-layers", nargs="+", type=offload_layers_arg, default=["auto"], metavar="L",
                       help="'auto' (default: the layers run by fewer than --offload-max-share of the decoded tokens "
                            "of a measured run) or decoder-layer indices.")
    group.add_argument("--offload-max-share", type=common.probability, default=DEFAULT_OFFLOAD_MAX_SHARE,
                       metavar="P", help="(default: %(default)s)")
    group.add_argument("--offload-folder", default=None, metavar="DIR", help="Where 'disk' writes its files.")
    group.add_argument("--no-memory", action="store_true", help="Skip the per-system memory subprocesses.")


def river_config(args: argparse.Namespace):
    """The one river the offload bench measures."""
    from ...core.generation import RiverConfig
    from ...core.settings import DEFAULT_TAU

    if args.signals:
        if len(args.signals) != 1 or not args.signal_taus or len(args.signal_taus) != 1:
            raise CLIError("--offload measures one river: one --signals NAME with one --signal-taus T, "
                           "or one --taus T.")
        return RiverConfig(tau=args.signal_taus[0], exit_signal=args.signals[0])
    if args.taus is not None and len(args.taus) != 1:
        raise CLIError("--offload measures one river: give one --taus T (or one --signals NAME --signal-taus T).")
    return RiverConfig(tau=args.taus[0] if args.taus else DEFAULT_TAU, exit_signal="cosine")


def run_offload(args: argparse.Namespace, quant_config, settings, output) -> int:
    from ...bench import records
    from ...bench.offload import ModelSpec, bench_offload, offload_table
    from ...bench.run import dtype_name, environment, finish_record
    from ...bench.shapes import random_model, random_prompts
    from ...bench.systems import twin_description
    from ...loading.models import build_chat_inputs

    if args.strategies:
        raise CLIError("--offload runs its own systems: no --strategies with it.")
    layers = args.offload_layers
    if "auto" in layers and len(layers) > 1:
        raise CLIError("--offload-layers: 'auto' or layer indices, not both.")
    config, started = river_config(args), environment()
    if args.random_model is not None:
        model = random_model(args.random_model, seed=args.seed, device=args.device,
                             dtype=common.random_model_dtype(args))
        prompts = random_prompts(model.config.vocab_size, settings.prompts, args.prompt_length, args.seed, args.device)
        texts, source, model_id = [f"{args.prompt_length} random token ids"] * settings.prompts, "random", \
            f"random:{args.random_model}"
        settings = replace(settings, fidelity_prompts=0)
    else:
        prompt_set = common.load_prompts(args, settings.prompts_used)
        model_id = common.model_id(args)
        model, tokenizer = common.load(args)
        texts, source = prompt_set.prompts, prompt_set.source
        prompts = [build_chat_inputs(tokenizer, text, args.device) for text in texts[:settings.prompts_used]]
    with plain_rounding() if args.random_model is not None else contextlib.nullcontext():  # as bench --random-model
        model = common.build(model, quant_config)
    kernels = twin_description(model)["kernels"]  # the memory subprocesses build the same kernels, unmeasured
    quant = replace(quant_config, backend=kernels[0]) if len(kernels) == 1 else quant_config
    spec = ModelSpec(model=args.model, gguf_file=args.gguf_file, random_model=args.random_model, seed=args.seed,
                     device=args.device, dtype=dtype_name(model), quant=quant.to_dict())
    with common.user_errors():
        record = bench_offload(model, prompts, settings, config, spec, to=args.offload,
                               layers="auto" if layers == ["auto"] else layers, max_share=args.offload_max_share,
                               folder=args.offload_folder, fidelity=args.random_model is None,
                               memory=not args.no_memory)
    record = finish_record(record, model_id, args.device, dtype_name(model), source, texts, common.arguments(args),
                           started)
    output = records.write_record(record, output)
    print(offload_table(record))
    print(f"\nrecord: {output}")
    return 0
