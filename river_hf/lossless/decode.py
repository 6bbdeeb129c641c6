"""Lossless mode: the river drafts, the backbone verifies, in one `RiverCache` (docs/lossless.md).

`generate(..., generation_config=RiverConfig(lossless=True, num_draft_tokens=4))` on a river model: the mixin hands
transformers' `generate` the decoding function below as `custom_generate` (its supported extension point: generate
prepares the inputs, logits processors, stopping criteria, max_length and the cache, then calls it), with a
`LosslessCache`. Each round:

1. draft: up to k river passes (one token each, the exit signal deciding as in a river generate) propose k tokens;
2. crop the cache back by those k positions (`RiverCache.crop` keeps the exit record aligned);
3. verify: one backbone pass over the last committed token and the k drafts writes their K/V (the cache's router is
   set aside for that pass, so every layer runs its backbone layer as in plain generate; the positions are recorded
   at depth num_layers) and gives k + 1 next-token distributions, each row computed as plain generate's one-token
   step computes it (`river_hf.lossless.exact_rows`), so they are the plain model's bit for bit;
4. keep the longest agreeing prefix plus the backbone's own next token (`river_hf.lossless.acceptance`), feed them to
   the stopping criteria and the streamer one by one, and crop the positions of the rejected drafts.

So every cached position ends up holding the backbone's K/V: the cache equals the backbone's own cache of the same
tokens, and no second cache or model exists. `DraftControl` times the steps and falls back to plain backbone steps
when drafting does not pay (`draft_fallback`). Batch size 1 only.
"""

from __future__ import annotations

import time
from contextlib import contextmanager, nullcontext

import torch
from transformers.generation.utils import GenerateDecoderOnlyOutput

from .acceptance import greedy_accept, speculative_accept
from ..core.kv_cache import RiverCache
from .draft_control import BACKBONE_CHOSE, DraftControl, DraftRecord, DraftRound, FallbackMemory
from .exact_rows import ExactRows
from ..core.twins import get_river


class LosslessCache(RiverCache):
    """The one cache of a lossless call: a RiverCache that also keeps the call's `DraftRecord` (`drafts`)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.drafts: DraftRecord | None = None

    def reset(self) -> None:
        super().reset()
        self.drafts = None


def lossless_generate_kwargs(settings, kwargs: dict) -> dict:
    """What the mixin adds to a lossless `generate` call: the decoding function, and the streamer again under a name
    of its own (transformers passes a `custom_generate` callable only the keyword arguments its `_sample` lacks;
    generate itself still streams the prompt)."""
    if kwargs.get("custom_generate") is not None:
        raise ValueError("`custom_generate`: lossless mode is a custom_generate function of its own; pass one of "
                         "them, not both.")
    return {"custom_generate": lossless_decoding, "lossless_streamer": kwargs.get("streamer"),
            "lossless_settings": settings}


def lossless_decoding(model, input_ids, logits_processor, stopping_criteria, generation_config, lossless_settings,
                      lossless_streamer=None, draft_clock=None, **model_kwargs):
    """transformers' `generate(custom_generate=...)` entry point. `draft_clock`: a `() -> seconds` clock for the
    fallback rule's timings (default `time.perf_counter`; tests pass a fake one)."""
    cache = model_kwargs.get("cache")
    _check_call(input_ids, generation_config, cache, model_kwargs)
    record = DraftRecord(num_layers=cache.num_layers)
    cache.drafts = record
    control = DraftControl(lossless_settings.num_draft_tokens, lossless_settings.draft_fallback, record,
                           draft_clock or time.perf_counter, fallback_memory(model, lossless_settings))
    decoder = _Decoder(model, input_ids, logits_processor, stopping_criteria, generation_config, model_kwargs,
                       lossless_streamer, control, ExactRows(model) if lossless_settings.exact_verify else None)
    decoder.run()
    control.call_done()
    return decoder.output()


def fallback_memory(model, settings) -> FallbackMemory:
    """The fallback verdicts of this river's earlier calls with the same river settings (kept in its `River`, like
    the ExitGain: a rebuilt river starts afresh)."""
    return get_river(model).lossless_fallbacks.setdefault(settings, FallbackMemory())


def forget_fallbacks(model) -> None:
    """Drop every fallback verdict and remembered t_plain of this river: its next lossless call probes afresh."""
    get_river(model).lossless_fallbacks.clear()


def _check_call(input_ids, generation_config, cache, model_kwargs) -> None:
    if generation_config.num_beams > 1:
        raise ValueError(f"`num_beams`={generation_config.num_beams}: lossless mode decodes greedily or samples; "
                         f"use num_beams=1 or lossless=False.")
    if input_ids.shape[0] != 1:
        raise ValueError(f"`input_ids`: lossless mode supports batch size 1 only; got {input_ids.shape[0]} rows "
                         f"(input rows x num_return_sequences). Generate one prompt at a time.")
    for name in ("output_attentions", "output_hidden_states"):
        if getattr(generation_config, name):
            raise ValueError(f"`{name}` is not supported in lossless mode (drafted passes would be mixed in); "
                             f"set it to False or use lossless=False.")
    if not isinstance(cache, LosslessCache) or cache.router is None:
        raise ValueError("`cache`: lossless mode runs on the LosslessCache its generate call makes; pass no cache.")
    if model_kwargs.get("inputs_embeds") is not None:
        raise ValueError("`inputs_embeds` is not supported in lossless mode; pass `input_ids`.")


@contextmanager
def backbone_pass(cache: RiverCache, num_tokens: int, device):
    """The pass inside the block is a plain backbone pass writing into the same cache: without its router the
    layers run their backbone layer directly (no dispatch, no signal, the original LM head), as plain generate does;
    its positions are recorded at depth num_layers afterwards."""
    with cache.backbone_pass():
        yield
    cache.record_step(cache.num_layers, 1, num_tokens, device)


class _Decoder:
    """The state of one lossless call: the committed tokens `ids` [1, C] (the cache holds C - 1 positions: the last
    token is fed by the next pass), `model_kwargs` aligned with them, and what the output returns."""

    def __init__(self, model, input_ids, processor, stopping, generation_config, model_kwargs, streamer, control,
                 exact: ExactRows | None):
        self.model, self.ids, self.processor, self.stopping = model, input_ids, processor, stopping
        self.exact = exact  # None: verification is one multi-row pass (equal to one-token steps up to rounding)
        self.config, self.model_kwargs, self.streamer, self.control = generation_config, model_kwargs, streamer, control
        self.cache: LosslessCache = model_kwargs["cache"]
        self.router = self.cache.router
        self.do_sample = generation_config.do_sample
        wants = generation_config.return_dict_in_generate
        self.scores = () if wants and generation_config.output_scores else None
        self.raw_logits = () if wants and generation_config.output_logits else None
        self.finished = False

    # ---- the loop -------------------------------------------------------------------------------------------------
    def run(self) -> None:
        self.cache.activate_past_recording()  # sliding-window layers keep what a crop may need to restore
        with backbone_pass(self.cache, self.ids.shape[1], self.ids.device):
            outputs = self.model._prefill(self.ids, self.config, self.model_kwargs)
        self.cache.crop(0)  # sliding-window layers: back to their window
        logits = outputs.logits[:, -1:].float()
        self._show_signal(logits)
        self._commit(*self._backbone_token(logits), [BACKBONE_CHOSE])
        while not self.finished:
            k = self.control.draft_length(self.config.max_length - self.ids.shape[1])
            self._speculate(k) if k > 0 else self._plain_step()
        if self.streamer is not None:
            self.streamer.end()

    def _plain_step(self) -> None:
        started = self.control.clock()
        with backbone_pass(self.cache, 1, self.ids.device), self._rows(1):
            logits = self._forward(self.ids, 1).logits[:, -1:].float()
        self._show_signal(logits)
        self._commit(*self._backbone_token(logits), [BACKBONE_CHOSE])
        self.control.plain_step_done(self.control.clock() - started)

    def _speculate(self, k: int) -> None:
        started = self.control.clock()
        drafts, draft_probs, depths = self._draft(k)
        draft_seconds = self.control.clock() - started
        if self.exact is not None:
            # once per row count and process: which linears must run row by row is probed here, off the round's
            # clock (the fallback prices rounds; a one-time probe in a verification made a new draft length look slow)
            self.exact.linears_apart(len(drafts) + 1)
        drafted = self.control.clock()
        self.cache.crop(-len(drafts))  # the drafted positions: the backbone writes them again
        with backbone_pass(self.cache, len(drafts) + 1, self.ids.device), self._rows(len(drafts) + 1):
            logits = self._forward(torch.cat([self.ids, drafts[None]], dim=1), len(drafts) + 1).logits
        logits = logits[:, -(len(drafts) + 1):].float()  # [1, k + 1, V]
        scores = self._processed(logits, drafts)
        if self.do_sample:
            accepted, tokens = speculative_accept(drafts, draft_probs, scores.softmax(dim=-1))
        else:
            accepted, tokens = greedy_accept(drafts, scores)
        committed = self._commit(tokens, logits, scores, depths[:accepted] + [BACKBONE_CHOSE])
        self.cache.crop(-(len(drafts) + 1 - committed))  # rejected drafts, and any a stopping criterion cut
        self._show_signal(logits[:, committed - 1:committed])
        self.control.round_done(DraftRound(len(drafts), accepted, committed, draft_seconds,
                                           self.control.clock() - drafted))

    def _draft(self, k: int) -> tuple[torch.Tensor, torch.Tensor | None, list[int]]:
        """Up to k river passes: (drafts [k'], their draft distributions [k', V] when sampling, exit depths). Stops
        after an EOS draft: nothing after it could be kept."""
        sequence, drafts, probs, depths = self.ids, [], [], []
        eos = self.config._eos_token_tensor
        for _ in range(k):
            logits = self._forward(sequence, 1).logits[:, -1].float()  # [1, V]
            scores = self.processor(sequence, logits)
            if self.do_sample:
                probs.append(scores.softmax(dim=-1)[0])
                token = torch.multinomial(probs[-1], 1)
            else:
                token = scores[0].argmax(dim=-1, keepdim=True)
            drafts.append(token)
            depths.append(self.router.depth)
            sequence = torch.cat([sequence, token[None]], dim=1)
            if eos is not None and bool(torch.isin(token, eos.to(token.device)).any()):
                break
        return torch.cat(drafts), torch.stack(probs) if probs else None, depths

    # ---- passes and tokens --------------------------------------------------------------------------------------
    def _rows(self, rows: int):
        """A backbone pass over `rows` tokens that computes each as plain generate's one-token step would
        (river_hf.lossless.exact_rows): the verified K/V and logits are then the plain model's bit for bit. One-token
        passes need it too, for sliding-window layers: the lossless cache keeps keys a crop may need, which plain
        generate's steps do not see."""
        return self.exact.rows(rows) if self.exact is not None else nullcontext()

    def _forward(self, sequence: torch.Tensor, num_new: int):
        """One model pass over the last `num_new` tokens of `sequence` (the committed ids, then drafts)."""
        extra = sequence.shape[1] - self.ids.shape[1]  # drafts beyond the committed tokens
        kwargs = self._extended_kwargs(extra)
        inputs = self.model.prepare_inputs_for_generation(sequence, next_sequence_length=num_new, **kwargs)
        if "logits_to_keep" in inputs:
            inputs["logits_to_keep"] = num_new
        return self.model(**inputs, return_dict=True)

    def _extended_kwargs(self, extra: int) -> dict:
        """model_kwargs (attention mask, position ids, ...) for `extra` tokens past the committed ones."""
        if extra == 0:
            return self.model_kwargs
        return self.model._update_model_kwargs_for_generation({}, dict(self.model_kwargs), num_new_tokens=extra)

    def _processed(self, logits: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
        """The logits processors on each of the k + 1 positions, with the prefix that position continues. -> [k+1, V]"""
        sequence = torch.cat([self.ids, drafts[None]], dim=1)
        base = self.ids.shape[1]
        return torch.cat([self.processor(sequence[:, :base + j], logits[:, j]) for j in range(logits.shape[1])])

    def _backbone_token(self, logits: torch.Tensor):
        """(token [1], logits, scores [1, V]): the backbone's own next token from logits [1, 1, V], processed, then
        argmax or sampled."""
        scores = self.processor(self.ids, logits[:, -1])
        if self.do_sample:
            return torch.multinomial(scores.softmax(dim=-1), 1)[0], logits, scores
        return scores.argmax(dim=-1), logits, scores

    def _commit(self, tokens: torch.Tensor, logits: torch.Tensor, scores: torch.Tensor, depths: list[int]) -> int:
        """Append tokens [n] one by one until a stopping criterion ends the call; returns how many were appended.
        logits [1, >= n, V]: the raw logits that chose them; scores [>= n, V]: the processed ones."""
        count = 0
        for token in tokens.tolist():
            if self.scores is not None:
                self.scores += (scores[count:count + 1],)
            if self.raw_logits is not None:
                self.raw_logits += (logits[:, count],)
            self.ids = torch.cat([self.ids, self.ids.new_tensor([[token]])], dim=1)
            self.control.record.draft_depth.append(depths[count])
            count += 1
            if self.streamer is not None:  # one token per put, as plain generate (token clocks count puts)
                self.streamer.put(self.ids[:, -1].cpu())
            if bool(self.stopping(self.ids, self.scores).all()):
                self.finished = True
                break
        self.model_kwargs = self._extended_kwargs(count)
        return count

    def _show_signal(self, logits: torch.Tensor) -> None:
        """A signal that reads the previous pass's logits (confidence) sees those that chose the last committed
        token (a backbone pass has no router, so `passes.end_pass` hands it nothing; after a verification these are
        the logits of the last kept position, not of the pass's last one)."""
        signal = self.router.signal
        if signal.needs_logits:
            signal.observe_logits(logits)

    def output(self):
        if not self.config.return_dict_in_generate:
            return self.ids
        return GenerateDecoderOnlyOutput(sequences=self.ids, scores=self.scores, logits=self.raw_logits,
                                         cache=self.cache)
