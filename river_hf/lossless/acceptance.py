"""Which drafted tokens the backbone keeps: the acceptance rules of lossless decoding. Pure tensors, one row.

Both rules get the k drafted tokens and the backbone's k + 1 next-token distributions from one verification pass
(position j: the backbone's prediction after the prompt, the committed tokens and drafts 1..j) and return
(n, tokens): the number n of drafts kept and the n + 1 tokens to append, the kept drafts then the backbone's own.

- greedy: keep drafts while each equals the backbone's argmax; the next token is the backbone's argmax after the last
  kept one. The output is the backbone's greedy output token for token.
- sampling (Leviathan et al. 2023, Chen et al. 2023; transformers' `_speculative_sampling`): draft j, sampled from
  q_j, is kept with probability min(1, p_j(d) / q_j(d)); at the first rejection the next token is sampled from
  norm(max(0, p_j - q_j)); after k kept drafts from p_k. Each appended token then follows the backbone's p exactly.
"""

from __future__ import annotations

import torch


def greedy_accept(drafts: torch.Tensor, target_scores: torch.Tensor) -> tuple[int, torch.Tensor]:
    """drafts: [k] token ids; target_scores: [k + 1, V] the backbone's (processed) scores. -> (n, tokens [n + 1])."""
    targets = target_scores.argmax(dim=-1)  # [k + 1]
    n = leading_true(drafts == targets[:-1])
    return n, targets[:n + 1]  # the kept drafts equal the targets, so the targets are the tokens


def speculative_accept(drafts: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor,
                       generator: torch.Generator | None = None) -> tuple[int, torch.Tensor]:
    """drafts: [k] sampled from draft_probs [k, V]; target_probs: [k + 1, V] the backbone's. -> (n, tokens [n + 1]).

    Random numbers come from `generator` (default: torch's global generator, as generate's own sampling)."""
    k = drafts.shape[0]
    rows = torch.arange(k, device=drafts.device)
    q = draft_probs[rows, drafts]  # [k] > 0: each draft was sampled from its q
    p = target_probs[rows, drafts]
    u = torch.rand(k, generator=generator, device=drafts.device, dtype=q.dtype)
    n = leading_true(u * q <= p)  # u <= p / q, without dividing
    last = torch.multinomial(next_distribution(n, draft_probs, target_probs), 1, generator=generator)
    return n, torch.cat([drafts[:n], last])


def next_distribution(n: int, draft_probs: torch.Tensor, target_probs: torch.Tensor) -> torch.Tensor:
    """The distribution [V] of the token after n kept drafts: the residual max(0, p - q) after a rejection, else p."""
    if n == draft_probs.shape[0]:
        return target_probs[n]
    residual = (target_probs[n] - draft_probs[n]).clamp(min=0)
    total = residual.sum()
    # p == q up to rounding: a rejection then has probability ~0, and p is the right distribution
    return residual / total if total > 0 else target_probs[n]


def leading_true(flags: torch.Tensor) -> int:
    """How many entries of a bool vector are True before the first False."""
    return int(flags.long().cumprod(dim=0).sum())
