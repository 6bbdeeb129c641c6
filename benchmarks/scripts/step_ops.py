"""Where a captured decode step's time goes, op by op: the compiled backbone against full quantization captured, on the
packaged SmolLM2 with the default twins (issue 31's "where the step's time goes", finer than captured_decode.py's
three-part split).

    python benchmarks/scripts/step_ops.py            # ms and calls per decoded token, by op (torch.profiler self CPU)
    python benchmarks/scripts/step_ops.py --sdpa     # + one attention call's µs after each kind of matmul

Each system: one warm-up generate (it compiles), then a generate of 64 new tokens and one of 1 under torch.profiler;
their difference over 63 steps is a decoded token's share of each op, so the prompt's cancels. `--sdpa` times
`scaled_dot_product_attention` at SmolLM2's decode shape (9 heads, 101 positions, bf16) right after nothing, a bf16
GEMV and an int8pack GEMV (576x1536), 2000 calls each, three interleaved rounds, median µs.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
import torch.nn.functional as F

from river_hf import RiverQuantConfig, build_river
from river_hf.loading.models import build_chat_inputs, load_model_and_tokenizer

from captured_decode import CHAT, systems


def op_table(model, inputs: dict, config, tokens: int = 64) -> dict[str, tuple[float, float]]:
    """{op: (ms per decoded token, calls per decoded token)}, self CPU time."""
    model.generate(**inputs, generation_config=copy.deepcopy(config))  # compiles
    tables = {}
    for n in (tokens, 1):
        run = copy.deepcopy(config)
        run.max_new_tokens = run.min_new_tokens = n
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
            model.generate(**inputs, generation_config=run)
        tables[n] = {event.key: (event.self_cpu_time_total, event.count) for event in profiler.key_averages()}
    steps = tokens - 1
    return {op: ((micros - tables[1].get(op, (0, 0))[0]) / steps / 1e3, (calls - tables[1].get(op, (0, 0))[1]) / steps)
            for op, (micros, calls) in tables[tokens].items()}


def sdpa_after(rounds: int = 3, calls: int = 2000) -> dict[str, list[float]]:
    """Median µs of one decode-shaped attention call right after each kind of GEMV, per round."""
    q = torch.randn(1, 9, 1, 64, dtype=torch.bfloat16)
    k, v = (torch.randn(1, 9, 101, 64, dtype=torch.bfloat16) for _ in range(2))
    mask = torch.ones(1, 1, 1, 101, dtype=torch.bool)
    x, w = torch.randn(1, 576, dtype=torch.bfloat16), torch.randn(1536, 576, dtype=torch.bfloat16)
    w8, s8 = torch.randint(-128, 127, (1536, 576), dtype=torch.int8), torch.rand(1536, dtype=torch.bfloat16)
    before = {"nothing": lambda: None, "a bf16 GEMV": lambda: torch.mm(x, w.t()),
              "an int8pack GEMV": lambda: torch._weight_int8pack_mm(x, w8, s8)}
    results = {name: [] for name in before}
    for _ in range(rounds):
        for name, call in before.items():
            times = []
            for _ in range(calls):
                call()
                started = time.perf_counter()
                F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
                times.append(time.perf_counter() - started)
            results[name].append(statistics.median(times) * 1e6)
    return results


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sdpa", action="store_true")
    parser.add_argument("--top", type=int, default=25, help="ops shown per system")
    args = parser.parse_args(argv)
    model, tokenizer = load_model_and_tokenizer(None, dtype=torch.bfloat16)
    model = build_river(model, RiverQuantConfig(), progress=False)
    inputs = build_chat_inputs(tokenizer, CHAT[0])
    configs = systems(argparse.Namespace(skip_module_guards=False, cpp_wrapper=False, mode=None, max_new_tokens=64,
                                         tau=0.3))
    for name in ("backbone compiled", "full quantization captured"):
        table = op_table(model, inputs, configs[name])
        print(f"== {name}: ms per decoded token by op (self CPU), calls per token; all ops: "
              f"{sum(ms for ms, _ in table.values()):.2f} ms")
        for op, (ms, calls) in sorted(table.items(), key=lambda item: -item[1][0])[:args.top]:
            print(f"{ms:8.3f} {calls:7.1f}  {op[:100]}", flush=True)
    if args.sdpa:
        for name, micros in sdpa_after().items():
            print(f"attention call after {name}: {', '.join(f'{m:.1f}' for m in micros)} µs", flush=True)


if __name__ == "__main__":
    main()
