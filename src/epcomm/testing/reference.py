"""Single-process reference: what every rank must receive, from all ranks' inputs at once.

Written from the spec with plain loops over (source, destination) pairs, independently of the
backends, so that it can serve as their oracle.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence

import torch

from .. import fp8
from ..layout import aligned_counts

ExpertFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""``expert_fn(expert_ids [N], rows [N, H] float32) -> [N, H]``: a stand-in expert computation."""


def _ranks_of_tokens(topk_idx: torch.Tensor, num_experts: int, num_ranks: int) -> torch.Tensor:
    """``[T, R]`` bool: rank j hosts one of token t's experts."""
    per_rank = num_experts // num_ranks
    out = torch.zeros(topk_idx.shape[0], num_ranks, dtype=torch.bool)
    for j in range(num_ranks):
        out[:, j] = ((topk_idx >= j * per_rank) & (topk_idx < (j + 1) * per_rank)).any(dim=1)
    return out


def reference_dispatch(xs: Sequence, topk_idxs: Sequence[torch.Tensor], topk_weights: Sequence[Optional[torch.Tensor]],
                       num_experts: int, expert_alignment: int = 1) -> List[Dict]:
    """Expected normal-mode dispatch outputs of every rank.

    Args:
        xs: per rank, bf16 ``[T_i, H]`` or an FP8 ``(values, scales)`` pair.
        topk_idxs / topk_weights: per rank ``[T_i, K]`` (weights may be None).

    Returns, per rank: ``recv_x`` (same form as the inputs), ``recv_topk_idx``, ``recv_topk_weights``,
    ``recv_src_idx``, ``rank_prefix_matrix`` and ``num_recv_tokens_per_expert_list``.
    """
    num_ranks = len(xs)
    per_rank = num_experts // num_ranks
    in_rank = [_ranks_of_tokens(t.cpu(), num_experts, num_ranks) for t in topk_idxs]
    counts = torch.tensor([[int(in_rank[i][:, j].sum()) for j in range(num_ranks)] for i in range(num_ranks)])
    prefix = counts.cumsum(0).to(torch.int32)
    results = []
    for j in range(num_ranks):
        rows, scale_rows, idx_rows, weight_rows, src_rows = [], [], [], [], []
        expert_counts = [0] * per_rank
        for i in range(num_ranks):
            tokens = in_rank[i][:, j].nonzero().flatten()
            x = xs[i]
            if isinstance(x, (tuple, list)):
                rows.append(x[0].cpu()[tokens])
                scale_rows.append(x[1].cpu()[tokens])
            else:
                rows.append(x.cpu()[tokens])
            src_rows.append(tokens.to(torch.int32))
            topk = topk_idxs[i].cpu()[tokens]
            local = topk - j * per_rank
            on_rank = (topk >= 0) & (local >= 0) & (local < per_rank)
            idx_rows.append(torch.where(on_rank, local, torch.full_like(local, -1)))
            if topk_weights[i] is not None:
                w = topk_weights[i].cpu()[tokens]
                weight_rows.append(torch.where(on_rank, w, torch.zeros_like(w)))
            for e in range(per_rank):
                # top-k entries, as get_dispatch_layout counts them (DeepEP too): a token listing
                # the expert twice counts twice
                expert_counts[e] += int((topk_idxs[i].cpu() == j * per_rank + e).sum())
        recv_x = torch.cat(rows)
        if scale_rows:
            recv_x = (recv_x, torch.cat(scale_rows))
        results.append({
            "recv_x": recv_x,
            "recv_topk_idx": torch.cat(idx_rows),
            "recv_topk_weights": torch.cat(weight_rows) if weight_rows else None,
            "recv_src_idx": torch.cat(src_rows),
            "rank_prefix_matrix": prefix,
            "num_recv_tokens_per_expert_list": aligned_counts(expert_counts, expert_alignment),
        })
    return results


def reference_combine(x_home: torch.Tensor, topk_idx: torch.Tensor, num_experts: int, num_ranks: int,
                      rank_fn: Callable[[int, torch.Tensor], torch.Tensor], bias: Sequence[torch.Tensor] = (),
                      ranks_per_node: int = 0) -> torch.Tensor:
    """Expected normal-mode combine at one home rank.

    Each rank ``j`` that received token ``t`` returns ``rank_fn(j, x_home[t:t+1])`` (a bf16 row);
    combine sums those rows in rank order in float32, adds ``bias`` and rounds to bf16.

    ``ranks_per_node`` > 0 models the two-level combine of the nvshmem backend (also on one node),
    as DeepEP's internode combine does: each node's rows are summed there (float32, rank order) and
    rounded to bf16 — the one row per token and node that crosses the network — then the nodes'
    partials are summed (float32, node order), the biases added and the sum rounded. The two
    roundings differ from one by up to about two bf16 ulps of the partials (more, relative to a
    result that the biases nearly cancel).
    """
    in_rank = _ranks_of_tokens(topk_idx.cpu(), num_experts, num_ranks)
    per_node = min(ranks_per_node, num_ranks) if ranks_per_node > 0 else num_ranks
    acc = torch.zeros(x_home.shape, dtype=torch.float32)
    for first in range(0, num_ranks, per_node):
        partial = torch.zeros(x_home.shape, dtype=torch.float32)
        for j in range(first, first + per_node):
            tokens = in_rank[:, j].nonzero().flatten()
            if tokens.numel():
                partial[tokens] += rank_fn(j, x_home.cpu()[tokens]).float()
        acc += partial.to(torch.bfloat16).float() if ranks_per_node > 0 else partial
    for b in bias:
        acc += b.cpu().float()
    return acc.to(torch.bfloat16)


def reference_low_latency_dispatch(xs: Sequence[torch.Tensor], topk_idxs: Sequence[torch.Tensor], num_experts: int,
                                   use_fp8: bool, round_scale: bool = False) -> List[List[Dict]]:
    """Expected low-latency dispatch: per rank, per local expert, the rows in (source, token) order.

    Each entry: ``{"src_rank": [N], "src_token": [N], "rows": [N, H] float32 as the expert sees them}``
    (FP8 rows are cast back, so they compare directly with a cast-back ``recv_x``).
    """
    num_ranks = len(xs)
    per_rank = num_experts // num_ranks
    seen = []
    for x in xs:
        if use_fp8:
            values, scales = fp8.per_token_cast_to_fp8(x.cpu(), round_scale=round_scale)
            seen.append(fp8.per_token_cast_back(values, scales, torch.float32))
        else:
            seen.append(x.cpu().float())
    results = []
    for j in range(num_ranks):
        experts = []
        for e in range(per_rank):
            global_e = j * per_rank + e
            src_rank, src_token, rows = [], [], []
            for i in range(num_ranks):
                # one row per top-k entry (no dedup in low-latency mode): a token listing the
                # expert twice arrives twice
                entries = (topk_idxs[i].cpu() == global_e).sum(dim=1)
                tokens = torch.repeat_interleave(torch.arange(entries.numel()), entries)
                src_rank.append(torch.full_like(tokens, i))
                src_token.append(tokens)
                rows.append(seen[i][tokens])
            experts.append({"src_rank": torch.cat(src_rank), "src_token": torch.cat(src_token), "rows": torch.cat(rows)})
        results.append(experts)
    return results


def reference_low_latency_combine(x_home: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                                  expert_fn: ExpertFn, use_fp8: bool, round_scale: bool = False) -> torch.Tensor:
    """Expected low-latency round trip at one home rank: ``Σ_k w[t,k] · bf16(expert_fn(e_k, x_t))``,
    where ``x_t`` is the token as the expert saw it (FP8 round trip when ``use_fp8``)."""
    x = x_home.cpu()
    if use_fp8:
        values, scales = fp8.per_token_cast_to_fp8(x, round_scale=round_scale)
        seen = fp8.per_token_cast_back(values, scales, torch.float32)
    else:
        seen = x.float()
    acc = torch.zeros(x.shape, dtype=torch.float32)
    topk_idx, topk_weights = topk_idx.cpu(), topk_weights.cpu()
    for k in range(topk_idx.shape[1]):
        tokens = (topk_idx[:, k] >= 0).nonzero().flatten()
        if tokens.numel():
            out = expert_fn(topk_idx[tokens, k], seen[tokens]).to(torch.bfloat16).float()
            acc[tokens] += topk_weights[tokens, k].unsqueeze(1) * out
    return acc.to(torch.bfloat16)
