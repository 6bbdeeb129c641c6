"""bench.step_split: a decode step's time split into matmuls, the rest of the layers, routing and the outside."""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig

from river_hf import RiverConfig
from river_hf.bench.step_split import PARTS, step_split
from river_hf.bench.systems import static_full_quant

from conftest import river_of, tiny_model

FIXED = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False)


@pytest.fixture(scope="module")
def river():
    return river_of(tiny_model(), start_layer=1, group_size=32)


def inputs():
    ids = torch.randint(3, 256, (1, 7), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


@pytest.mark.parametrize("config", [GenerationConfig(**FIXED), RiverConfig(tau=-1, exit_signal="cosine", **FIXED),
                                    RiverConfig(tau=0.5, exit_signal="cosine", **FIXED)])
def test_the_parts_add_up_to_the_decode_time_and_the_matmuls_are_counted(river, config):
    split = step_split(river, inputs(), config)
    assert set(split) == {*PARTS, "total"}
    assert sum(split[part] for part in PARTS) == pytest.approx(split["total"], rel=1e-6)
    assert split["matmuls"] > 0 and split["rest_of_layers"] > 0 and split["routing"] >= 0
    assert split["outside_layers"] > 0  # the LM head, sampling and the generate loop run every step


def test_a_plain_model_has_no_routing_and_the_hooks_go_away(river):
    static = static_full_quant(river)
    split = step_split(static, inputs(), GenerationConfig(**FIXED))
    assert split["routing"] == 0.0
    assert not any(module._forward_hooks or module._forward_pre_hooks for module in static.model.layers.modules())
