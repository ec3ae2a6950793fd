"""Multi-node normal-mode dispatch kernels: hop 1 between nodes (gpu/reach), hop 2 over NVLink.

The plan is :mod:`.hierarchy` (docs/MULTINODE.md); these kernels compute it on the GPU
(launched by the wiring backend, after the step barrier of step.py). They pass against the references with every
rank a thread of one GPU (epcomm.testing) and across GPUs and nodes (docs/MULTINODE.md).
The combine kernels are in combine.py.

Count rows. The count exchange leaves, on every rank, the same ``[R, meta_len]`` int32 table:
row ``s`` is what rank ``s`` sent (:class:`rows.MetaRow` gives the offsets): its per-rank,
per-expert and per-node counts, its token count, its ``gbl_channel_prefix_matrix [R, C]`` and its
``rdma_channel_prefix_matrix [N, C]``. Every offset below is derived from that table on the device.

Rows. A dispatched row is packed once, for both hops (:class:`rows.RowLayout`): x, the FP8
scales, the top-k ids and weights, the source token index and the in-node mask.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ...copy import NAN_BF16_WORD, NAN_E4M3_WORD, copy_rows, fill_nan, fill_rows, word_ptr
from ...launch import KernelSpec
from ..layout_kernel import expert_receive_counts
from ...sync import arrive, call_failed, load_acquire_sys, mailbox_words, now_ns, poll_epochs, report_late, store_release_sys
from ...reach.modes import FAR_LIBRARY, far_deliver
from ...walk import peer_after
from .channels import (SIGNAL_STRIDE, node_block_start, channel_range, hand_off, hop2_program, part_rows,
                       peer_reach)
from .areas import MAX_CHANNELS

# abort codes of a count row (gpu/agreement.py's numbering: raise_disagreement names the argument)
ABORT_NUM_TOKENS_PER_RANK = tl.constexpr(1)
ABORT_NUM_TOKENS_PER_EXPERT = tl.constexpr(2)
CALL_DISPATCH = tl.constexpr(1)  # agreement.CALL_DISPATCH in the call field of word 0

# ====================================================================== send layout
# ml_dispatch_send_layout, protocol:
#
# One program: hierarchy.send_layout, rows.node_tokens and rows.count_row in one pass, with
# no host work between the routing and the count exchange. Channels are the contiguous token
# ranges of hierarchy.channel_bounds (ceil(T / C) tokens each); walking them in order, per
# channel c and block of tokens:
#
#   in_node[t, n] = OR_j in_rank[t, n*k + j]         masks[t, n] = SUM_j in_rank[t, n*k + j] << j
#   node_tokens[n, seen[n] + #(earlier tokens of the block in n)] = t      (ascending per node)
#   gbl[r, c] = tokens of channels 0..c for rank r    rdma[n, c] = the same per node (inclusive)
#
# then the totals (gbl[:, C-1], rdma[:, C-1]), the per-expert counts and T close the row. The
# counts sent are the routing's own — per rank from is_token_in_rank, per expert from topk_idx
# (every valid entry; the caller's without HAS_TOPK) — so the receivers' offsets always agree
# with the rows sent; where the caller's differ, the row's abort word names the argument and
# every rank's notify reports it (the host raises EPInputError, as nvlink's staging check does).
# Plain stores and atomics: the notify kernel after it on the stream reads the row.
@triton.jit
def ml_dispatch_send_layout(
        # the call's routing and counts in; the send layout and this rank's count row out
        in_rank_ptr: "*i8",  # [T, R] bool (uint8): is_token_in_rank
        topk_ptr: "*i64",  # [T, K] int64 expert ids (HAS_TOPK)
        per_rank_ptr: "*i32",  # [R] int32: the caller's num_tokens_per_rank (checked)
        per_expert_ptr: "*i32",  # [E] int32: the caller's num_tokens_per_expert (checked with HAS_TOPK)
        masks_ptr: "*i32",  # out [T, N] int32: in-node masks (bit j: rank (n, j) needs the token)
        node_tokens_ptr: "*i32",  # out [N, T] int32: row n starts with node n's tokens, ascending
        row_ptr: "*i32",  # out [meta_len] int32: this rank's count row (rows.MetaRow), symmetric memory
        # sizes
        num_tokens: "i32", num_ranks: "i32", ranks_per_node: "i32", num_experts: "i32",
        num_channels: "i32", num_topk: "i32",
        # where each part of the count row lies (rows.MetaRow)
        per_expert_at: "i32", per_node_at: "i32", num_tokens_at: "i32", gbl_prefix_at: "i32",
        rdma_prefix_at: "i32", abort_at: "i32",
        # meta-parameters
        HAS_TOPK: tl.constexpr, BLOCK_T: tl.constexpr, R_P2: tl.constexpr, N_P2: tl.constexpr,
        BLOCK_E: tl.constexpr, K_P2: tl.constexpr):
    num_nodes = num_ranks // ranks_per_node
    ranks = tl.arange(0, R_P2)
    nodes = tl.arange(0, N_P2)
    rank_ok = ranks < num_ranks
    node_ok = nodes < num_nodes
    per_rank = tl.zeros([R_P2], tl.int32)  # tokens so far per rank: the running gbl prefix
    per_node = tl.zeros([N_P2], tl.int32)  # per node: the running rdma prefix, and node_tokens' fill
    per_channel = tl.cdiv(num_tokens, num_channels)
    for c in range(0, num_channels):
        lo = tl.minimum(c * per_channel, num_tokens)
        hi = tl.minimum(lo + per_channel, num_tokens)
        for first in range(lo, hi, BLOCK_T):
            tokens = first + tl.arange(0, BLOCK_T)
            live = tokens < hi
            t64 = tokens.to(tl.int64)
            needs = tl.load(in_rank_ptr + t64[:, None] * num_ranks + ranks[None, :],
                            mask=live[:, None] & rank_ok[None, :], other=0).to(tl.int32)
            per_rank += tl.sum(needs, axis=0)
            masks = tl.zeros([BLOCK_T, N_P2], tl.int32)
            for j in range(0, ranks_per_node):
                bit = tl.load(in_rank_ptr + t64[:, None] * num_ranks + (nodes * ranks_per_node + j)[None, :],
                              mask=live[:, None] & node_ok[None, :], other=0).to(tl.int32)
                masks |= bit << j
            tl.store(masks_ptr + t64[:, None] * num_nodes + nodes[None, :], masks,
                     mask=live[:, None] & node_ok[None, :])
            member = (masks != 0).to(tl.int32)
            position = per_node[None, :] + tl.cumsum(member, axis=0) - member
            tl.store(node_tokens_ptr + nodes[None, :].to(tl.int64) * num_tokens + position, tokens[:, None] + 0 * member,
                     mask=(member != 0) & node_ok[None, :])
            per_node += tl.sum(member, axis=0)
        tl.store(row_ptr + gbl_prefix_at + ranks * num_channels + c, per_rank, mask=rank_ok)
        tl.store(row_ptr + rdma_prefix_at + nodes * num_channels + c, per_node, mask=node_ok)
    tl.store(row_ptr + ranks, per_rank, mask=rank_ok)  # num_tokens_per_rank: the rows actually sent
    tl.store(row_ptr + per_node_at + nodes, per_node, mask=node_ok)
    tl.store(row_ptr + num_tokens_at, num_tokens)
    given = tl.load(per_rank_ptr + ranks, mask=rank_ok, other=0)
    abort = tl.where(tl.max((given != per_rank).to(tl.int32), axis=0) != 0, ABORT_NUM_TOKENS_PER_RANK, 0)
    for first in range(0, num_experts, BLOCK_E):
        e = first + tl.arange(0, BLOCK_E)
        if HAS_TOPK:
            tl.store(row_ptr + per_expert_at + e, tl.zeros([BLOCK_E], tl.int32), mask=e < num_experts)
        else:
            tl.store(row_ptr + per_expert_at + e, tl.load(per_expert_ptr + e, mask=e < num_experts),
                     mask=e < num_experts)
    if HAS_TOPK:  # count the routing's entries into the zeroed per-expert words, then compare
        tl.debug_barrier()  # the zeros precede the atomics
        k = tl.arange(0, K_P2)
        for first in range(0, num_tokens, BLOCK_T):
            tokens = first + tl.arange(0, BLOCK_T)
            ids = tl.load(topk_ptr + tokens[:, None].to(tl.int64) * num_topk + k[None, :],
                          mask=(tokens < num_tokens)[:, None] & (k < num_topk)[None, :], other=-1)
            valid = (ids >= 0) & (ids < num_experts)
            tl.atomic_add(row_ptr + per_expert_at + tl.where(valid, ids, 0).to(tl.int32), 1, mask=valid,
                          sem="relaxed")
        tl.debug_barrier()  # every atomic precedes the read-back (volatile: not from L1)
        for first in range(0, num_experts, BLOCK_E):
            e = first + tl.arange(0, BLOCK_E)
            counted = tl.load(row_ptr + per_expert_at + e, mask=e < num_experts, other=0, volatile=True)
            wrong = tl.max((counted != tl.load(per_expert_ptr + e, mask=e < num_experts, other=0)).to(tl.int32), axis=0)
            abort = tl.where((wrong != 0) & (abort == 0), ABORT_NUM_TOKENS_PER_EXPERT, abort)
    tl.store(row_ptr + abort_at, abort)


SEND_LAYOUT = KernelSpec(ml_dispatch_send_layout)


# ====================================================================== count exchange
# ml_notify_dispatch, protocol:
#
# Program i, for rank p = peer_after(i, rank, R) (the walk starts on the rank after this one, so
# the ranks' first puts go to R different ranks, not all to rank 0): put this rank's count row
# into row `rank` of rank p's table and SET p's signal [rank] to epoch after it (put_signal:
# seeing the signal means seeing the row); ACQUIRE this rank's signal [p] (bounded; a timeout
# is flagged for p in the mailbox). The program arriving last owns the whole table:
# rank_prefix_matrix, then the receive counts into the host mailbox and, last, the sequence
# number with a release — the host polls that word. A row whose abort word is set
# (ml_dispatch_send_layout: its caller's counts did not match its routing) is recorded in the
# mailbox like a disagreement (gpu/sync.py check_fingerprints): every rank sees every row, so
# every rank's host raises EPInputError naming the argument.
@triton.jit
def ml_notify_dispatch(
        # this call's state word, and the workspaces (gpu/reach maps them)
        failed_ptr: "*i64",  # int64 state word CALL_FAILED (gpu/sync.py call_failed)
        peer_bases_ptr: "*i64",  # [R] int64: each rank's workspace (where gpu/reach maps them)
        # the count rows: this rank's in, every rank's table and the rank_prefix_matrix out
        my_row_ptr: "*i32",  # [meta_len] int32 in symmetric memory: this rank's count row (rows.MetaRow)
        table: "i64", signals: "i64",  # int64 addresses of this half's [R, meta_len] table and [R_P2] signals
        table_ptr: "*i32",  # the same table as a pointer (read after the wait)
        state_ptr: "*i64",  # int64 local arrival counter
        prefix_ptr: "*i32",  # out [R, R] int32 rank_prefix_matrix
        # the host: its mailbox (receive counts, then the sequence number), the call's epoch, the timeout
        mailbox_address: "i64", epoch: "i64", sequence: "i64", timeout_ns: "i64",
        # this rank, sizes, where each part of a count row lies (rows.MetaRow)
        rank: "i32", num_ranks: "i32", meta_len: "i32", num_experts: "i32", num_tokens_at: "i32",
        expert_alignment: "i32", abort_at: "i32",
        # meta-parameters
        REMOTE: tl.constexpr, R_P2: tl.constexpr, BLOCK_E: tl.constexpr):
    if call_failed(failed_ptr, epoch):  # this call's step barrier found another call or a late rank
        return
    p = peer_after(tl.program_id(0), rank, num_ranks)  # every rank once, from the one after this one
    # RELEASE: this rank's count row -> rank p's notify, which acquires signal [rank] = epoch (set after the row lands)
    far_deliver(table + (rank * meta_len).to(tl.int64) * 4, my_row_ptr, (meta_len * 4).to(tl.int64),
                    signals + rank * 8, epoch, p, peer_bases_ptr, rank, REMOTE)
    peers = tl.arange(0, R_P2)
    one = peers == p
    timeouts, _, agreement, notify = mailbox_words(mailbox_address, num_ranks)
    _, _, late = poll_epochs((signals + peers * 8).to(tl.pointer_type(tl.int64)), one, epoch, timeout_ns,
                             EPOCH_SHIFT=0)  # ACQUIRE: rank p's row here
    report_late(late, peers, timeouts, timeouts, MASK_ON_TIMEOUT=False)
    if arrive(state_ptr, num_ranks):
        src = tl.arange(0, R_P2)
        # A rank that rejected its input set its signal to ABORT_EPOCH without putting a row (ml_abort):
        # its row here holds whatever earlier calls left in these bytes (combine rows, low-latency
        # data), so only rows signalled with this epoch are read. The step barrier has already
        # recorded the aborting rank's words (the argument) in the mailbox; the host raises.
        signalled = tl.load((signals + src * 8).to(tl.pointer_type(tl.int64)), mask=src < num_ranks, other=0)
        posted = (src < num_ranks) & (signalled == epoch)  # (acquired above, by each row's program)
        live = posted[:, None] & (src[None, :] < num_ranks)
        sends = tl.load(table_ptr + src[:, None] * meta_len + src[None, :], mask=live, other=0)  # per-rank counts
        prefix = tl.cumsum(sends, axis=0)
        tl.store(prefix_ptr + src[:, None] * num_ranks + src[None, :], prefix, mask=live)
        num_recv = tl.sum(tl.where((src[:, None] == num_ranks - 1) & (src[None, :] == rank), prefix, 0), axis=None)
        max_tokens = tl.max(tl.load(table_ptr + src * meta_len + num_tokens_at, mask=posted, other=0), axis=0)
        codes = tl.load(table_ptr + src * meta_len + abort_at, mask=posted, other=0).to(tl.int64)
        if tl.max(codes, axis=0) != 0:
            tl.store(agreement + src * 2, tl.zeros_like(codes), mask=codes != 0)
            tl.store(agreement + src * 2 + 1, codes, mask=codes != 0)  # the abort field of word 1
            tl.store(agreement + num_ranks * 2, CALL_DISPATCH)  # this rank's own pair: a dispatch
            tl.store(agreement - (num_ranks + 2), 1)  # the mailbox's "pending" word
        tl.store(notify + 1, num_recv.to(tl.int64))
        tl.store(notify + 2, max_tokens.to(tl.int64))
        num_local = num_experts // num_ranks
        for first in range(0, num_local, BLOCK_E):  # entries each local expert receives, aligned
            e = first + tl.arange(0, BLOCK_E)
            totals, aligned = expert_receive_counts(table_ptr + num_ranks + rank * num_local, meta_len, e, num_local,
                                                    num_ranks, expert_alignment)
            tl.store(notify + 3 + e, aligned.to(tl.int64), mask=e < num_local)
        tl.debug_barrier()  # all mailbox words precede the sequence number
        store_release_sys(notify.to(tl.int64), sequence)  # RELEASE -> host


NOTIFY = KernelSpec(ml_notify_dispatch, **FAR_LIBRARY)


# ====================================================================== hop 1: send
# ml_dispatch_send, protocol:
#
# Program (c * parts + part, y): slice `part` of the rows of channel c for node
# n = peer_after(y, node, N) (rows [lo, hi) of this rank's block there; the nodes in turn from
# the one after this rank's, so the ranks of a rail start on N different forwarders instead of
# all on node 0's, and this node's own block, a local copy, comes last), packed (x, scales,
# top-k, source index, in-node mask) and delivered to the forwarder (n, local). Another node:
# packed into this rank's send area, then put — one far_deliver when the channel is one program
# (the rows land before it SETs the forwarder's signal [this node][c] to epoch); with several,
# each program puts its slice and completes it (quiet) before it arrives, and the last to arrive
# SETs the signal, so the signal still follows every byte. The forwarder's node peers ACQUIRE
# that word before reading the rows (ml_dispatch_forward). This node: this rank is the
# forwarder; the rows go straight into its receive area and the program (the last to arrive)
# RELEASEs the signal itself (st.release.sys after a CTA barrier / the arrival's acq_rel: the
# same hand-off). A forwarder on another node whose workspace is mapped here (p2p: NVLink) is
# written the same way, through the mapping: no staging copy, no put.
@triton.jit
def ml_dispatch_send(failed_ptr: "*i64",  # int64 state word CALL_FAILED (gpu/sync.py call_failed)
                     # [R] int64: each rank's workspace mapped here (0: not mapped, another host)
                     peer_bases_ptr: "*i64",
                     # the call's tensors, and its routing (ml_dispatch_send_layout, the count exchange)
                     x_ptr: "*i8",  # [T, x_words] int64 words of x (bf16 or e4m3 bytes)
                     scales_ptr: "*fp32", scale_stride_t: "i64", scale_stride_c: "i64",  # [T, S] float32 (HAS_SCALES)
                     topk_ptr: "*i64", weights_ptr: "*fp32",  # [T, K] int64 / float32 (HAS_TOPK)
                     node_tokens_ptr: "*i32",  # [N, T] int32: row n = the tokens going to node n, ascending
                     masks_ptr: "*i32",  # [T, N] int32: in-node masks (hierarchy.in_node_masks)
                     # out [T, N] int32: token t's row in its block for node n (combine.py reads it)
                     node_row_ptr: "*i32",
                     meta_ptr: "*i32",  # [R, meta_len] int32: every rank's count row of this call
                     # int64 addresses of this half (symmetric memory)
                     send_area: "i64", recv_area: "i64", signals: "i64",
                     # the call's epoch, this rank, sizes
                     epoch: "i64", rank: "i32", num_ranks: "i32", ranks_per_node: "i32", num_tokens: "i32",
                     x_words: "i32", num_scales: "i32", num_topk: "i32",
                     # the packed row (rows.RowLayout), the send area's capacity, the count row (rows.MetaRow)
                     row_bytes: "i32", scales_at: "i32", ids_at: "i32", weights_at: "i32", src_at: "i32",
                     mask_at: "i32", send_cap: "i32", meta_len: "i32", per_node_at: "i32",
                     rdma_prefix_at: "i32", num_channels: "i32",
                     # how the sends are split and reach the forwarders
                     parts: "i32",  # programs per (channel, node): each packs and puts a slice of the rows
                     p2p: "i32",  # 1: store straight into a forwarder whose workspace is mapped here (peer_reach)
                     part_counters_ptr: "*i64",  # [MAX_CHANNELS * N] int64 local, zero between calls (parts > 1)
                     # meta-parameters
                     REMOTE: tl.constexpr, HAS_SCALES: tl.constexpr, HAS_TOPK: tl.constexpr, BLOCK_R: tl.constexpr,
                     BLOCK_W: tl.constexpr, S_P2: tl.constexpr, K_P2: tl.constexpr):
    if call_failed(failed_ptr, epoch):  # this call's step barrier found another call or a late rank
        return
    pid = tl.program_id(0)
    c = pid // parts
    part = pid % parts
    node = rank // ranks_per_node
    local = rank % ranks_per_node
    n = peer_after(tl.program_id(1), node, num_ranks // ranks_per_node)  # destination node
    lo, hi = channel_range(meta_ptr + rank * meta_len + rdma_prefix_at + n * num_channels, c)
    slice_lo, slice_hi = part_rows(lo, hi, part, parts)
    block_start = node_block_start(meta_ptr, meta_len, per_node_at, node, n, local, ranks_per_node)
    forwarder = n * ranks_per_node + local
    direct, shift = peer_reach(forwarder, rank, p2p, peer_bases_ptr)
    # row r of the block: at the forwarder (direct) or in the send area (put later)
    base = tl.where(direct, recv_area + shift + block_start.to(tl.int64) * row_bytes,
                    send_area + (n * send_cap).to(tl.int64) * row_bytes)
    for first in range(slice_lo, slice_hi, BLOCK_R):
        rows = first + tl.arange(0, BLOCK_R)
        live = rows < slice_hi
        tokens = tl.load(node_tokens_ptr + n * num_tokens + rows, mask=live, other=0).to(tl.int64)
        row = base + rows.to(tl.int64) * row_bytes
        copy_rows(x_ptr.to(tl.pointer_type(tl.int64), bitcast=True) + tokens * x_words, word_ptr(row, False), live,
                  x_words, BLOCK_W)
        if HAS_SCALES:
            s = tl.arange(0, S_P2)
            m = live[:, None] & (s < num_scales)[None, :]
            values = tl.load(scales_ptr + tokens[:, None] * scale_stride_t + s[None, :] * scale_stride_c, mask=m)
            tl.store((row + scales_at).to(tl.pointer_type(tl.float32))[:, None] + s[None, :], values, mask=m)
        if HAS_TOPK:
            k = tl.arange(0, K_P2)
            m = live[:, None] & (k < num_topk)[None, :]
            tl.store((row + ids_at).to(tl.pointer_type(tl.int64))[:, None] + k[None, :],
                     tl.load(topk_ptr + tokens[:, None] * num_topk + k[None, :], mask=m), mask=m)
            tl.store((row + weights_at).to(tl.pointer_type(tl.float32))[:, None] + k[None, :],
                     tl.load(weights_ptr + tokens[:, None] * num_topk + k[None, :], mask=m), mask=m)
        tl.store((row + src_at).to(tl.pointer_type(tl.int32)), tokens.to(tl.int32), mask=live)
        tl.store((row + mask_at).to(tl.pointer_type(tl.int32)),
                 tl.load(masks_ptr + tokens * (num_ranks // ranks_per_node) + n, mask=live, other=0), mask=live)
        tl.store(node_row_ptr + tokens * (num_ranks // ranks_per_node) + n, rows, mask=live)
    tl.debug_barrier()  # every thread's row stores precede the release / the put
    # RELEASE: the packed rows -> the forwarder's ml_dispatch_forward, which acquires signal [node][c]
    hand_off(recv_area + block_start.to(tl.int64) * row_bytes, send_area + (n * send_cap).to(tl.int64) * row_bytes,
              row_bytes, lo, hi, slice_lo, slice_hi, direct, shift, signals + (node * SIGNAL_STRIDE + c).to(tl.int64) * 8,
              epoch, forwarder, parts, part_counters_ptr + c * (num_ranks // ranks_per_node) + n, peer_bases_ptr, rank,
              REMOTE)


SEND = KernelSpec(ml_dispatch_send, **FAR_LIBRARY)


# ====================================================================== hop 2: forward
# ml_dispatch_forward, protocol:
#
# Program (s, c) at destination d = (node, j): the rows of source s = (m, l), channel c, that
# d needs. They sit in block m of forwarder f = (node, l) — put there by s over the network,
# or stored by s itself when m == node. ACQUIRE f's signal [m][c] over NVLink (bounded: a
# timeout is flagged for s in the host mailbox and nothing moves), then scan the channel's
# rows, keep those whose in-node mask has bit j, and copy them to recv_x from row
# rank_prefix_matrix[s - 1][d] + (s's rows for d in channels before c), in block order (on a
# timeout those rows are NaN instead: no plausible data):
# exactly the one-level dispatch's order (hierarchy.py). For the combine (combine.py) each
# received row keeps its row in the forwarder's area, and the forwarder (j == l) keeps the
# in-node mask of each row of its own area. Which program takes which s (channels.hop2_program):
# node by node, and within a node the forwarders from the one after d, so the node's ranks load
# from k different forwarders at once; the rows each (s, c) writes do not depend on it.
@triton.jit
def ml_dispatch_forward(failed_ptr: "*i64",  # int64 state word CALL_FAILED (gpu/sync.py call_failed)
                        peer_bases_ptr: "*i64",  # [R] int64: each rank's symmetric base over NVLink (this node's ranks)
                        # bytes from a base to this half's receive area / signals
                        area_offset: "i64", signals_offset: "i64",
                        # the count exchange's results in, the received rows out
                        meta_ptr: "*i32",  # [R, meta_len] int32: every rank's count row of this call
                        prefix_ptr: "*i32",  # [R, R] int32 rank_prefix_matrix (the count exchange)
                        recv_x_ptr: "*i8",  # [num_recv, x_words] int64 words
                        recv_scales_ptr: "*fp32",  # [num_recv, S] float32 (HAS_SCALES)
                        # [num_recv, K] int64 local ids / float32 (HAS_TOPK)
                        recv_topk_ptr: "*i64", recv_weights_ptr: "*fp32",
                        recv_src_ptr: "*i32",  # [num_recv] int32 source token index
                        # out [num_recv] int32: each row's row in its forwarder's receive area
                        recv_area_row_ptr: "*i32",
                        # out [area rows] int32: the in-node mask of each row of this rank's area
                        area_masks_ptr: "*i32",
                        # the host's timeout words, the call's epoch, this rank, sizes
                        timeouts_ptr: "*i64",  # the host mailbox's timeout words (sync.mailbox_words)
                        epoch: "i64", timeout_ns: "i64", rank: "i32", num_ranks: "i32", ranks_per_node: "i32",
                        x_words: "i32", num_scales: "i32", num_topk: "i32",
                        # the packed row (rows.RowLayout) and the count row (rows.MetaRow)
                        num_local_experts: "i32", row_bytes: "i32", scales_at: "i32", ids_at: "i32", weights_at: "i32",
                        src_at: "i32", mask_at: "i32", meta_len: "i32",
                        per_node_at: "i32", gbl_prefix_at: "i32", rdma_prefix_at: "i32", num_channels: "i32",
                        num_out_rows: "i32",  # rows of the outputs (num_worst_tokens: rows past it are not written)
                        # meta-parameters
                        HAS_SCALES: tl.constexpr, HAS_TOPK: tl.constexpr, BLOCK_R: tl.constexpr,
                        BLOCK_W: tl.constexpr, S_P2: tl.constexpr, K_P2: tl.constexpr):
    # A call whose step barrier found another call or a late rank moves nothing (step.py); its rows
    # are NaN, as are those of a source whose signal never came (the host raises: no plausible data).
    # (A full dispatch never gets here then: its host count wait raises first.)
    going = call_failed(failed_ptr, epoch) == 0
    s, c, j, m, base = hop2_program(peer_bases_ptr, rank, ranks_per_node)
    node = rank // ranks_per_node
    signal_word = base + signals_offset + (m * SIGNAL_STRIDE + c).to(tl.int64) * 8
    start = now_ns()
    seen = load_acquire_sys(signal_word)
    while going & (seen < epoch) & (now_ns() - start < timeout_ns):
        seen = load_acquire_sys(signal_word)  # ACQUIRE: the rows of block m, channel c
    tl.debug_barrier()  # the polling thread's acquire precedes every thread's row loads
    meta_s = meta_ptr + s * meta_len  # (the handle's count table in a cached dispatch: this rank's own)
    out, out_end = channel_range(meta_s + gbl_prefix_at + rank * num_channels, c)
    first_out = tl.load(prefix_ptr + (s - 1) * num_ranks + rank, mask=s > 0, other=0)
    out += first_out
    if going == 0 or seen < epoch:
        if going:
            tl.store(timeouts_ptr + s, 1)
            tl.store(timeouts_ptr - 1, 1)  # the mailbox's "pending" word
        # the rows (s, c) would have filled are missing: NaN in x (bf16, or e4m3 with scales), scales, weights
        missing = tl.maximum(tl.minimum(first_out + out_end, num_out_rows) - out, 0)
        fill_rows(recv_x_ptr.to(tl.pointer_type(tl.int64), bitcast=True) + out.to(tl.int64) * x_words, missing,
                  x_words, NAN_E4M3_WORD if HAS_SCALES else NAN_BF16_WORD, 0, 1, BLOCK_R, BLOCK_W)
        if HAS_SCALES:
            fill_nan(recv_scales_ptr + out.to(tl.int64) * num_scales, missing * num_scales, 0, 1, S_P2)
        if HAS_TOPK:
            fill_nan(recv_weights_ptr + out.to(tl.int64) * num_topk, missing * num_topk, 0, 1, K_P2)
    else:
        lo, hi = channel_range(meta_s + rdma_prefix_at + node * num_channels, c)
        block_start = node_block_start(meta_ptr, meta_len, per_node_at, m, node, s % ranks_per_node, ranks_per_node)
        area = base + area_offset + block_start.to(tl.int64) * row_bytes
        running = out
        for first in range(lo, hi, BLOCK_R):
            rows = first + tl.arange(0, BLOCK_R)
            row = area + rows.to(tl.int64) * row_bytes
            mask = tl.load((row + mask_at).to(tl.pointer_type(tl.int32)), mask=rows < hi, other=0)
            take = (rows < hi) & (((mask >> j) & 1) != 0)
            dest = (running + tl.cumsum(take.to(tl.int32), axis=0) - 1).to(tl.int64)
            running += tl.sum(take.to(tl.int32), axis=0)
            take &= dest < num_out_rows
            copy_rows(word_ptr(row, False), recv_x_ptr.to(tl.pointer_type(tl.int64), bitcast=True) + dest * x_words,
                      take, x_words, BLOCK_W)
            if HAS_SCALES:
                sc = tl.arange(0, S_P2)
                mk = take[:, None] & (sc < num_scales)[None, :]
                values = tl.load((row + scales_at).to(tl.pointer_type(tl.float32))[:, None] + sc[None, :], mask=mk)
                tl.store(recv_scales_ptr + dest[:, None] * num_scales + sc[None, :], values, mask=mk)
            if HAS_TOPK:
                k = tl.arange(0, K_P2)
                mk = take[:, None] & (k < num_topk)[None, :]
                ids = tl.load((row + ids_at).to(tl.pointer_type(tl.int64))[:, None] + k[None, :], mask=mk, other=-1)
                weights = tl.load((row + weights_at).to(tl.pointer_type(tl.float32))[:, None] + k[None, :], mask=mk,
                                  other=0.0)
                local_ids = ids - rank * num_local_experts
                mine = (ids >= 0) & (local_ids >= 0) & (local_ids < num_local_experts)
                tl.store(recv_topk_ptr + dest[:, None] * num_topk + k[None, :], tl.where(mine, local_ids, -1), mask=mk)
                tl.store(recv_weights_ptr + dest[:, None] * num_topk + k[None, :], tl.where(mine, weights, 0.0),
                         mask=mk)
            tl.store(recv_src_ptr + dest, tl.load((row + src_at).to(tl.pointer_type(tl.int32)), mask=take), mask=take)
            tl.store(recv_area_row_ptr + dest, block_start + rows, mask=take)
            if j == s % ranks_per_node:  # this rank is the forwarder of these rows
                tl.store(area_masks_ptr + block_start + rows, mask, mask=rows < hi)


FORWARD = KernelSpec(ml_dispatch_forward)
