"""Kernels whose weight lives in an object dynamo cannot put in a graph, made traceable: `OpaqueCall`.

fbgemm's packed weight (`w8a8_cpu`) is a TorchScript object and ONNX Runtime's session (`matmulnbits_cpu`) a plain
Python one; dynamo traces neither, so called directly they broke every captured decode step in two at each such
linear (measured on the AMX Xeon: a SmolLM2 river with a W8A8 LM head compiled in 50 s instead of 11 and ran 1.84x
the compiled backbone instead of 1.93x; docs/activations.md). Under torch.compile an `OpaqueCall` goes through one
custom op, `river_hf::opaque_matmul`, which takes the call's *handle*, an int the graph keeps as a constant, and
finds the call at run time. Eager calls skip the op's dispatch and call the kernel directly (a few µs a call counts
at batch-1 decoding).

Handles live as long as their `OpaqueCall` (a weak registry, so a freed module frees its kernel); a copy
(copy.deepcopy, pickle) and a module packed again get new ones, which dynamo's guard on the constant notices.
Subclasses: fbgemm_w8a8.FbgemmLinear, matmulnbits.MatMulNBits, shared_inputs.GroupMember.
"""

from __future__ import annotations

import itertools
import weakref

import torch


class OpaqueCall:
    """A kernel call `(x [M, K]) -> fp32 [M, out_features]` that a captured graph can hold. Subclasses compute in
    `compute` and say in `__reduce__` how to build a copy (which then registers under a handle of its own)."""

    def __init__(self, out_features: int):
        self.out_features = out_features
        self.handle = next(_HANDLES)
        OPAQUE_CALLS[self.handle] = self

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return opaque_matmul(x, self.handle, self.out_features)
        return self.compute(x)

    def compute(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def __reduce__(self):
        raise NotImplementedError(f"{type(self).__name__} must say how to copy itself (a copied handle would call "
                                  f"the original's kernel)")


_HANDLES = itertools.count()
# handle -> OpaqueCall, for as long as something (a module's kernel_inputs) holds the call
OPAQUE_CALLS: "weakref.WeakValueDictionary[int, OpaqueCall]" = weakref.WeakValueDictionary()


@torch.library.custom_op("river_hf::opaque_matmul", mutates_args=())
def opaque_matmul(x: torch.Tensor, handle: int, out_features: int) -> torch.Tensor:
    """x [M, K] -> fp32 [M, out_features] through the call registered under `handle`."""
    return OPAQUE_CALLS[handle].compute(x)


@opaque_matmul.register_fake
def _(x, handle, out_features):
    return x.new_empty(x.shape[0], out_features, dtype=torch.float32)
