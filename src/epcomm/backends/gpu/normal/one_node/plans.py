"""What normal mode's host keeps per shape (plans) and per dispatch (PullState, in the handle)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from ...launch import Specialisations


@dataclass
class PullState:
    """What the one-node backend keeps in ``DispatchHandle.backend_state``."""

    # int32 device words: the list index ([T, R]: each token's index in the list of each rank it
    # went to; the overlapped combine's reduce finds by it which pushed block holds a token's row),
    # then recv_info ([2]: rows received, most tokens any rank sends); after them (from 16-byte
    # boundaries) the handle's rank_prefix_matrix and, with num_worst_tokens, its recv_src_idx
    index_words: torch.Tensor
    max_tokens: int  # most tokens any rank sends (-1 when unknown: num_worst_tokens, one round)
    sequence: int  # the dispatch's notify sequence number: the same on every rank (fingerprints)
    expert_table: Optional[torch.Tensor] = None  # [R + 2, L] int32 expert-major group table (ep_notify_dispatch)
    # Addresses of what the kernels read, in this order: rank_prefix_matrix, recv_info,
    # recv_src_idx, expert table, expert-major dest, is_token_in_rank, list index.
    # Launch arguments are addresses, not tensors: Triton's launcher asks the driver about each tensor.
    addresses: tuple = ()


@dataclass(frozen=True)
class DispatchPlan:
    """Everything about a dispatch that depends only on its shape (cached per shape)."""

    x_words: int
    num_scales: int
    num_topk: int  # top-k width staged (0 in a cached dispatch)
    entry_topk: int  # width of the top-k entries the pull reads: num_topk, or the expert-major map's
    topk_row_bytes: int
    offsets: Tuple[int, int, int]  # staging offsets of x, scales, top-k rows (half 0)
    round_tokens: int
    block_r: int
    rows_aligned: bool  # rows are a multiple of 16 bytes (copy.py)
    expert_major: bool  # outputs in the expert-major layout (expert_major.py)
    stage_lists: Specialisations  # (ALIGNED, L_P2, E_P2, POSITION_SUB) -> stage + token lists (a full
    # dispatch's round 0); E_P2, POSITION_SUB: the expert-major positions' shape (1, 1 in the plain layout)
    stage: Specialisations  # (ALIGNED, E_P2, POSITION_SUB) -> stage
    notify_stage: Specialisations  # stage_lists' keys -> the count exchange and that stage in one launch (notify.py)
    pull_index: object  # BoundKernel: pull + receive index (round 0 of a full dispatch)
    pull: object
    # stage and pull in one launch (dispatch.py, ep_dispatch; one round, plain layout), or None:
    # (ALIGNED, L_P2, DOORBELL, NOTIFY) -> a full dispatch's (lists written, read; NOTIFY: with its count exchange)
    overlapped_full: Optional[Specialisations]
    overlapped_cached: Optional[Specialisations]  # ALIGNED -> a cached dispatch's
    fingerprint_full: Tuple[int, int]  # agreement.py: a full dispatch's words (num_experts, handle added)
    fingerprint_cached: Tuple[int, int]  # a cached dispatch's words (handle added)
    # The launch arguments of the stage, the pull in turn and the one launch that are the same on
    # every call of the plan, in the kernels' order (NormalMode._fixed_arguments): one tuple each,
    # unpacked per call.
    stage_fixed: tuple
    pull_fixed: tuple
    overlapped_fixed: tuple  # ep_dispatch's, up to its sequence argument


@dataclass(frozen=True)
class CombinePlan:
    slots_x: int
    slots_w: int
    round_tokens: int
    block_r: int
    rows_aligned: bool  # rows are a multiple of 16 bytes (copy.py)
    expert_major: bool  # x in the expert-major layout: the push folds it first
    push: Specialisations  # ALIGNED (expert outputs aligned) -> push
    reduce: Specialisations  # ALIGNED (biases aligned) -> reduce
    overlapped: Optional[Specialisations]  # (ALIGNED, OUT_ALIGNED) -> push and reduce in one launch (plain layout)
    fingerprint: Tuple[int, int]  # agreement.py: the call's words (handle added)
    # ep_combine's launch arguments that are the same on every call of the plan, in its order: the
    # workspace (rank ... the slots' offsets), the block flags, the host words, the fingerprint set
    overlapped_fixed: tuple
