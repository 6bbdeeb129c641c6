"""`river-hf calibrate` and `--tau auto`: the search on synthetic measurements, then end to end on a tiny model."""

from __future__ import annotations

import json

import pytest

import river_hf
from river_hf import RiverQuantConfig
from river_hf import cache_folder as user_cache
from river_hf.bench import calibrate
from river_hf.bench.calibrate import CalibrationError, Probe, search_tau
from river_hf.bench.fidelity import backbone_references, measure_fidelity
from river_hf.cli import main
from river_hf.loading.models import build_chat_inputs, load_model_and_tokenizer
from river_hf import RiverSettings

from conftest import QUESTIONS, save_tiny_model, write_questions

TOKENS = 12
TWINS = ("--nbits", "4", "--no-quantize-lm-head")  # 4-bit twins miss tokens on the tiny model; 8-bit ones do not
def step_measure(threshold: float, low: float = 0.85, high: float = 0.99):
    """A synthetic system: match jumps from `low` to `high` at `threshold`; depth grows with tau."""
    def measure(tau: float) -> Probe:
        return Probe(tau=tau, match=high if tau >= threshold else low, kl=0.0, mean_exit_depth=15 * (tau + 1))

    return measure


# ---- the search -------------------------------------------------------------------------------------------------
def test_bisection_lands_just_above_the_threshold():
    chosen, probes = search_tau(step_measure(0.97), target=0.98, tolerance=0.001, max_steps=30)
    assert 0.97 <= chosen.tau <= 0.971
    assert chosen.match >= 0.98
    assert [p.tau for p in probes[:2]] == [0.999, -1.0]  # both ends first
    assert chosen.mean_exit_depth == min(p.mean_exit_depth for p in probes if p.match >= 0.98)


def test_bisection_halves_the_distance_to_one():
    _, probes = search_tau(step_measure(0.97), target=0.98, max_steps=1)
    assert probes[2].tau == pytest.approx(1 - (2 * 0.001) ** 0.5)


def test_full_quantization_wins_when_it_meets_the_target():
    chosen, probes = search_tau(step_measure(-2.0), target=0.98)
    assert chosen.tau == -1.0 and len(probes) == 2


def test_the_shallowest_passing_probe_wins_even_if_match_is_not_monotone():
    def measure(tau):  # passes at -1 only through noise: still only measured passes qualify
        match = 0.99 if tau >= 0.9 else 0.5
        return Probe(tau=tau, match=match, kl=0.0, mean_exit_depth=30.0 if tau > 0.95 else 10.0)

    chosen, probes = search_tau(measure, target=0.98, tolerance=0.01)
    assert all(p.match >= 0.98 for p in probes if p is chosen)
    assert chosen.mean_exit_depth == 10.0 and 0.9 <= chosen.tau <= 0.95


def test_an_unreachable_target_reports_the_best_match():
    with pytest.raises(CalibrationError, match=r"even tau=0.999 .* measures match 0.9000") as info:
        search_tau(step_measure(2.0, low=0.9), target=0.95)
    assert info.value.best.match == 0.9


@pytest.mark.parametrize("target", [1.5, 0.0, -0.2, float("nan")])
def test_target_must_be_a_share(target):
    with pytest.raises(ValueError, match="`--target-match` must be a share"):
        calibrate.check_target(target)


# ---- the calibration file ---------------------------------------------------------------------------------------
def test_calibrations_are_kept_per_model_and_twins(tmp_path, monkeypatch):
    monkeypatch.setenv(user_cache.CACHE_ENV, str(tmp_path))
    four = calibrate.calibration_key("m", RiverQuantConfig(nbits=4), "cpu")
    eight = calibrate.calibration_key("m", RiverQuantConfig(nbits=8, group_size=None), "cpu")
    calibrate.save_calibration(four, {"tau": 0.97})
    path = calibrate.save_calibration(eight, {"tau": 0.5})
    assert path == tmp_path / "calibration.json"
    assert calibrate.lookup_calibration(four) == {"tau": 0.97}
    assert calibrate.lookup_calibration(eight) == {"tau": 0.5}
    assert calibrate.lookup_calibration(calibrate.calibration_key("m", RiverQuantConfig(), "cuda")) is None


def test_a_corrupt_calibration_file_says_what_to_do(tmp_path, monkeypatch):
    monkeypatch.setenv(user_cache.CACHE_ENV, str(tmp_path))
    (tmp_path / "calibration.json").write_text("{oops")
    with pytest.raises(ValueError, match="delete it and run `river-hf calibrate`"):
        calibrate.load_calibrations()


def test_model_ids(tmp_path):
    assert calibrate.model_id(None) == "packaged:SmolLM2-135M-Instruct.Q4_1.gguf"
    assert calibrate.model_id("org/name") == "org/name"
    assert calibrate.model_id(str(tmp_path)) == str(tmp_path.resolve())


# ---- end to end on a tiny model ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("calibrate")
    return save_tiny_model(root / "tiny-llama"), write_questions(root / "train.jsonl")


@pytest.fixture(scope="module")
def tiny_references(tiny):
    """(river model, backbone references) exactly as `river-hf calibrate` builds them for the tiny model."""
    model_dir, data = tiny
    model, tokenizer = load_model_and_tokenizer(model_dir)
    river_hf.build_river(model, RiverQuantConfig(nbits=4, quantize_lm_head=False), progress=False)
    ids = [build_chat_inputs(tokenizer, q)["input_ids"] for q in QUESTIONS]
    return model, [backbone_references(model, [i], TOKENS)[0] for i in ids]


def calibrate_cli(tiny, *extra):
    model_dir, data = tiny
    return main(["calibrate", "--model", model_dir, "--data", data, "--tokens", str(TOKENS), "--prompts", "3",
                 *TWINS, *extra])


def test_calibrated_tau_meets_the_target_and_generate_reads_it_back(tiny, tiny_references, tmp_path, monkeypatch,
                                                                     capsys):
    monkeypatch.setenv(user_cache.CACHE_ENV, str(tmp_path))
    model, references = tiny_references
    full_quant = measure_fidelity(model, references, RiverSettings(tau=-1, exit_signal="cosine")).match
    assert full_quant < 1.0, "the tiny model's twins should miss some tokens"
    target = (full_quant + 1.0) / 2
    assert calibrate_cli(tiny, "--target-match", str(target)) == 0
    entry = next(iter(json.loads((tmp_path / "calibration.json").read_text())["entries"].values()))
    assert entry["tau"] > -1.0 and entry["match"] >= target
    remeasured = measure_fidelity(model, references, RiverSettings(tau=entry["tau"], exit_signal="cosine"))
    assert remeasured.match >= target and remeasured.match == pytest.approx(entry["match"])
    assert "use it with `river-hf generate ... --tau auto`" in capsys.readouterr().out

    assert main(["generate", "what is two plus three?", "--model", tiny[0], "--tau", "auto", "--exit-signal",
                 "cosine", *TWINS, "--max-new-tokens", "3"]) == 0
    captured = capsys.readouterr()
    assert f"tau auto: {entry['tau']:g}" in captured.err
    assert f"(cosine tau {entry['tau']:g}, 4-bit twins" in captured.out


def test_tau_auto_without_a_calibration_takes_the_measured_default(tiny, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(user_cache.CACHE_ENV, str(tmp_path))
    assert main(["generate", "hi", "--model", tiny[0], "--tau", "auto", "--exit-signal", "cosine", *TWINS,
                 "--max-new-tokens", "2"]) == 0
    assert "no `river-hf calibrate` result saved" in capsys.readouterr().err


def test_a_cosine_calibration_is_not_used_for_another_signal(tiny, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(user_cache.CACHE_ENV, str(tmp_path))
    assert calibrate_cli(tiny, "--target-match", "0.5") == 0
    capsys.readouterr()
    assert main(["generate", "hi", "--model", tiny[0], *TWINS, "--max-new-tokens", "2"]) == 0  # confidence
    err = capsys.readouterr().err
    assert "calibrated" not in err and "the confidence signal's measured default" in err


def test_an_unreachable_target_is_a_usage_error_with_the_best_match(tiny, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(user_cache.CACHE_ENV, str(tmp_path))
    with pytest.raises(SystemExit) as info:  # hi = -0.5: every token exits at start_layer, as in full quantization
        calibrate_cli(tiny, "--target-match", "1.0", "--tau-range", "-1", "-0.5")
    assert info.value.code == 2
    assert "is out of reach: even tau=-0.5" in capsys.readouterr().err
    assert not (tmp_path / "calibration.json").exists()


@pytest.mark.parametrize("args, message", [
    (["--target-match", "1.5"], "`--target-match` must be a share of positions in (0, 1]"),
    (["--target-match", "0.9", "--tau-range", "0.5", "0.2"], "`--tau-range` must satisfy"),
    (["--target-match", "0.9", "--data", "/no/such.jsonl"], "`--data`: file '/no/such.jsonl' not found"),
    (["--target-match", "0.9", "--group-size", "48"], "`group_size`=48 is not supported"),
])
def test_bad_calibrate_arguments(args, message, capsys):
    with pytest.raises(SystemExit) as info:
        main(["calibrate", "--model", "/no/such/model", *args])
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_target_match_is_required(capsys):
    with pytest.raises(SystemExit):
        main(["calibrate"])
    assert "--target-match" in capsys.readouterr().err
