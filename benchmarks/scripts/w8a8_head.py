"""The LM head of exited steps on fbgemm's W8A8 kernel, activations at 7 and at 8 bits, against the default
weight-only 8-bit head: teacher-forced fidelity of the packaged SmolLM2's default river (twins untouched).

    python benchmarks/scripts/w8a8_head.py 20                                   # 20 GSM8K questions
    python benchmarks/scripts/w8a8_head.py 12 benchmarks/prompts/chat.jsonl     # the 12 chat prompts

8-bit activations are only exact on a CPU with AVX512-VNNI (river_hf.kernels.fbgemm_w8a8.w8a8_reduce_range); elsewhere
that row is not meaningful. Results in docs/activations.md.
"""

from __future__ import annotations

import sys

from river_hf.bench.data import load_prompts, read_jsonl_prompts
from river_hf.bench.fidelity import backbone_references, measure_fidelity
from river_hf.core.build import build_river
from river_hf.core.config import RiverQuantConfig
from river_hf.core.settings import RiverSettings
from river_hf.kernels import fbgemm_w8a8
from river_hf.kernels.quantize import RiverQuantLinear
from river_hf.loading.models import build_chat_inputs, load_model_and_tokenizer


def main(count: int, data: str | None) -> None:
    model, tokenizer = load_model_and_tokenizer()
    texts = read_jsonl_prompts(data, count) if data else load_prompts(count).prompts
    references = backbone_references(model, [build_chat_inputs(tokenizer, t)["input_ids"] for t in texts], 64)
    river = build_river(model, RiverQuantConfig(), progress=False)
    head = river.get_output_embeddings()
    weight_only = head.quantized_head
    w8a8 = RiverQuantLinear.from_linear(head.base_head, 8, None, backend="w8a8_cpu", activations="int8")
    machine_setting = fbgemm_w8a8.W8A8_REDUCE_RANGE
    heads = ((f"weight-only ({weight_only.backend})", weight_only, machine_setting),
             ("W8A8, 7-bit activations", w8a8, True), ("W8A8, 8-bit activations", w8a8, False))
    for name, quantized_head, reduce_range in heads:
        head.quantized_head, fbgemm_w8a8.W8A8_REDUCE_RANGE = quantized_head, reduce_range
        for tau in (-1.0, 0.3):
            f = measure_fidelity(river, references, RiverSettings(exit_signal="confidence", tau=tau))
            print(f"{name:26s} tau={tau:5} match={f.match * 100:.2f}% kl={f.kl:.4f}", flush=True)
    head.quantized_head, fbgemm_w8a8.W8A8_REDUCE_RANGE = weight_only, machine_setting


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 8, sys.argv[2] if len(sys.argv) > 2 else None)
