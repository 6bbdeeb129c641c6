"""The defaults: tau='auto' (the signal's measured tau where exiting pays on this machine, else the plain backbone),
the confidence signal, nbits='auto' (4-bit first quarter, 8-bit after) and lm_head_nbits='auto' (a 4-bit LM head
whose top 64 logits the original head recomputes; 8-bit where it may take W8A8 or the backend runs only 8 bits)."""

import warnings

import pytest
import torch

import river_hf
from river_hf import RiverConfig, RiverQuantConfig, RiverSettings
from river_hf.core import generation
from river_hf.core.kv_cache import RiverCache
from river_hf.cli import main
from river_hf.core.auto_tau import FULL_EXIT, MIN_GAIN, NEVER_EXITS, ExitGain, measure_exit_gain
from river_hf.core.twins import river_layers, twin_linears
from river_hf.core.lm_head import RiverLMHead
from river_hf.core.settings import DEFAULT_TAUS

from conftest import NUM_LAYERS, river_of, save_tiny_model, tiny_model

PAYS = ExitGain(backbone_ms=10.0, exited_ms=6.0, steps=5, device="cpu")
DOES_NOT_PAY = ExitGain(backbone_ms=10.0, exited_ms=9.9, steps=5, device="cpu")


@pytest.fixture
def measured(monkeypatch):
    """Replace the timing with a chosen ExitGain; returns the list of models it was measured for."""
    calls = []

    def use(gain: ExitGain):
        def measure(model):
            calls.append(model)
            return gain
        monkeypatch.setattr(generation, "measure_river_exit_gain", measure)
        return calls
    return use


def _auto(model, ids, **config):
    config = RiverConfig(max_new_tokens=8, do_sample=False, return_dict_in_generate=True, **config)
    return model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)


# ---- the settings' and the build's defaults -----------------------------------------------------------------------
def test_the_defaults_are_auto_tau_and_the_confidence_signal():
    settings = RiverSettings()
    assert settings.tau == "auto" and settings.exit_signal == "confidence"
    assert RiverSettings(tau=0.7).tau == 0.7
    with pytest.raises(ValueError, match="`tau`.*'auto'"):
        RiverSettings(tau="fast")


def test_nbits_auto_puts_4_bits_in_the_first_quarter_and_8_after():
    config = RiverQuantConfig()
    assert config.nbits == "auto" and config.quantize_lm_head and config.lm_head_nbits == "auto"
    assert config.resolved_nbits(30) == [4] * 7 + [8] * 22  # SmolLM2's 29 river layers: the measured best mix
    assert config.resolved_nbits(16) == [4] * 3 + [8] * 12  # Llama-3.2-1B: the rule scales with depth
    assert RiverQuantConfig(start_layer=2).resolved_nbits(4) == [8, 8]  # under 4 river layers: all 8-bit
    with pytest.raises(ValueError, match="`nbits`='auto' depends on the model's depth"):
        RiverQuantConfig().nbits_for(3)
    assert RiverQuantConfig().nbits_for(3, num_layers=30) == 4 and RiverQuantConfig().nbits_for(8, 30) == 8


def test_a_default_build_has_mixed_twins_and_a_quantized_head():
    model = river_hf.build_river(tiny_model("llama", num_hidden_layers=10), RiverQuantConfig(backend="auto"),
                                 progress=False)
    bits = [{linear.nbits for linear in twin_linears(layer.twin)} for layer in river_layers(model)[1:]]
    assert bits == [{4}, {4}] + [{8}] * 7  # 9 river layers: int(9 / 4) = 2 shallow ones
    assert all(linear.group_size is None for layer in river_layers(model)[3:] for linear in twin_linears(layer.twin))
    head = model.get_output_embeddings()
    assert isinstance(head, RiverLMHead)
    assert (head.quantized_head.nbits, head.quantized_head.group_size, head.exact_top_k) == (4, 64, 64)
    assert RiverQuantConfig().to_dict()["nbits"] == "auto"  # saved as the rule, not one model's schedule


@pytest.mark.parametrize("fields, bits", [
    ({}, 4),
    ({"lm_head_nbits": 8}, 8),
    ({"lm_head_nbits": 2}, 2),
    ({"activations": "int8"}, 8),  # the twins' int8 activations reach the head: fbgemm's W8A8 kernel is 8-bit
    ({"lm_head_activations": "int8"}, 8),
    ({"activations": "int8", "lm_head_activations": None}, 4),
    ({"nbits": 8, "backend": "int8pack_cpu"}, 8),  # a kernel that runs only 8 bits
    ({"nbits": 8, "backend": "w8a8_cpu", "activations": "int8"}, 8),
    ({"nbits": 4, "backend": "int4pack_cpu"}, 4),
    ({"nbits": 4, "backend": "hqq", "activations": "int8"}, 4),  # an explicit backend decides, not the activations
])
def test_lm_head_nbits_auto_is_4_bits_unless_the_head_takes_w8a8_or_the_backend_runs_only_8(fields, bits):
    config = RiverQuantConfig(**fields)
    assert config.head_nbits == bits
    assert config.lm_head_group_size == (None if bits == 8 else config.group_size)
    assert RiverQuantConfig.from_dict(config.to_dict()).head_nbits == bits  # resolved again the same way when loaded
    with pytest.raises(ValueError, match="`lm_head_nbits`='eight' is not supported"):
        RiverQuantConfig(lm_head_nbits="eight")



def test_a_saved_4_bit_head_loaded_for_w8a8_is_quantized_again_at_8_bits(tmp_path, hqq_calls):
    """A river saved with the default head (4-bit) and loaded with `lm_head_activations="int8"` (a loading field):
    'auto' now means the 8-bit W8A8 head, which the file does not hold. A TwinsMismatchWarning names the bits, the
    head alone is quantized again, at 8 bits per row, and the twins still come from the file."""
    from transformers import AutoModelForCausalLM

    from river_hf.saving.twin_files import TwinsMismatchWarning

    backbone, river = str(tmp_path / "backbone"), str(tmp_path / "river")
    tiny_model("llama").save_pretrained(backbone)
    AutoModelForCausalLM.from_pretrained(backbone, quantization_config=RiverQuantConfig(backend="auto")
                                         ).save_pretrained(river)
    hqq_calls[0] = 0
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*quantization_config.* from the model will be used")
        with pytest.warns(TwinsMismatchWarning, match=r"LM head: `lm_head_nbits`: 4 stored, 8 asked\. It is "
                                                      r"quantized again .*save the river again"):
            loaded = AutoModelForCausalLM.from_pretrained(
                river, quantization_config=RiverQuantConfig(backend="auto", lm_head_activations="int8"))
    head = loaded.get_output_embeddings().quantized_head
    assert (head.nbits, head.group_size, head.backend) == (8, None, "w8a8_cpu") and hqq_calls[0] == 1
    ids = torch.tensor([[3, 17, 42, 8]])
    assert loaded.generate(ids, max_new_tokens=4, do_sample=False).shape == (1, 8)


# ---- tau='auto' --------------------------------------------------------------------------------------------------
def test_where_exiting_pays_auto_is_the_signals_measured_tau(measured, prompt_ids):
    calls = measured(PAYS)
    model = river_of(tiny_model("llama"))
    ids = prompt_ids[:1]
    auto = _auto(model, ids)
    explicit = _auto(model, ids, tau=DEFAULT_TAUS["confidence"])
    assert auto.cache.router.settings.tau == DEFAULT_TAUS["confidence"]
    assert torch.equal(auto.sequences, explicit.sequences)
    assert _auto(model, ids, exit_signal="cosine").cache.router.settings.tau == DEFAULT_TAUS["cosine"]
    assert len(calls) == 1  # measured once per river


def test_where_exiting_does_not_pay_auto_runs_the_plain_backbone_and_warns_once(measured, prompt_ids):
    calls = measured(DOES_NOT_PAY)
    model = river_of(tiny_model("llama"))
    plain = model.generate(prompt_ids[:1], attention_mask=torch.ones_like(prompt_ids[:1]), max_new_tokens=8,
                           do_sample=False)
    with pytest.warns(UserWarning, match="9.9 ms against the backbone's 10.0 ms.*exiting does not pay"):
        out = _auto(model, prompt_ids[:1])
    assert torch.equal(out.sequences, plain)
    assert not isinstance(out.cache, RiverCache)  # no router, no twin: the backbone itself
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _auto(model, prompt_ids[:1])  # the second call: no second warning, no second measurement
        assert _auto(model, prompt_ids[:1], tau=-1.0).cache.mean_exit_depth() == 2  # an explicit tau is obeyed
    assert len(calls) == 1


def test_a_cache_made_by_hand_with_auto_exits_nothing_where_it_does_not_pay(measured, prompt_ids):
    measured(DOES_NOT_PAY)
    model = river_of(tiny_model("llama"))
    with pytest.warns(UserWarning, match="does not pay"):
        cache = generation.new_river_cache(model, RiverSettings())
    assert cache.router.settings.tau == NEVER_EXITS


def test_auto_needs_a_signal_with_a_measured_default(measured, prompt_ids):
    measured(PAYS)
    model = river_of(tiny_model("llama"))
    with pytest.raises(ValueError, match="`tau`='auto' has no measured default for `exit_signal`='update_norm'"):
        _auto(model, prompt_ids[:1], exit_signal="update_norm")


def test_the_gain_must_clear_the_margin():
    assert not ExitGain(10.0, 10.0 * (1 - MIN_GAIN / 2), 3, "cpu").pays
    assert ExitGain(10.0, 10.0 * (1 - MIN_GAIN), 3, "cpu").pays and PAYS.speedup == pytest.approx(10 / 6)


# ---- the measurement itself ----------------------------------------------------------------------------------------
def test_the_measurement_times_exited_steps_against_backbone_steps(prompt_ids):
    model = river_of(tiny_model("llama"))
    exited = generation.new_river_cache(model, FULL_EXIT)
    ticks = iter(range(10_000))
    gain = measure_exit_gain(model, exited, clock=lambda: next(ticks) * 1e-3)  # every clock read: +1 ms
    assert 3 <= gain.steps <= 8 and gain.backbone_ms == gain.exited_ms == 1.0
    decoded = exited.exit_depth[0, exited.prompt_length:]
    assert decoded.tolist() == [2] * (gain.steps + 1)  # warm-up + timed steps all exited at the river's start
    assert exited.exit_depth[0, :exited.prompt_length].tolist() == [NUM_LAYERS] * exited.prompt_length
    exited.check_kv_integrity()


def test_a_real_measurement_gives_positive_times(prompt_ids):
    gain = generation.measure_river_exit_gain(river_of(tiny_model("llama")))
    assert gain.backbone_ms > 0 and gain.exited_ms > 0 and gain.device == "cpu"


# ---- the command line --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny-defaults"), num_layers=4)


def _summary(capsys) -> str:
    return next(line for line in capsys.readouterr().out.splitlines() if line.startswith("[river-hf]"))


def test_cli_defaults_say_which_tau_auto_chose(measured, model_dir, capsys):
    measured(PAYS)
    assert main(["generate", "w5 w9", "--model", model_dir, "--max-new-tokens", "3", "--backend", "auto"]) == 0
    assert "confidence tau 0.3 (auto), 8x3-bit twins" in _summary(capsys)  # 3 river layers: int(3 / 4) = 0 at 4 bits


def test_cli_defaults_where_exiting_does_not_pay(measured, model_dir, capsys):
    measured(DOES_NOT_PAY)
    with pytest.warns(UserWarning, match="does not pay"):
        assert main(["generate", "w5 w9", "--model", model_dir, "--max-new-tokens", "3", "--backend", "auto",
                     "--show-exits"]) == 0
    out = capsys.readouterr().out
    assert "river off: every token ran all 4 layers (tau auto: exiting does not pay on this machine" in out
    assert "--show-exits: nothing exited" in out
