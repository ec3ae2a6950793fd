"""Handles returned by dispatch and consumed by combine (and by cached dispatch).

Both are NamedTuples so that DeepEP-style code that indexes them (``handle[0]`` is the
``rank_prefix_matrix`` in normal mode) keeps working.
"""
from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch


class DispatchHandle(NamedTuple):
    """Layout of one normal-mode dispatch, enough to repeat it (cached mode) or to combine.

    Fields:
        rank_prefix_matrix: ``[R, R]`` int32; ``[i][j]`` = tokens ranks ``0..i`` send to rank ``j``.
        recv_src_idx: ``[num_recv_rows]`` int32; for each received row, the token's index on its
            source rank (``-1`` for padding rows when ``num_worst_tokens`` was used).
        is_token_in_rank: ``[T, R]`` bool, the sender-side routing this dispatch used.
        num_recv_tokens: rows actually received (an int, or a 0-dim int tensor on the device when
            no host synchronisation was allowed).
        num_recv_rows: rows of ``recv_x`` (``num_worst_tokens`` when padding was asked for).
        backend_state: backend-private data (queue offsets, etc.); ``None`` for ``torch_dist``.
        expert_major: the row mapping when dispatched with ``expert_major=True`` (see
            :mod:`epcomm.expert_major`), else ``None``.
    """

    rank_prefix_matrix: torch.Tensor
    recv_src_idx: torch.Tensor
    is_token_in_rank: torch.Tensor
    num_recv_tokens: Any
    num_recv_rows: int
    backend_state: Optional[Any] = None
    expert_major: Optional[Any] = None


class LowLatencyHandle(NamedTuple):
    """Layout of one low-latency dispatch (DeepEP's 5-tuple, same field order).

    Fields:
        recv_src_info: ``[E_local, R*M]`` int32; token index on the source rank of each packed row.
        recv_layout_range: ``[E_local, R]`` int64; ``(offset << 32) | count`` of each source's rows.
        num_max_dispatch_tokens_per_rank: ``M``.
        hidden: ``H``.
        num_experts: ``E`` (global).
        backend_state: backend-private data (``None`` for ``torch_dist``), after DeepEP's fields.
    """

    recv_src_info: torch.Tensor
    recv_layout_range: torch.Tensor
    num_max_dispatch_tokens_per_rank: int
    hidden: int
    num_experts: int
    backend_state: Optional[Any] = None
