"""KV strategies: what the layers an exited token skips do about its K/V ("KV cache absence").

The exit decision (signal, tau, batch policy) is the router's and is shared by all of them; a strategy only says how
a backbone layer runs and what a skipped layer does. One strategy object lives in the `RiverCache` of one `generate`
call (it may hold per-call state: recompute's pending tokens).

| strategy            | a skipped layer ...                                          | K/V of an exited token there |
|---------------------|--------------------------------------------------------------|------------------------------|
| `river`             | runs its quantized twin (same cache slot)                    | written now, by the twin     |
| `recompute`         | is skipped; the token's hidden state waits (EE-LLM)          | written later, exactly       |
| `state_propagation` | computes only K/V, from the exit layer's hidden state (CALM) | written now, approximate     |
| `mask`              | writes a placeholder; later tokens never attend to it (D-LLM)| absent (masked)              |
| `mono_decreasing`   | is skipped; later tokens may not go deeper (SkipDecode)      | never needed                 |

Every strategy but the river runs the prompt on the full backbone (without twins a prompt exit would leave the same
holes the strategy exists to handle), and every layer call goes through HF's own layer: the strategies rearrange
inputs (recompute batches pending tokens with the current one) but never reimplement attention.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .architectures import hidden_of
from ..checks import check_choice

# Per-position layer inputs that recompute keeps for a pending token and concatenates with the current token's.
_SEQUENCE_KWARGS = ("position_embeddings", "position_ids", "cache_position")


class KVStrategy:
    """What a backbone layer runs and what a layer an exited step skips does. One per `generate` call (in its
    `RiverCache`), so per-call state lives on it. Subclasses set `name` and implement `run_skipped`."""

    name = ""
    runs_prompt_on_backbone = False
    follows_beam_search = True  # False: per-row state that beam reordering would scramble (refused up front)

    def __init__(self, layers, model_config=None):
        self.layers = layers  # the model's RiverLayers, in order
        self.num_layers = len(layers)

    def default_min_exit_depth(self, start_layer: int) -> int:
        return start_layer

    def begin_step(self, cache, router) -> None:
        """Called by layer 0 after the router opened the step."""

    def run_backbone(self, layer, hidden_states, args, kwargs, cache):
        return layer.base_layer(hidden_states, *args, **kwargs)

    def run_skipped(self, layer, hidden_states, args, kwargs, cache):
        raise NotImplementedError

    def expected_positions(self, layer_idx: int, cache) -> int:
        """How many positions layer `layer_idx` of the cache must hold now (KV integrity)."""
        return cache.recorded_length

    def before_batch_change(self) -> None:
        """Called before beam reordering / batch selection; a strategy with per-row state may refuse."""


class RiverStrategy(KVStrategy):
    """The river (the paper): skipped layers run on their KV-sharing twins, so the cache is complete at all times."""

    name = "river"

    def run_skipped(self, layer, hidden_states, args, kwargs, cache):
        return layer.twin(hidden_states, *args, **kwargs)


class StatePropagation(KVStrategy):
    """CALM: a skipped layer takes the exit layer's hidden state as its input and computes only its K/V."""

    name = "state_propagation"
    runs_prompt_on_backbone = True

    def run_skipped(self, layer, hidden_states, args, kwargs, cache):
        # The HF layer runs its input norm, projections and rotary embedding up to the cache write; the proxy cache
        # stops it right after the write, so attention, o_proj and the MLP never run (q_proj does: its cost is paid).
        try:
            layer.base_layer(hidden_states, *args, **_with_cache(kwargs, _StopAfterWrite(cache)))
        except _KVWritten:
            return hidden_states  # the token's state goes on unchanged to the final norm and LM head
        raise RuntimeError(f"decoder layer {layer.layer_idx} returned without writing its K/V to the cache")


class MonoDecreasing(KVStrategy):
    """SkipDecode: a position may not exit deeper than the previous one, so no later token needs the missing K/V."""

    name = "mono_decreasing"
    runs_prompt_on_backbone = True

    def begin_step(self, cache, router) -> None:
        if cache.recorded_length and not router.is_prefill:
            router.depth_cap = int(cache.exit_depth[:, -1].max())

    def run_skipped(self, layer, hidden_states, args, kwargs, cache):
        return hidden_states

    def expected_positions(self, layer_idx: int, cache) -> int:
        # depths never increase, so the positions that ran layer `layer_idx` are a prefix of the sequence
        return int((cache.exit_depth[0] > layer_idx).sum()) if cache.recorded_length else 0


class Mask(KVStrategy):
    """D-LLM: a skipped layer stores a placeholder K/V (keeping positions aligned) that is masked out for later
    tokens. It needs a minimum exit layer: tokens that skip most layers leave most of the model without context."""

    name = "mask"
    runs_prompt_on_backbone = True

    def __init__(self, layers, model_config=None):
        super().__init__(layers, model_config)
        _require_full_attention(self.name, layers, model_config)
        self.shallowest = self.num_layers  # the smallest exit depth recorded so far: layers below it mask nothing

    def default_min_exit_depth(self, start_layer: int) -> int:
        return max(start_layer, self.num_layers // 2)

    def begin_step(self, cache, router) -> None:
        if cache.recorded_length:  # once per step, not once per layer
            self.shallowest = int(cache.exit_depth.min())

    def run_backbone(self, layer, hidden_states, args, kwargs, cache):
        if cache.recorded_length and layer.layer_idx >= self.shallowest:
            kwargs = {**kwargs, "attention_mask": self._mask_skipped(layer.layer_idx, kwargs, cache, hidden_states)}
        return layer.base_layer(hidden_states, *args, **kwargs)

    def run_skipped(self, layer, hidden_states, args, kwargs, cache):
        cache_layer = cache.layers[layer.layer_idx]
        batch, heads, _, head_dim = cache_layer.keys.shape
        shape = (batch, heads, hidden_states.shape[1], head_dim)
        cache_layer.update(placeholder_kv(shape, cache_layer.keys), placeholder_kv(shape, cache_layer.values))
        return hidden_states

    @staticmethod
    def _mask_skipped(layer_idx, kwargs, cache, hidden_states):
        """The layer's mask, with the keys of positions that skipped this layer switched off."""
        batch, num_new = hidden_states.shape[:2]
        computed = cache.exit_depth > layer_idx  # [B, recorded]
        computed = torch.cat([computed, computed.new_ones(batch, num_new)], dim=1)  # this step's tokens run it now
        allowed = _allowed(kwargs.get("attention_mask"), batch, num_new, computed.shape[1], hidden_states.device)
        return _as_mask_like(kwargs.get("attention_mask"), allowed & computed[:, None, None, :])


def placeholder_kv(shape, like: torch.Tensor) -> torch.Tensor:
    """What the mask strategy writes for a skipped position. Never attended: tests put garbage here to prove it."""
    return torch.zeros(shape, dtype=like.dtype, device=like.device)


@dataclass
class _PendingToken:
    """A recompute-strategy token that exited: its hidden state waits for the layer it has not run yet."""

    key_index: int  # its index on the cache's sequence axis
    hidden: torch.Tensor  # [B, 1, D]: the input of layer `frontier`
    frontier: int
    layer_inputs: dict[int, dict] = field(default_factory=dict)  # per skipped layer: its sequence kwargs and mask


class Recompute(KVStrategy):
    """EE-LLM: an exited token skips the rest of the layers; when a later token runs a layer the exited tokens have not
    run, they run it too, batched with that token, so their K/V there is the backbone's own (exact, only late)."""

    name = "recompute"
    follows_beam_search = False
    runs_prompt_on_backbone = True

    def __init__(self, layers, model_config=None):
        super().__init__(layers, model_config)
        _require_full_attention(self.name, layers, model_config)
        self.pending: list[_PendingToken] = []

    def run_skipped(self, layer, hidden_states, args, kwargs, cache):
        if hidden_states.shape[1] != 1:
            raise RuntimeError("kv_strategy='recompute' exits decode steps only (one new token per row)")
        if layer.layer_idx == cache.router.depth:  # the first layer it skips: it becomes pending here
            key_index = cache.layers[0].get_seq_length() - 1
            self.pending.append(_PendingToken(key_index, hidden_states, frontier=layer.layer_idx))
        self.pending[-1].layer_inputs[layer.layer_idx] = _layer_inputs(kwargs)
        return hidden_states

    def run_backbone(self, layer, hidden_states, args, kwargs, cache):
        waiting = self._waiting_at(layer.layer_idx)
        if not waiting:
            return layer.base_layer(hidden_states, *args, **kwargs)
        if args:
            raise RuntimeError("kv_strategy='recompute' needs the decoder layer's inputs as keyword arguments")
        current = _layer_inputs(kwargs)
        merged = torch.cat([token.hidden for token in waiting] + [hidden_states], dim=1)
        merged_kwargs = {**kwargs, **_merged_inputs(layer.layer_idx, waiting, current, merged)}
        output = layer.base_layer(merged, **merged_kwargs)
        hidden = hidden_of(output)
        self._advance(waiting, hidden, layer.layer_idx)
        return _replace_hidden(output, hidden[:, len(waiting):])

    def flush(self, cache) -> None:
        """Run every pending token through the layers it skipped, so every layer holds every position."""
        for layer in self.layers:
            waiting = self._waiting_at(layer.layer_idx)
            if not waiting:
                continue
            merged = torch.cat([token.hidden for token in waiting], dim=1)
            merged_kwargs = _merged_inputs(layer.layer_idx, waiting, None, merged)
            output = layer.base_layer(merged, **merged_kwargs, **_with_cache({}, cache), use_cache=True)
            self._advance(waiting, hidden_of(output), layer.layer_idx)

    def expected_positions(self, layer_idx: int, cache) -> int:
        return cache.recorded_length - len(self._waiting_at_or_before(layer_idx))

    def before_batch_change(self) -> None:
        if self.pending:
            raise NotImplementedError(
                "kv_strategy='recompute' keeps exited tokens' states per batch row and does not follow beam search "
                "or batch reordering; use num_beams=1, or another kv_strategy."
            )

    def _waiting_at(self, layer_idx: int) -> list[_PendingToken]:
        return [token for token in self.pending if token.frontier == layer_idx]

    def _waiting_at_or_before(self, layer_idx: int) -> list[_PendingToken]:
        return [token for token in self.pending if token.frontier <= layer_idx]

    def _advance(self, waiting, hidden, layer_idx: int) -> None:
        for offset, token in enumerate(waiting):
            token.hidden = hidden[:, offset:offset + 1]
            token.frontier = layer_idx + 1
            token.layer_inputs.pop(layer_idx, None)
        self.pending = [token for token in self.pending if token.frontier < self.num_layers]


STRATEGIES = {cls.name: cls for cls in (RiverStrategy, Recompute, StatePropagation, Mask, MonoDecreasing)}


def strategy_names() -> tuple[str, ...]:
    return tuple(STRATEGIES)


def make_strategy(name: str, layers, model_config=None) -> KVStrategy:
    check_choice("kv_strategy", name, strategy_names())
    return STRATEGIES[name](layers, model_config)


def check_beam_search(name: str, num_beams: int | None) -> None:
    """Refuse, before generation starts, a beam search the strategy `name` cannot follow."""
    if (num_beams or 1) > 1 and not STRATEGIES[name].follows_beam_search:
        raise ValueError(f"`kv_strategy`='{name}' keeps exited tokens' states per batch row and does not follow "
                         f"beam search (got num_beams={num_beams}); use num_beams=1, or another kv_strategy.")


# ---------------------------------------------------------------- helpers: layer inputs and masks


class _KVWritten(Exception):
    """Raised by `_StopAfterWrite` once the layer's K/V is in the cache: nothing after it needs to run."""


class _StopAfterWrite:
    """A cache stand-in that writes K/V into the real cache and then stops the layer."""

    def __init__(self, cache):
        self._cache = cache

    def update(self, *args, **kwargs):
        self._cache.update(*args, **kwargs)
        raise _KVWritten

    def __getattr__(self, name):
        return getattr(self._cache, name)


def _with_cache(kwargs: dict, cache) -> dict:
    key = "past_key_values" if "past_key_values" in kwargs and "cache" not in kwargs else "cache"
    return {**kwargs, key: cache}


def _replace_hidden(output, hidden: torch.Tensor):
    if isinstance(output, (tuple, list)):
        return type(output)((hidden, *output[1:]))
    return hidden


def _layer_inputs(kwargs: dict) -> dict:
    """The per-position inputs of one layer call (what must be concatenated when tokens are batched)."""
    inputs = {name: kwargs[name] for name in _SEQUENCE_KWARGS if kwargs.get(name) is not None}
    inputs["attention_mask"] = kwargs.get("attention_mask")
    return inputs


def _cat_inputs(values: list):
    if isinstance(values[0], (tuple, list)):  # (cos, sin): each [B, T, d]
        return tuple(torch.cat(parts, dim=1) for parts in zip(*values))
    return torch.cat(values, dim=-1 if values[0].dim() == 1 else 1)  # cache_position [T]; position_ids [B, T]


def _merged_inputs(layer_idx: int, waiting, current: dict | None, merged_hidden: torch.Tensor) -> dict:
    """Layer inputs for the pending tokens (and the current token, last), with a causal mask over all keys."""
    per_token = [token.layer_inputs[layer_idx] for token in waiting] + ([current] if current is not None else [])
    merged = {}
    for name in _SEQUENCE_KWARGS:
        if all(name in inputs for inputs in per_token):
            merged[name] = _cat_inputs([inputs[name] for inputs in per_token])
    batch, device = merged_hidden.shape[0], merged_hidden.device
    num_keys = waiting[0].key_index + len(per_token)  # the layer holds every position before the first waiting one
    key_indices = [token.key_index for token in waiting] + ([num_keys - 1] if current is not None else [])
    rows = [_allowed_row(inputs.get("attention_mask"), batch, key_index, num_keys, device)
            for inputs, key_index in zip(per_token, key_indices)]
    masks = [inputs.get("attention_mask") for inputs in per_token]
    like = next((mask for mask in masks if mask is not None and mask.dtype != torch.bool), None)
    merged["attention_mask"] = _as_mask_like(like, torch.cat(rows, dim=2))
    return merged


def _allowed_row(mask, batch: int, key_index: int, num_keys: int, device) -> torch.Tensor:
    """Bool [B, 1, 1, num_keys]: what a query at `key_index` may attend to. Its own step's mask row (which carries
    padding) when there was one, else causal; keys after it are never visible."""
    causal = torch.arange(num_keys, device=device) <= key_index
    if mask is None:
        return causal.expand(batch, 1, 1, num_keys)
    row = _to_bool(mask)[:, :, -1:, :]
    row = torch.nn.functional.pad(row, (0, num_keys - row.shape[-1]), value=False)[..., :num_keys]
    return row & causal


def _allowed(mask, batch: int, num_queries: int, num_keys: int, device) -> torch.Tensor:
    if mask is None:
        return torch.ones(batch, 1, num_queries, num_keys, dtype=torch.bool, device=device)
    return _to_bool(mask)


def _to_bool(mask: torch.Tensor) -> torch.Tensor:
    """HF passes boolean masks (sdpa: True = attend) or additive float masks (eager: 0 = attend)."""
    return mask if mask.dtype == torch.bool else mask == 0


def _as_mask_like(like, allowed: torch.Tensor) -> torch.Tensor:
    """`allowed` in the format the layer was given: additive float when HF gave one, else boolean."""
    if like is None or like.dtype == torch.bool:
        return allowed
    return torch.zeros(allowed.shape, dtype=like.dtype, device=like.device).masked_fill(
        ~allowed, torch.finfo(like.dtype).min)


def _require_full_attention(name: str, layers, model_config) -> None:
    """Recompute and mask address keys by position; sliding-window layers drop old keys, so they are not supported."""
    types = getattr(model_config, "layer_types", None) or []
    sliding = [idx for idx, kind in enumerate(types) if "sliding" in str(kind)]
    if sliding or getattr(model_config, "sliding_window", None) and getattr(model_config, "use_sliding_window", True):
        raise ValueError(
            f"`kv_strategy`={name!r} needs full attention in every layer; this model uses sliding-window attention"
            f"{f' in layers {sliding}' if sliding else ''}. Use kv_strategy='river', 'state_propagation' or "
            f"'mono_decreasing'."
        )
