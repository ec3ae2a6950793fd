"""The expert-major receive layout for grouped GEMM (``dispatch(..., expert_major=True)``).

The plain layout has one row per received token (rows grouped by source rank) and the token's
local experts in ``recv_topk_idx``; a grouped GEMM wants rows grouped by expert instead. Here
every ``(row, k)`` entry with a local expert becomes one row of expert ``recv_topk_idx[row, k]``'s
group (a token appears once per local expert it chose — twice if it lists one twice); groups come
in local-expert order, keep the plain ``(row, k)`` order inside, and are padded with zero rows to
``expert_alignment``. ``num_recv_tokens_per_expert_list`` holds the padded group sizes, so group
``l`` starts at the sum of the sizes before it.

Combine takes that layout back: the home's result is ``Σ_k topk_weights[t, k] · y[row of (t, k)]``
in float32 — the weights are applied there (expert outputs are passed unweighted), then the plain
cross-rank sum of :meth:`epcomm.Buffer.combine` runs on the folded rows.

One mapping serves every backend (:class:`ExpertMajor`, kept in the handle). Backends that build
the layout in their own kernels (``Backend.native_expert_major``: nvlink writes each received row
straight to its expert groups and folds inside its combine) produce it themselves; for the others
:func:`plan`, :func:`expand` and :func:`fold` build it from torch ops on the plain layout.
"""
from __future__ import annotations

from typing import List, NamedTuple

import torch


class ExpertMajor(NamedTuple):
    """How a dispatch's plain rows map to its expert-major rows (kept in the handle).

    Fields:
        dest: ``[N, K]`` int32: expert-major row of plain entry ``(row, k)``; ``-1`` where the
            entry's expert is not local.
        row_experts: ``[M]`` int64: each expert-major row's local expert, ``-1`` on padding.
        row_weights: ``[M]`` float32: each expert-major row's top-k weight, ``0`` on padding.
        num_rows: ``M``, padding included.
        group_sizes: padded rows per local expert (``num_recv_tokens_per_expert_list``).
    """

    dest: torch.Tensor
    row_experts: torch.Tensor
    row_weights: torch.Tensor
    num_rows: int
    group_sizes: List[int]


def _to_device(values: List[int], device: torch.device) -> torch.Tensor:
    """A host list as an int64 tensor on ``device`` without waiting for the stream: on CUDA through
    pinned memory and an asynchronous copy (a copy from pageable memory would synchronise)."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=torch.int64, device=device)
    return torch.tensor(values, dtype=torch.int64, pin_memory=True).to(device, non_blocking=True)


def plan(recv_topk_idx: torch.Tensor, recv_topk_weights: torch.Tensor, group_sizes: List[int]) -> ExpertMajor:
    """The mapping for one dispatch from its plain top-k outputs (``[N, K]`` local ids / weights).
    ``group_sizes``: the padded per-expert counts the dispatch returned. No host synchronisation:
    a stable sort of every entry by its expert (entries of no local expert sort last, as expert
    ``L``) gives each entry its place in its group; scatters with those entries aimed at a spare
    last slot fill the outputs."""
    device = recv_topk_idx.device
    num_local = len(group_sizes)
    flat = recv_topk_idx.reshape(-1)
    num_entries = flat.numel()
    expert = torch.where(flat >= 0, flat, num_local)  # [N*K]: local expert, or L for none
    order = torch.sort(expert, stable=True).indices  # group by expert, plain (row, k) order inside
    sorted_expert = expert[order]
    counts = torch.zeros(num_local + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, expert, torch.ones_like(expert))
    padded = _to_device(list(group_sizes) + [0], device)
    group_start = padded.cumsum(0) - padded  # [L + 1]: where each group starts (L: after the last)
    position = torch.arange(num_entries, device=device) - (counts.cumsum(0) - counts)[sorted_expert]
    num_rows = int(sum(group_sizes))
    local = sorted_expert < num_local
    row = torch.where(local, group_start[sorted_expert] + position, num_rows)  # [N*K] in sorted order
    dest = torch.empty(num_entries, dtype=torch.int32, device=device)
    dest[order] = torch.where(local, row, -1).to(torch.int32)
    row_experts = torch.full((num_rows + 1,), -1, dtype=torch.int64, device=device)
    row_weights = torch.zeros(num_rows + 1, dtype=torch.float32, device=device)
    row_experts.scatter_(0, row, torch.where(local, sorted_expert, -1))
    row_weights.scatter_(0, row, torch.where(local, recv_topk_weights.reshape(-1)[order].float(), 0.0))
    return ExpertMajor(dest.view(recv_topk_idx.shape), row_experts[:num_rows], row_weights[:num_rows], num_rows,
                       list(group_sizes))


def expand(recv_x, mapping: ExpertMajor):
    """Plain rows → expert-major rows (padding rows zero). ``recv_x``: bf16 ``[N, H]`` or an FP8
    pair ``(values [N, H], scales [N, S])``."""
    mine = mapping.dest >= 0
    plain_row = mine.nonzero()[:, 0]
    dest = mapping.dest[mine].long()

    def gather(t: torch.Tensor) -> torch.Tensor:
        out = torch.zeros((mapping.num_rows,) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
        out[dest] = t[plain_row]
        return out
    if isinstance(recv_x, tuple):
        values = gather(recv_x[0].view(torch.uint8)).view(recv_x[0].dtype)
        return values, gather(recv_x[1].contiguous())
    return gather(recv_x)


def fold(y: torch.Tensor, mapping: ExpertMajor) -> torch.Tensor:
    """Expert-major outputs ``[M, H]`` → plain rows ``[N, H]``: ``row[r] = Σ_k w · y[dest[r, k]]``,
    in float32, rounded to bf16 for the cross-rank combine."""
    num_plain, num_topk = mapping.dest.shape
    rows = torch.zeros(num_plain, y.shape[1], dtype=torch.float32, device=y.device)
    for k in range(num_topk):
        dest = mapping.dest[:, k].long()
        mine = dest >= 0
        d = dest[mine]
        rows[mine] += y[d].float() * mapping.row_weights[d].unsqueeze(1)
    return rows.to(torch.bfloat16)
