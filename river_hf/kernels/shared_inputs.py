"""Twin linears that read the same input run as one `matmulnbits_cpu` call: attention's q/k/v projections, the MLP's
gate/up projections.

Why: each ONNX Runtime call costs time besides its matmul (the session run, waking its second thread), paid ~7
times per layer and step. One call for q, k and v (and one for gate and up) pays it 4 times instead of 7. HF's
attention and MLP code stays as it is: it still calls `q_proj(h)`, `k_proj(h)`, `v_proj(h)` one after the other.
The group's first member to be called computes every member's rows in one run and keeps the others' parts for their
own calls, which take them if they get the same input (same storage, shape and version counter: nothing wrote to it
since); any other input, or a second call, computes afresh. So any call order stays exact; only the fast path
relies on HF's convention of calling the members back to back on one tensor.

Each member keeps its own buffers (a saved river stores them as before); only its `kernel_inputs`, the ONNX Runtime
session, is replaced by the group's. Moving or re-loading a member (`_apply`, `load_state_dict`) gives it back a
session of its own: slower, still exact.

When (`activations="int8"` and `backend` "fastest" or "matmulnbits_cpu"): where every member already runs on
`matmulnbits_cpu` (fewer calls of the same kernel: on a 2-core AVX2 CPU 1.09-1.20x faster decoding at SmolLM2's
size, never slower at 1B; benchmarks/scripts/shared_inputs.py, docs/activations.md). With `backend="fastest"`, also
where the concatenated shape timed on `matmulnbits_cpu` beats the members' own chosen kernels summed by `TIE_MARGIN`
(river_hf.kernels.choice; the concatenated shape's timing is one more entry in `measured_choices()`); its members then
run on `matmulnbits_cpu` even where another kernel won at their own shape.
"""

from __future__ import annotations

import threading

import torch
from torch import nn

from . import matmulnbits as ort_kernel
from .choice import TIE_MARGIN, fastest_backend
from .opaque_calls import OpaqueCall
from .quantize import RiverQuantLinear

# Members by their HF names, in calling order. Llama, Mistral, Qwen2/3, Gemma and most decoder-only models use them.
SIBLING_NAMES = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
KERNEL = "matmulnbits_cpu"


class SharedInputGroup:
    """One MatMulNBits session for several linears' weights stacked along N."""

    def __init__(self, members: list[RiverQuantLinear]):
        self.sizes = [member.out_features for member in members]
        self.session = ort_kernel.prepack(ort_kernel.concatenate([member._buffers for member in members]),
                                          members[0].nbits)
        self._pending = threading.local()  # per thread: two threads generating with one model

    def __getstate__(self):  # deepcopy / pickle: the session rebuilds itself, nothing pending is copied
        return {"sizes": self.sizes, "session": self.session}

    def __setstate__(self, state):
        self.__dict__.update(state, _pending=threading.local())

    def output(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Member `index`'s rows of x [M, K] @ W.T (fp32 [M, N_index])."""
        key = _input_key(x)
        pending = getattr(self._pending, "parts", None)
        if pending is not None and pending[0] == key and pending[1][index] is not None:
            part, pending[1][index] = pending[1][index], None
            if all(kept is None for kept in pending[1]):
                self._pending.parts = None
            return part
        parts = list(self.session(x).split(self.sizes, dim=1))
        part, parts[index] = parts[index], None
        # The input itself is kept too: its storage cannot be freed and reused by another tensor while it is a key
        self._pending.parts = (key, parts, x)
        return part


def _input_key(x: torch.Tensor) -> tuple:
    # Inference-mode tensors have no version counter; nothing in an HF layer writes to its projections' input
    version = None if x.is_inference() else x._version
    return x.data_ptr(), x.dtype, tuple(x.shape), x.stride(), version


class GroupMember(OpaqueCall):
    """A member's `kernel_inputs`: called as its MatMulNBits session was, `(x [M, K]) -> fp32 [M, N]`."""

    def __init__(self, group: SharedInputGroup, index: int):
        super().__init__(group.sizes[index])
        self.group, self.index = group, index

    def compute(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.output(self.index, x)

    def __reduce__(self):  # copied with the module: the copy's members share the copied group
        return GroupMember, (self.group, self.index)


def sibling_groups(module: nn.Module) -> list[tuple[nn.Module, tuple[str, ...]]]:
    """(parent, member names) for every SIBLING_NAMES set whose members are all twin linears of one K, bits, group
    size and device under one parent."""
    found = []
    for parent in module.modules():
        for names in SIBLING_NAMES:
            members = [parent._modules.get(name) for name in names]
            if all(isinstance(member, RiverQuantLinear) for member in members) and len(
                    {(m.in_features, m.nbits, m.group_size, m.scale.device) for m in members}) == 1:
                found.append((parent, names))
    return found


def fuse_shared_inputs(twin: nn.Module, quant_config) -> int:
    """Make each group of `twin`'s sibling linears one `matmulnbits_cpu` call where `quant_config` allows it and it
    pays (module docstring). Returns how many groups were fused."""
    if quant_config.activations != "int8" or quant_config.backend not in ("fastest", KERNEL):
        return 0
    fused = 0
    for parent, names in sibling_groups(twin):
        if _fusion_pays([parent._modules[name] for name in names], quant_config.backend):
            group_siblings(parent, names)
            fused += 1
    return fused


def group_siblings(parent: nn.Module, names: tuple[str, ...]) -> list[RiverQuantLinear]:
    """Put `parent`'s linears `names` into one group, whether it pays or not (repacked onto KERNEL where they run on
    another kernel); returns the members now in place."""
    members = [on_matmulnbits(parent._modules[name]) for name in names]
    group = SharedInputGroup(members)
    for index, (name, member) in enumerate(zip(names, members)):
        member.kernel_inputs = GroupMember(group, index)
        parent._modules[name] = member
    return members


def _fusion_pays(members: list[RiverQuantLinear], backend: str) -> bool:
    first = members[0]
    if ort_kernel.shape_problem(first.out_features, first.in_features, first.group_size) is not None:
        return False
    if all(member.backend == KERNEL for member in members):
        return True  # fewer calls, same kernel: never slower end to end, faster at small layers (docs/activations.md)
    if backend == KERNEL:
        return False
    total = sum(member.out_features for member in members)
    stacked = fastest_backend(first.nbits, first.group_size, total, first.in_features, first.scale.device, "int8")
    separate = [fastest_backend(m.nbits, m.group_size, m.out_features, m.in_features, m.scale.device, "int8")
                for m in members]
    if KERNEL not in stacked.microseconds or any(m.backend not in c.microseconds for m, c in zip(members, separate)):
        return False
    own = sum(choice.microseconds[member.backend] for member, choice in zip(members, separate))
    return stacked.microseconds[KERNEL] * TIE_MARGIN <= own


def on_matmulnbits(member: RiverQuantLinear) -> RiverQuantLinear:
    """`member` itself if it runs on KERNEL, else the same codes repacked for it (its fingerprint carried over)."""
    if member.backend == KERNEL:
        return member
    repacked = RiverQuantLinear.from_codes(member.codes(), member.scale, member.zero, member.bias, member.nbits,
                                           member.group_size, KERNEL, activations="int8")
    repacked.source_fingerprint = member.source_fingerprint
    return repacked


def unfuse(twin: nn.Module) -> int:
    """Give every fused member of `twin` its own session again (for A/B timings). Returns how many members."""
    members = [module for module in twin.modules()
               if isinstance(module, RiverQuantLinear) and isinstance(module.kernel_inputs, GroupMember)]
    for member in members:
        member._prepack()
    return len(members)
