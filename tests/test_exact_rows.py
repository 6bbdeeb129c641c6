"""Row-exact verification (river_hf.lossless.exact_rows): a lossless call's greedy output and cache are the plain
model's bit for bit, in fp32 and bf16, with sdpa and eager attention; the pass's switches (attention implementation,
row-wise linears) are undone after it, also when it fails."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from river_hf.lossless import exact_rows
from river_hf.lossless.exact_rows import PREFIX, ExactRows

from conftest import ARCHITECTURES, generate, river_of, tiny_model

NEW = 16


@pytest.fixture
def prompt():
    torch.manual_seed(5)
    return torch.randint(3, 256, (1, 11))


def assert_same_cache_bits(cache, reference):
    for idx, (ours, theirs) in enumerate(zip(cache.layers, reference.layers, strict=True)):
        kept = theirs.keys.shape[-2]  # sliding-window layers keep only their window
        assert torch.equal(ours.keys[..., -kept:, :], theirs.keys), f"layer {idx} keys"
        assert torch.equal(ours.values[..., -kept:, :], theirs.values), f"layer {idx} values"


def lossless_against_plain(model, prompt, **settings):
    reference = generate(model, prompt, max_new_tokens=NEW, output_logits=True)
    river = river_of(model)
    out = generate(river, prompt, max_new_tokens=NEW, output_logits=True, lossless=True, draft_fallback=False,
                   **settings)
    return out, reference


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_output_logits_and_cache_are_the_plain_models_bits(arch, dtype, prompt):
    model = tiny_model(arch).to(dtype)
    out, reference = lossless_against_plain(model, prompt, tau=-1.0, num_draft_tokens=4)
    assert torch.equal(out.sequences, reference.sequences)
    assert all(torch.equal(a, b) for a, b in zip(out.logits, reference.logits, strict=True))
    assert_same_cache_bits(out.cache, reference.cache)
    assert out.cache.drafts.rounds  # it did verify drafts


def test_eager_attention_is_exact_too(prompt):
    model = tiny_model("gemma3", attn_implementation="eager").to(torch.bfloat16)
    assert model.config._attn_implementation == "eager"
    out, reference = lossless_against_plain(model, prompt, tau=-1.0, num_draft_tokens=3)
    assert torch.equal(out.sequences, reference.sequences)
    assert_same_cache_bits(out.cache, reference.cache)
    assert model.config._attn_implementation == "eager"


def test_batched_verification_stays_available_and_close(prompt):
    model = tiny_model("llama")
    out, reference = lossless_against_plain(model, prompt, tau=-1.0, num_draft_tokens=4, exact_verify=False)
    assert torch.equal(out.sequences, reference.sequences)
    for ours, theirs in zip(out.cache.layers, reference.cache.layers, strict=True):
        torch.testing.assert_close(ours.keys, theirs.keys, atol=2e-5, rtol=1e-5)


def test_a_pass_sets_its_switches_and_undoes_them_even_on_error(monkeypatch):
    model = tiny_model("llama")
    monkeypatch.setattr(exact_rows, "batch_invariant", lambda linear, rows: False)  # every linear row by row
    hooked = model.lm_head
    hooked.forward = lambda x: nn.Linear.forward(hooked, x)  # like accelerate's hook: an instance forward
    own = hooked.forward
    exact = ExactRows(model)
    with pytest.raises(RuntimeError, match="inside"):
        with exact.rows(3):
            assert model.config._attn_implementation == PREFIX + "sdpa"
            assert all("forward" in m.__dict__ for m in exact.linears)
            raise RuntimeError("inside")
    assert model.config._attn_implementation == "sdpa"
    assert hooked.forward is own
    assert not any("forward" in m.__dict__ for m in exact.linears if m is not hooked)


def test_row_wise_linears_give_the_one_row_bits(monkeypatch):
    model = tiny_model("llama")
    monkeypatch.setattr(exact_rows, "batch_invariant", lambda linear, rows: False)
    linear = model.model.layers[0].mlp.down_proj
    x = torch.randn(1, 5, linear.in_features)
    with torch.no_grad(), ExactRows(model).rows(5):
        rows = linear(x)
    with torch.no_grad():
        apart = torch.cat([linear(x[:, r:r + 1]) for r in range(5)], dim=1)
    assert torch.equal(rows, apart)


def test_the_batch_invariance_probe_is_remembered_per_shape():
    linear = nn.Linear(64, 96)
    before = exact_rows.probed_shapes()
    first = exact_rows.batch_invariant(linear, 4)
    assert exact_rows.batch_invariant(nn.Linear(64, 96), 4) == first
    assert exact_rows.probed_shapes() - before == 1


def _linear_that_differs_at(batched_call: int | None, calls: dict):
    """A batch-invariant F.linear (several rows: one row at a time), except that its `batched_call`-th call with several
    rows returns one output one ulp off: a kernel whose other summation order moves a rounding only rarely (None:
    never)."""
    real = torch.nn.functional.linear

    def linear(x, weight, bias=None):
        out = torch.cat([real(x[..., r:r + 1, :], weight, bias) for r in range(x.shape[-2])], dim=-2)
        if x.shape[-2] > 1:
            calls["batched"] += 1
            if calls["batched"] == batched_call:
                out = out.clone()
                out[..., 0, 0] = torch.nextafter(out[..., 0, 0], torch.tensor(float("inf")))
        return out
    return linear


@pytest.fixture
def fresh_probes():
    """Probes of a faked F.linear must not outlive the test: forgotten before and after."""
    exact_rows.forget_probes()
    yield
    exact_rows.forget_probes()


def test_the_probe_finds_a_kernel_that_differs_on_a_few_outputs_only(monkeypatch, fresh_probes):
    """A batched kernel that sums in another order differs from one-row calls only where that moves a bf16 rounding
    (~1 output in 8000 on an AMD EPYC with AVX-512-BF16), so one random input can miss it: the probe tries more."""
    calls = {"batched": 0}
    monkeypatch.setattr(exact_rows.F, "linear", _linear_that_differs_at(10, calls))
    assert not exact_rows.batch_invariant(nn.Linear(64, 96), 4)
    assert calls["batched"] == 10  # it stops at the first difference


def test_the_probe_compares_its_quota_of_outputs_before_calling_a_kernel_invariant(monkeypatch, fresh_probes):
    calls = {"batched": 0}
    monkeypatch.setattr(exact_rows.F, "linear", _linear_that_differs_at(None, calls))
    assert exact_rows.batch_invariant(nn.Linear(64, 96), 4)
    assert calls["batched"] == min(exact_rows.MAX_PROBES, -(-exact_rows.PROBE_OUTPUTS // (4 * 96)))
    calls["batched"] = 0
    assert exact_rows.batch_invariant(nn.Linear(64, 4096), 8)  # a wide weight: fewer inputs reach the quota
    assert calls["batched"] == -(-exact_rows.PROBE_OUTPUTS // (8 * 4096)) < exact_rows.MAX_PROBES


def test_exact_verify_must_be_a_bool():
    from river_hf import RiverConfig
    with pytest.raises(ValueError, match="`exact_verify`"):
        RiverConfig(lossless=True, exact_verify="yes")
