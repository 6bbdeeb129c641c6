"""HQQ's optimizer against plain min-max rounding for 8-bit twins: teacher-forced fidelity on the packaged SmolLM2.

    python benchmarks/scripts/rounding_8bit.py 20                                   # 20 GSM8K questions
    python benchmarks/scripts/rounding_8bit.py 12 benchmarks/prompts/chat.jsonl     # the 12 chat prompts

Twins: the defaults (`nbits="auto"`), all 8-bit from layer 1, all 8-bit from layer 2; each built twice, with HQQ's
optimizer at every width ("hqq", what build_river does) and with it skipped for the 8-bit layers and the 8-bit head
("plain8": min-max rounding per row, `river_hf.kernels.quantize.plain_rounding`). Fidelity as `river-hf bench`
measures it (river_hf.bench.fidelity: 64 tokens of the backbone's greedy continuation per prompt), at tau=-1 (every
token on the twins) and at the default confidence tau 0.3. Records: benchmarks/avx512/rounding-8bit-*.txt.
"""

from __future__ import annotations

import copy
import sys

from river_hf.bench.data import load_prompts, read_jsonl_prompts
from river_hf.bench.fidelity import backbone_references, measure_fidelity
from river_hf.core.build import build_river
from river_hf.core.config import RiverQuantConfig
from river_hf.core.settings import RiverSettings
from river_hf.kernels import quantize
from river_hf.loading.models import build_chat_inputs, load_model_and_tokenizer

TWINS = {"defaults": {}, "all8 from1": {"nbits": 8, "group_size": None, "start_layer": 1},
         "all8 from2": {"nbits": 8, "group_size": None, "start_layer": 2}}
optimized_quantize = quantize.hqq_quantize


def plain_8bit_quantize(weight, nbits, group_size):
    if nbits != 8:
        return optimized_quantize(weight, nbits, group_size)
    with quantize.plain_rounding():
        return optimized_quantize(weight, nbits, group_size)


def main(count: int, data: str | None) -> None:
    model, tokenizer = load_model_and_tokenizer()
    texts = read_jsonl_prompts(data, count) if data else load_prompts(count).prompts
    references = backbone_references(model, [build_chat_inputs(tokenizer, t)["input_ids"] for t in texts], 64)
    for mode, quantizer in (("hqq", optimized_quantize), ("plain8", plain_8bit_quantize)):
        quantize.hqq_quantize = quantizer  # RiverQuantLinear.from_linear looks it up at each call
        for name, twins in TWINS.items():
            river = build_river(copy.deepcopy(model), RiverQuantConfig(**twins), progress=False)
            for tau in (-1.0, 0.3):
                f = measure_fidelity(river, references, RiverSettings(exit_signal="confidence", tau=tau))
                print(f"{mode:7s} {name:11s} tau={tau:5} match={f.match * 100:.2f}% kl={f.kl:.4f} "
                      f"depth={f.mean_exit_depth:.1f}", flush=True)
    quantize.hqq_quantize = optimized_quantize


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 8, sys.argv[2] if len(sys.argv) > 2 else None)
