"""The backbone's dtype, chosen by measurement (river_hf.kernels.backbone_dtype) and by the command line's
--dtype auto."""

import pytest
import torch
from transformers import LlamaConfig, PretrainedConfig

from conftest import save_tiny_model, tiny_model
from river_hf.kernels import backbone_dtype, choice as kernel_choice
from river_hf import fastest_dtype
from river_hf.cli import main


@pytest.fixture(autouse=True)
def fresh_choices(tmp_path, monkeypatch):
    """Each test starts with nothing measured: no memo, an empty cache folder of its own."""
    monkeypatch.setenv("RIVER_HF_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("RIVER_HF_DTYPE", raising=False)  # conftest pins the command line's default: 'auto' here
    backbone_dtype.forget()
    yield
    backbone_dtype.forget()


def timings(bf16: float, fp32: float):
    """A stand-in for the interleaved timing of the two dtypes: these µs, and how many times it was asked (the twins'
    kernel timings still run)."""
    calls, real = [], kernel_choice.interleaved_medians

    def medians(rounds):
        if set(rounds) != set(backbone_dtype.CANDIDATES):
            return real(rounds)
        calls.append(sorted(rounds))
        return {"bfloat16": bf16, "float32": fp32}
    return medians, calls


@pytest.mark.parametrize("bf16, fp32, expected", [
    (100.0, 95.0, torch.bfloat16),   # fp32 faster, but within the tie margin: bf16 (half the memory) stays
    (100.0, 200.0, torch.bfloat16),
    (100.0, 80.0, torch.float32),    # fp32 faster by more than the margin
])
def test_bf16_stays_unless_fp32_wins_by_the_margin(monkeypatch, bf16, fp32, expected):
    medians, calls = timings(bf16, fp32)
    monkeypatch.setattr(kernel_choice, "interleaved_medians", medians)
    assert backbone_dtype.choose((128, 64)).torch_dtype == expected
    assert calls == [["bfloat16", "float32"]]


def test_a_choice_is_measured_once_then_remembered_on_this_machine(monkeypatch):
    medians, calls = timings(100.0, 80.0)
    monkeypatch.setattr(kernel_choice, "interleaved_medians", medians)
    first = backbone_dtype.choose((128, 64))
    assert backbone_dtype.choose((128, 64)) is first and len(calls) == 1  # the process's memo
    backbone_dtype.forget()  # a new process on the same machine
    again = backbone_dtype.choose((128, 64))
    assert len(calls) == 1 and again.remembered and again.dtype == "float32"
    assert again.microseconds == first.microseconds and "measured earlier on this machine" in again.describe()
    backbone_dtype.forget()
    kernel_choice.forget()  # forgetting the machine's measurements times again
    backbone_dtype.choose((128, 64))
    assert len(calls) == 2


def test_the_real_timing_measures_both_candidates_at_the_shape():
    choice = backbone_dtype.choose((96, 64))
    assert choice.dtype in backbone_dtype.CANDIDATES and not choice.remembered
    assert set(choice.microseconds) == {"bfloat16", "float32"} and min(choice.microseconds.values()) > 0
    assert (choice.out_features, choice.in_features) == (96, 64)
    assert "64x96" in choice.describe()


def test_fastest_dtype_reads_a_config_a_model_or_a_folder(monkeypatch, tmp_path):
    medians, calls = timings(100.0, 50.0)
    monkeypatch.setattr(kernel_choice, "interleaved_medians", medians)
    folder = save_tiny_model(tmp_path / "tiny")
    model = tiny_model("llama", hidden_size=64, intermediate_size=128)
    for given in (model, model.config, folder, tmp_path / "tiny"):
        assert fastest_dtype(given) == torch.float32
    assert len(calls) == 1 and backbone_dtype.measured_choices()[0].out_features == 128  # [intermediate, hidden]


def test_a_config_without_an_intermediate_size_times_four_times_hidden():
    assert backbone_dtype.mlp_shape(PretrainedConfig(hidden_size=32)) == (128, 32)
    assert backbone_dtype.mlp_shape(LlamaConfig(hidden_size=32, intermediate_size=48)) == (48, 32)


def test_bad_input_is_named():
    with pytest.raises(TypeError, match="`model` must be a hub id or folder"):
        fastest_dtype(123)
    with pytest.raises(ValueError, match="no `hidden_size`"):
        fastest_dtype(PretrainedConfig())


def test_the_dtype_variable_sets_the_command_lines_default(monkeypatch, tmp_path, capsys):
    folder = save_tiny_model(tmp_path / "tiny")
    argv = ["generate", "hi", "--model", folder, "--max-new-tokens", "2", "--no-river"]
    monkeypatch.setenv("RIVER_HF_DTYPE", "float32")
    assert main(argv) == 0 and "backbone dtype, measured" not in capsys.readouterr().err
    monkeypatch.setenv("RIVER_HF_DTYPE", "fp16")
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert "$RIVER_HF_DTYPE='fp16' is not a dtype the command line loads" in capsys.readouterr().err


@pytest.mark.parametrize("flag, measured, expected", [
    ([], (100.0, 50.0), torch.float32),                          # auto, fp32 measured faster: upcast after loading
    ([], (100.0, 200.0), torch.bfloat16),
    (["--dtype", "float32"], None, torch.float32),               # an explicit dtype is obeyed, nothing timed
    (["--dtype", "bfloat16"], (100.0, 50.0), torch.bfloat16),
])
def test_the_command_line_loads_the_dtype_asked_or_measured(monkeypatch, tmp_path, capsys, flag, measured,
                                                            expected):
    from river_hf.cli.commands import common

    medians, calls = timings(*(measured or (1.0, 1.0)))
    monkeypatch.setattr(kernel_choice, "interleaved_medians", medians)
    loaded = []
    real_load = common.load

    def spy(args):
        model, tokenizer = real_load(args)
        loaded.append(model.dtype)
        return model, tokenizer
    monkeypatch.setattr(common, "load", spy)
    folder = save_tiny_model(tmp_path / "tiny")
    assert main(["generate", "hello world", "--model", folder, "--max-new-tokens", "3", "--tau", "-1", *flag]) == 0
    assert loaded == [expected]
    err = capsys.readouterr().err
    assert ("backbone dtype, measured" in err) == (not flag)
    assert len(calls) == (0 if flag else 1)


def test_the_benchs_memory_subprocess_loads_the_parents_dtype(tmp_path):
    from dataclasses import asdict

    from river_hf.bench.memory import load_system
    from river_hf.bench.offload import ModelSpec

    folder = save_tiny_model(tmp_path / "tiny")
    for dtype in ("float32", "bfloat16"):
        job = {"spec": asdict(ModelSpec(model=folder, dtype=dtype)), "system": "backbone", "max_new_tokens": 2}
        model, _ = load_system(job)
        assert model.dtype == getattr(torch, dtype)


def test_the_command_line_keeps_bf16_where_the_config_gives_no_shape(capsys):
    from river_hf.cli.commands.common import measured_dtype

    assert measured_dtype(PretrainedConfig(), "cpu") == torch.bfloat16  # no hidden_size: nothing to time
    assert "backbone dtype: bfloat16, not measured (the model's config" in capsys.readouterr().err


def test_a_random_shape_gets_the_dtype_measured_for_its_config(monkeypatch, capsys):
    from river_hf.cli import build_parser
    from river_hf.cli.commands.common import random_model_dtype

    medians, calls = timings(100.0, 50.0)
    monkeypatch.setattr(kernel_choice, "interleaved_medians", medians)
    args = build_parser().parse_args(["bench", "--random-model", "tiny-test"])
    assert random_model_dtype(args) == torch.float32 and len(calls) == 1
    assert "backbone dtype, measured" in capsys.readouterr().err
    args = build_parser().parse_args(["bench", "--random-model", "tiny-test", "--dtype", "bfloat16"])
    assert random_model_dtype(args) == torch.bfloat16 and len(calls) == 1
