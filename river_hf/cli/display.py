"""What `river-hf generate` shows: the summary line of one call (decode speed, prefill, exit depth) and the answer
with each token coloured by its exit depth. Plain functions of a finished `generate` call, usable from a notebook:

    clock = TokenClock(then=TextStreamer(tokenizer, skip_prompt=True))
    out = model.generate(**inputs, streamer=clock, return_dict_in_generate=True, tau=0.5)
    depths = token_exit_depths(out.cache, prompt_length, new_tokens)
    print(GenerationStats.collect(clock, num_layers, depths).summary_line("confidence tau 0.5"))
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..bench.speed import TokenClock


def token_exit_depths(cache, prompt_length: int, num_new_tokens: int) -> list[int]:
    """Exit depth of the forward pass that chose each new token.

    New token i was predicted at position prompt_length - 1 + i: token 0 by the prefill's last position, the others
    by decode steps. The last token never goes through the model, so the cache holds one position fewer.
    """
    depth = cache.exit_depth[0]  # [seq_len]
    return depth[prompt_length - 1:prompt_length - 1 + num_new_tokens].tolist()


@dataclass
class GenerationStats:
    """What the summary line reports for one generate call (batch 1)."""

    new_tokens: int
    prefill_s: float  # from the call to the first new token
    decode_tokens_per_s: float  # tokens after the first, over the time after the first; nan with < 2 tokens
    num_layers: int
    mean_exit_depth: float | None = None  # over decode steps; None without a river
    exit_share: float | None = None  # share of decode steps that ran fewer than num_layers backbone layers
    compiling_steps: int = 0  # decode steps left out of the speed: they compiled their graph first (--compile)
    compiling_s: float = 0.0  # their seconds

    @classmethod
    def collect(cls, clock: TokenClock, num_layers: int, depths: list[int] | None = None,
                compiling_steps=()) -> GenerationStats:
        """From the clock that timed the call (`start`, `token_times`) and the new tokens' exit depths.
        `compiling_steps`: indices of new tokens whose decode step compiled a graph first; the speed leaves them out."""
        times = clock.token_times
        prefill_s = times[0] - clock.start if times else math.nan
        left_out = [k for k in set(compiling_steps) if 1 <= k < len(times)]
        compiling_s = sum(times[k] - times[k - 1] for k in left_out)
        decode_s = (times[-1] - times[0] if len(times) > 1 else 0.0) - compiling_s
        steps = len(times) - 1 - len(left_out)
        rate = steps / decode_s if steps > 0 and decode_s > 0 else math.nan
        stats = cls(new_tokens=len(times), prefill_s=prefill_s, decode_tokens_per_s=rate, num_layers=num_layers,
                    compiling_steps=len(left_out), compiling_s=compiling_s)
        decoded = depths[1:] if depths else []  # depths[0] belongs to the prefill
        if depths is not None:
            stats.mean_exit_depth = sum(decoded) / len(decoded) if decoded else math.nan
            stats.exit_share = sum(d < num_layers for d in decoded) / len(decoded) if decoded else math.nan
        return stats

    def summary_line(self, river: str | None = None) -> str:
        """One line; `river` describes the river's settings (None: the plain backbone ran)."""
        compiled = (f" (without the {self.compiling_steps} step{'s' if self.compiling_steps > 1 else ''} that "
                    f"compiled first: {self.compiling_s:.1f} s)" if self.compiling_steps else "")
        parts = [f"{self.new_tokens} new tokens", f"decode {self.decode_tokens_per_s:.1f} tok/s{compiled}",
                 f"prefill {self.prefill_s:.2f} s"]
        if self.mean_exit_depth is None:
            parts.append(f"river off: every token ran all {self.num_layers} layers" + (f" ({river})" if river else ""))
        else:
            parts.append(f"mean exit depth {self.mean_exit_depth:.1f} of {self.num_layers} layers")
            parts.append(f"{self.exit_share:.0%} of tokens exited early ({river})")
        return "[river-hf] " + " · ".join(parts)


# ---- --show-exits -----------------------------------------------------------------------------------------------
# Shallow exits (cheap tokens) to deep ones, then the colour of tokens that ran the whole backbone.
EXIT_COLORS = ("\033[96m", "\033[92m", "\033[93m", "\033[95m")  # bright cyan, green, yellow, magenta
FULL_DEPTH_COLOR = "\033[91m"  # bright red
RESET = "\033[0m"


def depth_bucket(depth: int, start_layer: int, num_layers: int, buckets: int = len(EXIT_COLORS)) -> int:
    """Which of `buckets` equal slices of [start_layer, num_layers) holds `depth`; `buckets` when it never exited."""
    if depth >= num_layers:
        return buckets
    span = max(num_layers - start_layer, 1)
    return min(max(depth - start_layer, 0) * buckets // span, buckets - 1)


def render_exits(tokenizer, token_ids: list[int], depths: list[int], start_layer: int, num_layers: int,
                 color: bool = True) -> str:
    """The answer with each token coloured by its exit depth (or followed by it in brackets), then a legend."""
    colors = EXIT_COLORS + (FULL_DEPTH_COLOR,)
    out = []
    for text, last in token_pieces(tokenizer, token_ids[:len(depths)]):
        depth = depths[last]
        out.append(f"{colors[depth_bucket(depth, start_layer, num_layers)]}{text}{RESET}" if color
                   else f"{text}[{depth}]")
    return "".join(out) + "\n" + exit_legend(start_layer, num_layers, color)


def token_pieces(tokenizer, token_ids: list[int]) -> list[tuple[str, int]]:
    """(text, index of its last token) per displayable piece. Decoding growing prefixes keeps spaces and multi-token
    characters right; a piece ending in U+FFFD is an incomplete UTF-8 character, so it waits for the next token.
    """
    pieces, shown = [], ""
    for idx in range(len(token_ids)):
        text = tokenizer.decode(token_ids[:idx + 1], skip_special_tokens=True)
        if text.endswith("\ufffd") or not text.startswith(shown):
            continue
        if len(text) > len(shown):
            pieces.append((text[len(shown):], idx))
        shown = text
    return pieces


def exit_legend(start_layer: int, num_layers: int, color: bool = True) -> str:
    """One line naming the depth range of each colour."""
    if not color:
        return f"[n] after each token: the backbone layers it ran, of {num_layers} ({num_layers} = never exited)"
    ranges: dict[int, list[int]] = {}
    for depth in range(start_layer, num_layers + 1):
        ranges.setdefault(depth_bucket(depth, start_layer, num_layers), []).append(depth)
    colors = EXIT_COLORS + (FULL_DEPTH_COLOR,)
    items = []
    for bucket, depths in sorted(ranges.items()):
        label = f"{depths[0]}" if len(depths) == 1 else f"{depths[0]}-{depths[-1]}"
        label += " (never exited)" if depths[0] >= num_layers else ""
        items.append(f"{colors[bucket]}■ {label}{RESET}")
    return "exit depth (backbone layers run): " + "  ".join(items)
