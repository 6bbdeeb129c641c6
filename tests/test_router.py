"""The exit decision on hand-made hidden states: signals, the batch-min policy, prefill vs decode."""

from __future__ import annotations

import pytest
import torch

from river_hf import RiverSettings
from river_hf.core.exit_decision import ExitRouter
from river_hf.core.signals import batch_passes, min_token_cosine, sequence_similarity, token_similarity
from river_hf.core.signals import Cosine, CosineAtOneLayer, PreviousConfidence, RandomExit, UpdateNorm

from conftest import run_step, states_with_cosines


def test_token_similarity_is_the_cosine_of_the_last_position():
    h_in, h_out = states_with_cosines([0.2, 0.9])
    assert torch.allclose(token_similarity(h_in, h_out), torch.tensor([0.2, 0.9]), atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fast_decode_cosine_is_the_batch_minimum_of_the_cosine(dtype):
    generator = torch.Generator().manual_seed(0)
    h_in = torch.randn(3, 1, 64, generator=generator).to(dtype)
    h_out = (h_in.float() + torch.randn(3, 1, 64, generator=generator) * torch.tensor([0.1, 2.0, 0.5])[:, None, None])
    h_out = h_out.to(dtype)
    cosines = token_similarity(h_in, h_out)
    assert min_token_cosine(h_in, h_out) == pytest.approx(cosines.min().item(), abs=1e-6)
    assert min_token_cosine(h_in[:1], h_out[:1]) == pytest.approx(cosines[0].item(), abs=1e-6)
    longer = torch.cat([torch.zeros_like(h_in), h_in], dim=1), torch.cat([h_out, h_out], dim=1)
    assert min_token_cosine(*longer) == pytest.approx(cosines.min().item(), abs=1e-6)  # the last position only
    assert min_token_cosine(torch.zeros_like(h_in), h_out) == 0.0  # a zero vector scores 0, like F.cosine_similarity


def test_sequence_similarity_ignores_padding():
    h_in = torch.cat([states_with_cosines([0.0])[0]] * 3, dim=1)  # [1, 3, D]
    h_out = torch.cat([states_with_cosines([c])[1] for c in (-1.0, 0.5, 0.7)], dim=1)
    mask = torch.tensor([[0, 1, 1]])
    assert sequence_similarity(h_in, h_out, mask).item() == pytest.approx(0.6, abs=1e-6)
    assert sequence_similarity(h_in, h_out, None).item() == pytest.approx(0.2 / 3, abs=1e-6)


def test_batch_min_needs_every_row():
    assert batch_passes(torch.tensor([0.95, 0.99]), 0.9)
    assert not batch_passes(torch.tensor([0.95, 0.85]), 0.9)
    with pytest.raises(ValueError, match="`exit_policy`"):
        batch_passes(torch.tensor([1.0]), 0.9, policy="any")


def test_decode_exits_after_the_first_layer_whose_batch_min_passes():
    router = ExitRouter(RiverSettings(exit_signal="cosine", tau=0.9), start_layer=1, num_layers=5)
    assert run_step(router, [[0.1, 0.2], [0.95, 0.5], [0.95, 0.93], [0.99, 0.99]]) == 3


def test_no_exit_before_start_layer_nor_after_the_last_layer():
    router = ExitRouter(RiverSettings(exit_signal="cosine", tau=0.5), start_layer=3, num_layers=4)
    assert run_step(router, [[0.9], [0.9], [0.9], [0.9]]) == 3  # layers 0, 1 pass but have no twin after them
    assert run_step(router, [[0.1], [0.1], [0.1], [0.99]]) == 4  # passing at the last layer is not an exit


def test_tau_extremes():
    never = ExitRouter(RiverSettings(exit_signal="cosine", tau=1.01), start_layer=1, num_layers=4)
    assert run_step(never, [[1.0]] * 4) == 4
    always = ExitRouter(RiverSettings(exit_signal="cosine", tau=-1), start_layer=2, num_layers=4)
    assert run_step(always, [[-1.0]] * 4) == 2


def test_prefill_uses_the_fixed_or_no_exit():
    assert run_step(ExitRouter(RiverSettings(exit_signal="cosine", tau=-1, prefill_exit="none"), 1, 4), [[0.0]] * 4, 5,
                    first=True) == 4
    assert run_step(ExitRouter(RiverSettings(exit_signal="cosine", tau=-1, prefill_exit=3), 1, 4), [[0.0]] * 4, 5,
                    first=True) == 3
    # a fixed prefill exit below start_layer is lifted to start_layer
    assert run_step(ExitRouter(RiverSettings(exit_signal="cosine", tau=2, prefill_exit=1), 2, 4), [[0.0]] * 4, 5,
                    first=True) == 2
    # and a decode step after it is token-level again
    router = ExitRouter(RiverSettings(exit_signal="cosine", tau=0.5, prefill_exit="none"), 1, 4)
    assert run_step(router, [[0.9]] * 4, 5, first=True) == 4
    assert run_step(router, [[0.9]] * 4) == 1


def test_the_router_asks_the_signal_its_settings_name():
    kinds = {"cosine": Cosine, "cosine_first": CosineAtOneLayer, "update_norm": UpdateNorm, "random": RandomExit}
    assert type(ExitRouter(RiverSettings(tau=0.9), 1, 4).signal) is PreviousConfidence  # the default
    assert type(ExitRouter(RiverSettings(exit_signal="cosine", tau=0.9), 1, 4).signal) is Cosine  # the paper's
    for name, kind in kinds.items():
        settings = RiverSettings(tau=0.9, exit_signal=name, exit_rate=0.5, seed=0)
        assert type(ExitRouter(settings, 1, 4).signal) is kind


def test_a_cosine_decision_reads_the_host_once(monkeypatch):
    """The cosine runs after every layer of every decoded token: one host read (`.item()` / `.tolist()`) per
    decision."""
    reads = []
    item, tolist = torch.Tensor.item, torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "item", lambda self: reads.append(1) or item(self))
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: reads.append(1) or tolist(self))
    router = ExitRouter(RiverSettings(exit_signal="cosine", tau=0.9), start_layer=1, num_layers=5)
    assert run_step(router, [[0.1, 0.2], [0.95, 0.5], [0.95, 0.93], [0.99, 0.99]]) == 3
    assert len(reads) == 3  # depths 1, 2, 3
