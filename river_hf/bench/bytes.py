"""The byte limit: bytes of weights one decoded token reads, computed from the modules, and what that bounds.

A batch-1 decode step on CPU is memory-bound: every weight it uses is read from memory once. So the bytes a token
reads give the speed-up a purely memory-bound decode could reach (`byte_ratio` = backbone bytes / system bytes), and
a system's measured `speed_ratio` as a share of it says how far it is from that limit (`share_of_byte_limit`).

What a token reads, per module:
- a decoder layer: its parameters and buffers; a twin: its own norms and, for each `RiverQuantLinear`, only what the
  kernel's matmul reads (`qweight` and `scales_and_zeros` / `kernel_scale` / `zero_shift`, plus `bias`; HQQ's fp32
  `scale`/`zero` meta only on the 'hqq' backend, which dequantizes from them on every call);
- the embedding: one row (`hidden_size * element_size`), not the table;
- the parameters outside the layers (the final norm);
- the LM head: its whole weight, even when it is tied to the embedding; the quantized head's kernel buffers for the
  steps that exited (`quantize_lm_head`).
A river token of exit depth d runs layers < d on the backbone and the rest on their twins; its expected bytes come
from the measured exit-depth histogram.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ..core.architectures import find_decoder_layers
from ..core.twins import RiverLayer
from ..core.lm_head import RiverLMHead
from ..kernels.quantize import RiverQuantLinear

HQQ_META = ("scale", "zero")  # HQQ's fp32 per-group meta: read only by the 'hqq' backend's dequantization


def read_bytes(module: nn.Module | None) -> int:
    """Bytes one batch-1 call of `module` reads from its weights (every tensor once)."""
    if module is None:
        return 0
    seen: set[int] = set()
    total = 0
    for sub in module.modules():
        skip = HQQ_META if isinstance(sub, RiverQuantLinear) and sub.backend != "hqq" else ()
        tensors = [t for name, t in (*sub.named_parameters(recurse=False), *sub.named_buffers(recurse=False))
                   if name not in skip and t is not None]
        for tensor in tensors:
            if id(tensor) not in seen:
                seen.add(id(tensor))
                total += tensor.numel() * tensor.element_size()
    return total


@dataclass
class ByteTable:
    """Per decoder layer, the bytes of its backbone layer and of what replaces it past the exit (its twin, or the
    backbone layer where it has none); the bytes outside the layers; the full and the quantized LM head."""

    backbone_layers: list[int]
    twin_layers: list[int]
    outside: int         # the embedding row and the parameters outside the layers (the final norm)
    head: int
    quantized_head: int | None  # None: exited steps use the full head too

    @property
    def num_layers(self) -> int:
        return len(self.backbone_layers)

    def at_depth(self, depth: int) -> int:
        """Bytes of a token that ran layers < depth on the backbone (depth = num_layers: never exited)."""
        exited = depth < self.num_layers
        head = self.quantized_head if exited and self.quantized_head is not None else self.head
        return sum(self.backbone_layers[:depth]) + sum(self.twin_layers[depth:]) + self.outside + head

    def expected(self, histogram: dict) -> float:
        """Mean bytes per token over an exit-depth histogram {depth (int or str): tokens}."""
        total = sum(histogram.values())
        if not total:
            return float(self.at_depth(self.num_layers))
        return sum(self.at_depth(int(depth)) * count for depth, count in histogram.items()) / total


def byte_table(model: nn.Module) -> ByteTable:
    """The table of a river model or of a plain one (a plain layer is its own 'twin': it runs at every depth)."""
    backbone, twins = [], []
    for layer in find_decoder_layers(model):
        if isinstance(layer, RiverLayer):
            backbone.append(read_bytes(layer.base_layer))
            twins.append(read_bytes(layer.twin) if layer.twin is not None else backbone[-1])
        else:
            backbone.append(read_bytes(layer))
            twins.append(backbone[-1])
    head = model.get_output_embeddings()
    full_head, quantized = (head.base_head, head.quantized_head) if isinstance(head, RiverLMHead) else (head, None)
    return ByteTable(backbone, twins, _outside_bytes(model), read_bytes(full_head),
                     None if quantized is None else read_bytes(quantized))


def _outside_bytes(model: nn.Module) -> int:
    """One embedding row plus the parameters of the layer list's siblings other than the embedding (the final
    norm; the rotary embedding has buffers only, derived per step)."""
    embedding = model.get_input_embeddings()
    row = embedding.weight.shape[1] * embedding.weight.element_size()
    layers = find_decoder_layers(model)
    parent = next(module for module in model.modules() if any(child is layers for child in module.children()))
    siblings = [child for child in parent.children() if child is not layers and child is not embedding]
    return row + sum(p.numel() * p.element_size() for child in siblings for p in child.parameters())


def system_bytes(model: nn.Module, histogram: dict | None) -> float:
    """Bytes per decoded token of a system run on `model`: over its exit-depth histogram when it has one (the
    river's systems), else the model as it runs without a router (every layer as it is, the full head)."""
    table = byte_table(model)
    return table.expected(histogram) if histogram else float(table.at_depth(table.num_layers))


def add_byte_limits(records: list[dict], models: list[nn.Module]) -> None:
    """Add `weight_bytes_per_token`, `byte_ratio` and `share_of_byte_limit` to each system record's summary
    (`models[i]`: the model system i ran on); the first system of kind 'backbone' is the reference."""
    for record, model in zip(records, models):
        record["summary"]["weight_bytes_per_token"] = system_bytes(model, record["summary"]["exit_depth_histogram"])
    base = next((r["summary"]["weight_bytes_per_token"] for r in records if r["kind"] == "backbone"), None)
    for record in records:
        summary = record["summary"]
        summary["byte_ratio"] = base / summary["weight_bytes_per_token"] if base else None
        summary["share_of_byte_limit"] = (summary["speed_ratio"] / summary["byte_ratio"]
                                          if summary["byte_ratio"] else None)


def byte_limit_lines(systems: list[dict]) -> list[str]:
    """One line per system: how far its measured speed-up is from the byte limit."""
    lines = []
    for system in systems:
        sm = system["summary"]
        if sm.get("byte_ratio") is None:
            continue
        lines.append(f"- {system['name']}: {sm['weight_bytes_per_token'] / 2**20:.1f} MiB/token, byte limit "
                     f"{sm['byte_ratio']:.2f}x, measured {sm['speed_ratio']:.2f}x = {sm['share_of_byte_limit']:.0%} "
                     f"of it")
    return lines
