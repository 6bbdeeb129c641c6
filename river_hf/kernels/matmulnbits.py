"""The `matmulnbits_cpu` twin kernel: ONNX Runtime's `MatMulNBits` (com.microsoft), run one linear at a time.

Why a second runtime: on AVX2-only CPUs torch 2.13 has no fast 4-bit GEMV (its int4 kernel gains ~1.4x over a bf16
GEMV at Llama-3.2-1B's shapes, bound by unpacking), while ONNX Runtime's MLAS kernel, with `accuracy_level=4`,
rounds the activations to int8 per block of K and runs integer dot products: 2.2-2.9x a bf16 GEMV at its 2048x8192
and 8192x2048 shapes when torch's OpenMP threads do not spin long (`GOMP_SPINCOUNT=10000`; build timings in the
AVX2 records of docs/activations.md). It quantizes
activations, so it is a `quantizes_activations` kernel: a river uses it only with `RiverQuantConfig(activations=
"int8")`. Each call also pays ONNX Runtime's own overhead, so at small shapes (SmolLM2's 576-wide linears) it loses
to torch's kernels and `backend="fastest"` does not pick it.

HQQ's zero points are floats; MLAS is fast only with integer ones (uint8; with float zero points it took a ~50x
slower path in ad-hoc timings). So each group's zero is split: the kernel gets round(zero), and the rest,
(zero - round(zero)) * scale per (row, group), is subtracted after the kernel, in the same ONNX graph, as x's group
sums [M, G] times [G, N]: exactly HQQ's weight (W_q - zero) * scale, up to the kernel's int8 rounding of x.

onnxruntime and onnx are optional (`pip install river-hf[ort]`); without them the kernel is simply not offered.
"""

from __future__ import annotations

import importlib.util
import os
import threading
import warnings

import numpy as np
import torch

from .opaque_calls import OpaqueCall

REQUIRED_MODULES = ("onnxruntime", "onnx")
# MLAS's int8-activation path (CompInt8). Levels 0-3 compute in fp32 and were slower than a bf16 GEMV on AVX2.
_ACCURACY_LEVEL = 4
# Below this many weights a call runs on one thread: waking a second one (ORT's threads must not spin, torch needs
# the cores between calls) cost more than it saved (ad-hoc timings on a 2-core AVX2 EPYC: 58 vs 104 µs at 576x192,
# 95 vs 115 at 576x1536; from 2048x2048 up two threads won: 294 vs 363 µs, 895 vs 1440 at 2048x8192).
_ONE_THREAD_BELOW = 1 << 22


# How torch's OpenMP threads wait after a parallel region: read once, when torch loads its OpenMP runtime, so river_hf
# cannot change it for a running process. Spinning threads take the core ONNX Runtime's second thread needs.
OPENMP_WAIT_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def warn_if_openmp_spins() -> None:
    """Say once, where twins run on this kernel with more than one thread, that torch's OpenMP threads spin by
    default and how to stop it (measured in docs/activations.md)."""
    if torch_threads() > 1 and not any(name in os.environ for name in OPENMP_WAIT_VARIABLES):
        warnings.warn("river_hf: some twins run on 'matmulnbits_cpu' (ONNX Runtime), whose second thread shares a "
                      "core with torch's OpenMP threads while they spin after each parallel region. Export "
                      "GOMP_SPINCOUNT=10000 before starting Python: at Llama-3.2-1B's shape on a 2-core AVX2 CPU "
                      "full quantization ran 1.49x the backbone without it, 1.57-2.12x with it "
                      "(docs/activations.md).", UserWarning, stacklevel=3)


def torch_threads() -> int:
    return torch.get_num_threads()


def available() -> bool:
    return all(importlib.util.find_spec(name) is not None for name in REQUIRED_MODULES)


def shape_problem(out_features: int, in_features: int, group_size: int | None) -> str | None:
    if group_size is None:
        return "per-row codes: MatMulNBits needs a group size (a power of two from 16)"
    if group_size < 16 or group_size & (group_size - 1) or in_features % group_size:
        return f"`group_size`={group_size} is not a power of two from 16 that divides {in_features}"
    return None


def pack(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size, nbits: int) -> dict:
    """HQQ codes [N, K], scale and zero [N, G] -> MatMulNBits' inputs, kept as buffers (portable: plain bytes)."""
    rows, cols = codes.shape
    groups = scale.shape[1]
    blocks = codes.to(torch.uint8).reshape(rows, groups, cols // groups)
    integral_zero = zero.float().round().clamp(0, 2 ** nbits - 1)
    return {"qweight": _two_per_byte(blocks) if nbits == 4 else blocks.contiguous(),  # [N, G, bytes per group]
            "kernel_scale": scale.float().reshape(-1).contiguous(),  # [N * G]
            "kernel_zero": _zero_points(integral_zero.to(torch.uint8), nbits),
            # what round(zero) left out, as a correction subtracted from the kernel's output: [G, N]
            "zero_residual": ((zero.float() - integral_zero) * scale.float()).t().contiguous()}


def _two_per_byte(values: torch.Tensor) -> torch.Tensor:  # [..., 2n] 4-bit values -> [..., n], low nibble first
    return (values[..., 0::2] | (values[..., 1::2] << 4)).contiguous()


def _zero_points(zero: torch.Tensor, nbits: int) -> torch.Tensor:  # uint8 [N, G] -> MatMulNBits' zero points
    if nbits == 8:
        return zero.reshape(-1).contiguous()
    if zero.shape[1] % 2:  # 4-bit zero points are packed per row, a row's last byte padded
        zero = torch.cat([zero, torch.zeros_like(zero[:, :1])], dim=1)
    return _two_per_byte(zero).reshape(-1)


def concatenate(buffer_sets: list[dict]) -> dict:
    """The buffers of linears that share K, bits and group size, stacked along N (output features) in order: one
    MatMulNBits call for them all (river_hf.kernels.shared_inputs)."""
    def stacked(name, dim=0):
        return torch.cat([buffers[name] for buffers in buffer_sets], dim=dim).contiguous()

    # kernel_scale and kernel_zero are flat but laid out row after row (4-bit zero points padded per row)
    return {"qweight": stacked("qweight"), "kernel_scale": stacked("kernel_scale"),
            "kernel_zero": stacked("kernel_zero"), "zero_residual": stacked("zero_residual", dim=1)}


def codes(module) -> torch.Tensor:
    """The [N, K] codes back from the packed bytes."""
    packed = module.qweight
    if module.nbits == 4:
        packed = torch.stack([packed & 15, packed >> 4], dim=-1)
    return packed.reshape(module.out_features, module.in_features)


def prepack(buffers: dict, nbits: int) -> "MatMulNBits":
    return MatMulNBits(buffers, nbits)


class MatMulNBits(OpaqueCall):
    """One ONNX Runtime session holding one linear's weight. `__call__(x [M, K] float)` -> fp32 [M, N] (an
    OpaqueCall: a captured step calls it through a custom op)."""

    def __init__(self, buffers: dict, nbits: int):
        rows, groups, group_bytes = buffers["qweight"].shape
        super().__init__(rows)
        self._source = (buffers, nbits)  # to rebuild the session in a copy (copy.deepcopy, pickle)
        self.in_features = groups * group_bytes * 8 // nbits
        self.session = _session(buffers, self.in_features, rows, self.in_features // groups, nbits)
        # A decode step's single row goes through buffers bound once (binding costs more than the run itself), one
        # set per thread: two threads generating with one model must not share them
        self._per_thread = threading.local()

    def _row_binding(self):
        bound = getattr(self._per_thread, "row", None)
        if bound is None:
            # Normal tensors even when the first call runs under torch.inference_mode: an inference tensor cannot be
            # written in place by a later call outside it
            with torch.inference_mode(False):
                row_in, row_out = torch.empty(1, self.in_features), torch.empty(1, self.out_features)
            bound = self._per_thread.row = (row_in, row_out, self._bind(row_in, row_out))
        return bound

    def __reduce__(self):
        return MatMulNBits, self._source

    def _bind(self, x: torch.Tensor, y: torch.Tensor):
        binding = self.session.io_binding()
        binding.bind_input("A", "cpu", 0, np.float32, list(x.shape), x.data_ptr())
        binding.bind_output("Y", "cpu", 0, np.float32, list(y.shape), y.data_ptr())
        return binding

    def compute(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if rows == 1:
            row_in, row_out, binding = self._row_binding()
            row_in.copy_(x)
            self.session.run_with_iobinding(binding)
            return row_out.clone()  # the bound row is reused by the next call
        x = x.float().contiguous()  # held here: the binding keeps only its address
        y = torch.empty(rows, self.out_features)
        self.session.run_with_iobinding(self._bind(x, y))
        return y


def _session(buffers: dict, in_features: int, out_features: int, block: int, nbits: int):
    import onnxruntime
    from onnx import TensorProto, helper

    def constant(name, tensor, dtype):
        array = (tensor.float() if dtype == TensorProto.FLOAT else tensor).contiguous().numpy()
        return helper.make_tensor(name, dtype, array.shape, array.tobytes(), raw=True)

    groups = in_features // block
    nodes = [
        helper.make_node("MatMulNBits", ["A", "B", "scales", "zero_points"], ["Y_kernel"], domain="com.microsoft",
                         K=in_features, N=out_features, bits=nbits, block_size=block, accuracy_level=_ACCURACY_LEVEL),
        # The zero points' fractional part, in the same run (one call from Python, not four torch ops):
        # Y = Y_kernel - group_sums(A) @ zero_residual
        helper.make_node("Reshape", ["A", "grouped_shape"], ["A_grouped"]),
        helper.make_node("ReduceSum", ["A_grouped", "last_axis"], ["group_sums"], keepdims=0),
        helper.make_node("MatMul", ["group_sums", "zero_residual"], ["correction"]),
        helper.make_node("Sub", ["Y_kernel", "correction"], ["Y"])]
    graph = helper.make_graph(
        nodes, "river_twin_linear",
        [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["M", in_features])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["M", out_features])],
        [constant("B", buffers["qweight"], TensorProto.UINT8),
         constant("scales", buffers["kernel_scale"], TensorProto.FLOAT),
         constant("zero_points", buffers["kernel_zero"], TensorProto.UINT8),
         constant("zero_residual", buffers["zero_residual"], TensorProto.FLOAT),
         helper.make_tensor("grouped_shape", TensorProto.INT64, [3], [-1, groups, block]),
         helper.make_tensor("last_axis", TensorProto.INT64, [1], [2])])
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = 1 if in_features * out_features < _ONE_THREAD_BELOW else torch.get_num_threads()
    # Its threads must not spin between calls: torch runs the rest of the step on the same cores
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.log_severity_level = 3
    return onnxruntime.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
