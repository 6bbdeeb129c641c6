"""Which twin is more faithful to a LoRA-adapted layer: (a) one quantized linear of the merged weight W + s·B·A
(river_hf's behaviour), or (b) a quantized W with the LoRA's A, B kept in full precision on top (two extra matmuls per
adapted linear)? And (c), for scale: a quantized W that drops the adapter.

    python examples/lora_twins.py [--rho 0.05] [--nbits 4] [--group-size 64] [--prompts 8] [--tokens 48]

On the packaged SmolLM2-135M (bf16), a LoRA (r=16, alpha=32) on every linear of every layer: B is drawn at random and
scaled per layer so that ||s·B·A|| = rho·||W|| (a trained-looking delta); `--rho 0` keeps peft's own random
`init_lora_weights=False`. Twins from layer 1 on (the default start_layer). Prints, per system:
- linear rel. error: mean over the adapted linears of layers >= 1 of ||twin(x) - lora(x)|| / ||lora(x)||, x the
  linear's real inputs on the prompts;
- match / KL: teacher-forced next-token agreement with the adapted model (river_hf.bench.fidelity) of the model whose
  layers >= 1 are the twins (full quantization: what a tau=-1 river computes), and of a tau=-1 river built by
  build_river, which also quantizes the LM head (8-bit), so it is (a) plus a quantized head.
Fidelity only: nothing is timed.
"""

from __future__ import annotations

import argparse
import copy
from contextlib import contextmanager

import torch
from peft import LoraConfig, get_peft_model
from peft.tuners.lora import LoraLayer

import river_hf
from river_hf import RiverQuantConfig, RiverSettings
from river_hf.adapters import tuner_layers
from river_hf.architectures import find_decoder_layers
from river_hf.bench.data import load_gsm8k
from river_hf.bench.fidelity import backbone_references, measure_fidelity
from river_hf.layers import make_twin
from river_hf.models import load_model_and_tokenizer
from river_hf.quantize import RiverQuantLinear

START = 1
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def adapted_model(rho: float):
    model, tokenizer = load_model_and_tokenizer()
    config = LoraConfig(r=16, lora_alpha=32, target_modules=TARGETS, init_lora_weights=False)
    peft_model = get_peft_model(model, config).eval()
    if rho > 0:
        torch.manual_seed(0)
        for _, layer in tuner_layers(peft_model):
            set_delta_scale(layer, rho)
    return peft_model, tokenizer


@torch.no_grad()
def set_delta_scale(layer: LoraLayer, rho: float) -> None:
    """B random, rescaled so that the adapter's delta weight has rho times the base weight's Frobenius norm."""
    lora_b = layer.lora_B["default"].weight
    lora_b.normal_()
    delta = layer.get_delta_weight("default").float()
    lora_b.mul_(rho * layer.get_base_layer().weight.float().norm() / delta.norm())


def quantizer(args):
    def quantize(linear):
        return RiverQuantLinear.from_linear(linear, nbits=args.nbits, group_size=args.group_size, backend="auto")
    return quantize


def twin_keep_lora(layer, quantize):
    """(b): the decoder layer's copy whose LoRA layers keep A, B (shared, full precision) over a quantized base."""
    memo = {id(t): t for t in (*layer.parameters(), *layer.buffers())}
    twin = copy.deepcopy(layer, memo)
    for _, lora in tuner_layers(twin):
        lora.base_layer = quantize(lora.get_base_layer())
    return _quantize_rest(twin, quantize)


def twin_without_adapters(layer, quantize):
    """(c): the decoder layer's copy whose linears are quantized base weights; the adapters are dropped."""
    memo = {id(t): t for t in (*layer.parameters(), *layer.buffers())}
    twin = copy.deepcopy(layer, memo)
    for name, lora in tuner_layers(twin):
        twin.set_submodule(name, quantize(lora.get_base_layer()))
    return _quantize_rest(twin, quantize)


def _quantize_rest(twin, quantize):
    for name, module in list(twin.named_modules()):
        if type(module) is torch.nn.Linear and not name.endswith("base_layer") and ".lora_" not in f".{name}":
            twin.set_submodule(name, quantize(module))
    return twin


@contextmanager
def layers_replaced(model, replacement: dict[int, torch.nn.Module]):
    """Inside the block, decoder layer i of `model` is replacement[i]: a static full-quantization model."""
    layers = find_decoder_layers(model)
    original = list(layers)
    for idx, layer in replacement.items():
        layers[idx] = layer
    try:
        yield model
    finally:
        for idx, layer in enumerate(original):
            layers[idx] = layer


@torch.no_grad()
def linear_inputs(model, ids: torch.Tensor) -> dict[tuple[int, str], torch.Tensor]:
    """The input x [T, K] of every adapted linear in layers >= START, on one forward over `ids` [1, T]."""
    inputs, hooks = {}, []
    for idx, layer in enumerate(find_decoder_layers(model)):
        for name, lora in tuner_layers(layer) if idx >= START else []:
            def keep(module, args, key=(idx, name)):
                inputs[key] = args[0].reshape(-1, args[0].shape[-1])
            hooks.append(lora.register_forward_pre_hook(keep))
    model(ids)
    for hook in hooks:
        hook.remove()
    return inputs


@torch.no_grad()
def linear_error(model, twins: dict[int, torch.nn.Module], inputs) -> float:
    """Mean over the adapted linears of ||twin(x) - lora(x)|| / ||lora(x)||."""
    layers = find_decoder_layers(model)
    errors = []
    for (idx, name), x in inputs.items():
        reference = layers[idx].get_submodule(name)(x).float()
        errors.append(((twins[idx].get_submodule(name)(x).float() - reference).norm() / reference.norm()).item())
    return sum(errors) / len(errors)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rho", type=float, default=0.05)
    parser.add_argument("--nbits", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=48)
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    model, tokenizer = adapted_model(args.rho)
    _, rows, _ = load_gsm8k()
    prompts = [tokenizer(row["question"], return_tensors="pt").input_ids for row in rows[:args.prompts]]
    references = backbone_references(model, prompts, max_new_tokens=args.tokens)
    quantize = quantizer(args)
    layers = find_decoder_layers(model)
    builders = {"(a) merged W + s*B*A, quantized (river_hf)": lambda layer: make_twin(layer, quantize, []),
                "(b) quantized W + full-precision LoRA": lambda layer: twin_keep_lora(layer, quantize),
                "(c) quantized W, adapter dropped": lambda layer: twin_without_adapters(layer, quantize)}
    first = references[0]
    inputs = linear_inputs(model, torch.cat([first.prompt_ids[0], first.continuation]).view(1, -1))
    print(f"cpu capability {torch.backends.cpu.get_cpu_capability()}; SmolLM2-135M bf16; LoRA r=16 on {TARGETS}; "
          f"rho={args.rho}; twins {args.nbits}-bit group {args.group_size} from layer {START}; "
          f"{args.prompts} GSM8K prompts x {args.tokens} tokens")
    print("| twin | linear rel. error | match | KL |\n|---|---:|---:|---:|")
    for label, build in builders.items():
        twins = {idx: build(layers[idx]) for idx in range(START, len(layers))}
        error = linear_error(model, twins, inputs)
        with layers_replaced(model, twins):
            fidelity = measure_fidelity(model, references, None)
        print(f"| {label} | {error:.4f} | {fidelity.match:.1%} | {fidelity.kl:.4f} |")
    river_hf.build_river(model, RiverQuantConfig(nbits=args.nbits, group_size=args.group_size, start_layer=START,
                                                 backend="auto", quantize_lm_head=True), progress=False)
    fidelity = measure_fidelity(model, references, RiverSettings(tau=-1.0, exit_signal="cosine", prefill_exit="sequence"))
    print(f"| build_river on the PeftModel, tau=-1, 8-bit LM head | - | {fidelity.match:.1%} | {fidelity.kl:.4f} |")


if __name__ == "__main__":
    main()
