"""Why lossless mode verifies row by row: one backbone pass over k + 1 tokens against k + 1 one-token steps,
bit for bit.

    python benchmarks/scripts/verify_rows.py [--model PATH] [--dtype bfloat16] [--rows 5] [--repeats 15]
    python benchmarks/scripts/verify_rows.py --gsm8k 3 --offsets 0,6,12,18,24,30,36,42,48,54,60,66

After one prompt, the same k + 1 tokens are computed (a) as k + 1 one-token steps, as plain generate does, then as
one pass: (b) batched, as transformers' assisted decoding verifies; (c) with only attention row by row; (d) with only
the linears row by row; (e) with `river_hf.lossless.exact_rows` (lossless mode's default: attention row by row, and the
linears whose kernel the probe finds not batch-invariant at this shape). Per variant: how many logits and cached
K/V elements differ from (a), and the pass's median time over `--repeats` (interleaved; time it on a quiet machine).

`--gsm8k N --offsets ...` checks real text instead: the N-th GSM8K prompt (chat template) followed by the model's own
greedy continuation; at each offset t, the prompt plus t generated tokens is the context and the next `--rows` tokens
are the rows, and only (b) and (e) are compared (no timing). A kernel that is batch-invariant on most inputs but not
all shows up here (benchmarks/zen4.md#lossless-mode).
"""

from __future__ import annotations

import argparse
import statistics
import time
from contextlib import nullcontext

import torch
from transformers import DynamicCache

from river_hf.lossless.exact_rows import ExactRows
from river_hf.loading.models import load_model_and_tokenizer

PROMPT = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many "
          "clips did Natalia sell altogether in April and May?")


def variants(model, rows: int) -> dict:
    """name -> a context for the pass (None: the one-token steps)."""
    exact = ExactRows(model)
    attention_only, linears_only = ExactRows(model), ExactRows(model)
    attention_only._apart = {rows: []}
    linears_only.configs, linears_only._apart = [], {rows: linears_only.linears}
    return {"one-token steps": None, "one pass, batched": nullcontext, "one pass, attention by row":
            lambda: attention_only.rows(rows), "one pass, linears by row": lambda: linears_only.rows(rows),
            "one pass, river_hf.lossless.exact_rows": lambda: exact.rows(rows)}


def real_text(model, tokenizer, number: int, offsets: list[int], rows: int) -> dict:
    """(b) and (e) against one-token steps on the `number`-th GSM8K prompt, at each offset into its continuation."""
    from river_hf.bench.data import load_prompts
    from river_hf.loading.models import build_chat_inputs

    prompt_ids = build_chat_inputs(tokenizer, load_prompts(number).prompts[number - 1])["input_ids"]
    start = prompt_ids.shape[1]
    with torch.no_grad():
        text = model.generate(input_ids=prompt_ids, attention_mask=torch.ones_like(prompt_ids), do_sample=False,
                              max_new_tokens=max(offsets) + rows, min_new_tokens=max(offsets) + rows)
    exact = ExactRows(model)
    run(model, prompt_ids, text[:, start:start + rows], None)  # warm-up (see main)
    print(f"cpu capability: {torch.backends.cpu.get_cpu_capability()}; threads {torch.get_num_threads()}; "
          f"{rows} rows; GSM8K prompt {number} ({start} tokens) and its greedy continuation")
    print("| context tokens | exact_rows: logits differing | K/V differing | batched: logits differing |")
    print("|---:|---:|---:|---:|")
    results = {}
    for offset in offsets:
        context, tokens = text[:, :start + offset], text[:, start + offset:start + offset + rows]
        reference = run(model, context, tokens, None)
        exact_result = differing(reference, run(model, context, tokens, lambda: exact.rows(rows)))
        batched = differing(reference, run(model, context, tokens, nullcontext))
        print(f"| {start + offset} | {exact_result['logits_differing']} of {exact_result['logits']} | "
              f"{exact_result['kv_differing']} | {batched['logits_differing']} |")
        results[start + offset] = {"exact_rows": exact_result, "batched": batched}
    return results


@torch.no_grad()
def run(model, prompt_ids, tokens, context) -> tuple[torch.Tensor, DynamicCache, float]:
    """(logits [rows, V], cache, seconds of the rows' passes) for `tokens` after the prompt."""
    cache = DynamicCache(config=model.config)
    model(input_ids=prompt_ids, past_key_values=cache)
    start, rows = prompt_ids.shape[1], tokens.shape[1]
    began = time.perf_counter()
    if context is None:
        logits = torch.cat([model(input_ids=tokens[:, r:r + 1], past_key_values=cache,
                                  position_ids=torch.tensor([[start + r]])).logits[0] for r in range(rows)])
    else:
        with context():
            logits = model(input_ids=tokens, past_key_values=cache,
                           position_ids=torch.arange(start, start + rows)[None], logits_to_keep=rows).logits[0]
    return logits, cache, time.perf_counter() - began


def differing(reference, other) -> dict:
    (ref_logits, ref_cache, _), (logits, cache, _) = reference, other
    kv = sum(int((a.keys != b.keys).sum() + (a.values != b.values).sum())
             for a, b in zip(ref_cache.layers, cache.layers, strict=True))
    return {"logits_differing": int((ref_logits != logits).sum()), "logits": ref_logits.numel(), "kv_differing": kv}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a hub id or local path (default: the packaged SmolLM2)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--rows", type=int, default=5, help="k + 1: the drafts and the last committed token")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--gsm8k", type=int, default=None, metavar="N", help="check the N-th GSM8K prompt's text")
    parser.add_argument("--offsets", default="0,6,12", help="with --gsm8k: generated tokens before the rows")
    args = parser.parse_args(argv)
    if args.gsm8k is not None and args.gsm8k < 1:
        parser.error(f"--gsm8k {args.gsm8k}: GSM8K prompts are numbered from 1")
    try:
        offsets = [int(t) for t in args.offsets.split(",")]
    except ValueError:
        parser.error(f"--offsets {args.offsets!r}: give whole numbers separated by commas, e.g. 0,6,12")
    model, tokenizer = load_model_and_tokenizer(args.model, dtype=getattr(torch, args.dtype))
    if args.gsm8k is not None:
        return real_text(model, tokenizer, args.gsm8k, offsets, args.rows)
    prompt_ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    tokens = torch.randint(100, min(20000, model.config.vocab_size), (1, args.rows),
                           generator=torch.Generator().manual_seed(0))
    contexts = variants(model, args.rows)
    # warm-up: on an AMX CPU (Intel Xeon, torch AVX512) a process's first passes rounded differently from every later
    # one (its reference then differed from a second run of itself in 200801 of 245760 logits), so compare warm passes
    run(model, prompt_ids, tokens, None)
    reference = run(model, prompt_ids, tokens, None)
    results = {name: differing(reference, run(model, prompt_ids, tokens, context))
               for name, context in contexts.items()}
    seconds = {name: [] for name in contexts}
    for _ in range(args.repeats):
        for name, context in contexts.items():
            seconds[name].append(run(model, prompt_ids, tokens, context)[2])
    print(f"cpu capability: {torch.backends.cpu.get_cpu_capability()}; threads {torch.get_num_threads()}; "
          f"{args.dtype}; {args.rows} rows after a {prompt_ids.shape[1]}-token prompt")
    print("| pass | logits differing from one-token steps | K/V elements differing | ms (median) |")
    print("|---|---:|---:|---:|")
    for name, result in results.items():
        result["ms"] = 1000 * statistics.median(seconds[name])
        print(f"| {name} | {result['logits_differing']} of {result['logits']} | {result['kv_differing']} | "
              f"{result['ms']:.1f} |")
    return results


if __name__ == "__main__":
    main()
