"""Where the river stops paying as the context grows: decode speed and next-token match of the river against the
backbone at 128, 2k and 8k-token prompts, and each one's peak memory while generating at the longest.

    python benchmarks/scripts/context_length.py                       # SmolLM2, 128 / 2048 / 8192 tokens
    python benchmarks/scripts/context_length.py --lengths 128 4096 --tau 0.5 --output record.json

A decode step reads every weight once, but it also reads the whole KV cache in every attention layer: attention's
cost grows with the context while the twins only shrink the linears, so the river's gain falls as the prompt grows.
Prompts are the GSM8K questions the package ships, joined and cut to length (real text, not random ids).
Speed: the two systems take turns after a warm-up (`bench.speed.interleaved`), medians of `--rounds` runs. Match:
teacher-forced next-token agreement with the backbone along its own greedy continuation (`bench.fidelity`).
Memory: each system generates at the longest length in a process of its own while a thread samples its private
anonymous memory (RssAnon, every 2 ms: weights, KV cache, activations; not the libraries and mapped files that VmHWM
also counts). The river's peak is compared with the backbone's peak plus the twins' bytes: the river keeps one KV
cache, never a second copy. VmHWM is kept in the record beside it.
Invariants at the longest length (`--no-checks` skips them): tau > 1 generates the backbone's tokens, every layer's
cache holds every position after random exits (80% of decoded tokens, at random depths), and lossless decoding
generates the backbone's tokens.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

import torch
from transformers import GenerationConfig

from river_hf import RiverConfig, RiverQuantConfig, river_layers
from river_hf.bench.data import load_prompts
from river_hf.bench.fidelity import backbone_references, measure_fidelity
from river_hf.bench.memory import AnonSampler, proc_status, reset_peak
from river_hf.bench.speed import interleaved
from river_hf.cli.stored_twins import build_river_cached
from river_hf.core.freed_memory import release_freed_memory
from river_hf.core.settings import DEFAULT_TAUS, RiverSettings
from river_hf.core.twins import twin_linears
from river_hf.kernels.machine import cpu_description
from river_hf.loading.models import load_model_and_tokenizer


def prompt_ids(tokenizer, length: int) -> torch.Tensor:
    """[1, length] ids of the shipped GSM8K questions, joined (repeated if need be) and cut to `length` tokens."""
    text = "\n\n".join(load_prompts(1319).prompts)
    ids = tokenizer(text, return_tensors="pt").input_ids
    while ids.shape[1] < length:
        ids = torch.cat([ids, ids], dim=1)
    return ids[:, :length]


def twin_bytes(model) -> int:
    return sum(buffer.numel() * buffer.element_size() for layer in river_layers(model) if layer.twin is not None
               for linear in twin_linears(layer.twin) for buffer in linear.buffers())


def kv_bytes(model, length: int) -> int:
    config = model.config.get_text_config(decoder=True)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    element = next(model.parameters()).element_size()
    return 2 * config.num_hidden_layers * length * config.num_key_value_heads * head_dim * element


def memory_child(model_id: str | None, system: str, length: int, tau: float) -> dict:
    """One system's peak memory while generating 8 tokens after a `length`-token prompt (this process)."""
    model, tokenizer = load_model_and_tokenizer(model_id, dtype=torch.bfloat16)
    config = GenerationConfig(max_new_tokens=8, do_sample=False)
    if system == "river":
        build_river_cached(model, RiverQuantConfig(), progress=False)
        config = RiverConfig(tau=tau, max_new_tokens=8, do_sample=False)
    ids = prompt_ids(tokenizer, length)
    release_freed_memory()
    reset_peak()  # VmHWM from here: the build's own peak does not count
    before = proc_status()
    sampler = AnonSampler()
    sampler.start()
    model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    peaks = sampler.stop()
    return {"rss_before_bytes": before["VmRSS"], "anon_before_bytes": before["RssAnon"],
            "peak_anon_bytes": peaks["RssAnon"], "peak_bytes": proc_status()["VmHWM"],
            "twin_bytes": twin_bytes(model) if system == "river" else 0, "kv_bytes": kv_bytes(model, length + 8)}


def peak_memory(model_id: str | None, length: int, tau: float) -> dict:
    results = {}
    for system in ("backbone", "river"):
        done = subprocess.run([sys.executable, __file__, "--child", system, "--lengths", str(length),
                               "--tau", str(tau)] + (["--model", model_id] if model_id else []),
                              capture_output=True, text=True, check=True, timeout=3600)
        results[system] = json.loads(done.stdout.strip().splitlines()[-1])
    backbone, river, twins = results["backbone"], results["river"], results["river"]["twin_bytes"]
    return {**results, "river_minus_backbone_anon_bytes": river["peak_anon_bytes"] - backbone["peak_anon_bytes"],
            "river_anon_vs_backbone_plus_twins": river["peak_anon_bytes"] / (backbone["peak_anon_bytes"] + twins),
            "river_minus_backbone_bytes": river["peak_bytes"] - backbone["peak_bytes"],
            "river_peak_vs_backbone_plus_twins": river["peak_bytes"] / (backbone["peak_bytes"] + twins)}


def invariants(model, length: int, tokenizer) -> dict:
    """The river's promises on one `length`-token prompt (each generate prefills it once)."""
    ids = prompt_ids(tokenizer, length)
    fixed = {"max_new_tokens": 8, "min_new_tokens": 8, "do_sample": False, "return_dict_in_generate": True}

    def run(config):
        return model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)

    backbone = run(GenerationConfig(**fixed)).sequences
    exits = run(RiverConfig(exit_signal="random", exit_rate=0.8, seed=0, **fixed)).past_key_values
    decoded = exits.exit_depth[:, exits.prompt_length:]
    return {"length": length, "new_tokens": fixed["max_new_tokens"],
            "tau_above_1_is_backbone": torch.equal(run(RiverConfig(tau=1.5, **fixed)).sequences, backbone),
            "kv_integrity_errors": exits.kv_integrity_errors(),
            "decoded_exit_depths": decoded[0].tolist(), "prompt_exit_depth": int(exits.exit_depth[0, 0]),
            "lossless_is_backbone": torch.equal(
                run(RiverConfig(tau=-1, lossless=True, draft_fallback=False, **fixed)).sequences, backbone)}


def speed_and_match(model, tokenizer, lengths: list[int], new_tokens: int, rounds: int, tau: float) -> dict:
    fixed = {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens, "do_sample": False}
    systems = {"backbone": GenerationConfig(**fixed), "river": RiverConfig(tau=tau, **fixed)}
    settings = RiverSettings(tau=tau)
    table = {}
    for length in lengths:
        ids = prompt_ids(tokenizer, length)
        timings = interleaved(model, systems, [{"input_ids": ids, "attention_mask": torch.ones_like(ids)}],
                              rounds=rounds)
        rate = {name: statistics.median(t.decode_tokens_per_s for t in runs) for name, runs in timings.items()}
        prefill = {name: statistics.median(t.prefill_s for t in runs) for name, runs in timings.items()}
        fidelity = measure_fidelity(model, backbone_references(model, [ids], new_tokens), settings)
        table[length] = {"backbone_tokens_per_s": rate["backbone"], "river_tokens_per_s": rate["river"],
                         "speedup": rate["river"] / rate["backbone"], "backbone_prefill_s": prefill["backbone"],
                         "river_prefill_s": prefill["river"], "match": fidelity.match,
                         "mean_exit_depth": fidelity.mean_exit_depth}
    return table


def print_tables(record: dict) -> None:
    print(f"{record['machine']['cpu_model']} ({record['machine']['cpu_capability']}), "
          f"{record['machine']['torch_threads']} threads; tau={record['tau']} ({record['exit_signal']}); "
          f"{record['new_tokens']} new tokens, {record['rounds']} rounds")
    if record["speed"]:
        print("| prompt tokens | backbone tok/s | river tok/s | river / backbone | match | mean exit depth | "
              "prompt s (backbone / river) |\n|---:|---:|---:|---:|---:|---:|---:|")
    for length, row in record["speed"].items():
        print(f"| {length} | {row['backbone_tokens_per_s']:.1f} | {row['river_tokens_per_s']:.1f} | "
              f"{row['speedup']:.2f}x | {row['match']:.1%} | {row['mean_exit_depth']:.1f} | "
              f"{row['backbone_prefill_s']:.2f} / {row['river_prefill_s']:.2f} |")
    if record.get("checks"):
        checks = record["checks"]
        print(f"\nat {checks['length']} tokens: tau>1 is the backbone: {checks['tau_above_1_is_backbone']}; "
              f"KV whole after random exits (decoded depths {checks['decoded_exit_depths']}): "
              f"{not checks['kv_integrity_errors']}; lossless is the backbone: {checks['lossless_is_backbone']}")
    if record.get("memory"):
        memory = record["memory"]
        for kind, peak in (("private (RssAnon)", "peak_anon_bytes"), ("resident (VmHWM)", "peak_bytes")):
            mib = {name: memory[name][peak] / 2**20 for name in ("backbone", "river")}
            ratio = memory["river_anon_vs_backbone_plus_twins" if peak == "peak_anon_bytes"
                          else "river_peak_vs_backbone_plus_twins"]
            print(f"peak {kind} memory at {record['memory_length']} tokens: backbone {mib['backbone']:.0f} MiB, "
                  f"river {mib['river']:.0f} MiB (twins {memory['river']['twin_bytes'] / 2**20:.0f} MiB, one KV "
                  f"cache {memory['river']['kv_bytes'] / 2**20:.0f} MiB): river / (backbone + twins) = {ratio:.3f}")


def fitted_lengths(lengths: list[int], config, new_tokens: int) -> list[int]:
    """`lengths`, each cut so that prompt + new tokens fit the model's positions (SmolLM2: 8192 in all): past them a
    model runs on positions it was never trained on, and transformers warns that it may fail."""
    positions = getattr(config, "max_position_embeddings", None)
    if positions is None:
        return lengths
    fitted = [min(length, positions - new_tokens) for length in lengths]
    if fitted != lengths:
        print(f"prompt lengths {lengths} cut to {fitted}: the model has {positions} positions and each prompt is "
              f"followed by {new_tokens} new tokens")
    return fitted


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 2048, 8192])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tau", type=float, default=DEFAULT_TAUS[RiverSettings().exit_signal],
                        help="The default signal's tau (default: its measured default, what tau='auto' takes where "
                             "exiting pays).")
    parser.add_argument("--no-memory", action="store_true", help="Skip the peak-memory processes.")
    parser.add_argument("--no-checks", action="store_true", help="Skip the invariants at the longest length.")
    parser.add_argument("--no-speed", action="store_true", help="Skip the speed and match table.")
    parser.add_argument("--model", default=None, help="A hub id or local path (default: the packaged SmolLM2).")
    parser.add_argument("--output", default=None, help="Write the record (JSON) here.")
    parser.add_argument("--child", choices=("backbone", "river"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(memory_child(args.model, args.child, args.lengths[-1], args.tau)))
        return {}

    model, tokenizer = load_model_and_tokenizer(args.model, dtype=torch.bfloat16)
    args.lengths = fitted_lengths(args.lengths, model.config, args.new_tokens)
    build_river_cached(model, RiverQuantConfig(), progress=False)
    record = {"machine": cpu_description(), "torch": torch.__version__, "tau": args.tau,
              "exit_signal": RiverSettings().exit_signal, "new_tokens": args.new_tokens, "rounds": args.rounds,
              "speed": {} if args.no_speed else speed_and_match(model, tokenizer, args.lengths, args.new_tokens,
                                                                 args.rounds, args.tau)}
    if not args.no_checks:
        record["checks"] = invariants(model, max(args.lengths), tokenizer)
    if not args.no_memory:
        del model
        release_freed_memory()
        record["memory_length"] = max(args.lengths)
        record["memory"] = peak_memory(args.model, max(args.lengths), args.tau)
    print_tables(record)
    if args.output:
        with open(args.output, "w") as file:
            json.dump(record, file, indent=1)
    return record


if __name__ == "__main__":
    main()
