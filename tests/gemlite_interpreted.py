"""The gemlite twin kernels run on a CPU, in Triton's interpreter: their layouts, zero-point correction and read-back
checked against HQQ's weight where no GPU is lent (tests/test_gemlite_interpreted.py runs each check here in its
own process; tests/test_cuda_kernels.py runs them on a GPU).

Why a separate process: gemlite reads the GPU when it is imported, so `pretend_gpu()` patches torch.cuda and
Triton's driver for good. The interpreter runs the same Triton programs as the GPU (emulated in numpy, slowly, with
gemlite's default launch configuration instead of its autotuning), so a wrong packing, a wrong sign or a wrong
correction shows here; speed, CUDA graphs and the GPU's own code generation do not.

Needs `triton` and `gemlite` importable (`pip install --no-deps triton gemlite`, ~1 GB); `python
tests/gemlite_interpreted.py CHECK` runs one check, exit status 0 when it holds.
"""

from __future__ import annotations

import os
import sys
import types

os.environ["TRITON_INTERPRET"] = "1"  # read when triton is imported: before anything imports it

import torch  # noqa: E402

H100 = types.SimpleNamespace(name="NVIDIA H100 80GB HBM3", major=9, minor=0, multi_processor_count=132,
                             total_memory=80 * 2 ** 30, L2_cache_size=50 * 2 ** 20)
GEMLITE_BACKENDS = ("gemlite_int8_cuda", "gemlite_int4_cuda")
# The interpreter computes nonsense in bf16 (NaN, 1e10 errors: gemlite's own layers too) and right in float16; the
# kernels' dtype is a flag in the same programs (river_hf.kernels.gemlite_kernels.ACTIVATION_DTYPE)
DTYPE = torch.float16


def pretend_gpu() -> None:
    """What gemlite reads at import (compute capability, SM count, Triton's target) answered as an H100 would; the
    river_hf kernels that need CUDA re-registered for the CPU, where the interpreter runs them."""
    import triton
    from triton.backends.compiler import GPUTarget

    cuda_is_available, torch.cuda.is_available = torch.cuda.is_available, lambda: True
    torch.cuda.get_device_capability = lambda *args, **kwargs: (H100.major, H100.minor)
    torch.cuda.get_device_name = lambda *args, **kwargs: H100.name
    torch.cuda.get_device_properties = lambda *args, **kwargs: H100

    class InterpretedDriver:
        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_current_device(self):
            return 0

        def get_active_torch_device(self):
            return torch.device("cpu")

        def get_benchmarker(self):  # autotuning gemlite's GEMMs (prompts): no timing here, every setting ties
            return lambda kernel_call, quantiles=None, **kwargs: [1.0] * len(quantiles or [0])

        utils = types.SimpleNamespace(get_device_properties=lambda device: {  # an H100's, for launch settings
            "max_shared_mem": 228 * 1024, "multiprocessor_count": H100.multi_processor_count})

    triton.runtime.driver.set_active(InterpretedDriver())
    import gemlite

    torch.cuda.is_available = cuda_is_available  # read at import only; torch.compile asks it again (CUDA's RNG)
    from gemlite.triton_kernels.config import set_autotune
    set_autotune(False)  # gemlite's default launch settings: autotuning times kernels on a GPU
    # The interpreter has no bf16 atomic add: split-K partial sums go through an fp32 output (the GPU adds them in
    # bf16 on sm90, a rounding difference only)
    gemlite.set_native_atomic_bfp16(False)
    from river_hf.kernels import gemlite_kernels, registry
    gemlite_kernels.ACTIVATION_DTYPE = DTYPE
    for name in GEMLITE_BACKENDS:
        registry.KERNELS[name] = registry.KERNELS[name]._replace(device_type="cpu", activation_dtype=DTYPE)


def hqq_reference(linear, nbits, group_size):
    from river_hf.kernels.quantize import hqq_quantize
    from river_hf.kernels.registry import dequantize

    codes, scale, zero = hqq_quantize(linear.weight, nbits, group_size)
    return codes, dequantize(codes, scale, zero)  # [N, K] float32: HQQ's weight


def check_kernel(backend: str, nbits: int, group_size: int | None) -> None:
    """The kernel's output is x @ HQQ's weight (bf16 output rounding aside), for a decode row and a short prompt;
    its read-back codes are HQQ's, and a twin packed again from them computes the same."""
    from torch import nn

    from river_hf.kernels.quantize import RiverQuantLinear

    torch.manual_seed(0)
    linear = nn.Linear(256, 96, bias=False, dtype=DTYPE)
    twin = RiverQuantLinear.from_linear(linear, nbits, group_size, backend=backend)
    assert twin.backend == backend, twin.backend
    codes, weight = hqq_reference(linear, nbits, group_size)
    for rows in (1, 3):
        x = torch.randn(rows, 256, dtype=DTYPE)
        reference = x.float() @ weight.t()
        error = ((twin(x).float() - reference).abs().max() / reference.abs().max()).item()
        assert error < 0.01, f"{backend} {nbits}-bit, {rows} rows: {error:.4f} of the output's range"
    assert torch.equal(twin.codes(), codes), "the codes read back from gemlite's layout are not HQQ's"
    again = RiverQuantLinear.from_codes(codes, twin.scale, twin.zero, nbits=nbits, group_size=group_size,
                                        backend=backend)
    assert torch.equal(again(x), twin(x))


def check_int8_zero_is_exact() -> None:
    """Zero points far from 128 (a skewed row): the rank-1 correction makes gemlite's symmetric int8 kernel compute
    HQQ's asymmetric weight, not the weight shifted by the zero's rounding."""
    from torch import nn

    from river_hf.kernels.quantize import RiverQuantLinear

    torch.manual_seed(1)
    linear = nn.Linear(128, 64, bias=False, dtype=DTYPE)
    with torch.no_grad():
        linear.weight.add_(torch.rand(64, 1, dtype=DTYPE) * 0.3)  # every row shifted: zeros far from 128
    twin = RiverQuantLinear.from_linear(linear, 8, None, backend="gemlite_int8_cuda")
    _, weight = hqq_reference(linear, 8, None)
    x = torch.randn(1, 128, dtype=DTYPE)
    reference = x.float() @ weight.t()
    error = ((twin(x).float() - reference).abs().max() / reference.abs().max()).item()
    assert error < 0.01, f"{error:.4f} of the output's range"


def check_river() -> None:
    """A tiny river whose twins (4-bit) and head (8-bit) run on the gemlite kernels: tau > 1 is the backbone; every
    step exiting keeps every KV slot and gives the tokens of a plain model whose layers are those twins."""
    sys.path.insert(0, os.path.dirname(__file__))
    from conftest import assert_full_quantization_is_exact, generate, river_of, tiny_model

    ids = torch.randint(3, 256, (1, 8))
    for backend, nbits, head in (("gemlite_int4_cuda", 4, False), ("gemlite_int8_cuda", 8, True)):
        model = tiny_model().to(DTYPE)
        plain = generate(model, ids).sequences
        river = river_of(model, backend=backend, nbits=nbits, group_size=None if nbits == 8 else 64,
                         quantize_lm_head=head, lm_head_nbits=8)
        assert {twin.backend for twin in river.modules() if hasattr(twin, "kernel_inputs")} == {backend}
        if head:
            assert_full_quantization_is_exact(river, ids, plain)
        else:
            assert torch.equal(generate(river, ids, tau=1.5).sequences, plain)
            generate(river, ids, tau=-1).cache.check_kv_integrity()


def check_compiled() -> None:
    """Traced by torch.compile (gemlite's custom op and its fake implementation, as in a captured decode step), each
    kernel computes what it does eagerly."""
    from torch import nn

    from river_hf.kernels.quantize import RiverQuantLinear

    for backend, nbits, group_size in (("gemlite_int8_cuda", 8, None), ("gemlite_int4_cuda", 4, 64)):
        torch.manual_seed(2)
        twin = RiverQuantLinear.from_linear(nn.Linear(128, 64, bias=False, dtype=DTYPE), nbits, group_size,
                                            backend=backend)
        x = torch.randn(1, 128, dtype=DTYPE)
        compiled = torch.compile(twin, fullgraph=True)
        torch.testing.assert_close(compiled(x), twin(x), atol=0, rtol=0)


CHECKS = {"int8": lambda: check_kernel("gemlite_int8_cuda", 8, None),
          "int4": lambda: check_kernel("gemlite_int4_cuda", 4, 64),
          "int2": lambda: check_kernel("gemlite_int4_cuda", 2, 64),
          "int8_zero": check_int8_zero_is_exact,
          "river": check_river,
          "compiled": check_compiled}

if __name__ == "__main__":
    pretend_gpu()
    torch.set_num_threads(1)
    for name in sys.argv[1:] or CHECKS:
        CHECKS[name]()
        print(f"{name}: holds")
