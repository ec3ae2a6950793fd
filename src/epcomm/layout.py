"""Routing → layout: which tokens go to which rank, and the counts every backend needs.

Pure torch, no communication; runs on CPU or GPU tensors alike and is shared by all backends.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch


def tokens_to_ranks(topk_idx: torch.Tensor, num_experts: int, num_ranks: int) -> torch.Tensor:
    """``is_token_in_rank [T, R] bool``: True where at least one of a token's experts lives on the rank.

    ``topk_idx == -1`` means "no expert" and routes nowhere. Experts are split evenly:
    rank ``r`` hosts experts ``[r * E_local, (r + 1) * E_local)``.
    """
    num_tokens = topk_idx.shape[0]
    experts_per_rank = num_experts // num_ranks
    # Send the -1 holes (and ids outside [0, E), which validation rejects) to an extra sentinel
    # column that is cut off afterwards: no out-of-range index ever reaches scatter_.
    valid = (topk_idx >= 0) & (topk_idx < num_experts)
    rank_of = torch.where(valid, topk_idx // experts_per_rank, torch.full_like(topk_idx, num_ranks))
    is_token_in_rank = torch.zeros(num_tokens, num_ranks + 1, dtype=torch.bool, device=topk_idx.device)
    is_token_in_rank.scatter_(1, rank_of, True)
    return is_token_in_rank[:, :num_ranks].contiguous()


def tokens_per_expert(topk_idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``[E] int32``: how many tokens selected each expert (``-1`` entries ignored)."""
    flat = topk_idx.reshape(-1)
    flat = flat[(flat >= 0) & (flat < num_experts)]
    return torch.bincount(flat, minlength=num_experts).to(torch.int32)


def tokens_to_nodes(is_token_in_rank: torch.Tensor, ranks_per_node: int) -> torch.Tensor:
    """``is_token_in_node [T, N] bool``: some rank of node n (``ranks_per_node`` consecutive ranks)
    needs token t."""
    T, R = is_token_in_rank.shape
    return is_token_in_rank.view(T, R // ranks_per_node, ranks_per_node).any(-1)


def dispatch_layout(topk_idx: torch.Tensor, num_experts: int, num_ranks: int,
                    num_ranks_per_node: Optional[int] = None
                    ) -> Tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor, torch.Tensor]:
    """DeepEP's layout: ``(num_tokens_per_rank [R], num_tokens_per_rdma_rank [N] | None,
    num_tokens_per_expert [E], is_token_in_rank [T, R])``, counts as int32.

    ``num_tokens_per_rdma_rank`` (tokens per node) is ``None`` when all ranks share one node.
    """
    is_token_in_rank = tokens_to_ranks(topk_idx, num_experts, num_ranks)
    num_tokens_per_rank = is_token_in_rank.sum(0, dtype=torch.int32)
    num_tokens_per_rdma_rank = None
    if num_ranks_per_node is not None and num_ranks_per_node < num_ranks:
        num_tokens_per_rdma_rank = tokens_to_nodes(is_token_in_rank, num_ranks_per_node).sum(0, dtype=torch.int32)
    return num_tokens_per_rank, num_tokens_per_rdma_rank, tokens_per_expert(topk_idx, num_experts), is_token_in_rank


def rank_prefix_matrix(send_counts: torch.Tensor) -> torch.Tensor:
    """``[R, R] int32`` prefix over sources from ``send_counts[i][j]`` (= tokens rank i sends to j)."""
    return send_counts.to(torch.int64).cumsum(0).to(torch.int32)


def align_up(value: int, alignment: int) -> int:
    return (value + alignment - 1) // alignment * alignment


def aligned_counts(counts, alignment: int) -> list:
    """``num_recv_tokens_per_expert_list``: each count rounded up to ``expert_alignment``."""
    return [align_up(int(c), alignment) for c in counts]


def local_expert_ids(topk_idx: torch.Tensor, rank: int, num_local_experts: int) -> torch.Tensor:
    """Global expert ids → ids local to ``rank`` (``-1`` for experts elsewhere and for holes)."""
    local = topk_idx - rank * num_local_experts
    on_rank = (topk_idx >= 0) & (local >= 0) & (local < num_local_experts)
    return torch.where(on_rank, local, torch.full_like(local, -1))
