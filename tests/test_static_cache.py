"""The river on HF's static cache (`cache_implementation="static"`) and its captured decode steps
(river_hf.core.captured_decode).

Invariants, on tiny random models: the static river gives the same tokens and exit record as the dynamic one, tau > 1
is the backbone, every layer's static slots hold every position; compiled, a planning signal's decode steps run as one
graph per exit depth and give the eager river's tokens. Compiled tests use dynamo with the `eager` backend (the traced
graph run as it is: bit-exact, and seconds instead of inductor's minute); one test compiles with inductor.
"""

from __future__ import annotations

import io
import sys

import pytest
import torch
from transformers import CompileConfig, TextStreamer

import river_hf
from river_hf import RiverStaticCache

from test_peft import MAKERS as LORA_MAKERS
from conftest import (ARCHITECTURES, confidence_tau, decoded_depths, generate, mixed_tau, plain_copy_with_twins,
                      river_of, tiny_model)

START = 2  # river_of's default


@pytest.fixture
def fresh_dynamo():
    """Each compiled test starts with dynamo's caches empty, so graph counts are its own."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def cpu_compile(backend="eager") -> CompileConfig:
    """transformers' CompileConfig, told to compile on CPU too (it compiles only on CUDA and the like by default)."""
    config = CompileConfig(backend=backend, mode=None, fullgraph=False)
    config._compile_all_devices = True
    return config


class GraphCounter:
    """A dynamo backend that counts the graphs it is handed and runs each as traced. A function, not an object:
    transformers deep-copies its CompileConfig, and a copied function is the same function."""

    def __init__(self):
        self.graphs = []

        def backend(graph_module, example_inputs):
            self.graphs.append(graph_module)
            return graph_module.forward

        self.backend = backend

    @property
    def frame_count(self) -> int:
        return len(self.graphs)


def same_run(static, dynamic) -> None:
    assert isinstance(static.cache, RiverStaticCache)
    assert torch.equal(static.sequences, dynamic.sequences)
    assert torch.equal(static.cache.exit_depth, dynamic.cache.exit_depth)
    static.cache.check_kv_integrity()


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_static_river_equals_the_dynamic_river(arch, prompt_ids):
    """tau > 1 (the backbone), tau = -1 (every decode step on the twins) and a mixed tau, eagerly, every architecture
    (gemma3's sliding layers hold a window of 5, exceeded by the prompt)."""
    model = tiny_model(arch)
    backbone = generate(model, prompt_ids).sequences
    tau = mixed_tau(model, prompt_ids)
    river_of(model)
    assert torch.equal(generate(model, prompt_ids, tau=1.5, cache_implementation="static").sequences, backbone)
    for t in (1.5, -1, tau):
        same_run(generate(model, prompt_ids, tau=t, cache_implementation="static"), generate(model, prompt_ids, tau=t))


def test_static_river_full_quantization(prompt_ids):
    model = river_of(tiny_model())
    out = generate(model, prompt_ids, tau=-1, cache_implementation="static")
    assert (out.cache.exit_depth == START).all()
    assert torch.equal(out.sequences, generate(plain_copy_with_twins(model), prompt_ids).sequences)


def test_the_model_generation_config_can_ask_for_it(prompt_ids):
    model = river_of(tiny_model())
    dynamic = generate(model, prompt_ids, tau=-1)
    model.generation_config.cache_implementation = "static"
    same_run(generate(model, prompt_ids, tau=-1), dynamic)
    # a plain generate on the river model: transformers' own static cache, the backbone
    assert type(generate(model, prompt_ids).cache).__name__ == "StaticCache"


def test_kv_integrity_finds_a_static_layer_that_skipped_a_step(prompt_ids):
    """A static layer writes at its own running count: one that skipped a step holds one position fewer."""
    cache = generate(river_of(tiny_model()), prompt_ids, tau=-1, cache_implementation="static").cache
    with torch.inference_mode():  # the buffers were made inside generate's inference mode
        cache.layers[3].cumulative_length.sub_(1)
    with pytest.raises(river_hf.KVIntegrityError, match="layer 3 holds 19 positions, expected 20"):
        cache.check_kv_integrity()


def test_static_kv_integrity_holds_for_a_left_padded_batch(left_padded_batch):
    """Padded positions may hold all-zero keys (a zero pad embedding): they are written, and the check says so."""
    ids, mask = left_padded_batch
    out = generate(river_of(tiny_model()), ids, mask, tau=-1, cache_implementation="static")
    out.cache.check_kv_integrity()


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_captured_confidence_steps_are_two_graphs(arch, prompt_ids, fresh_dynamo):
    """The default signal decides before the step: every decode step is the backbone graph or the graph exiting at the
    first eligible depth, with a quantized head on exited steps. Tokens and exits equal the eager dynamic river."""
    model = tiny_model(arch)
    backbone = GraphCounter()  # transformers' own graphs: gemma3's sliding layers add a recompile as they fill
    generate(model, prompt_ids, cache_implementation="static", compile_config=cpu_compile(backbone.backend),
             max_new_tokens=16)
    torch._dynamo.reset()
    river_of(model, quantize_lm_head=True)
    tau = confidence_tau(model, prompt_ids)
    counter = GraphCounter()
    for t in (1.5, -1, tau):
        out = generate(model, prompt_ids, tau=t, exit_signal="confidence", cache_implementation="static",
                       compile_config=cpu_compile(counter.backend), max_new_tokens=16)
        same_run(out, generate(model, prompt_ids, tau=t, exit_signal="confidence", max_new_tokens=16))
    assert set(decoded_depths(out.cache).unique().tolist()) == {START, 6}
    # one graph per depth (the backbone's own count for the first), kept across calls and their new caches
    assert counter.frame_count == backbone.frame_count + 1


@pytest.mark.parametrize("lora_twins", ["full_precision", "merged"])
@pytest.mark.parametrize("maker", ["peft_model", "in_place"])
def test_a_river_on_lora_adapters_is_captured_too(maker, lora_twins, prompt_ids, fresh_dynamo):
    """Twins of LoRA-adapted linears (the LoRA on top of the quantized weight, or one merged linear) in captured
    steps: one graph per depth, the eager river's tokens and exits, the adapted model's tokens at tau > 1."""
    model = LORA_MAKERS[maker]()
    adapted = generate(model, prompt_ids).sequences
    river_of(model, quantize_lm_head=True, lora_twins=lora_twins)
    counter = GraphCounter()
    for tau in (1.5, -1):
        out = generate(model, prompt_ids, tau=tau, exit_signal="confidence", cache_implementation="static",
                       compile_config=cpu_compile(counter.backend))
        same_run(out, generate(model, prompt_ids, tau=tau, exit_signal="confidence"))
        assert tau < 1 or torch.equal(out.sequences, adapted)
    assert counter.frame_count == 2


def test_captured_river_with_module_guards_skipped(prompt_ids, fresh_dynamo):
    """torch's guard filter that skips nn.Module guards (compile options, the documented speed-up: ~1.5 ms a step
    on SmolLM2) keeps the captured river right: its steps still find their graph by the cache's planned depth, a
    guard on the cache, not on a module; the quantized head's per-step flag follows that depth."""
    model = river_of(tiny_model(), quantize_lm_head=True)
    counter = GraphCounter()
    config = cpu_compile(counter.backend)
    config.options = {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
    tau = confidence_tau(model, prompt_ids)
    for t in (1.5, -1, tau, 1.5):
        out = generate(model, prompt_ids, tau=t, exit_signal="confidence", cache_implementation="static",
                       compile_config=config, max_new_tokens=16)
        same_run(out, generate(model, prompt_ids, tau=t, exit_signal="confidence", max_new_tokens=16))
        out.cache.check_kv_integrity()
    assert set(decoded_depths(out.cache).unique().tolist()) == {6}
    assert counter.frame_count == 2  # the backbone's graph and the exit's, as without the filter


def test_compile_config_for_each_device():
    """transformers' own defaults on CUDA (CUDA graphs); elsewhere inductor's default mode, with the flag without
    which transformers compiles nothing off CUDA-like devices."""
    from river_hf import compile_config_for

    cpu = compile_config_for("cpu")
    assert cpu._compile_all_devices and cpu.mode == "default"
    cuda = compile_config_for(torch.device("cuda", 0))
    assert not cuda._compile_all_devices and cuda.mode == CompileConfig().mode


@pytest.mark.parametrize("cache_dir, warned", [(None, True), ("own", False)])
def test_a_capability_override_into_the_shared_inductor_cache_is_warned(cache_dir, warned, monkeypatch, tmp_path):
    """ATEN_CPU_CAPABILITY changes inductor's vector ISA but not its cache key (torch 2.13): compiling a river's steps
    with it set and no cache folder of the run's own warns, naming TORCHINDUCTOR_CACHE_DIR; with one, nothing."""
    import warnings

    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    if cache_dir is None:
        monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    else:
        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    model = river_of(tiny_model())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.get_compiled_call(cpu_compile())
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert any("TORCHINDUCTOR_CACHE_DIR" in message for message in messages) == warned


def test_captured_random_steps_one_graph_per_depth(prompt_ids, fresh_dynamo):
    model = river_of(tiny_model(), start_layer=3)
    counter = GraphCounter()
    kwargs = dict(exit_signal="random", exit_rate=0.7, seed=3, max_new_tokens=20)
    out = generate(model, prompt_ids, cache_implementation="static", compile_config=cpu_compile(counter.backend),
                   **kwargs)
    same_run(out, generate(model, prompt_ids, **kwargs))
    assert counter.frame_count == decoded_depths(out.cache).unique().numel() >= 2
    # the cache notes the steps that compiled: the first at each depth, by position (what the CLI leaves out)
    first_at_depth = {}
    for step, depth in enumerate(decoded_depths(out.cache)[0].tolist()):
        first_at_depth.setdefault(depth, out.cache.prompt_length + step)
    assert sorted(out.cache.compiling_steps) == sorted(first_at_depth.values())
    assert all(seconds > 0 for seconds in out.cache.compiling_steps.values())


@pytest.mark.parametrize("signal", ["cosine", "cosine_first", "update_norm"])
def test_similarity_signals_at_the_extremes_are_captured(signal, prompt_ids, fresh_dynamo):
    """tau > 1 and tau = -1 read no score, so their steps are planned: the backbone graph and the full-exit one."""
    model = river_of(tiny_model())
    counter = GraphCounter()
    for tau in (1.5, -1):
        out = generate(model, prompt_ids, tau=tau, exit_signal=signal, cache_implementation="static",
                       compile_config=cpu_compile(counter.backend))
        same_run(out, generate(model, prompt_ids, tau=tau, exit_signal=signal))
    assert counter.frame_count == 2


def test_compiling_a_new_exit_depth_shows_a_progress_line(prompt_ids, fresh_dynamo, capsys):
    model = river_of(tiny_model())
    config = cpu_compile()
    generate(model, prompt_ids, tau=-1, exit_signal="confidence", cache_implementation="static", compile_config=config)
    assert "river: capturing the decode step exiting after 2 backbone layers" in capsys.readouterr().err
    generate(model, prompt_ids, tau=-1, exit_signal="confidence", cache_implementation="static", compile_config=config)
    assert "capturing" not in capsys.readouterr().err  # compiled once, kept


@pytest.mark.parametrize("terminal", [True, False])
def test_a_capture_on_a_terminal_keeps_what_was_streamed(terminal, prompt_ids, fresh_dynamo, monkeypatch):
    """A capture comes after the streamer printed the first token; on a terminal tqdm draws its bar from the start of
    the line ('\\r'), so the bar gets a line of its own there, and nothing extra elsewhere."""
    class Stream(io.StringIO):
        def isatty(self):
            return terminal

    screen = Stream()  # stdout and stderr on one screen, as in a terminal
    monkeypatch.setattr(sys, "stdout", screen)
    monkeypatch.setattr(sys, "stderr", screen)
    config = river_hf.RiverConfig(tau=-1, max_new_tokens=4, do_sample=False, cache_implementation="static",
                                  compile_config=cpu_compile())
    river_of(tiny_model()).generate(prompt_ids[:1], generation_config=config,
                                    streamer=TextStreamer(_Tokens(), skip_prompt=True))
    before_bar = screen.getvalue().split("river: capturing")[0]
    assert before_bar.split("\r")[0] == ("<first> \n" if terminal else "<first> ")


class _Tokens:
    """A tokenizer for TextStreamer whose tokens decode to whole words, so it prints the first new token at once."""

    def decode(self, ids, **kwargs):
        return "".join("<first> " if i == 0 else "<next> " for i in range(len(ids)))


def test_a_signal_deciding_inside_the_step_runs_eagerly(prompt_ids, fresh_dynamo):
    """The cosine reads each layer's output: its steps are not captured, and equal the dynamic river."""
    model = river_of(tiny_model())
    tau = mixed_tau(model, prompt_ids)
    counter = GraphCounter()
    out = generate(model, prompt_ids, tau=tau, cache_implementation="static",
                   compile_config=cpu_compile(counter.backend))
    same_run(out, generate(model, prompt_ids, tau=tau))
    assert counter.frame_count == 0


def test_plain_static_generate_on_a_river_model_is_the_compiled_backbone(prompt_ids, fresh_dynamo):
    model = tiny_model()
    expected = generate(model, prompt_ids).sequences
    river_of(model)
    counter = GraphCounter()
    out = generate(model, prompt_ids, cache_implementation="static", compile_config=cpu_compile(counter.backend))
    assert torch.equal(out.sequences, expected)
    assert counter.frame_count == 1


@pytest.mark.parametrize("bad, match", [
    (dict(lossless=True), "`lossless`=True"),
    (dict(kv_strategy="mono_decreasing"), "`kv_strategy`='river'"),
])
def test_what_a_static_river_cannot_hold_is_refused(bad, match, prompt_ids):
    model = river_of(tiny_model())
    with pytest.raises(ValueError, match=match):
        generate(model, prompt_ids, tau=0.5, cache_implementation="static", **bad)
    same_run(generate(model, prompt_ids, tau=-1, cache_implementation="static"), generate(model, prompt_ids, tau=-1))


def test_an_offloaded_backbone_is_refused_until_reloaded(prompt_ids, tmp_path):
    model = river_of(tiny_model())
    dynamic = generate(model, prompt_ids, tau=-1)
    river_hf.offload_backbone(model, layers=[3, 4], to="disk", folder=tmp_path, progress=False)
    with pytest.raises(ValueError, match=r"accelerate hooks.*reload_backbone"):
        generate(model, prompt_ids, tau=-1, cache_implementation="static")
    river_hf.reload_backbone(model)
    same_run(generate(model, prompt_ids, tau=-1, cache_implementation="static"), dynamic)


def test_a_passed_static_cache_too_short_is_refused_before_any_token(prompt_ids):
    model = river_of(tiny_model())
    def run(cache):
        return model.generate(prompt_ids, attention_mask=torch.ones_like(prompt_ids), cache=cache, tau=-1,
                              exit_signal="cosine", max_new_tokens=12, do_sample=False, return_dict_in_generate=True)

    cache = RiverStaticCache(config=model.config, max_cache_len=20)
    with pytest.raises(ValueError, match=r"`cache`: this RiverStaticCache holds 20 positions, and this call needs 21"):
        run(cache)
    assert cache.recorded_length == 0 and not cache.layers[0].is_initialized
    same_run(run(RiverStaticCache(config=model.config, max_cache_len=21)), generate(model, prompt_ids, tau=-1))


def test_a_used_static_cache_of_another_batch_or_dtype_is_refused_before_any_token(prompt_ids):
    """A RiverStaticCache made its tensors at its first call's batch and dtype: another batch, or a model moved to
    another dtype, is a ValueError naming `cache` (not index_copy_'s error mid-step); the cache is left as it was."""
    model = river_of(tiny_model())
    def run(ids, cache, **extra):
        extra = {"do_sample": False, **extra}
        return model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, tau=-1, exit_signal="cosine",
                              max_new_tokens=4, return_dict_in_generate=True, **extra)

    cache = RiverStaticCache(config=model.config, max_cache_len=64)
    run(prompt_ids[:1], cache)
    held = cache.recorded_length
    with pytest.raises(ValueError, match=r"`cache`: this RiverStaticCache holds a batch of 1 sequences, and this "
                                         r"call runs 2"):
        run(prompt_ids[:2], cache)
    with pytest.raises(ValueError, match="runs 3"):  # expanded rows count: one prompt, three return sequences
        run(prompt_ids[:1], cache, num_return_sequences=3, do_sample=True)
    model.to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"holds torch.float32 keys and values, and the model computes in "
                                         r"torch.bfloat16"):
        run(prompt_ids[:1], cache)
    assert cache.recorded_length == held
    fresh = RiverStaticCache(config=model.config, max_cache_len=64)
    same_run(run(prompt_ids[:2], fresh), generate(model, prompt_ids[:2], tau=-1, max_new_tokens=4))


def test_inductor_compiled_river(prompt_ids, fresh_dynamo):
    """The real compiler (inductor, on CPU): tau > 1 gives the compiled backbone's tokens, and a river exiting every
    decode step keeps every slot."""
    model = tiny_model()
    config = cpu_compile("inductor")
    backbone = generate(model, prompt_ids, cache_implementation="static", compile_config=config).sequences
    river_of(model)
    out = generate(model, prompt_ids, tau=1.5, exit_signal="confidence", cache_implementation="static",
                   compile_config=config)
    assert torch.equal(out.sequences, backbone)
    out = generate(model, prompt_ids, tau=-1, exit_signal="confidence", cache_implementation="static",
                   compile_config=config)
    assert (decoded_depths(out.cache) == START).all()
    out.cache.check_kv_integrity()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphs_river(prompt_ids, fresh_dynamo):
    """On CUDA transformers compiles the static decode step by itself (mode "reduce-overhead": CUDA graphs), one graph
    per exit depth: tau > 1 gives the compiled backbone's tokens; every step exiting keeps every slot."""
    model = tiny_model().to("cuda")
    ids = prompt_ids.to("cuda")
    backbone = generate(model, ids, cache_implementation="static").sequences
    river_of(model, quantize_lm_head=True)
    out = generate(model, ids, tau=1.5, exit_signal="confidence", cache_implementation="static")
    assert torch.equal(out.sequences, backbone)
    out = generate(model, ids, tau=-1, exit_signal="confidence", cache_implementation="static")
    assert (decoded_depths(out.cache) == START).all()
    out.cache.check_kv_integrity()
