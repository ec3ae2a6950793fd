"""The multi-node workspace's layout: where each area of the normal-mode kernels lies (arithmetic
only; the backend allocates ``num_rdma_bytes`` of symmetric memory and carves it so).

One region, no halves: every call starts with a step barrier (step.py) that each rank passes only
after every rank has finished its previous call's kernels, so no area is still being read when the
next call writes it. Signal and flag words stay at fixed offsets for the buffer's life (a wait
compares them with the call's epoch, which only grows; a word that had held row data could hold
anything). Everything else is carved afresh per call from the data region::

    preamble (fixed, zeroed once)
      step_rows        int64 [R][4]           row s: (fp0, fp1, epoch) of the call rank s reached
      fingerprint      int64 [4]              this rank's own (fp0, fp1): the source of its step puts
      notify_signals   int64 [R_P2]           word s: rank s's count row arrived
      dispatch_signals int64 [N][MAX_CHANNELS] word [m][c]: block m, channel c arrived (forwarder)
      push_flags       int64 [N][MAX_CHANNELS][k] (+ p2(k))  flag [m][c][j]: rank j of the node pushed
      home_signals     int64 [p2(N * MAX_CHANNELS)]  word [n][c]: node n's partials of channel c arrived
    data, a dispatch (:func:`dispatch_layout`)
      table            int32 [R][meta_len]    count rows, row s put by rank s (ml_notify_dispatch)
      count_row        int32 [meta_len]       this rank's count row: the source of its puts
      send             rows  [N][token_cap]   rows packed for other nodes (ml_dispatch_send)
      recv             rows  [N * token_cap]  the forwarder's receive area: block m after block m-1
    data, a combine (:func:`combine_layout`)
      slots            combine rows [N * token_cap][k]   pushed by the node's ranks (ml_combine_push)
      partials         combine rows [N * token_cap]      staged for the puts home (ml_combine_forward)
      home             combine rows [N][token_cap]       the partials of each node (ml_combine_reduce)

A rank sends at most ``token_cap`` tokens per call, so a forwarder's area holds at most
``N * token_cap`` rows (one block per rail peer). Word arrays a kernel polls as power-of-two lanes
get room for the dead lanes (they are read, and ignored). Every area starts on a 256-byte boundary.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Tuple

from .....errors import EPInputError
from .....layout import align_up
from ...workspace import ALIGN as WORKSPACE_ALIGN, Workspace
from .rows import CombineRow, MetaRow, RowLayout

ALIGN = 256
STEP_ROW_BYTES = 32  # (fp0, fp1, epoch, spare): the rows gpu/sync.py's fingerprint checks read
MAX_CHANNELS = 64  # channels per call (Config.num_sms // 2) the fixed signal areas have room for


def _p2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _carve(start: int, areas: List[Tuple[str, int]]) -> Tuple[Dict[str, int], int]:
    """Offsets of consecutive 256-byte aligned areas from ``start``, and the end of the last."""
    offsets, offset = {}, start
    for name, size in areas:
        offsets[name] = offset
        offset += align_up(size, ALIGN)
    return offsets, offset


@dataclass(frozen=True)
class Preamble:
    """Byte offsets of the fixed areas; ``data`` is where the per-call areas start."""

    step_rows: int
    fingerprint: int
    notify_signals: int
    dispatch_signals: int
    push_flags: int
    home_signals: int
    data: int


def preamble(num_ranks: int, ranks_per_node: int) -> Preamble:
    R, k = num_ranks, ranks_per_node
    N = R // k
    offsets, end = _carve(0, [("step_rows", R * STEP_ROW_BYTES), ("fingerprint", STEP_ROW_BYTES),
                              ("notify_signals", _p2(R) * 8), ("dispatch_signals", N * MAX_CHANNELS * 8),
                              ("push_flags", (N * MAX_CHANNELS * k + _p2(k)) * 8),
                              ("home_signals", _p2(N * MAX_CHANNELS) * 8)])
    return Preamble(data=end, **offsets)


@dataclass(frozen=True)
class DispatchLayout:
    """Byte offsets (from the workspace's start) of one dispatch's areas."""

    token_cap: int  # most tokens a rank may send in one call with this shape
    row: RowLayout
    meta: MetaRow
    table: int
    count_row: int
    send: int
    recv: int
    end: int


@dataclass(frozen=True)
class CombineLayout:
    """Byte offsets (from the workspace's start) of one combine's areas."""

    token_cap: int  # most tokens any rank dispatched (home rows per node, area rows per rail peer)
    row: CombineRow
    slots: int
    partials: int
    home: int
    end: int


def _token_cap(total_bytes: int, start: int, fixed: List[Tuple[str, int]], per_token: List[Tuple[str, int]],
               what: str) -> int:
    used = start + sum(align_up(size, ALIGN) for _, size in fixed) + ALIGN * len(per_token)
    token_cap = (total_bytes - used) // sum(size for _, size in per_token)
    if token_cap < 1:
        need = used + sum(size for _, size in per_token)
        raise EPInputError("num_rdma_bytes", f"multi-node {what} needs at least {need} bytes for one token "
                                             f"(have {total_bytes})")
    return token_cap


def dispatch_layout(total_bytes: int, num_ranks: int, ranks_per_node: int, num_experts: int, num_channels: int,
                    x_bytes: int, num_scales: int, num_topk: int) -> DispatchLayout:
    """A dispatch's areas in a workspace of ``total_bytes``, with the largest ``token_cap`` that fits.
    Raises EPInputError naming ``num_rdma_bytes`` when not one token fits.

    Args:
        x_bytes: bytes of one dispatched row of x (2H for BF16, H for FP8); ``num_scales``: FP8
            scale columns (0 for BF16); ``num_topk``: K (0 in a cached dispatch, which sends none).
    """
    R, k = num_ranks, ranks_per_node
    N = R // k
    row = RowLayout(x_bytes, num_scales, num_topk)
    meta = MetaRow(R, num_experts, N, num_channels)
    start = preamble(R, k).data
    fixed = [("table", R * meta.length * 4), ("count_row", meta.length * 4)]
    per_token = [("send", N * row.row_bytes), ("recv", N * row.row_bytes)]
    token_cap = _token_cap(total_bytes, start, fixed, per_token, "dispatch")
    offsets, end = _carve(start, fixed + [(name, token_cap * size) for name, size in per_token])
    return DispatchLayout(token_cap, row, meta, end=end, **offsets)


def combine_layout(total_bytes: int, num_ranks: int, ranks_per_node: int, hidden: int, num_topk: int
                   ) -> CombineLayout:
    """A combine's areas in a workspace of ``total_bytes`` (``num_topk``: K when top-k weights are
    combined too, else 0), with the largest ``token_cap`` that fits."""
    R, k = num_ranks, ranks_per_node
    N = R // k
    row = CombineRow(hidden, num_topk)
    per_token = [("slots", N * k * row.row_bytes), ("partials", N * row.row_bytes), ("home", N * row.row_bytes)]
    token_cap = _token_cap(total_bytes, preamble(R, k).data, [], per_token, "combine")
    offsets, end = _carve(preamble(R, k).data, [(name, token_cap * size) for name, size in per_token])
    return CombineLayout(token_cap, row, end=end, **offsets)


def bytes_for_tokens(num_tokens: int, num_ranks: int, ranks_per_node: int, num_experts: int, hidden: int,
                     num_topk: int) -> int:
    """``num_rdma_bytes`` that lets every rank dispatch ``num_tokens`` BF16 tokens with top-k (FP8
    rows are smaller, so they fit too) and combine them with their weights, at any channel count."""
    R, k = num_ranks, ranks_per_node
    N = R // k
    start = preamble(R, k).data
    meta = MetaRow(R, num_experts, N, MAX_CHANNELS)
    row, combine_row = RowLayout(2 * hidden, 0, num_topk), CombineRow(hidden, num_topk)
    dispatch = _carve(start, [("table", R * meta.length * 4), ("count_row", meta.length * 4),
                              ("send", num_tokens * N * row.row_bytes), ("recv", num_tokens * N * row.row_bytes)])[1]
    combine = _carve(start, [("slots", num_tokens * N * k * combine_row.row_bytes),
                             ("partials", num_tokens * N * combine_row.row_bytes),
                             ("home", num_tokens * N * combine_row.row_bytes)])[1]
    return max(dispatch, combine) + 3 * ALIGN  # the layouts' allowance for each area's alignment


# ---------------------------------------------------------------------- the low-latency region
def low_latency_start(num_ranks: int, ranks_per_node: int) -> int:
    """Where a multi-node Buffer's low-latency workspace starts in its one allocation: after normal
    mode's fixed signal words. The per-call areas start there too — the two modes share those
    bytes, as in DeepEP, so low-latency calls after normal-mode ones need a clean first."""
    return align_up(preamble(num_ranks, ranks_per_node).data, WORKSPACE_ALIGN)  # (the workspace's own)


def allocation_bytes(num_rdma_bytes: int, num_ll_bytes: int, num_ranks: int, ranks_per_node: int) -> int:
    """Bytes of symmetric memory per rank: ``num_rdma_bytes``, or more if the low-latency workspace
    (``num_ll_bytes``, gpu/workspace.py's layout) after the fixed signal words needs it."""
    if not num_ll_bytes:
        return num_rdma_bytes
    ll_end = low_latency_start(num_ranks, ranks_per_node) + Workspace.size_for(num_ranks, 0, num_ll_bytes,
                                                                               normal=False)
    return max(num_rdma_bytes, ll_end)
