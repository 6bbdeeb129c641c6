"""Fidelity of a river against its own backbone, as in the paper's Fig. 7: teacher-forced next-token match rate
and KL(backbone || system), over the backbone's own greedy continuation.

Teacher forcing feeds the same tokens to both systems, one decode step at a time (so the river makes its
token-level exit decisions exactly as in `generate`), and compares the next-token distributions at every step.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm
from transformers import DynamicCache

from ..core.generation import new_river_cache
from ..core.settings import RiverSettings


@dataclass
class Fidelity:
    match: float          # share of positions where the system's argmax equals the backbone's
    kl: float             # mean KL(backbone || system) per position, in nats
    mean_exit_depth: float
    positions: int


@torch.no_grad()
def teacher_forced_logits(model, prompt_ids: torch.Tensor, continuation: torch.Tensor,
                          settings: RiverSettings | None) -> tuple[torch.Tensor, float]:
    """Next-token logits [T, V] (float32) for each continuation token; backbone when `settings` is None.

    prompt_ids: [1, P]; continuation: [T]. Returns (logits, mean exit depth over the decoded steps).
    """
    cache = DynamicCache() if settings is None else new_river_cache(model, settings)
    logits = [model(prompt_ids, cache=cache, use_cache=True).logits[0, -1].float()]
    for token in continuation[:-1]:
        logits.append(model(token.view(1, 1), cache=cache, use_cache=True).logits[0, -1].float())
    depth = cache.mean_exit_depth() if settings is not None else float("nan")
    return torch.stack(logits), depth


def compare(reference_logits: torch.Tensor, system_logits: torch.Tensor) -> tuple[float, float]:
    """(match rate, mean KL(reference || system)) of two [T, V] logit tensors."""
    match = (reference_logits.argmax(-1) == system_logits.argmax(-1)).float().mean().item()
    ref_logp = F.log_softmax(reference_logits, dim=-1)
    sys_logp = F.log_softmax(system_logits, dim=-1)
    kl = (ref_logp.exp() * (ref_logp - sys_logp)).sum(-1).mean().item()
    return match, kl


@torch.no_grad()
def greedy_continuation(model, prompt_ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    """The backbone's own greedy continuation [T] (a river model runs its backbone when given no river settings)."""
    out = model.generate(prompt_ids, attention_mask=torch.ones_like(prompt_ids), max_new_tokens=max_new_tokens,
                         do_sample=False)
    return out[0, prompt_ids.shape[1]:]


@dataclass
class Reference:
    """The backbone's side of a fidelity measurement for one prompt, computed once for every system compared."""

    prompt_ids: torch.Tensor   # [1, P]
    continuation: torch.Tensor  # [T] the backbone's greedy tokens
    logits: torch.Tensor       # [T, V] the backbone's next-token logits along them


def backbone_references(model, prompts: list[torch.Tensor], max_new_tokens: int = 64,
                        progress: bool = False) -> list[Reference]:
    """The backbone's greedy continuation of each prompt ([1, P] ids) and its logits along it (`progress`: a bar)."""
    references = []
    for prompt_ids in tqdm(prompts, desc="backbone references", file=sys.stderr, disable=not progress):
        continuation = greedy_continuation(model, prompt_ids, max_new_tokens)
        logits, _ = teacher_forced_logits(model, prompt_ids, continuation, None)
        references.append(Reference(prompt_ids, continuation, logits))
    return references


def measure_fidelity(model, references: list[Reference], settings: RiverSettings | None) -> Fidelity:
    """Teacher-forced fidelity of the river at `settings` against precomputed backbone references, pooled over
    prompts (weighted by their number of positions). `settings=None` measures `model` as a plain model (e.g. a
    static full-quantization reference); its mean exit depth is then nan."""
    matches, kls, depths, total, decoded = 0.0, 0.0, 0.0, 0, 0
    for ref in references:
        system, depth = teacher_forced_logits(model, ref.prompt_ids, ref.continuation, settings)
        match, kl = compare(ref.logits, system)
        n = len(ref.continuation)  # positions compared; the first comes from the prompt, so n - 1 decode steps
        matches, kls, total = matches + match * n, kls + kl * n, total + n
        if n > 1:
            depths, decoded = depths + depth * (n - 1), decoded + n - 1
    mean_depth = depths / decoded if decoded else float("nan")
    return Fidelity(match=matches / total, kl=kls / total, mean_exit_depth=mean_depth, positions=total)
