"""Twin linears that read the same input run as one call: attention's q/k/v projections, the MLP's gate/up
projections. Two ways, by kernel:

- **Stacked siblings** (`stack_siblings`, the CPU weight-only kernels int8pack, int4pack and dense): the members'
  packed buffers, concatenated, are one [sum of N, K] twin linear, `StackedSiblings.stacked` (these kernels lay a
  weight out row by row; that the stack computes each member's rows bit for bit is checked on a probe at build),
  and each member keeps views of its rows, so nothing is stored twice (a saved river's next load on the machine
  maps the stack its packed-twins cache kept: river_hf.saving.packed_cache, `stacked_members`). Why: at
  SmolLM2's size a 2-core CPU spends as much on a GEMV call's fixed cost as on its bytes. Compiled, an 8-bit
  layer's q/k/v took 203 µs as three calls (int8pack for q, dense for k and v) and 134 µs as one int8pack call, its
  gate/up 301 against 276; a 4-bit layer's q/k/v 201 against 109, gate/up 193 against 161
  (benchmarks/scripts/stacked_gemv.py on a 2-core Ice Lake Xeon: ~3 ms of a SmolLM2 step; docs/static-cache.md).
  Stacked where every member already runs on one such kernel, and with `backend="fastest"` also where the members
  run on different ones and the stacked shape timed faster than their kernels summed (by `TIE_MARGIN`; an 8-bit
  layer's k/v, dense, join q on int8pack). Inside a captured step the members' calls become one matmul and its
  split in the graph; dynamo sees the same input tensor go to each member.
- **One MatMulNBits session** (`fuse_shared_inputs`, `activations="int8"`): the group below.

The rest of this docstring is about the second; both share how a member finds its rows (`_input_key`).

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


# Kernels whose packed buffers hold each output row apart, along dim 0 (`scales_and_zeros`: dim 1)
ROW_STACKED_KERNELS = ("int8pack_cpu", "int8pack_fp32_cpu", "int4pack_cpu", "dense")
_ROW_DIM = {"scales_and_zeros": 1}


class StackedSiblings:
    """Sibling twin linears' rows as one twin linear: the first member called with an input computes every member's
    rows in one GEMV and keeps the others' parts for their calls with the same input; any other call computes
    afresh, so every call order is exact. Eagerly the parts wait per thread, keyed by the input's storage and version
    (as in `SharedInputGroup`); while dynamo traces a step, in `traced`, keyed by the traced tensor itself: the graph
    holds one matmul and its split, and `traced` is None again once the last member took its part."""

    def __init__(self, stacked: RiverQuantLinear, sizes: list[int]):
        self.stacked, self.sizes = stacked, sizes
        self.traced = None
        self._pending = threading.local()

    def __getstate__(self):  # deepcopy / pickle: nothing pending is copied
        return {"stacked": self.stacked, "sizes": self.sizes, "traced": None}

    def __setstate__(self, state):
        self.__dict__.update(state, _pending=threading.local())

    def output(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Member `index`'s rows of the stacked linear at x [..., K] (what the member computes alone, bit for bit)."""
        tracing = torch.compiler.is_compiling()
        key = x if tracing else _input_key(x)
        pending = self.traced if tracing else getattr(self._pending, "parts", None)
        if pending is not None and _same(pending[0], key, tracing) and pending[1][index] is not None:
            parts = list(pending[1])
            part, parts[index] = parts[index], None
            kept = None if all(left is None for left in parts) else (pending[0], parts, x)
        else:
            parts = list(self.stacked(x).split(self.sizes, dim=-1))
            part, parts[index] = parts[index], None
            kept = (key, parts, x)  # x kept too: its storage cannot be reused by another tensor while it is a key
        if tracing:
            self.traced = kept
        else:
            self._pending.parts = kept
        return part


def _same(kept_key, key, tracing: bool) -> bool:
    return kept_key is key if tracing else kept_key == key


def stack_siblings(twin: nn.Module, quant_config) -> int:
    """Stack each group of `twin`'s sibling linears where it pays (module docstring). Returns how many groups."""
    stacked = 0
    for parent, names in sibling_groups(twin):
        members = [parent._modules[name] for name in names]
        if any(m.siblings is not None or isinstance(m.kernel_inputs, GroupMember) for m in members):
            continue
        backend = _stack_backend(members, quant_config)
        if backend is not None and _stack(parent, names, members, backend):
            stacked += 1
    return stacked


def _stack_backend(members: list[RiverQuantLinear], quant_config) -> str | None:
    """The kernel the stack runs on, or None where stacking does not pay (or cannot run)."""
    if len({(m.bias is None) for m in members}) > 1:
        return None
    shared = {m.backend for m in members}
    if len(shared) == 1:  # fewer calls of the same kernel: timed alone, hot in cache, a stack can look slower, but
        # in a step whose weights stream from memory the call's fixed cost decides (module docstring)
        return shared.pop() if shared <= set(ROW_STACKED_KERNELS) else None
    if quant_config.backend != "fastest":
        return None
    first, activations = members[0], quant_config.activations
    total = sum(member.out_features for member in members)
    stacked = fastest_backend(first.nbits, first.group_size, total, first.in_features, first.scale.device,
                              activations)
    separate = [fastest_backend(m.nbits, m.group_size, m.out_features, m.in_features, m.scale.device, activations)
                for m in members]
    if stacked.backend not in ROW_STACKED_KERNELS or any(m.backend not in c.microseconds
                                                         for m, c in zip(members, separate)):
        return None
    own = sum(choice.microseconds[member.backend] for member, choice in zip(members, separate))
    return stacked.backend if stacked.microseconds[stacked.backend] * TIE_MARGIN <= own else None


@torch.no_grad()
def _stack(parent: nn.Module, names: tuple[str, ...], members: list[RiverQuantLinear], backend: str) -> bool:
    """Put `members` (the linears `names` of `parent`) into one stack on `backend`; False, leaving them as they are,
    where the stack does not compute each member's rows exactly (checked on a probe input)."""
    members = [member if member.backend == backend else _repacked(member, backend) for member in members]
    first, sizes = members[0], [member.out_features for member in members]
    # the kernels' layouts keep rows apart: the stack's buffers are the members' own, concatenated (no repacking,
    # so a river loaded from packed twins stays unpacked)
    buffers = {name: torch.cat([member._buffers[name] for member in members], dim=_ROW_DIM.get(name, 0))
               for name, tensor in first._buffers.items() if tensor is not None and name != "bias"}
    bias = None if first.bias is None else torch.cat([member.bias for member in members])
    stack = RiverQuantLinear(first.in_features, sum(sizes), first.nbits, first.group_size, backend, buffers, bias)
    probe = torch.randn(2, first.in_features, generator=torch.Generator().manual_seed(0)).to(first.scale.device,
                                                                                             torch.bfloat16)
    if not all(torch.equal(part, member.compute(probe))
               for part, member in zip(stack.compute(probe).split(sizes, dim=-1), members)):
        return False
    for name, member, view in zip(names, members, stacked_members(stack, sizes)):
        view.source_fingerprint = member.source_fingerprint
        parent._modules[name] = view
    return True


def stacked_members(stack: RiverQuantLinear, sizes: list[int]) -> list[RiverQuantLinear]:
    """The members of `stack`, whose out_features are `sizes` in order: each a twin linear on its rows of the stack's
    buffers, whose calls the stack answers (`StackedSiblings`)."""
    group = StackedSiblings(stack, sizes)
    rows = {name: tensor.split(sizes, dim=_ROW_DIM.get(name, 0)) for name, tensor in stack._buffers.items()
            if tensor is not None}
    members = []
    for index, size in enumerate(sizes):
        # a member still runs alone (a call with another input): the few strided views (int4's scales) are copied
        own = {key: parts[index] if parts[index].is_contiguous() else parts[index].contiguous()
               for key, parts in rows.items()}
        bias = own.pop("bias", None)
        member = RiverQuantLinear(stack.in_features, size, stack.nbits, stack.group_size, stack.backend, own, bias)
        member.siblings, member.sibling_index = group, index
        members.append(member)
    return members


def _repacked(member: RiverQuantLinear, backend: str) -> RiverQuantLinear:
    """`member`'s codes packed for `backend` (a stack chosen by timing may run on another kernel than a member)."""
    repacked = RiverQuantLinear.from_codes(member.codes(), member.scale, member.zero, member.bias, member.nbits,
                                           member.group_size, backend)
    repacked.source_fingerprint = member.source_fingerprint
    return repacked


def unstack(twin: nn.Module) -> int:
    """Let every stacked member of `twin` run alone again, on its own rows (for A/B timings). Returns how many."""
    members = [module for module in twin.modules()
               if isinstance(module, RiverQuantLinear) and module.siblings is not None]
    for member in members:
        member.siblings = None
    return len(members)


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
