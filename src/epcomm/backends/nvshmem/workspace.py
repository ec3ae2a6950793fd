"""The multi-node workspace's layout: where each area of the normal-mode kernels lies (arithmetic
only; the backend allocates ``num_rdma_bytes`` of NVSHMEM symmetric memory and carves it so).

Two halves (call parity, as on nvlink), each laid out per call shape by :func:`normal_layout`::

    table            int32 [R][meta_len]       count rows, row s put by rank s (ml_notify)
    notify_signals   int64 [R]                 signal s: rank s's row arrived
    dispatch_signals int64 [N][C]              signal [m][c]: block m, channel c arrived (forwarder)
    send             rows  [N][token_cap]      rows packed for other nodes (ml_dispatch_send)
    recv             rows  [N * token_cap]     the forwarder's receive area: block m after block m-1
    slots            combine rows [N * token_cap][k]   pushed by the node's ranks (ml_combine_push)
    push_flags       int64 [N][C][k]           flag [m][c][j]: rank j of this node pushed
    partials         combine rows [N * token_cap]      staged for the puts home (ml_combine_forward)
    home             combine rows [N][token_cap]       the partials of each node (ml_combine_reduce)
    home_signals     int64 [N][C]              signal [n][c]: node n's partials of channel c arrived

A rank sends at most ``token_cap`` tokens per call, so a forwarder's area holds at most
``N * token_cap`` rows (one block per rail peer). Flag and signal arrays get room for the
power-of-two lanes the kernels poll (dead lanes are read, and ignored). Every area starts on a
256-byte boundary.
"""
from __future__ import annotations

from dataclasses import dataclass

from ...errors import EPInputError
from ...layout import align_up
from .rows import CombineRow, MetaRow, RowLayout

ALIGN = 256


def _p2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@dataclass(frozen=True)
class NormalLayout:
    """Byte offsets within one half, for one call shape; ``half_bytes`` is what the half uses."""

    token_cap: int  # most tokens a rank may send in one call with this shape
    row: RowLayout
    combine_row: CombineRow
    meta: MetaRow
    table: int
    notify_signals: int
    dispatch_signals: int
    send: int
    recv: int
    slots: int
    push_flags: int
    partials: int
    home: int
    home_signals: int
    half_bytes: int


def normal_layout(half_bytes: int, num_ranks: int, ranks_per_node: int, num_experts: int, num_channels: int,
                  hidden: int, x_bytes: int, num_scales: int, num_topk: int) -> NormalLayout:
    """The layout of one half of ``half_bytes`` bytes for this shape, with the largest
    ``token_cap`` that fits. Raises EPInputError (naming ``num_rdma_bytes``) when not one token fits.

    Args:
        x_bytes: bytes of one dispatched row of x (2H for BF16, H for FP8); ``num_scales``: FP8
            scale columns (0 for BF16); ``num_topk``: K (top-k ids and weights travel with rows and
            weights come back combined).
    """
    R, k, C = num_ranks, ranks_per_node, num_channels
    N = R // k
    row = RowLayout(x_bytes, num_scales, num_topk)
    combine_row = CombineRow(hidden, num_topk)
    meta = MetaRow(R, num_experts, N, C)
    fixed = [("table", R * meta.length * 4), ("notify_signals", _p2(R) * 8),
             ("dispatch_signals", (N * C + _p2(N * C)) * 8), ("push_flags", (N * C * k + _p2(k)) * 8),
             ("home_signals", (N * C + _p2(N * C)) * 8)]
    per_token = [("send", N * row.row_bytes), ("recv", N * row.row_bytes),
                 ("slots", N * k * combine_row.row_bytes), ("partials", N * combine_row.row_bytes),
                 ("home", N * combine_row.row_bytes)]
    fixed_bytes = sum(align_up(size, ALIGN) for _, size in fixed)
    padding = ALIGN * len(per_token)
    token_cap = (half_bytes - fixed_bytes - padding) // sum(size for _, size in per_token)
    if token_cap < 1:
        need = 2 * (fixed_bytes + padding + sum(size for _, size in per_token))
        raise EPInputError("num_rdma_bytes", f"multi-node normal mode needs at least {need} bytes for one token of "
                                             f"hidden {hidden} on {N} nodes x {k} ranks (have {2 * half_bytes})")
    offsets, offset = {}, 0
    for name, size in fixed + [(name, token_cap * size) for name, size in per_token]:
        offsets[name] = offset
        offset += align_up(size, ALIGN)
    return NormalLayout(token_cap, row, combine_row, meta, half_bytes=offset, **offsets)


def bytes_for_tokens(num_tokens: int, num_ranks: int, ranks_per_node: int, num_experts: int, num_channels: int,
                     hidden: int, num_topk: int) -> int:
    """``num_rdma_bytes`` that lets every rank send ``num_tokens`` BF16 tokens per call (FP8 rows
    are smaller, so they fit too): both halves."""
    probe = normal_layout(1 << 40, num_ranks, ranks_per_node, num_experts, num_channels, hidden, 2 * hidden, 0,
                          num_topk)
    per_token = (probe.half_bytes - probe.send) // probe.token_cap  # the per-token areas, per token
    half = probe.send + per_token * num_tokens + 5 * ALIGN
    while normal_layout(half, num_ranks, ranks_per_node, num_experts, num_channels, hidden, 2 * hidden, 0,
                        num_topk).token_cap < num_tokens:
        half += ALIGN
    return 2 * half
