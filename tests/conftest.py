"""Shared test fixtures and helpers, defined once for every test module:

- tiny randomly initialised models, one per supported architecture, built from configs (no hub access), their
  tokenizers and saved checkpoints;
- `river_of` (build a river), `generate` (greedy generation returning the dict output), `decoded_depths`,
  `count_twin_calls`, `mixed_tau`, `plain_copy_with_twins`;
- hand-made hidden states for the router (`states_with_cosines`, `run_step`);
- `scripted_exits`: a test exit signal registered through the public `river_hf.register_signal` seam.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import importlib.util
import os
import tempfile

import pytest
import torch
import torch.nn.functional as F
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, PreTrainedTokenizerFast

import river_hf
from river_hf import ExitSignal, RiverConfig, RiverQuantConfig, RiverSettings, register_signal
from river_hf.kernels import quantize
from river_hf.core.exit_decision import ExitRouter

# Converted GGUFs (river_hf.loading.gguf) go to a folder of this test session, not the user's cache; subprocesses (the
# CLI tests) inherit it, so the packaged model is converted once per session.
os.environ.setdefault("RIVER_HF_CACHE", tempfile.mkdtemp(prefix="river_hf_test_cache_"))
# The command line loads bf16, as the library calls the tests compare it with do, instead of the dtype `--dtype auto`
# would time for a tiny model on this machine (tests/test_backbone_dtype.py tests 'auto' itself); subprocesses too.
os.environ.setdefault("RIVER_HF_DTYPE", "bfloat16")

def load_module(path):
    """A script (an example, a measurement script) imported from its file, so that a test can call its main()."""
    spec = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(path))[0], path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def one_thread():
    """Tiny matrices: a second thread only adds sync cost, and on a busy 2-core box OpenMP waits dominate (10-100x).
    Modules of kernel tests use it for every test (`pytestmark = pytest.mark.usefixtures("one_thread")`)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def hqq_calls(monkeypatch):
    """Counts HQQ quantizations (one per twin linear built from scratch): [count]."""
    calls = [0]
    real = quantize.hqq_quantize

    def counting(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(quantize, "hqq_quantize", counting)
    return calls


# ---------------------------------------------------------------- tiny models

SIZES = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=6, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, max_position_embeddings=256, pad_token_id=0, eos_token_id=1,
             bos_token_id=2)
NUM_LAYERS = SIZES["num_hidden_layers"]

ARCHITECTURES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    # hybrid cache: sliding-window layers (window 5, exceeded by every test) interleaved with full attention
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {
        "sliding_window": 5,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention"] * 2,
    }),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}),
}


def tiny_model(arch: str = "llama", seed: int = 0, **overrides) -> transformers.PreTrainedModel:
    """A random model of `arch` (SIZES, then `overrides`), initialised after torch.manual_seed(seed), in eval mode."""
    config_name, model_name, extra = ARCHITECTURES[arch]
    config = getattr(transformers, config_name)(**{**SIZES, **extra, **overrides})
    torch.manual_seed(seed)
    return getattr(transformers, model_name)(config).eval()


def river_of(model, start_layer: int = 2, **quant):
    """`model` with a river from `start_layer` on (`quant`: further RiverQuantConfig fields, e.g. group_size).

    The kernel is the device's preferred one (`backend="auto"`), not the measured fastest (the default): which kernel
    wins a timing on a tiny layer depends on the machine, and these tests check behaviour, not speed
    (tests/test_kernel_choice.py covers `backend="fastest"`)."""
    quant.setdefault("backend", "auto")
    # The invariant tests compare against `plain_copy_with_twins` (layers only) and count exits per layer: uniform
    # 4-bit twins and the backbone's own head keep them simple (the defaults, mixed bits and an 8-bit head, have
    # their own tests).
    quant.setdefault("nbits", 4)
    quant.setdefault("quantize_lm_head", False)
    return river_hf.build_river(model, RiverQuantConfig(start_layer=start_layer, **quant), progress=False)


def plain_copy_with_twins(river_model):
    """A plain (river-less) copy of a river model whose layers >= start_layer ARE the twins: full quantization."""
    reference = copy.deepcopy(river_model)
    layers = river_hf.core.architectures.find_decoder_layers(reference)
    for idx, layer in enumerate(layers):
        layers[idx] = layer.twin if layer.twin is not None else layer.base_layer
    reference.__class__ = type(river_model)._river_base_class
    return reference


def assert_full_quantization_is_exact(river, prompt_ids, plain, start_layer: int = 2) -> None:
    """A river with a quantized head: tau > 1 gives the backbone's tokens (`plain`); tau = -1 exits every step at
    `start_layer`, keeps every KV slot, and gives the tokens of a plain model whose layers are the twins."""
    assert torch.equal(generate(river, prompt_ids, tau=1.5).sequences, plain)  # nothing exits: the backbone
    out = generate(river, prompt_ids, tau=-1)
    assert (out.cache.exit_depth == start_layer).all()
    out.cache.check_kv_integrity()
    reference = with_exited_head(plain_copy_with_twins(river))
    assert torch.equal(out.sequences, generate(reference, prompt_ids).sequences)


class ExitedHead(torch.nn.Module):
    """A RiverLMHead as a plain model's head that always gives an exited step's logits (`exited_logits`: the
    quantized head's, their top `exact_top_k` recomputed by the original head)."""

    def __init__(self, head):
        super().__init__()
        self.head = head

    def forward(self, hidden_states):
        return self.head.exited_logits(hidden_states)


def with_exited_head(reference):
    """`reference` (a plain copy of a river model) whose head always computes as an exited step's."""
    reference.set_output_embeddings(ExitedHead(reference.get_output_embeddings()))
    return reference


# ---------------------------------------------------------------- generating

RIVER_FIELDS = frozenset(f.name for f in dataclasses.fields(RiverSettings))


def generate(model, ids, mask=None, *, max_new_tokens: int = 12, output_logits: bool = False, **config):
    """Greedy (unless `do_sample`) `model.generate` returning the dict output (sequences, cache, logits when
    `output_logits`). `config`: GenerationConfig fields; any river field (tau, exit_signal, kv_strategy...) makes it a
    RiverConfig, else a plain GenerationConfig (on a river model: the backbone). `mask` defaults to all ones."""
    cls = RiverConfig if RIVER_FIELDS & config.keys() else GenerationConfig
    if cls is RiverConfig:  # these tests' taus are cosines (mixed_tau...): the paper's signal unless one is named
        config.setdefault("exit_signal", "cosine")
    config = cls(**{"max_new_tokens": max_new_tokens, "do_sample": False, **config}, return_dict_in_generate=True,
                 output_logits=output_logits)
    return model.generate(ids, attention_mask=mask if mask is not None else torch.ones_like(ids),
                          generation_config=config)


def decoded_depths(cache) -> torch.Tensor:
    """The exit depth of each generated token fed back: [B, recorded positions after the prompt]."""
    return cache.exit_depth[:, cache.prompt_length:]


def count_calls(*modules) -> list[int]:
    """Install hooks that count the forwards of `modules` (all together); returns the live counter, [count]."""
    calls = [0]
    for module in modules:
        module.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def count_twin_calls(model) -> list[int]:
    """`count_calls` on every twin of a river model."""
    return count_calls(*(layer.twin for layer in river_hf.river_layers(model) if layer.twin is not None))


def slow_drafts_clock(model):
    """A lossless `draft_clock` for a river at tau=-1: every forward pass costs one unit and a draft pass (the last
    layer's twin runs) one more, so drafting never pays, even with every draft kept (the fallback engages)."""
    passes, draft_passes = count_calls(model), count_calls(river_hf.river_layers(model)[-1].twin)
    return lambda: passes[0] + draft_passes[0]


def cheap_drafts_clock(model):
    """A lossless `draft_clock` that counts only backbone passes of the last layer: drafts that exit early cost
    nothing, so drafting always pays (the fallback never engages)."""
    passes = count_calls(river_hf.river_layers(model)[-1].base_layer)
    return lambda: passes[0]


def mixed_tau(model, ids, start_layer: int = 2) -> float:
    """A threshold inside the model's own similarity range (median over the eligible layers), so that steps exit
    at different depths."""
    with torch.no_grad():
        states = model(ids, output_hidden_states=True).hidden_states
    num_layers = len(states) - 1
    sims = [F.cosine_similarity(states[l].float(), states[l + 1].float(), dim=-1).mean()
            for l in range(start_layer - 1, num_layers - 1)]
    return torch.stack(sims).median().item()


def step_confidences(logits) -> torch.Tensor:
    """The batch-min top-1 probability of each generated step (logits: generate's per-step tuple) -> [steps]."""
    return torch.stack([torch.softmax(step.float(), -1).amax(-1).min() for step in logits])


def confidence_tau(model, ids, max_new_tokens: int = 16) -> float:
    """A tau between the backbone's per-step confidences (their median), so that some steps exit and some do not."""
    return step_confidences(generate(model, ids, max_new_tokens=max_new_tokens, output_logits=True).logits
                            ).median().item()


# ---------------------------------------------------------------- the router on hand-made states


def states_with_cosines(cosines: list[float], dim: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """h_in, h_out of shape [B, 1, D] whose row-wise cosine is exactly the given value."""
    h_in = torch.zeros(len(cosines), 1, dim)
    h_in[:, 0, 0] = 1.0
    h_out = torch.zeros_like(h_in)
    for row, cos in enumerate(cosines):
        h_out[row, 0, 0] = cos
        h_out[row, 0, 1] = (1 - cos**2) ** 0.5
    return h_in, h_out


def run_step(router: ExitRouter, cosines_per_layer: list[list[float]], num_new_tokens=1, first=False) -> int:
    """One step through `router`: layer i reports states whose per-row cosines are cosines_per_layer[i]; returns
    the step's exit depth."""
    router.begin_step(num_new_tokens, is_first_step=first)
    for layer_idx, cosines in enumerate(cosines_per_layer):
        if router.exited:
            break
        router.observe(layer_idx, *states_with_cosines(cosines))
    return router.depth


# ---------------------------------------------------------------- scripted exits (a registered test signal)


class ScriptedExit(ExitSignal):
    """A test signal: decode step i exits after `plan[i]` backbone layers, whatever the hidden states; prefill steps
    never exit. The router's rules still apply: a depth below its minimum exits at the minimum, the last depth or
    more never exits. Each router (each generate call) starts the plan from the beginning."""

    name = "scripted"
    reads_tau = False  # tau 'auto' (the default) leaves it alone
    plan: tuple[int, ...] = ()  # set on the subclass `scripted_exits` registers

    def __init__(self):
        self.steps = iter(self.plan)
        self.target: int | None = None  # this step's exit depth; None: stays on the backbone

    @classmethod
    def from_settings(cls, settings, num_layers: int) -> ScriptedExit:
        return cls()

    def begin_step(self, is_prefill: bool, min_depth: int) -> None:
        self.target = None if is_prefill else next(self.steps)

    def decide(self, depth, h_in, h_out, mask) -> bool:
        return self.target is not None and depth >= self.target


@pytest.fixture
def scripted_exits():
    """`script(plan) -> name`: registers a ScriptedExit following `plan` (one exit depth per decode step) as
    `exit_signal=name`; unregistered after the test."""
    names = []

    def script(plan, name: str = ScriptedExit.name) -> str:
        register_signal(type("Scripted", (ScriptedExit,), {"name": name, "plan": tuple(plan)}))
        names.append(name)
        return name

    yield script
    for name in names:
        river_hf.core.signals.unregister_signal(name)


# ---------------------------------------------------------------- inputs


@pytest.fixture
def prompt_ids():
    torch.manual_seed(1)
    return torch.randint(3, SIZES["vocab_size"], (2, 9))


@pytest.fixture
def left_padded_batch():
    """Two prompts of different lengths, left-padded: (input_ids, attention_mask)."""
    torch.manual_seed(2)
    ids = torch.randint(3, SIZES["vocab_size"], (2, 10))
    mask = torch.ones_like(ids)
    ids[1, :4] = SIZES["pad_token_id"]
    mask[1, :4] = 0
    return ids, mask


# ---------------------------------------------------------------- tokenizers and saved checkpoints


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over the tiny models' 256 ids ("w3 w17 ..."), built locally (no hub)."""
    vocab = {"<pad>": 0, "</s>": 1, "<s>": 2, **{f"w{i}": i for i in range(3, SIZES["vocab_size"])}}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="</s>", bos_token="<s>",
                                   padding_side="left")


@pytest.fixture
def saved_tiny_model(tmp_path):
    """A tiny Llama and its tokenizer saved to disk, as a user's local checkpoint would be."""
    path = tmp_path / "tiny-llama"
    tiny_model("llama").save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


# A ChatML template like SmolLM2's, short enough to read.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_tiny_tokenizer(chat_template: str | None = CHAT_TEMPLATE) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained in milliseconds: real byte-level decoding (multi-byte characters split across tokens)
    without the hub."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(["what is two plus three? the answer is five. hello world"] * 10, trainer)
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<|im_start|>", eos_token="<|im_end|>")
    wrapped.chat_template = chat_template
    return wrapped


def save_tiny_model(path, chat_template: str | None = CHAT_TEMPLATE, num_layers: int = 4) -> str:
    """A random Llama (hidden 64, GQA 4/2 heads) and its chat tokenizer (`make_tiny_tokenizer`) in `path`; returns
    the folder."""
    tokenizer = make_tiny_tokenizer(chat_template)
    # LlamaConfig's own defaults for what SIZES sets (head_dim 16 = 64 / 4 heads, 2048 positions) and no pad/eos
    model = tiny_model("llama", vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                       num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                       max_position_embeddings=2048, bos_token_id=tokenizer.bos_token_id, eos_token_id=None,
                       pad_token_id=None)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


QUESTIONS = ["what is two plus three?", "hello world", "the answer is five"]


def write_questions(path, questions=QUESTIONS, field: str = "question") -> str:
    """A JSONL prompt file (one {field: question} per line, what `--data` reads) at `path`; returns its path."""
    path.write_text("".join(json.dumps({field: q}) + "\n" for q in questions))
    return str(path)
