"""A one-node dispatch's outputs, allocated after the host's count wait.

A full dispatch learns how many rows it receives only from the count exchange, so it allocates its
outputs after the wait, on the host's path to the pull's launch. Allocating them before the wait at
a plan's recent rows and returning views after it (2026-11-29d's ``early-outputs``) cost 16 µs more
host time per call on one H200 (notes/performance-log.md, 2026-11-29e) and was removed.
"""
from __future__ import annotations

from typing import Optional

import torch

from .plans import DispatchPlan


def dispatch_outputs(plan: DispatchPlan, x: torch.Tensor, scales: Optional[torch.Tensor], num_rows: int, mapping):
    """A dispatch's outputs: ``(recv_x, recv_scales, recv_topk, recv_weights, addresses)`` —
    [M, H] like x, [M, S] float32 like ``scales`` (the FP8 wire's float32 words; None: bf16, no
    scales), [N, K] int64 / float32 (a full dispatch with top-k; expert-major: the mapping's [M]
    per-row expert and weight; else None), and the addresses the pull writes them at (recv_x's
    for those it does not write). M: the rows, ``num_rows`` or the expert-major mapping's."""
    out_rows = mapping.num_rows if mapping is not None else num_rows
    # (new_empty: no device argument to parse, and for recv_x and recv_scales, of a tensor of the
    # dtype wanted, no dtype either; ~1 µs less each on the GPU hosts, where this path sets a small
    # batch's pace)
    recv_x = x.new_empty((out_rows, x.shape[1]))
    recv_x_address = recv_x.data_ptr()
    is_fp8 = scales is not None
    recv_scales = scales.new_empty((out_rows, plan.num_scales)) if is_fp8 else None
    if mapping is not None:
        recv_topk, recv_weights = mapping.row_experts, mapping.row_weights
    elif plan.num_topk:
        recv_topk = x.new_empty((num_rows, plan.num_topk), dtype=torch.int64)
        recv_weights = x.new_empty((num_rows, plan.num_topk), dtype=torch.float32)
    else:
        recv_topk = recv_weights = None
    return recv_x, recv_scales, recv_topk, recv_weights, (
        recv_x_address, recv_scales.data_ptr() if is_fp8 else recv_x_address,
        recv_topk.data_ptr() if plan.num_topk else recv_x_address,
        recv_weights.data_ptr() if plan.num_topk else recv_x_address)
