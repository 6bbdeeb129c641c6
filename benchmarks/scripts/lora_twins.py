"""Which twin is more faithful to a LoRA-adapted layer: (a) one quantized linear of the merged weight W + s·B·A
(river_hf's behaviour before issue 11, and still its behaviour for DoRA and non-LoRA tuners), or (b) a quantized W
with the LoRA's A, B kept in full precision on top (two extra rank-r matmuls per adapted linear; river_hf's behaviour
for plain LoRA now: the twins `river_hf.core.twins.make_twin` builds)? And (c), for scale: a quantized W that drops the
adapter.

    python benchmarks/scripts/lora_twins.py [--rho 0.05] [--seed 0] [--nbits 4] [--group-size 64] [--prompts 8]
        [--tokens 48]

On the packaged SmolLM2-135M (bf16), a LoRA (r=16, alpha=32) on every linear of every layer: B is drawn at random and
scaled per layer so that ||s·B·A|| = rho·||W|| (a trained-looking delta); `--rho 0` keeps peft's own random
`init_lora_weights=False`. Twins from layer 1 on (the default start_layer). Prints, per system:
- linear rel. error: mean over the adapted linears of layers >= 1 of ||twin(x) - lora(x)|| / ||lora(x)||, x the
  linear's real inputs on the prompts;
- match / KL: teacher-forced next-token agreement with the adapted model (river_hf.bench.fidelity), over its greedy
  continuations of the GSM8K questions through the chat template (`positions` compared), of the model whose
  layers >= 1 are the twins (full quantization: what a tau=-1 river computes), and of a tau=-1 river built by
  build_river, which also quantizes the LM head (8-bit), so it is (b) plus a quantized head.

    python benchmarks/scripts/lora_twins.py --time [--rounds 3] [--prompts 4] [--tokens 64]

times instead (fidelity is not measured): decode tokens/s, interleaved in one process after a warm-up, of the adapted
backbone (plain generate), and of tau=-1 rivers (every decode step on the twins, 8-bit LM head) whose adapted
linears' twins are (b) (build_river) or (a) (the same river with merged twins swapped in), same kernel
(`backend="auto"`). Take it on a quiet machine: a second busy process makes the ratios meaningless.
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
from river_hf.core.adapters import merged_linear, tuner_layers
from river_hf.core.architectures import find_decoder_layers
from river_hf.bench.data import load_gsm8k
from river_hf.bench.fidelity import backbone_references, measure_fidelity
from river_hf.bench.speed import interleaved, median_rate
from river_hf.core.generation import RiverConfig
from river_hf.core.twins import make_twin
from river_hf.loading.models import build_chat_inputs, load_model_and_tokenizer
from river_hf.kernels.quantize import RiverQuantLinear

START = 1
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def adapted_model(rho: float, seed: int):
    model, tokenizer = load_model_and_tokenizer()
    config = LoraConfig(r=16, lora_alpha=32, target_modules=TARGETS, init_lora_weights=False)
    torch.manual_seed(seed)  # A (and, with --rho 0, B) are drawn here: the same adapter on every run
    peft_model = get_peft_model(model, config).eval()
    if rho > 0:
        torch.manual_seed(seed)
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


def twin_merged(layer, quantize):
    """(a): the decoder layer's copy whose LoRA layers are one quantized linear of peft's merge W + s*B*A."""
    memo = {id(t): t for t in (*layer.parameters(), *layer.buffers())}
    twin = copy.deepcopy(layer, memo)
    for name, lora in tuner_layers(layer):
        twin.set_submodule(name, merged_linear(lora))
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


def river_config(args) -> RiverQuantConfig:
    return RiverQuantConfig(nbits=args.nbits, group_size=args.group_size, start_layer=START, backend="auto",
                            quantize_lm_head=True)


def time_twins(args, model, tokenizer, rows) -> None:
    """Decode speed of the backbone and of tau=-1 rivers with (b) and (a) twins, interleaved; prints a table."""
    from transformers import GenerationConfig

    merged_model = copy.deepcopy(model)  # built before any river: both rivers start from the same adapted model
    river_hf.build_river(model, river_config(args), progress=False)
    river_hf.build_river(merged_model, river_config(args), progress=False)
    quantize = quantizer(args)
    for layer in river_hf.river_layers(merged_model)[START:]:
        layer.twin = twin_merged(layer.base_layer, quantize)  # (a); the fingerprint check still passes
    greedy = dict(max_new_tokens=args.tokens, min_new_tokens=args.tokens, do_sample=False)
    systems = {"adapted backbone": GenerationConfig(**greedy),
               "(b) tau=-1": RiverConfig(tau=-1.0, exit_signal="cosine", **greedy),
               "(a) tau=-1": RiverConfig(tau=-1.0, exit_signal="cosine", **greedy)}
    prompts = [build_chat_inputs(tokenizer, row["question"]) for row in rows[:args.prompts]]
    timings = interleaved(model, systems, prompts, rounds=args.rounds, models={"(a) tau=-1": merged_model})
    rates = {name: median_rate(runs) for name, runs in timings.items()}
    print("| system | decode tok/s (median) | vs backbone |\n|---|---:|---:|")
    for name, rate in rates.items():
        print(f"| {name} | {rate:.1f} | {rate / rates['adapted backbone']:.3f}x |")
    print(f"(b) / (a): {rates['(b) tau=-1'] / rates['(a) tau=-1']:.3f}x")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rho", type=float, default=0.05)
    parser.add_argument("--nbits", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--time", action="store_true", help="time the twins instead of measuring fidelity")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0, help="draws the adapter's A and B")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    model, tokenizer = adapted_model(args.rho, args.seed)
    _, rows, _ = load_gsm8k()
    if args.time:
        print(f"cpu capability {torch.backends.cpu.get_cpu_capability()}; threads {torch.get_num_threads()}; "
              f"SmolLM2-135M bf16; LoRA r=16 on {TARGETS}; twins {args.nbits}-bit group {args.group_size} from "
              f"layer {START}, backend auto; {args.prompts} GSM8K prompts x {args.tokens} tokens x "
              f"{args.rounds} rounds")
        return time_twins(args, model, tokenizer, rows)
    # through the chat template, as `river-hf bench` does: a bare question makes the Instruct model end at once (one
    # compared position per prompt)
    prompts = [build_chat_inputs(tokenizer, row["question"])["input_ids"] for row in rows[:args.prompts]]
    references = backbone_references(model, prompts, max_new_tokens=args.tokens)
    quantize = quantizer(args)
    layers = find_decoder_layers(model)
    builders = {"(a) merged W + s*B*A, quantized (river_hf before; DoRA, IA3, ... now)":
                lambda layer: twin_merged(layer, quantize),
                "(b) quantized W + full-precision LoRA (river_hf now: make_twin)":
                lambda layer: make_twin(layer, quantize, []),
                "(c) quantized W, adapter dropped": lambda layer: twin_without_adapters(layer, quantize)}
    first = references[0]
    inputs = linear_inputs(model, torch.cat([first.prompt_ids[0], first.continuation]).view(1, -1))
    print(f"cpu capability {torch.backends.cpu.get_cpu_capability()}; SmolLM2-135M bf16; LoRA r=16 on {TARGETS}; "
          f"rho={args.rho}, seed {args.seed}; twins {args.nbits}-bit group {args.group_size} from layer {START}; "
          f"{args.prompts} GSM8K prompts x {args.tokens} tokens")
    print("| twin | linear rel. error | match | KL | positions |\n|---|---:|---:|---:|---:|")
    for label, build in builders.items():
        twins = {idx: build(layers[idx]) for idx in range(START, len(layers))}
        error = linear_error(model, twins, inputs)
        with layers_replaced(model, twins):
            fidelity = measure_fidelity(model, references, None)
        print(f"| {label} | {error:.4f} | {fidelity.match:.1%} | {fidelity.kl:.4f} | {fidelity.positions} |")
    river_hf.build_river(model, river_config(args), progress=False)
    fidelity = measure_fidelity(model, references,
                                RiverSettings(tau=-1.0, exit_signal="cosine", prefill_exit="sequence"))
    print(f"| build_river on the PeftModel (b), tau=-1, 8-bit LM head | - | {fidelity.match:.1%} | "
          f"{fidelity.kl:.4f} | {fidelity.positions} |")


if __name__ == "__main__":
    main()
