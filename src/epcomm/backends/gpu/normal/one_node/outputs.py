"""A one-node dispatch's outputs: allocated after the host's count wait (the default), or before it.

A full dispatch learns how many rows it receives only from the count exchange, so by default it
allocates its outputs after the wait, on the host's path to the pull's launch. For a small batch
that path sets the call's pace (the GPU idles until the pull is launched), and its allocations were
its largest part (about 2-3.4 µs each on the GPU hosts, 4-5 per call: notes/performance-log.md).
``NormalMode.early_outputs`` allocates them before the wait instead, while the count exchange runs,
at the most rows the plan received in its last calls, and returns views of their first rows after
it. The pull writes the same addresses either way; a batch that receives more rows than that
allocates after the wait as by default. A returned tensor then holds a larger allocation than its
rows (at most EARLY_OUTPUT_BYTES of all outputs), which is why this is bounded to small batches.
"""
from __future__ import annotations

from typing import Optional

import torch

from .plans import DispatchPlan

# The outputs of one call allocated before the wait together take at most this many bytes (rows,
# scales, top-k ids and weights, source indices): small batches, whose host time sets their pace
# (T=512 at H=7168 receives at most 4096 rows at 8 ranks: about 59 MB).
EARLY_OUTPUT_BYTES = 64 << 20
# The rows allocated before the wait: the most the plan received in this many of its last calls.
RECENT_CALLS = 4


def dispatch_outputs(plan: DispatchPlan, x: torch.Tensor, is_fp8: bool, num_rows: int, mapping, device):
    """A dispatch's outputs: ``(recv_x, recv_scales, recv_topk, recv_weights, addresses)`` —
    [M, H] like x, [M, S] float32 (FP8, else None), [N, K] int64 / float32 (a full dispatch with
    top-k; expert-major: the mapping's [M] per-row expert and weight; else None), and the
    addresses the pull writes them at (recv_x's for those it does not write). M: the rows,
    ``num_rows`` or the expert-major mapping's."""
    out_rows = mapping.num_rows if mapping is not None else num_rows
    recv_x = x.new_empty((out_rows, x.shape[1]))  # (new_empty: no device argument to parse, NormalMode.dispatch)
    recv_x_address = recv_x.data_ptr()
    recv_scales = torch.empty((out_rows, plan.num_scales), dtype=torch.float32, device=device) if is_fp8 else None
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


class EarlyOutputs:
    """A plain full dispatch's outputs and its recv_src_idx ([rows] int32, like ``index_like``),
    allocated before the count wait at the most rows ``plan`` received in its last RECENT_CALLS
    calls (:meth:`allocate`: None on a plan's first call, or past EARLY_OUTPUT_BYTES); after the
    wait :meth:`take` gives views of their first ``num_rows`` rows, or None where more arrived."""

    __slots__ = ("capacity", "src_idx", "outputs")

    def __init__(self, capacity: int, src_idx: torch.Tensor, outputs: tuple):
        self.capacity, self.src_idx, self.outputs = capacity, src_idx, outputs

    @classmethod
    def allocate(cls, plan: DispatchPlan, x: torch.Tensor, is_fp8: bool, index_like: torch.Tensor,
                 device) -> Optional["EarlyOutputs"]:
        recent = plan.recent_rows
        if not recent:
            return None
        capacity = max(recent)
        row_bytes = x.shape[1] * x.element_size() + 4 * plan.num_scales * is_fp8 + 12 * plan.num_topk + 4
        if capacity * row_bytes > EARLY_OUTPUT_BYTES:
            return None
        return cls(capacity, index_like.new_empty(capacity), dispatch_outputs(plan, x, is_fp8, capacity, None, device))

    def take(self, num_rows: int):
        """``(src_idx, outputs)`` as :func:`dispatch_outputs` gives them, views of the first
        ``num_rows`` rows (the addresses unchanged: a view starts where its allocation does), or
        None where ``num_rows`` is past the capacity."""
        if num_rows > self.capacity:
            return None
        recv_x, recv_scales, recv_topk, recv_weights, addresses = self.outputs
        return self.src_idx[:num_rows], (
            recv_x[:num_rows], None if recv_scales is None else recv_scales[:num_rows],
            None if recv_topk is None else recv_topk[:num_rows],
            None if recv_weights is None else recv_weights[:num_rows], addresses)


def remember_rows(plan: DispatchPlan, num_rows: int) -> None:
    """Keep ``num_rows`` among the plan's last RECENT_CALLS calls' (EarlyOutputs.allocate)."""
    recent = plan.recent_rows
    recent.append(num_rows)
    if len(recent) > RECENT_CALLS:
        del recent[0]
