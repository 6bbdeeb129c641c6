"""The byte limit (river_hf.bench.bytes): expected numbers computed here from the tiny model's parameter shapes."""

import pytest
import torch
from conftest import river_of, tiny_model
from torch import nn

from river_hf.bench.bytes import (
    add_byte_limits,
    byte_limit_lines,
    byte_table,
    read_bytes,
    system_bytes,
)
from river_hf.bench.systems import static_full_quant
from river_hf.kernels.quantize import RiverQuantLinear

FP32 = 4


def linear_shapes(config):
    """(out, in) of every linear in one Llama decoder layer."""
    h, i, d = config.hidden_size, config.intermediate_size, config.head_dim
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
    return [(q, h), (kv, h), (kv, h), (h, q), (i, h), (i, h), (h, i)]


def layer_bytes(config) -> int:
    norms = 2 * config.hidden_size
    return FP32 * (sum(n * k for n, k in linear_shapes(config)) + norms)


def int4_twin_bytes(config, group: int = 64) -> int:
    # int4pack_cpu: two codes per byte, and a bf16 (scale, zero) pair per group and row; the norms are shared (fp32)
    linears = sum(n * k // 2 + (k // group) * n * 2 * 2 for n, k in linear_shapes(config))
    return linears + FP32 * 2 * config.hidden_size


def int8_bytes(n: int, k: int) -> int:
    return n * k + 2 * 2 * n  # int8 codes, bf16 kernel_scale and zero_shift per row


@pytest.fixture(scope="module")
def tied():
    return tiny_model("llama", tie_word_embeddings=True)


def test_backbone_reads_every_layer_one_embedding_row_and_the_whole_tied_head(tied):
    c = tied.config
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    outside = FP32 * c.hidden_size * 2  # one embedding row + the final norm
    head = FP32 * c.vocab_size * c.hidden_size
    assert system_bytes(tied, None) == c.num_hidden_layers * layer_bytes(c) + outside + head


def test_river_depths_read_backbone_then_twins_and_the_quantized_head_once_exited():
    model = tiny_model("llama", tie_word_embeddings=True)
    c = model.config
    river = river_of(model, start_layer=2, group_size=64, quantize_lm_head=True, lm_head_nbits=8)
    table = byte_table(river)
    outside, head = FP32 * c.hidden_size * 2, FP32 * c.vocab_size * c.hidden_size
    qhead = int8_bytes(c.vocab_size, c.hidden_size)
    assert table.twin_layers[:2] == table.backbone_layers[:2] == [layer_bytes(c)] * 2
    assert table.twin_layers[2:] == [int4_twin_bytes(c)] * (c.num_hidden_layers - 2)
    at2 = 2 * layer_bytes(c) + 4 * int4_twin_bytes(c) + outside + qhead
    at6 = 6 * layer_bytes(c) + outside + head
    assert table.at_depth(2) == at2 and table.at_depth(6) == at6
    assert system_bytes(river, {"2": 3, "6": 1}) == pytest.approx((3 * at2 + at6) / 4)
    assert system_bytes(river, None) == at6  # the backbone system on the river model
    # the static reference runs the twins without a router, on the full head (plain generate)
    assert system_bytes(static_full_quant(river), None) == 2 * layer_bytes(c) + 4 * int4_twin_bytes(c) + outside + head


def test_quantized_linears_count_what_their_kernel_reads():
    torch.manual_seed(0)
    linear = nn.Linear(128, 64, bias=True)
    int8 = RiverQuantLinear.from_linear(linear, nbits=8, group_size=None, backend="int8pack_cpu")
    assert read_bytes(int8) == int8_bytes(64, 128) + FP32 * 64  # + the fp32 bias; HQQ's scale/zero are not read
    with pytest.warns(UserWarning, match="'hqq' was asked for"):
        hqq = RiverQuantLinear.from_linear(linear, nbits=4, group_size=64, backend="hqq")
    assert read_bytes(hqq) == 64 * 128 + 2 * FP32 * 64 * 2 + FP32 * 64  # codes + fp32 scale/zero per group + bias


def test_byte_ratio_and_share_of_the_limit(monkeypatch):
    records = [{"name": "backbone", "kind": "backbone", "summary": {"speed_ratio": 1.0, "exit_depth_histogram": None}},
               {"name": "static", "kind": "static-full-quant",
                "summary": {"speed_ratio": 1.5, "exit_depth_histogram": None}}]
    big, small = nn.Module(), nn.Module()
    sizes = iter([400.0, 100.0])
    monkeypatch.setattr("river_hf.bench.bytes.system_bytes", lambda model, histogram: next(sizes))
    add_byte_limits(records, [big, small])
    assert records[0]["summary"]["byte_ratio"] == 1.0 and records[0]["summary"]["share_of_byte_limit"] == 1.0
    assert records[1]["summary"]["byte_ratio"] == 4.0
    assert records[1]["summary"]["share_of_byte_limit"] == pytest.approx(1.5 / 4)
    lines = byte_limit_lines(records)
    assert len(lines) == 2 and "byte limit 4.00x, measured 1.50x = 38% of it" in lines[1]
