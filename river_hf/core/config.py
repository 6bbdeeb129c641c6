"""How the river is built: `RiverQuantConfig`, a transformers quantization config (typed, validated, serialisable).

It works two ways:
- `river_hf.build_river(model, RiverQuantConfig(...))` on a loaded model, or
- `AutoModelForCausalLM.from_pretrained(path, quantization_config=RiverQuantConfig(...))`, through the quantizer that
  `river_hf.saving.hf_quantizer` registers with transformers under the method name "river".

Twin precision can vary by depth: `nbits` is one int for every twin, or a *schedule*, one int per river layer
(`start_layer` .. num_layers - 1, in order), e.g. 8-bit twins for the first river layers and 4-bit after
(`RiverQuantConfig.schedule(...)` builds one). `quantize_lm_head=True` also gives the LM head a quantized copy that
only the steps which left the backbone use (river_hf.core.lm_head).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from itertools import groupby

from transformers.utils.quantization_config import QuantizationConfigMixin

from ..checks import check_choice, checked_histogram, is_int, is_text
from ..kernels.registry import KERNELS
from ..kernels.backends import ACTIVATIONS, BACKENDS, backend_nbits
from ..kernels.quantize import SUPPORTED_GROUP_SIZES, SUPPORTED_NBITS

RIVER_QUANT_METHOD = "river"
PER_ROW_NBITS = 8  # schedule entries and LM heads of this many bits are quantized per row (the int8 kernel's layout)
OFFLOAD_DESTINATIONS = ("disk", "cpu")  # where river_hf.offload_backbone keeps offloaded backbone weights
DEFAULT_OFFLOAD_MAX_SHARE = 0.05  # "auto" offloads backbone layers run by fewer than this share of decoded tokens
# nbits="auto", the default: 4-bit twins for the first quarter of the river layers, 8-bit (per row) after. Measured on
# SmolLM2 (benchmarks/README.md, "Twin precision per layer"): exited tokens always run the deepest layers on twins, so
# precision belongs there; all-4-bit twins lose 12 pp of match at full quantization, all-8-bit ones 20% of the speed.
AUTO_NBITS = "auto"
LORA_TWINS = ("full_precision", "merged")
# How a saved river's load checks the backbone weights against its stored twins (river_hf.saving.twin_loading)
VERIFY_TWINS = ("sampled", "full")
# Fields that say how to load a saved river, not what its twins are: a RiverQuantConfig passed to from_pretrained for
# a saved river sets these (those it sets to other than their default) on the saved config (transformers' "loading
# attributes"); its other fields give way to the saved ones
LOADING_FIELDS = ("backend", "activations", "lm_head_activations", "lm_head_exact_top_k", "verify_twins")
AUTO_SHALLOW_SHARE, AUTO_SHALLOW_BITS, AUTO_DEEP_BITS = 0.25, 4, 8
# The exited steps' LM head (docs/defaults.md): 4-bit for lm_head_nbits="auto", its top 64 logits recomputed with the
# original head (64: a 4-bit head then keeps the 8-bit head's match; transformers samples from top_k=50 by default)
AUTO_HEAD_BITS, DEFAULT_EXACT_TOP_K = 4, 64
# lm_head_activations' default: the quantized LM head's kernels may do to activations what the twins' may
AS_TWINS = "as_twins"


@dataclass
class RiverQuantConfig(QuantizationConfigMixin):
    """Configuration of the exit river: which layers get a quantized twin and how the twins are quantized."""

    nbits: int | list[int] | str = field(
        default=AUTO_NBITS,
        metadata={"help": f"Bits per twin weight, each one of {SUPPORTED_NBITS}: 'auto' (the default: 4-bit twins for "
                  f"the first quarter of the river layers, rounded down, and 8-bit per-row twins after: the most "
                  f"faithful mix at a given speed in our measurements, as a rule that scales with depth), one int for "
                  f"every twin, or a schedule, a list with one int per river layer (layers start_layer .. "
                  f"num_layers - 1, in order; its length must be num_layers - start_layer), e.g. 8 for the first "
                  f"river layers and 4 after. In a schedule, 8-bit layers are quantized with one group per output row "
                  f"(the int8 kernel's layout, no warning) and `group_size` applies to the layers of 4 bits or fewer."},
    )
    group_size: int | None = field(
        default=64,
        metadata={"help": f"HQQ quantization group size, one of {SUPPORTED_GROUP_SIZES} (None: one group per row). "
                  f"In a schedule it applies to the layers of 4 bits or fewer (8-bit layers are per row); the "
                  f"quantized LM head uses it when `lm_head_nbits` <= 4."},
    )
    axis: int = field(default=1, metadata={"help": "HQQ quantization axis; only 1 (groups along the input dimension)."})
    start_layer: int = field(
        default=1,
        metadata={"help": "L_s: the first decoder layer that has a twin; tokens run at least this many backbone "
                  "layers."},
    )
    skip_modules: list[str] = field(
        default_factory=list,
        metadata={"help": "Linear layers (name or name suffix inside a decoder layer, e.g. 'down_proj') kept in "
                  "full precision in the twins; they share the backbone's weights."},
    )
    backend: str = field(
        default="fastest",
        metadata={"help": f"Twin kernel, one of {BACKENDS}. 'fastest' times the kernels that can run each layer on "
                  f"this machine, at that layer's shape, and takes the fastest (river_hf.kernels.choice); 'auto' takes "
                  f"the device's preferred kernel per width without measuring (CPU: int4pack_cpu for 2-4 bits, "
                  f"int8pack_cpu for 8; CUDA: tinygemm_cuda for 2-4, gemlite_int8_cuda for 8 with gemlite "
                  f"installed: river-hf[cuda])."},
    )
    activations: str | None = field(
        default=None,
        metadata={"help": f"What the twins' kernels may do to activations, one of {ACTIVATIONS}. None (the default): "
                  f"weight-only kernels, activations stay bf16/fp32. 'int8': 8-bit twins (and an 8-bit LM head, "
                  f"unless `lm_head_activations` says otherwise) may run on fbgemm's dynamic int8 linear "
                  f"('w8a8_cpu', CPU), which rounds each token's activations to 7 bits (8 on CPUs with "
                  f"AVX512-VNNI): 2.2-2.3x a bf16 GEMV at 1B-model sizes on AVX2, at a fidelity cost "
                  f"(SmolLM2: 86.5% vs 97.7% match; docs/activations.md). 'auto' then prefers it; 'fastest' times "
                  f"it with the others, and with onnxruntime installed (river-hf[ort]) also ONNX Runtime's "
                  f"MatMulNBits ('matmulnbits_cpu': 4-bit twins, activations int8 per block), which "
                  f"'fastest' takes where it times faster (AVX2, 1B shapes, GOMP_SPINCOUNT=10000: 1.3-2.1x torch's "
                  f"int4 kernel per GEMV in the records of docs/activations.md)."},
    )
    lora_twins: str = field(
        default="full_precision",
        metadata={"help": f"The twin of a LoRA-adapted linear (peft), one of {LORA_TWINS}: 'full_precision' (the "
                  f"default) quantizes W and keeps the LoRA in full precision on top (more faithful: 84.4% vs 81.8% "
                  f"match on SmolLM2, docs/peft.md), 'merged' quantizes peft's merge W + s·B·A into one linear "
                  f"(faster: no rank-r matmuls; 1.53x vs 1.12x the adapted backbone at tau=-1 there, AVX2). DoRA "
                  f"and peft's other tuners are always merged."},
    )
    quantize_lm_head: bool = field(
        default=True,
        metadata={"help": "Give the LM head a quantized copy, used only for the logits of steps that left the "
                  "backbone (tau > 1 and plain generate always use the original head). The original head, tied "
                  "or not, is never changed; remove_river and save_pretrained give it back."},
    )
    lm_head_nbits: int | str = field(
        default=AUTO_NBITS,
        metadata={"help": f"Bits of the quantized LM head, 'auto' or one of {SUPPORTED_NBITS}; 8 bits: one group "
                  f"per row, fewer: `group_size`. 'auto': 4 (with `lm_head_exact_top_k` it keeps the 8-bit head's "
                  f"match, docs/defaults.md), 8 where the head may take int8 activations (W8A8) or `backend` runs "
                  f"no 4-bit weights."},
    )
    lm_head_activations: str | None = field(
        default=AS_TWINS,
        metadata={"help": f"What the quantized LM head's kernel may do to activations: {AS_TWINS!r} (the default: "
                  f"what `activations` says for the twins), None (weight-only, whatever the twins do) or 'int8' "
                  f"(an 8-bit head may run on fbgemm's W8A8 'w8a8_cpu' while the twins stay as `activations` "
                  f"says). The head is the largest single GEMV of a 1B model's exited step: on an AVX512-VNNI CPU, "
                  f"captured, Llama-3.2-1B's shape at full quantization ran 2.68x the compiled backbone with it "
                  f"against 2.21x weight-only; at SmolLM2's size it bought nothing (docs/activations.md)."},
    )
    lm_head_exact_top_k: int = field(
        default=DEFAULT_EXACT_TOP_K,
        metadata={"help": "The quantized LM head's k highest logits of each exited step, recomputed from the "
                  "original head's k rows (a few KB read per token), so the greedy token is the original head's "
                  "on the same hidden state whenever the quantized head ranks it among its top k; 0 keeps the "
                  "quantized logits as they are (docs/defaults.md)."},
    )
    verify_twins: str = field(
        default="sampled",
        metadata={"help": f"Loading a saved river (its twins stored beside the checkpoint), one of {VERIFY_TWINS}: "
                  f"'sampled' (the default) checks each backbone weight against the weight its twin was made from by "
                  f"a fixed sample of 128 KiB of it, which tells another checkpoint or a fine-tuned weight apart but "
                  f"may miss a few changed elements (the odds: docs/saved-rivers.md); 'full' reads every byte of "
                  f"every weight, and also checks the twins file's tensors and the packed twins this machine keeps "
                  f"against their checksums."},
    )
    offload: str | None = field(
        default=None,
        metadata={"help": f"Backbone offloading after the build (river_hf.offload_backbone), one of "
                  f"{OFFLOAD_DESTINATIONS} or None (no offloading): 'disk' keeps the offloaded backbone weights in "
                  f"memory-mapped safetensors files, 'cpu' (CUDA models) in CPU memory; they page in for the steps "
                  f"that run those backbone layers. The twins and the quantized LM head stay resident."},
    )
    offload_layers: str | list[int] = field(
        default="auto",
        metadata={"help": "The decoder layers whose backbone weights are offloaded (from start_layer on), or 'auto': "
                  "those run by fewer than `offload_max_share` of decoded tokens in `offload_exit_histogram`."},
    )
    offload_folder: str | None = field(
        default=None, metadata={"help": "Where offload='disk' writes its files (a fresh subfolder per model); None: "
                                "$RIVER_HF_CACHE/offload or ~/.cache/river_hf/offload."})
    offload_max_share: float = field(default=DEFAULT_OFFLOAD_MAX_SHARE, metadata={"help": "See `offload_layers`."})
    offload_exit_histogram: dict | None = field(
        default=None,
        metadata={"help": "For offload_layers='auto': a measured {exit depth: decoded tokens} histogram, e.g. from "
                  "river_hf.exit_depth_histogram(...) or a bench record's `exit_depth_histogram`."},
    )
    quant_method: str = field(default=RIVER_QUANT_METHOD, metadata={"help": "Fixed: 'river'."})

    def __post_init__(self):
        if isinstance(self.nbits, (list, tuple)):
            if not self.nbits:
                raise ValueError("`nbits` is an empty schedule; give one int per river layer, or a single int.")
            for index, bits in enumerate(self.nbits):
                if not (is_int(bits) and int(bits) in SUPPORTED_NBITS):
                    raise ValueError(f"`nbits`[{index}]={bits!r} is not supported; choose one of {SUPPORTED_NBITS} "
                                     f"(entry {index} is the twin of river layer start_layer + {index}).")
            self.nbits = [int(bits) for bits in self.nbits]
        elif not is_text(self.nbits, AUTO_NBITS):
            self.nbits = check_choice("nbits", self.nbits, SUPPORTED_NBITS)
        # check_choice gives back the plain choice: a numpy integer is stored as an int (config.json stays JSON)
        self.group_size = check_choice("group_size", self.group_size, SUPPORTED_GROUP_SIZES)
        self.axis = check_choice("axis", self.axis, (1,))  # the kernels need groups along the input dimension
        self.backend = check_choice("backend", self.backend, BACKENDS)
        self.activations = check_choice("activations", self.activations, ACTIVATIONS)
        if KERNELS.get(self.backend) is not None and KERNELS[self.backend].quantizes_activations \
                and self.activations != "int8":
            raise ValueError(f"`backend`={self.backend!r} quantizes activations to int8 (a fidelity cost); say so "
                             f"with activations='int8', or choose a weight-only backend.")
        self.lm_head_activations = check_choice("lm_head_activations", self.lm_head_activations,
                                                (AS_TWINS,) + ACTIVATIONS)
        if KERNELS.get(self.backend) is not None and KERNELS[self.backend].quantizes_activations \
                and self.quantize_lm_head and self.head_activations != "int8":
            raise ValueError(f"`backend`={self.backend!r} quantizes activations to int8, but `lm_head_activations`="
                             f"{self.lm_head_activations!r} keeps the LM head weight-only; use backend='fastest' "
                             f"(it picks a kernel per layer), or quantize_lm_head=False.")
        self.lora_twins = check_choice("lora_twins", self.lora_twins, LORA_TWINS)
        self.verify_twins = check_choice("verify_twins", self.verify_twins, VERIFY_TWINS)
        self.quant_method = check_choice("quant_method", self.quant_method, (RIVER_QUANT_METHOD,))
        if not is_int(self.start_layer) or self.start_layer < 1:
            raise ValueError(
                f"`start_layer` must be an integer >= 1 (layer 0 always runs on the backbone, its similarity is the "
                f"first exit signal); got {self.start_layer!r}."
            )
        self.start_layer = int(self.start_layer)
        if not isinstance(self.skip_modules, (list, tuple)) or not all(isinstance(n, str) for n in self.skip_modules):
            raise ValueError(f"`skip_modules` must be a list of module names; got {self.skip_modules!r}.")
        self.skip_modules = list(self.skip_modules)
        if not isinstance(self.quantize_lm_head, bool):
            raise ValueError(f"`quantize_lm_head` must be True or False; got {self.quantize_lm_head!r}.")
        self.lm_head_nbits = check_choice("lm_head_nbits", self.lm_head_nbits, (AUTO_NBITS,) + SUPPORTED_NBITS)
        if not is_int(self.lm_head_exact_top_k) or self.lm_head_exact_top_k < 0:
            raise ValueError(f"`lm_head_exact_top_k` must be an integer >= 0 (0: no logit recomputed); got "
                             f"{self.lm_head_exact_top_k!r}.")
        self.lm_head_exact_top_k = int(self.lm_head_exact_top_k)
        self._check_backend_runs_every_width()
        self._check_grouped_codes()
        self._check_offload()

    def _check_offload(self) -> None:
        """The offload fields' own rules; layer indices against the model are checked when the river is built."""
        if self.offload is None:
            return
        check_choice("offload", self.offload, OFFLOAD_DESTINATIONS)
        if isinstance(self.offload_layers, str):
            check_choice("offload_layers", self.offload_layers, ("auto",))
            if self.offload_exit_histogram is None:
                raise ValueError("`offload_layers`='auto' needs `offload_exit_histogram` (a measured {exit depth: "
                                 "decoded tokens}, e.g. from river_hf.exit_depth_histogram); or give layer indices.")
        elif not isinstance(self.offload_layers, (list, tuple)) or not all(is_int(i) for i in self.offload_layers):
            raise ValueError(f"`offload_layers` must be 'auto' or a list of decoder-layer indices; got "
                             f"{self.offload_layers!r}.")
        else:
            self.offload_layers = [int(idx) for idx in self.offload_layers]
        if self.offload_folder is not None and not isinstance(self.offload_folder, (str, os.PathLike)):
            raise ValueError(f"`offload_folder` must be None or a folder path; got {self.offload_folder!r}.")
        if self.offload_exit_histogram is not None:
            self.offload_exit_histogram = checked_histogram("offload_exit_histogram", self.offload_exit_histogram)
        share = self.offload_max_share
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share <= 1:
            raise ValueError(f"`offload_max_share` must be a share of decoded tokens in (0, 1]; got {share!r}.")

    def _check_backend_runs_every_width(self) -> None:
        """An explicit kernel must run every bit width asked of it (a device-independent check; 'auto' picks one
        kernel per layer)."""
        supported = backend_nbits(self.backend)
        widths = [("nbits", bits) for bits in self.schedule_bits()]
        if self.quantize_lm_head:
            widths.append(("lm_head_nbits", self.head_nbits))
        for name, bits in widths:
            if bits not in supported:
                raise ValueError(
                    f"`backend`={self.backend!r} runs only {'/'.join(map(str, supported))}-bit weights, but `{name}` "
                    f"asks for {bits} bits; use backend='auto' (it picks the kernel per layer) or 'hqq'."
                )

    def _check_grouped_codes(self) -> None:
        """'matmulnbits_cpu' reads grouped codes only; a schedule's 8-bit layers and an 8-bit LM head are per row."""
        if self.backend != "matmulnbits_cpu":
            return
        if self.group_size is None:
            raise ValueError("`backend`='matmulnbits_cpu' needs grouped codes, but `group_size` is None; set it "
                             "(e.g. 64).")
        if self.is_schedule and PER_ROW_NBITS in self.schedule_bits():
            raise ValueError(f"`backend`='matmulnbits_cpu' needs grouped codes, but `nbits`={self.nbits!r} gives "
                             f"some twins 8 bits with one scale per row; use nbits=4 (or a single 8), or "
                             f"backend='fastest' (it picks a per-row kernel for those layers).")
        if self.quantize_lm_head and self.lm_head_group_size is None:
            raise ValueError(f"`backend`='matmulnbits_cpu' needs grouped codes, but `lm_head_nbits`="
                             f"{self.head_nbits} quantizes the LM head with one scale per row; use "
                             f"quantize_lm_head=False, lm_head_nbits=4, or backend='fastest'.")

    @classmethod
    def schedule(cls, num_layers: int, first_layers: int, first_bits: int = 8, rest_bits: int = 4,
                 start_layer: int = 1, **kwargs) -> "RiverQuantConfig":
        """A depth schedule for a model with `num_layers` decoder layers: the first `first_layers` river layers
        (from `start_layer` on) get `first_bits`-bit twins, the rest `rest_bits`-bit ones. Other fields: kwargs.

            RiverQuantConfig.schedule(num_layers=30, first_layers=8)  # layers 1-8: 8-bit, 9-29: 4-bit
        """
        for name, value in (("num_layers", num_layers), ("start_layer", start_layer)):
            if not is_int(value):
                raise ValueError(f"`{name}` must be an integer; got {value!r}.")
        river_layers = num_layers - start_layer
        if river_layers < 1:
            raise ValueError(f"`num_layers`={num_layers} leaves no river layer after `start_layer`={start_layer}.")
        if not is_int(first_layers) or not 0 <= first_layers <= river_layers:
            raise ValueError(f"`first_layers` must be an integer between 0 and {river_layers} (the river layers "
                             f"{start_layer}..{num_layers - 1}); got {first_layers!r}.")
        nbits = [first_bits] * first_layers + [rest_bits] * (river_layers - first_layers)
        return cls(nbits=nbits, start_layer=start_layer, **kwargs)

    @property
    def is_schedule(self) -> bool:
        """True when the twins' bits vary by layer: `nbits` is a per-layer list, or 'auto'."""
        return isinstance(self.nbits, list) or self.nbits == AUTO_NBITS

    def schedule_bits(self) -> list[int]:
        """Every bit width the twins use: the schedule, or [nbits]."""
        if self.nbits == AUTO_NBITS:
            return [AUTO_SHALLOW_BITS, AUTO_DEEP_BITS]
        return list(self.nbits) if self.is_schedule else [self.nbits]

    def resolved_nbits(self, num_layers: int) -> int | list[int]:
        """`nbits` for a model of `num_layers` decoder layers: 'auto' becomes its per-layer schedule."""
        if self.nbits != AUTO_NBITS:
            return self.nbits
        river_layers = num_layers - self.start_layer
        shallow = int(river_layers * AUTO_SHALLOW_SHARE)
        return [AUTO_SHALLOW_BITS] * shallow + [AUTO_DEEP_BITS] * (river_layers - shallow)

    def nbits_for(self, layer_idx: int, num_layers: int | None = None) -> int:
        """The bits of decoder layer `layer_idx`'s twin (layer_idx >= start_layer). nbits='auto' needs the model's
        depth: `num_layers`, or the depth `check_model_depth` last saw (build_river checks it first)."""
        if not is_int(layer_idx) or layer_idx < self.start_layer:
            raise ValueError(f"layer {layer_idx!r} has no twin: the river starts at `start_layer`={self.start_layer}.")
        nbits = self.nbits
        if nbits == AUTO_NBITS:
            depth = num_layers if num_layers is not None else getattr(self, "_model_depth", None)
            if depth is None:
                raise ValueError("`nbits`='auto' depends on the model's depth: pass `num_layers`, or build the river.")
            nbits = self.resolved_nbits(depth)
        if not isinstance(nbits, list):
            return nbits
        position = layer_idx - self.start_layer
        if position >= len(nbits):
            raise ValueError(f"layer {layer_idx} is past the `nbits` schedule, which covers layers "
                             f"{self.start_layer}..{self.start_layer + len(nbits) - 1}.")
        return nbits[position]

    def group_size_for(self, layer_idx: int, num_layers: int | None = None) -> int | None:
        """The HQQ group size of layer `layer_idx`'s twin: `group_size`, except per row (None) for the 8-bit
        layers of a schedule. (A single `nbits=8` passes `group_size` on: the int8 kernel warns that it ignores it.)"""
        bits = self.nbits_for(layer_idx, num_layers)
        return None if self.is_schedule and bits == PER_ROW_NBITS else self.group_size

    @property
    def head_activations(self) -> str | None:
        """What the quantized LM head's kernel may do to activations: `lm_head_activations`, or `activations` when
        it says AS_TWINS."""
        return self.activations if self.lm_head_activations == AS_TWINS else self.lm_head_activations

    @property
    def head_nbits(self) -> int:
        """`lm_head_nbits`; 'auto': 4, or 8 where the head's kernel, picked per machine, may be fbgemm's W8A8 (8-bit,
        the fast one there) or `backend` runs no 4-bit weights."""
        if self.lm_head_nbits != AUTO_NBITS:
            return self.lm_head_nbits
        w8a8_head = self.head_activations == "int8" and self.backend in ("auto", "fastest")
        if w8a8_head or AUTO_HEAD_BITS not in backend_nbits(self.backend):
            return PER_ROW_NBITS
        return AUTO_HEAD_BITS

    @property
    def lm_head_group_size(self) -> int | None:
        """The group size of the quantized LM head: per row for 8 bits, else `group_size`."""
        return None if self.head_nbits == PER_ROW_NBITS else self.group_size

    def check_model_depth(self, num_layers: int) -> None:
        """The river needs at least one twin: start_layer must name an existing layer; a schedule covers exactly the
        river layers."""
        if self.start_layer >= num_layers:
            raise ValueError(
                f"`start_layer`={self.start_layer} is out of range: the model has {num_layers} decoder layers, so "
                f"`start_layer` must be between 1 and {num_layers - 1}."
            )
        expected = num_layers - self.start_layer
        self._model_depth = num_layers  # not a field: nbits='auto' resolves against it, and it is never saved
        if isinstance(self.nbits, list) and len(self.nbits) != expected:
            raise ValueError(
                f"`nbits` has {len(self.nbits)} entries, but this model has {expected} river layers (decoder layers "
                f"{self.start_layer}..{num_layers - 1}: num_layers {num_layers} - start_layer {self.start_layer}); "
                f"give exactly {expected} entries, entry i being the bits of layer start_layer + i's twin, or one "
                f"int for all twins."
            )

    def to_dict(self) -> dict:
        return {name: _plain(getattr(self, name)) for name in self.__dataclass_fields__}

    def get_loading_attributes(self) -> dict:
        """The LOADING_FIELDS this config sets to other than their default (transformers applies them to a saved
        river's own config when this one is passed to from_pretrained)."""
        fields = self.__dataclass_fields__
        return {name: getattr(self, name) for name in LOADING_FIELDS if getattr(self, name) != fields[name].default}


def _plain(value):
    if isinstance(value, dict):
        return dict(value)
    return list(value) if isinstance(value, (list, tuple)) else value  # a copy: the dict must not alias the config


def bits_label(nbits) -> str:
    """For tables and messages: 4 -> '4'; a schedule [8, 8, 4] -> '8x2/4x1' (runs of equal bits)."""
    if nbits == AUTO_NBITS:
        return f"auto ({AUTO_SHALLOW_BITS} for the first quarter, {AUTO_DEEP_BITS} after)"
    if not isinstance(nbits, (list, tuple)):
        return str(nbits)
    return "/".join(f"{bits}x{len(list(run))}" for bits, run in groupby(nbits))
