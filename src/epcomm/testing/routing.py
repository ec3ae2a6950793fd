"""Routing generators: ``[T, K]`` int64 expert ids as a router would produce them.

All take a ``torch.Generator`` so every rank (and the reference) can rebuild every rank's routing.
"""
from __future__ import annotations

from typing import Optional

import torch


def uniform_topk(num_tokens: int, num_experts: int, num_topk: int, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """DeepEP's test routing: ``topk(|randn| + 1, K)`` — distinct experts, roughly uniform load."""
    scores = torch.randn(num_tokens, num_experts, generator=generator).abs() + 1
    return scores.topk(num_topk, dim=-1, sorted=False).indices.to(torch.int64)


def skewed_topk(num_tokens: int, num_experts: int, num_topk: int, alpha: float = 1.2,
                generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Zipf-skewed load: expert popularity ∝ 1 / rank**alpha over a random expert order."""
    popularity = 1.0 / torch.arange(1, num_experts + 1, dtype=torch.float64) ** alpha
    popularity = popularity[torch.randperm(num_experts, generator=generator)]
    if num_tokens == 0:
        return torch.empty(0, num_topk, dtype=torch.int64)
    return torch.multinomial(popularity.expand(num_tokens, num_experts), num_topk, replacement=False,
                             generator=generator).to(torch.int64)


def with_holes(topk_idx: torch.Tensor, fraction: float = 0.25, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """A copy of ``topk_idx`` with about ``fraction`` of its entries set to -1 (no expert)."""
    holes = torch.rand(topk_idx.shape, generator=generator) < fraction
    return torch.where(holes, torch.full_like(topk_idx, -1), topk_idx)


def single_rank_topk(num_tokens: int, num_experts: int, num_topk: int, target_rank: int, num_ranks: int,
                     generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Every token picks only experts of ``target_rank`` (hot-spot); extra slots are -1."""
    num_local = num_experts // num_ranks
    picks = min(num_topk, num_local)
    scores = torch.rand(num_tokens, num_local, generator=generator)
    local = scores.topk(picks, dim=-1).indices.to(torch.int64) + target_rank * num_local
    if picks < num_topk:
        local = torch.cat([local, torch.full((num_tokens, num_topk - picks), -1, dtype=torch.int64)], dim=1)
    return local


def random_weights(topk_idx: torch.Tensor, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """float32 ``[T, K]`` positive router weights (0 where ``topk_idx == -1``)."""
    weights = torch.rand(topk_idx.shape, generator=generator) + 0.1
    return torch.where(topk_idx >= 0, weights, torch.zeros_like(weights))


def group_limited_topk(num_tokens: int, num_experts: int, num_topk: int, num_groups: int, topk_groups: int,
                       generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Group-limited gating (DeepSeek-V3, as DeepEP's internode tests route): the experts form
    ``num_groups`` equal groups (one per node), each token keeps the ``topk_groups`` groups with
    the best expert score and picks its ``num_topk`` experts among them only."""
    scores = torch.randn(num_tokens, num_experts, generator=generator).abs() + 1
    group_scores = scores.view(num_tokens, num_groups, -1).amax(dim=-1)
    kept = group_scores.topk(min(topk_groups, num_groups), dim=-1, sorted=False).indices
    keep = torch.zeros(num_tokens, num_groups, dtype=torch.bool).scatter_(1, kept, True)
    masked = scores.masked_fill(~keep.repeat_interleave(num_experts // num_groups, dim=1), float("-inf"))
    return masked.topk(num_topk, dim=-1, sorted=False).indices.to(torch.int64)
