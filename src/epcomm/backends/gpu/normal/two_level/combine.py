"""Multi-node normal-mode combine kernels: reduce within the node first, one row per token and
node over the network (launched by the wiring backend; tested with ranks as threads of one GPU).

The data flow is the one :func:`epcomm.testing.two_level.two_level_combine` simulates (CPU-tested
against the one-level reference, tests/test_hierarchy.py). Rank names: ``s = (m, l)`` a home
rank (node m, local index l), ``f = (n, l)`` its forwarder on node n, ``d = (n, j)`` a rank of
node n that received some of s's tokens. What each rank kept from the dispatch (dispatch.py):

    at d: recv_area_row [num_recv]   each received row's row in its forwarder's receive area
    at f: area_masks [area rows]     each area row's in-node mask (bit j: rank (n, j) has it)
    at s: node_row [T, N]            token t's row in its block for node n (the block's order)
          masks [T, N]               in-node masks (nonzero: node n received t)
    all:  the count table [R, meta_len] of that dispatch (rows.MetaRow)

Three launches, C channels of contiguous tokens as in the dispatch:

    ml_combine_push     at d, grid (R, C): program (s, c) stores d's rows of source s, channel c
                        into the forwarder's slots (area row, j) over NVLink, then RELEASEs the
                        forwarder's flag [m][c][j].
    ml_combine_forward  at f, grid (N, C): program (m, c) ACQUIREs the k flags [m][c][*], sums each
                        area row's slots over the ranks in its mask (float32, ascending j), rounds
                        to bf16 and delivers the partial rows to home s = (m, l), block n, rows
                        [lo, hi): one far_deliver (the rows land before the signal), or,
                        when s is f itself or its workspace is mapped here (p2p: NVLink), stores
                        straight into s's area and a RELEASE of the signal.
    ml_combine_reduce   at s, <= num_sms programs over the tokens: ACQUIRE the N x C signals of
                        this call, then per token sum the partials of the nodes in its mask (float32, ascending node),
                        add the biases, round to bf16.

Rows (slots and partials, :class:`rows.CombineRow`): bf16 [H], then float32 [K] top-k weights when
they are combined too; 16-byte multiples. Signals carry the call's epoch; a wait that passes the
timeout flags the late rank in the host mailbox (gpu/mailbox.py) and moves nothing. The areas are
free to write because the call's step barrier (step.py) passed: every rank finished its previous
call.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ...copy import copy_rows, fill_nan, word_ptr
from ...launch import KernelSpec
from ...sync import call_failed, mailbox_words, poll_epochs, report_late, store_release_sys
from ...warps import cta_any
from ...reach.modes import FAR_LIBRARY
from ...walk import peer_after
from .channels import (SIGNAL_STRIDE, node_block_start, channel_range, hand_off, hop2_program, part_rows,
                       peer_reach)


# ====================================================================== at each receiving rank
# ml_combine_push, protocol:
#
# Program (s, c) at d = (node, j): the rows d received from s in channel c are rows
# [rank_prefix_matrix[s - 1][d] + gbl_prefix[s][d][c - 1], ... + gbl_prefix[s][d][c]) of y.
# Each goes to slot (area row, j) of forwarder f = (node, l) with plain NVLink stores; after a
# CTA barrier the program RELEASEs f's flag [m][c][j] (st.release.sys: the stores are seen by
# whoever acquires the flag). Every (s, c) program releases, with rows or without. Which program
# takes which s (channels.hop2_program): the node's ranks store into k different forwarders at
# once, each starting on the forwarder after itself.
@triton.jit
def ml_combine_push(failed_ptr: "*i64",  # int64 state word CALL_FAILED (gpu/sync.py call_failed)
                    y_ptr: "*i64",  # [num_recv, H] bf16 expert outputs, dispatch order (8-byte aligned rows)
                    weights_ptr: "*fp32",  # [num_recv, K] float32 (HAS_WEIGHTS)
                    recv_area_row_ptr: "*i32",  # [num_recv] int32 (the dispatch's ml_dispatch_forward)
                    meta_ptr: "*i32",  # [R, meta_len] int32: the dispatch's count table
                    prefix_ptr: "*i32",  # [R, R] int32 rank_prefix_matrix
                    peer_bases_ptr: "*i64",  # [R] int64: each rank's symmetric base over NVLink (this node's ranks)
                    slots_offset: "i64", flags_offset: "i64",  # bytes from a base to this half's slots / push flags
                    epoch: "i64", rank: "i32", num_ranks: "i32", ranks_per_node: "i32", x_words: "i32", num_topk: "i32",
                    row_bytes: "i32", weights_at: "i32", meta_len: "i32",
                    gbl_prefix_at: "i32", num_channels: "i32",
                    HAS_WEIGHTS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr, K_P2: tl.constexpr):
    if call_failed(failed_ptr, epoch):  # this call's step barrier found another call or a late rank
        return
    s, c, j, m, base = hop2_program(peer_bases_ptr, rank, ranks_per_node)
    lo, hi = channel_range(meta_ptr + s * meta_len + gbl_prefix_at + rank * num_channels, c)
    first_row = tl.load(prefix_ptr + (s - 1) * num_ranks + rank, mask=s > 0, other=0)
    for first in range(first_row + lo, first_row + hi, BLOCK_R):
        rows = first + tl.arange(0, BLOCK_R)
        live = rows < first_row + hi
        area_rows = tl.load(recv_area_row_ptr + rows, mask=live, other=0).to(tl.int64)
        slot = base + slots_offset + (area_rows * ranks_per_node + j) * row_bytes
        copy_rows(y_ptr.to(tl.pointer_type(tl.int64), bitcast=True) + rows.to(tl.int64) * x_words,
                  word_ptr(slot, False), live, x_words, BLOCK_W)
        if HAS_WEIGHTS:
            k = tl.arange(0, K_P2)
            mk = live[:, None] & (k < num_topk)[None, :]
            tl.store((slot + weights_at).to(tl.pointer_type(tl.float32))[:, None] + k[None, :],
                     tl.load(weights_ptr + rows[:, None] * num_topk + k[None, :], mask=mk), mask=mk)
    tl.debug_barrier()  # every thread's slot stores precede the release
    # RELEASE: this program's slots (area row, j) -> forwarder's ml_combine_forward, which acquires flags [m][c][*]
    store_release_sys(base + flags_offset + ((m * SIGNAL_STRIDE + c) * ranks_per_node + j).to(tl.int64) * 8, epoch)


PUSH = KernelSpec(ml_combine_push)


# ====================================================================== at each forwarder
# ml_combine_forward, protocol:
#
# Program (m, c) at f = (node, l), for home s = (m, l): ACQUIRE the flags [m][c][0..k) that the
# node's ranks released after pushing (bounded; a late rank is flagged in the mailbox and
# nothing is sent: the home's wait times out too and names f). Rows [lo, hi) of s's block in
# this rank's area: the float32 sum over the ranks j in each row's mask, in ascending j,
# rounded to bf16 — the same sums, in the same order, as two_level_combine. The partial rows
# go to rows [lo, hi) of block `node` of s's home area; put_signal SETs s's signal
# [node][c] to epoch after them. When s is this rank (m == node), local stores and a RELEASE.
# With several programs per (m, c), each takes a slice of the rows (channels.hand_off).
# Programs (y * parts + part, c) take the home nodes from the one after this rank's,
# m = peer_after(y, node, N): the forwarders of a rail deliver to N different homes at once
# instead of all to node 0's first. The slots this program sums lie in this rank's own memory
# (pushed there by the node's ranks), so their loads, and their sum's order, stay as they were.
@triton.jit
def ml_combine_forward(failed_ptr: "*i64",  # int64 state word CALL_FAILED (gpu/sync.py call_failed)
                       # [R] int64: each rank's workspace mapped here (0: not mapped, another host)
                       peer_bases_ptr: "*i64",
                       area_masks_ptr: "*i32",  # [area rows] int32 (the dispatch's ml_dispatch_forward)
                       meta_ptr: "*i32",  # [R, meta_len] int32: the dispatch's count table
                       # int64 local addresses of this half's slots [area rows][k] and flags [N][C][k]
                       slots: "i64", flags: "i64",
                       partials: "i64",  # int64 local address of this half's outgoing partial rows [area rows]
                       # int64 symmetric addresses (any rank's: puts and local stores)
                       home_area: "i64", home_signals: "i64",
                       mailbox_address: "i64",  # host mailbox (gpu/mailbox.py)
                       epoch: "i64", timeout_ns: "i64", rank: "i32", num_ranks: "i32", ranks_per_node: "i32",
                       hidden: "i32", num_topk: "i32", row_bytes: "i32", weights_at: "i32",
                       home_cap: "i32", meta_len: "i32", per_node_at: "i32", rdma_prefix_at: "i32", num_channels: "i32",
                       parts: "i32",  # programs per (node, channel): each sums and puts a slice of the rows
                       p2p: "i32",  # 1: store straight into a home whose workspace is mapped here (normal.peer_reach)
                       part_counters_ptr: "*i64",  # [MAX_CHANNELS * N] int64 local, zero between calls (parts > 1)
                       REMOTE: tl.constexpr, HAS_WEIGHTS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                       K_P2: tl.constexpr, LOCAL_P2: tl.constexpr):
    if call_failed(failed_ptr, epoch):  # this call's step barrier found another call or a late rank
        return
    node = rank // ranks_per_node
    m = peer_after(tl.program_id(0) // parts, node, num_ranks // ranks_per_node)  # the home's node
    part = tl.program_id(0) % parts
    c = tl.program_id(1)
    local = rank % ranks_per_node
    s = m * ranks_per_node + local
    lanes = tl.arange(0, LOCAL_P2)
    timeouts, _, _, _ = mailbox_words(mailbox_address, num_ranks)
    flag_words = flags + ((m * SIGNAL_STRIDE + c) * ranks_per_node + lanes).to(tl.int64) * 8
    _, _, late = poll_epochs(flag_words, lanes < ranks_per_node, epoch, timeout_ns, EPOCH_SHIFT=0)  # ACQUIRE
    report_late(late, node * ranks_per_node + lanes, timeouts, timeouts, MASK_ON_TIMEOUT=False)
    if cta_any(tl.max(late.to(tl.int32), axis=0)) == 0:  # (a vote: at the deadline the warps may disagree)
        lo, hi = channel_range(meta_ptr + s * meta_len + rdma_prefix_at + node * num_channels, c)
        block_start = node_block_start(meta_ptr, meta_len, per_node_at, m, node, local, ranks_per_node)
        direct, shift = peer_reach(s, rank, p2p, peer_bases_ptr)
        # partial row r: straight into the home area when s is this rank or mapped here (p2p),
        # else staged for the put
        out_base = tl.where(direct, home_area + shift + (node * home_cap).to(tl.int64) * row_bytes,
                            partials + block_start.to(tl.int64) * row_bytes)
        part_lo, part_hi = part_rows(lo, hi, part, parts)
        for first in range(part_lo, part_hi, BLOCK_R):
            rows = first + tl.arange(0, BLOCK_R)
            live = rows < part_hi
            area_rows = (block_start + rows).to(tl.int64)
            masks = tl.load(area_masks_ptr + area_rows, mask=live, other=0)
            out_rows = out_base + rows.to(tl.int64) * row_bytes
            for col in range(0, hidden, BLOCK_C):
                cols = col + tl.arange(0, BLOCK_C)
                mc = live[:, None] & (cols < hidden)[None, :]
                acc = tl.zeros((BLOCK_R, BLOCK_C), dtype=tl.float32)
                for jj in range(0, ranks_per_node):
                    take = mc & (((masks >> jj) & 1) != 0)[:, None]
                    slot = (slots + (area_rows * ranks_per_node + jj) * row_bytes).to(tl.pointer_type(tl.bfloat16))
                    acc += tl.load(slot[:, None] + cols[None, :], mask=take, other=0.0).to(tl.float32)
                tl.store(out_rows.to(tl.pointer_type(tl.bfloat16))[:, None] + cols[None, :], acc.to(tl.bfloat16),
                         mask=mc)
            if HAS_WEIGHTS:
                k = tl.arange(0, K_P2)
                mk = live[:, None] & (k < num_topk)[None, :]
                acc_w = tl.zeros((BLOCK_R, K_P2), dtype=tl.float32)
                for jj in range(0, ranks_per_node):
                    take = mk & (((masks >> jj) & 1) != 0)[:, None]
                    slot = slots + (area_rows * ranks_per_node + jj) * row_bytes + weights_at
                    acc_w += tl.load(slot.to(tl.pointer_type(tl.float32))[:, None] + k[None, :], mask=take, other=0.0)
                tl.store((out_rows + weights_at).to(tl.pointer_type(tl.float32))[:, None] + k[None, :], acc_w, mask=mk)
        tl.debug_barrier()  # every thread's partial rows precede the release / the put
        # RELEASE: the partial rows -> home s's ml_combine_reduce, which acquires signal [node][c]
        hand_off(home_area + (node * home_cap).to(tl.int64) * row_bytes,
                  partials + block_start.to(tl.int64) * row_bytes, row_bytes, lo, hi, part_lo, part_hi, direct, shift,
                  home_signals + (node * SIGNAL_STRIDE + c).to(tl.int64) * 8, epoch, s, parts,
                  part_counters_ptr + c * (num_ranks // ranks_per_node) + m, peer_bases_ptr, rank, REMOTE)


FORWARD = KernelSpec(ml_combine_forward, **FAR_LIBRARY)


# ====================================================================== at home
# ml_combine_reduce, protocol:
#
# Every program ACQUIREs all N x C signals of this call (each forwarder program signals, with
# rows or without; a late one is flagged in the mailbox for its forwarder (n, local) and this
# program's share of the output is NaN: no plausible data), then takes token blocks pid, pid + P, ... of BLOCK_T tokens (P
# programs, at most num_sms, so that few programs spin: on one GPU shared by many ranks,
# a grid per token block filled the SMs with waiters while the pushes they waited for could
# not start). Per token: the float32 sum over the nodes in each token's mask, in ascending node
# order, of the partial row at node_row[t][n] of block n, plus the biases, rounded to bf16.
@triton.jit
def ml_combine_reduce(failed_ptr: "*i64",  # int64 state word CALL_FAILED (gpu/sync.py call_failed)
                      masks_ptr: "*i32",  # [T, N] int32 in-node masks of the dispatch (nonzero: node n has the token)
                      node_row_ptr: "*i32",  # [T, N] int32 (the dispatch's ml_dispatch_send)
                      out_ptr: "*bf16",  # [T, H] bf16
                      out_weights_ptr: "*fp32",  # [T, K] float32 (HAS_WEIGHTS)
                      bias0_ptr: "*bf16", bias1_ptr: "*bf16",  # [T, H] bf16 (NUM_BIAS of them)
                      # int64 local addresses of this half: partials [N][cap], [N][C] signals
                      home_area: "i64", home_signals: "i64",
                      mailbox_address: "i64",  # host mailbox (gpu/mailbox.py)
                      epoch: "i64", timeout_ns: "i64", rank: "i32", num_ranks: "i32", ranks_per_node: "i32",
                      num_tokens: "i32", hidden: "i32", num_topk: "i32", row_bytes: "i32",
                      weights_at: "i32", home_cap: "i32", num_channels: "i32",
                      HAS_WEIGHTS: tl.constexpr, NUM_BIAS: tl.constexpr, BLOCK_T: tl.constexpr,
                      BLOCK_C: tl.constexpr, K_P2: tl.constexpr, SIGNALS_P2: tl.constexpr):
    pid = tl.program_id(0)
    if call_failed(failed_ptr, epoch):  # the step barrier found another call or a late rank: NaN, DESIGN 5
        fill_nan(out_ptr, num_tokens * hidden, pid, tl.num_programs(0), BLOCK_C)
        if HAS_WEIGHTS:
            fill_nan(out_weights_ptr, num_tokens * num_topk, pid, tl.num_programs(0), BLOCK_C)
        return
    num_nodes = num_ranks // ranks_per_node
    local = rank % ranks_per_node
    lanes = tl.arange(0, SIGNALS_P2)
    timeouts, _, _, _ = mailbox_words(mailbox_address, num_ranks)
    words = home_signals + ((lanes // num_channels) * SIGNAL_STRIDE + lanes % num_channels).to(tl.int64) * 8
    _, _, late = poll_epochs(words, lanes < num_nodes * num_channels, epoch, timeout_ns,
                             EPOCH_SHIFT=0)  # ACQUIRE: the partial rows of every node
    report_late(late, (lanes // num_channels) * ranks_per_node + local, timeouts, timeouts, MASK_ON_TIMEOUT=False)
    if cta_any(tl.max(late.to(tl.int32), axis=0)) != 0:  # a partial is missing (a vote): no sum is known (NaN)
        fill_nan(out_ptr, num_tokens * hidden, pid, tl.num_programs(0), BLOCK_C)
        if HAS_WEIGHTS:
            fill_nan(out_weights_ptr, num_tokens * num_topk, pid, tl.num_programs(0), BLOCK_C)
    else:
        for first in range(pid * BLOCK_T, num_tokens, tl.num_programs(0) * BLOCK_T):
            tokens = first + tl.arange(0, BLOCK_T)
            live = tokens < num_tokens
            for col in range(0, hidden, BLOCK_C):
                cols = col + tl.arange(0, BLOCK_C)
                mc = live[:, None] & (cols < hidden)[None, :]
                acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
                for n in range(0, num_nodes):
                    has = tl.load(masks_ptr + tokens * num_nodes + n, mask=live, other=0) != 0
                    row = tl.load(node_row_ptr + tokens * num_nodes + n, mask=live & has, other=0).to(tl.int64)
                    partial = (home_area + (n * home_cap + row) * row_bytes).to(tl.pointer_type(tl.bfloat16))
                    acc += tl.load(partial[:, None] + cols[None, :], mask=mc & has[:, None], other=0.0).to(tl.float32)
                offsets = tokens[:, None].to(tl.int64) * hidden + cols[None, :]
                if NUM_BIAS >= 1:
                    acc += tl.load(bias0_ptr + offsets, mask=mc, other=0.0).to(tl.float32)
                if NUM_BIAS >= 2:
                    acc += tl.load(bias1_ptr + offsets, mask=mc, other=0.0).to(tl.float32)
                tl.store(out_ptr + offsets, acc.to(tl.bfloat16), mask=mc)
            if HAS_WEIGHTS:
                k = tl.arange(0, K_P2)
                mk = live[:, None] & (k < num_topk)[None, :]
                acc_w = tl.zeros((BLOCK_T, K_P2), dtype=tl.float32)
                for n in range(0, num_nodes):
                    has = tl.load(masks_ptr + tokens * num_nodes + n, mask=live, other=0) != 0
                    row = tl.load(node_row_ptr + tokens * num_nodes + n, mask=live & has, other=0).to(tl.int64)
                    partial = home_area + (n * home_cap + row) * row_bytes + weights_at
                    acc_w += tl.load(partial.to(tl.pointer_type(tl.float32))[:, None] + k[None, :],
                                     mask=mk & has[:, None], other=0.0)
                tl.store(out_weights_ptr + tokens[:, None] * num_topk + k[None, :], acc_w, mask=mk)


REDUCE = KernelSpec(ml_combine_reduce)
