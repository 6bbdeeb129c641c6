"""river_hf.kernels.quantize: HQQ quantization run on the CPU kernels, checked against HQQ's own dequantization."""

from __future__ import annotations

import copy
import importlib.util
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hqq.core.quantize import Quantizer
from torch import nn

from river_hf.kernels.backends import BACKENDS, resolve_backend
from river_hf.kernels.quantize import SUPPORTED_GROUP_SIZES, SUPPORTED_NBITS, RiverQuantLinear, plain_rounding
from river_hf.kernels.registry import KERNELS

CPU = torch.device("cpu")
IN, OUT = 256, 128  # OUT: a multiple of 16, as the int4 CPU kernel needs


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny matrices run faster on one thread


def make_linear(in_features=IN, out_features=OUT, bias=True, seed=0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(in_features, out_features, bias=bias)


def quiet_from_linear(linear, **kwargs) -> RiverQuantLinear:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # 8-bit + group_size: "one group per row", tested on its own below
        return RiverQuantLinear.from_linear(linear, **kwargs)


def rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float() - expected.float()).norm() / expected.float().norm()).item()


def hqq_reference(weight: torch.Tensor, nbits: int, group_size: int | None, optimize: bool = True):
    """HQQ's own quantize + dequantize, independent of river_hf: (codes [N, K], scale [N, G], zero [N, G], W)."""
    w_q, meta = Quantizer.quantize(weight.detach(), nbits=nbits, group_size=group_size, optimize=optimize, axis=1,
                                   bitpack=False, device="cpu")
    deq = Quantizer.dequantize(w_q, {**meta, "compute_dtype": torch.float32})
    rows = weight.shape[0]
    return w_q.reshape(weight.shape), meta["scale"].reshape(rows, -1), meta["zero"].reshape(rows, -1), deq


# ---------------------------------------------------------------- the twin computes the HQQ weight's linear


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("nbits", [2, 3, 4, 8])
def test_twin_matches_dequantized_linear(nbits, group_size, bias):
    linear = make_linear(bias=bias)
    twin = quiet_from_linear(linear, nbits=nbits, group_size=group_size)
    weight = twin.dequantized_weight()  # [OUT, IN] float32
    assert weight.shape == (OUT, IN) and weight.dtype == torch.float32
    torch.manual_seed(1)
    for shape in [(5, IN), (2, 3, IN)]:
        for dtype in [torch.float32, torch.bfloat16]:
            x = torch.randn(shape, dtype=dtype)
            y = twin(x)
            assert y.dtype == dtype and y.shape == (*shape[:-1], OUT)
            # The kernels take bf16 activations; the reference does the rest in float32.
            expected = F.linear(x.to(torch.bfloat16).float(), weight, linear.bias)
            # bf16 scales and outputs: ~3e-3 is bf16 rounding; a wrong code or group would be > 5e-2.
            assert rel_error(y, expected) < 6e-3, (shape, dtype)


@pytest.mark.parametrize("nbits, group_size", [(4, None), (3, None), (2, 64), (8, None), (8, 64)])
def test_hqq_fallback_and_per_row_groups(nbits, group_size):
    """Both the kernel and the 'hqq' fallback compute the linear of HQQ's own weight (the fallback IS
    `F.linear(x, dequantized_weight())`, so only an independent reference can catch a wrong weight there)."""
    linear = make_linear()
    x = torch.randn(4, IN)
    for backend in ["auto", "hqq"]:
        twin = quiet_from_linear(linear, nbits=nbits, group_size=group_size, backend=backend)
        *_, weight = hqq_reference(linear.weight, nbits, twin.group_size)  # 8-bit 'auto': one group per row
        expected = F.linear(x.to(torch.bfloat16).float(), weight, linear.bias)
        assert rel_error(twin(x), expected) < 6e-3, backend


def test_dequantized_weight_is_hqqs_weight():
    """dequantized_weight reads the kernel's codes back and equals HQQ's own dequantization exactly."""
    linear = make_linear(bias=False)
    for nbits, group_size in [(4, 64), (2, 32), (3, 128), (4, None), (8, None)]:
        twin = quiet_from_linear(linear, nbits=nbits, group_size=group_size)
        *_, expected = hqq_reference(linear.weight, nbits, group_size)
        torch.testing.assert_close(twin.dequantized_weight(), expected, rtol=0, atol=0)
    wide = make_linear(in_features=2304, out_features=32, bias=False)  # int4 codes are read back 1024 columns a time
    twin = RiverQuantLinear.from_linear(wide, nbits=4, group_size=128)
    torch.testing.assert_close(twin.dequantized_weight(), hqq_reference(wide.weight, 4, 128)[-1], rtol=0, atol=0)


def test_plain_rounding_skips_hqqs_optimizer_inside_the_block_only():
    linear = make_linear(bias=False)
    with plain_rounding():
        plain = RiverQuantLinear.from_linear(linear, nbits=4, group_size=64)
    optimized = RiverQuantLinear.from_linear(linear, nbits=4, group_size=64)
    torch.testing.assert_close(plain.dequantized_weight(), hqq_reference(linear.weight, 4, 64, optimize=False)[-1],
                               rtol=0, atol=0)
    torch.testing.assert_close(optimized.dequantized_weight(), hqq_reference(linear.weight, 4, 64)[-1], rtol=0, atol=0)
    assert not torch.equal(plain.dequantized_weight(), optimized.dequantized_weight())
    assert {name: t.shape for name, t in plain.named_buffers()} == {n: t.shape for n, t in optimized.named_buffers()}


@pytest.mark.parametrize("nbits, group_size", [(4, 64), (4, 32), (4, None), (3, 64), (2, 128), (8, None)])
def test_kernel_layout_matches_hqq_formula(nbits, group_size):
    """The kernel's own weight (read with an identity input) equals HQQ's (W_q - zero) * scale to bf16 rounding."""
    linear = make_linear(bias=False)
    twin = quiet_from_linear(linear, nbits=nbits, group_size=group_size)
    codes, scale, zero, expected = hqq_reference(linear.weight, nbits, group_size)
    kernel_weight = twin(torch.eye(IN)).t()  # [OUT, IN] float32; the identity is exact in bf16
    step = scale.repeat_interleave(IN // scale.shape[1], dim=1)  # [OUT, IN]: one quantization step
    # A wrong code costs a whole step. bf16 (unit roundoff 2^-8) costs: scale and Z rounding, a few hundredths of a
    # step for <= 4 bits; scale and output rounding, 2 * 2^-8 * |W| (for 8 bits that is more than a step).
    assert ((kernel_weight - expected).abs() <= 0.15 * step + 2**-7 * expected.abs()).all()
    assert 0 <= codes.min() and codes.max() <= 2**nbits - 1


def test_tinygemm_zero_mapping_matches_torchao():
    """For 4 bits the kernel's Z is torchao's scale * 8 - zero * scale."""
    linear = make_linear(bias=False)
    twin = RiverQuantLinear.from_linear(linear, nbits=4, group_size=64)
    _, scale, zero, _ = hqq_reference(linear.weight, 4, 64)
    expected = torch.stack([scale, scale * 8 - zero * scale], dim=-1).transpose(0, 1).to(torch.bfloat16)
    assert twin.kernel_group_size == 64 and twin.scales_and_zeros.shape == (IN // 64, OUT, 2)
    torch.testing.assert_close(twin.scales_and_zeros, expected)


def test_dequantized_weight_close_to_original():
    linear = make_linear()
    four = RiverQuantLinear.from_linear(linear, nbits=4, group_size=64)
    eight = RiverQuantLinear.from_linear(linear, nbits=8, group_size=None)
    error_4bit = rel_error(four.dequantized_weight(), linear.weight)
    error_8bit = rel_error(eight.dequantized_weight(), linear.weight)
    assert error_4bit < 0.1  # uniform-init weights: ~0.06
    assert error_8bit < 0.01 and error_8bit < error_4bit / 8


# ---------------------------------------------------------------- choosing a backend


def test_resolve_backend_auto():
    assert resolve_backend("auto", 4, CPU) == "int4pack_cpu"
    assert resolve_backend("auto", 2, CPU) == "int4pack_cpu"
    assert resolve_backend("auto", 3, "cpu") == "int4pack_cpu"
    assert resolve_backend("auto", 8, CPU) == "int8pack_cpu"
    assert resolve_backend("auto", 4, torch.device("cuda")) == "tinygemm_cuda"  # pure logic: no GPU needed


def gemlite_installed(monkeypatch, installed: bool) -> None:
    for name in ("gemlite_int8_cuda", "gemlite_int4_cuda"):
        monkeypatch.setitem(KERNELS, name, KERNELS[name]._replace(available=lambda: installed))


def test_8bit_on_cuda_without_gemlite_falls_back_to_dense(monkeypatch):
    """Without gemlite no 8-bit kernel runs on CUDA: 'dense' (the backbone's speed), never 'hqq' (a dequantization
    per call), with a warning that names the package; with it, gemlite's int8 GEMV."""
    gemlite_installed(monkeypatch, False)
    with pytest.warns(UserWarning, match=r"'dense'.*pip install river-hf\[cuda\]"):
        assert resolve_backend("auto", 8, torch.device("cuda")) == "dense"
    gemlite_installed(monkeypatch, True)
    assert resolve_backend("auto", 8, torch.device("cuda")) == "gemlite_int8_cuda"
    assert resolve_backend("auto", 4, torch.device("cuda")) == "tinygemm_cuda"  # 4 bits: tinygemm stays preferred
    assert resolve_backend("gemlite_int4_cuda", 2, torch.device("cuda")) == "gemlite_int4_cuda"
    with pytest.raises(ValueError, match="cannot run 3-bit"):
        resolve_backend("gemlite_int4_cuda", 3, torch.device("cuda"))


def test_gemlite_backends_name_the_missing_package(monkeypatch):
    gemlite_installed(monkeypatch, False)
    with pytest.raises(ValueError, match=r"`backend`='gemlite_int8_cuda' needs gemlite.*river-hf\[cuda\]"):
        resolve_backend("gemlite_int8_cuda", 8, torch.device("cuda"))


def test_resolve_backend_explicit():
    assert resolve_backend("hqq", 4, CPU) == "hqq"
    assert resolve_backend("int8pack_cpu", 8, CPU) == "int8pack_cpu"
    assert set(BACKENDS) == {"auto", "fastest", "int4pack_cpu", "int8pack_cpu", "int8pack_fp32_cpu", "w8a8_cpu",
                             "matmulnbits_cpu", "dense", "tinygemm_cuda", "gemlite_int8_cuda", "gemlite_int4_cuda",
                             "hqq"}


@pytest.mark.parametrize("kwargs, field", [
    ({"nbits": 5}, "`nbits`=5"),
    ({"nbits": True}, "`nbits`=True"),
    ({"group_size": 48}, "`group_size`=48"),
    ({"axis": 0}, "`axis`=0"),
    ({"backend": "marlin"}, "`backend`='marlin'"),
    ({"backend": "tinygemm_cuda"}, "`backend`='tinygemm_cuda'"),
    ({"backend": "int8pack_cpu", "nbits": 4}, "`backend`='int8pack_cpu'"),
    ({"backend": "int4pack_cpu", "nbits": 8}, "`backend`='int4pack_cpu'"),
])
def test_bad_arguments_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        RiverQuantLinear.from_linear(make_linear(), **kwargs)


def test_bad_arguments_list_the_choices():
    with pytest.raises(ValueError, match=r"choose one of \(2, 3, 4, 8\)"):
        resolve_backend("auto", 5, CPU)
    with pytest.raises(ValueError, match="int4pack_cpu"):  # the usable backends are listed
        resolve_backend("tinygemm_cuda", 4, CPU)
    with pytest.raises(ValueError, match="`linear`"):
        RiverQuantLinear.from_linear(nn.Conv1d(4, 4, 1))


def test_group_size_must_divide_in_features():
    with pytest.raises(ValueError, match="`group_size`=64 does not divide `in_features`=96"):
        RiverQuantLinear.from_linear(make_linear(in_features=96), nbits=4, group_size=64)


def test_shapes_a_kernel_cannot_run():
    odd_rows = make_linear(out_features=24)  # int4 CPU kernel: rows in blocks of 16
    with pytest.raises(ValueError, match="`out_features`=24"):
        RiverQuantLinear.from_linear(odd_rows, nbits=4, backend="int4pack_cpu")
    with pytest.warns(UserWarning, match="'hqq'"):
        twin = RiverQuantLinear.from_linear(odd_rows, nbits=4, backend="auto")
    assert twin.backend == "hqq"
    x = torch.randn(3, IN)
    torch.testing.assert_close(twin(x), F.linear(x, hqq_reference(odd_rows.weight, 4, 64)[-1], odd_rows.bias))
    with pytest.raises(ValueError, match="`in_features`=40"):  # int8 kernel: K in blocks of 16 (else it crashes)
        RiverQuantLinear.from_linear(make_linear(in_features=40), nbits=8, group_size=None, backend="int8pack_cpu")


# ---------------------------------------------------------------- warnings


def test_int8_kernel_warns_once_about_per_row_groups():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        twin = RiverQuantLinear.from_linear(make_linear(), nbits=8, group_size=64)
    assert [str(w.message) for w in caught if "one group per output row" in str(w.message)] != []
    assert len(caught) == 1 and "`group_size`=64" in str(caught[0].message)
    assert twin.backend == "int8pack_cpu" and twin.group_size is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # per-row 8-bit asked for: nothing to warn about
        RiverQuantLinear.from_linear(make_linear(), nbits=8, group_size=None)


def test_hqq_backend_warns_it_is_slow():
    with pytest.warns(UserWarning, match="dequantizes the whole weight on every call") as caught:
        RiverQuantLinear.from_linear(make_linear(), nbits=4, backend="hqq")
    assert "int4pack_cpu" in str(caught[0].message)  # names the fast alternative


def test_warnings_do_not_repeat_per_layer():
    """Building a twin quantizes dozens of linears: the message must not depend on the layer, so it shows once."""
    messages = set()
    for in_features, out_features in [(256, 128), (128, 512)]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            RiverQuantLinear.from_linear(make_linear(in_features, out_features), nbits=8, group_size=64)
        messages |= {str(w.message) for w in caught}
    assert len(messages) == 1


# ---------------------------------------------------------------- module behaviour


def test_module_surface():
    linear = make_linear()
    twin = RiverQuantLinear.from_linear(linear, nbits=4, group_size=64)
    assert (twin.in_features, twin.out_features, twin.nbits, twin.group_size, twin.backend) == (
        IN, OUT, 4, 64, "int4pack_cpu")
    assert repr(twin) == (
        f"RiverQuantLinear(in_features={IN}, out_features={OUT}, nbits=4, group_size=64, backend=int4pack_cpu)")
    assert list(twin.parameters()) == []  # buffers only: nothing to train, nothing for an optimizer to find
    assert {"qweight", "scales_and_zeros", "scale", "zero", "bias"} <= set(twin.state_dict())
    torch.testing.assert_close(twin.bias, linear.bias.detach())
    assert RiverQuantLinear.from_linear(make_linear(bias=False), 4, 64).bias is None
    assert set(SUPPORTED_NBITS) == {2, 3, 4, 8} and None in SUPPORTED_GROUP_SIZES


def test_copy_and_dtype_cast_keep_working():
    linear = make_linear()
    x = torch.randn(2, IN, dtype=torch.bfloat16)
    for nbits in [4, 8]:
        twin = quiet_from_linear(linear, nbits=nbits, group_size=None)
        expected = twin(x)
        torch.testing.assert_close(copy.deepcopy(twin)(x), expected)
        # A model cast to bf16 casts these float buffers too; the kernels still get what they need.
        cast = copy.deepcopy(twin).to(torch.bfloat16)
        assert rel_error(cast(x), expected) < 1e-2


def test_input_on_another_device_is_refused():
    twin = RiverQuantLinear.from_linear(make_linear(), nbits=4, group_size=64)
    with pytest.raises(RuntimeError, match="packed for cpu"):
        twin(torch.empty(2, IN, device="meta"))


def test_bench_kernels_example_runs(capsys):
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "scripts" / "bench_kernels.py"
    spec = importlib.util.spec_from_file_location("bench_kernels", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    results = bench.main(["--sizes", "64x32,128x64", "--weights", "2", "--rounds", "3", "--warmup", "1"])
    assert set(results) == {(64, 32), (128, 64)}
    assert "hqq fallback, 4-bit g64" in results[(64, 32)] and "hqq fallback, 4-bit g64" not in results[(128, 64)]
    assert "| 128x64 | int4pack_cpu, 4-bit g64 |" in capsys.readouterr().out
