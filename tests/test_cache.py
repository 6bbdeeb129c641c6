"""RiverCache: the exit record follows every batch operation, and statistics are computed from it."""

from __future__ import annotations

import pytest
import torch

from river_hf import RiverCache


def filled_cache(batch=3, steps=(4, 1, 1, 1), num_layers=2) -> RiverCache:
    cache = RiverCache(num_layers=num_layers)
    for step, length in enumerate(steps):
        for layer in range(num_layers):
            kv = torch.randn(batch, 2, length, 8)
            cache.update(kv, kv.clone(), layer)
        cache.record_step(depth=step % num_layers + 1, batch_size=batch, num_tokens=length, device=torch.device("cpu"))
    return cache


def test_exit_record_and_statistics():
    cache = filled_cache()
    assert cache.exit_depth.shape == (3, 7)
    assert cache.exit_depth[0].tolist() == [1, 1, 1, 1, 2, 1, 2]
    assert cache.prompt_length == 4
    assert cache.mean_exit_depth() == torch.tensor([2.0, 1, 2]).mean().item()
    assert cache.exit_share() == pytest.approx(1 / 3)  # depth 2 of 2 layers is no exit
    cache.check_kv_integrity()


def test_reorder_follows_beams():
    cache = filled_cache()
    cache._depth_chunks = [torch.arange(21).view(3, 7)]
    keys = cache.layers[1].keys.clone()
    cache.reorder_cache(torch.tensor([2, 0, 0]))
    assert cache.exit_depth[:, 0].tolist() == [14, 0, 0]
    assert torch.equal(cache.layers[1].keys, keys[[2, 0, 0]])
    cache.check_kv_integrity()


def test_repeat_select_crop_reset():
    cache = filled_cache(batch=2)
    cache.batch_repeat_interleave(2)
    assert cache.exit_depth.shape == (4, 7)
    cache.batch_select_indices(torch.tensor([0, 3]))
    assert cache.exit_depth.shape == (2, 7)
    assert cache.recorded_length == 7
    cache.crop(-2)
    assert cache.exit_depth.shape == (2, 5) and cache.get_seq_length() == 5 and cache.recorded_length == 5
    cache.check_kv_integrity()
    cache.record_step(depth=1, batch_size=2, num_tokens=3, device=torch.device("cpu"))
    assert cache.recorded_length == 8 == cache.exit_depth.shape[1]
    cache.reset()
    assert cache.exit_depth.numel() == 0 and cache.prompt_length == 0 and cache.recorded_length == 0
