"""The expert-major receive layout for grouped GEMM (``dispatch(..., expert_major=True)``).

The plain layout has one row per received token (rows grouped by source rank) and the token's
local experts in ``recv_topk_idx``; a grouped GEMM wants rows grouped by expert instead. Here
every ``(row, k)`` entry with a local expert becomes one row of expert ``recv_topk_idx[row, k]``'s
group (a token appears once per local expert it chose — twice if it lists one twice); groups come
in local-expert order, keep the plain row order inside, and are padded with zero rows to
``expert_alignment``. ``num_recv_tokens_per_expert_list`` holds the padded group sizes, so group
``l`` starts at the sum of the sizes before it.

Combine takes that layout back: the home's result is ``Σ_k topk_weights[t, k] · y[row of (t, k)]``
in float32 — the weights are applied here (expert outputs are passed unweighted), then the plain
cross-rank sum of :meth:`epcomm.Buffer.combine` runs on the folded rows.

Built from torch ops on the plain layout, so every backend supports it; the cost is one gather
(dispatch) and one scatter-add (combine) of the received rows.
"""
from __future__ import annotations

from typing import List, NamedTuple, Tuple

import torch


class ExpertMajor(NamedTuple):
    """How a dispatch's plain rows map to its expert-major rows (kept in the handle)."""

    entry_row: torch.Tensor  # [N_entries] int64: plain row of each entry, in expert-major order
    entry_dest: torch.Tensor  # [N_entries] int64: its expert-major row
    entry_weight: torch.Tensor  # [N_entries] float32: its top-k weight
    entry_expert: torch.Tensor  # [N_entries] int64: its local expert
    num_rows: int  # expert-major rows, padding included
    group_sizes: List[int]  # padded rows per local expert


def plan(recv_topk_idx: torch.Tensor, recv_topk_weights: torch.Tensor, num_local_experts: int,
         expert_alignment: int, group_sizes: List[int]) -> ExpertMajor:
    """The mapping for one dispatch. ``group_sizes``: the padded per-expert counts the dispatch
    returned (``num_recv_tokens_per_expert_list``), so no extra host synchronisation is needed."""
    row, k = (recv_topk_idx >= 0).nonzero(as_tuple=True)
    expert = recv_topk_idx[row, k]
    order = torch.sort(expert, stable=True).indices  # group by expert, plain row order inside
    row, k, expert = row[order], k[order], expert[order]
    counts = torch.bincount(expert, minlength=num_local_experts)
    starts = torch.zeros(num_local_experts, dtype=torch.int64, device=row.device)
    padded = torch.tensor(group_sizes, dtype=torch.int64, device=row.device)
    starts[1:] = padded.cumsum(0)[:-1]
    first_entry = counts.cumsum(0) - counts
    position = torch.arange(row.numel(), device=row.device) - first_entry[expert]
    return ExpertMajor(row, starts[expert] + position, recv_topk_weights[row, k].float(), expert,
                       int(sum(group_sizes)), list(group_sizes))


def expand(recv_x, mapping: ExpertMajor):
    """Plain rows → expert-major rows (padding rows zero). ``recv_x``: bf16 ``[N, H]`` or an FP8
    pair ``(values [N, H], scales [N, S])``."""
    def gather(t: torch.Tensor) -> torch.Tensor:
        out = torch.zeros((mapping.num_rows,) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
        out[mapping.entry_dest] = t[mapping.entry_row]
        return out
    if isinstance(recv_x, tuple):
        values = gather(recv_x[0].view(torch.uint8)).view(recv_x[0].dtype)
        return values, gather(recv_x[1].contiguous())
    return gather(recv_x)


def entry_fields(mapping: ExpertMajor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per expert-major row: ``(local expert [M] int64, -1 on padding; weight [M] float32, 0 on padding)``."""
    device = mapping.entry_row.device
    experts = torch.full((mapping.num_rows,), -1, dtype=torch.int64, device=device)
    weights = torch.zeros(mapping.num_rows, dtype=torch.float32, device=device)
    experts[mapping.entry_dest] = mapping.entry_expert
    weights[mapping.entry_dest] = mapping.entry_weight
    return experts, weights


def fold(y: torch.Tensor, mapping: ExpertMajor, num_plain_rows: int) -> torch.Tensor:
    """Expert-major outputs → plain rows: ``row[r] = Σ_entries of r weight · y[entry]`` (float32,
    rounded to bf16 for the cross-rank combine)."""
    rows = torch.zeros(num_plain_rows, y.shape[1], dtype=torch.float32, device=y.device)
    rows.index_add_(0, mapping.entry_row, y[mapping.entry_dest].float() * mapping.entry_weight.unsqueeze(1))
    return rows.to(torch.bfloat16)

