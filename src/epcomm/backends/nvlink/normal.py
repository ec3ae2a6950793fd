"""Normal mode (training, prefill) on NVLink: layout, dispatch and combine kernels and their launches.

Launches per call (one cross-rank barrier per launch pair, halves alternate by barrier epoch)::

    get_dispatch_layout   ep_dispatch_layout                          1 launch
    dispatch (full)       ep_notify_dispatch ; ep_dispatch_stage ; [host polls the mailbox] ; ep_dispatch_pull
    dispatch (cached)     ep_dispatch_stage ; ep_dispatch_pull        2 launches
    combine               ep_combine_push ; ep_combine_reduce         2 launches
    (a batch larger than one half of the payload area repeats stage/pull or push/reduce per round)

Dispatch is "stage and pull": each rank copies its tokens (x, scales, top-k) into its own
workspace half at HBM speed and writes, for each destination, the ascending list of tokens it
sends there; then every receiver pulls its rows straight from the sources into ``recv_x``, at
rank-prefix offsets (rows grouped by source in rank order, source token order within). Combine is
"push and reduce": each rank stores every received row into slot ``(token, own rank)`` of the
token's home, and the home sums the slots present in ``is_token_in_rank`` in float32.

Ordering follows the contract in :mod:`.sync`: every kernel that writes for peers ends with an
arrival and a release of the next epoch; every kernel that reads peers' data begins with the
acquire-wait. The host never synchronises the stream: the one host wait of a full dispatch polls
the mailbox word the notify kernel publishes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from ...errors import EPInputError
from ...handle import DispatchHandle
from ...expert_major import ExpertMajor
from ..base import DispatchArgs, DispatchResult
from . import sync
from . import agreement
from .copy import copy_rows, copy_rows_to_each, for_word_copies, is_aligned, multiple, ptr_at, word_ptr
from .launch import KernelSpec, Specialisations, current_stream
from .workspace import FP_NORMAL
from .sync import (arrive, check_fingerprints, fingerprint_half, fingerprints_settled, mailbox_words, post_fingerprint,
                   post_fingerprint_to_peers, report_dropped, signal_peers, store_release_sys, wait_peers)

# Copy tiles: remote loads take microseconds, so each program keeps many bytes in flight.
COPY_TILE_WORDS = 16384
COPY_WARPS = 16
LAYOUT_BLOCK_T = 128  # tokens per program of the layout kernel
POSITION_TOKENS = 32  # tokens per program of the expert-major positions (_expert_positions)
POSITION_HIST_ENTRIES = tl.constexpr(4096)  # top-k entries per histogram step of _expert_positions
POSITION_ELEMENTS = 16384  # the positions' [SUB, K, E] one-hot tile: SUB = this // (K * E), at least 1
# The expert-major pull and fold store (read) each row once per local entry of its token — about
# K * L / E times the plain layout's local bytes — so they run on this many times Config.num_sms
# programs (bounded by the device's SMs): with num_sms programs alone the local stores, not NVLink,
# would set their speed.
EXPERT_MAJOR_SM_FACTOR = 6
EXPERT_MAJOR_BLOCK_W = 1024  # words per row chunk of the expert-major pull (2048 spills registers)
FOLD_COLUMNS = tl.constexpr(512)  # bf16 columns per chunk of the expert-major fold (_fold_expert_major)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def p2(n: int) -> int:
    """Next power of two >= n (>= 1). Not triton.next_power_of_2: that one costs ~3 µs per call."""
    return 1 << (max(int(n), 1) - 1).bit_length()


def copy_block_shape(row_words: int) -> Tuple[int, int]:
    """(BLOCK_R, BLOCK_W) for rows of ``row_words`` 8-byte words: whole rows per step when they fit."""
    block_w = min(p2(row_words), COPY_TILE_WORDS)
    return max(COPY_TILE_WORDS // block_w, 1), block_w


# ====================================================================== get_dispatch_layout
@triton.jit
def ep_dispatch_layout(topk_ptr,  # [T, K] int64 global expert ids (-1 = none)
                       per_rank_ptr,  # out [R] int32: tokens sent to each rank
                       per_expert_ptr,  # out [E] int32: tokens choosing each expert
                       in_rank_ptr,  # out [T, R] int8 (bool): token t goes to rank j
                       partial_ptr,  # scratch [programs, E_P2 + R_P2] int32: each program's counts
                       state_ptr,  # [16] int64 local (arrival counter)
                       mailbox_address,  # host mailbox (sync.py): count of ids outside [-1, E)
                       num_tokens, num_topk, num_experts, num_ranks, experts_per_rank,
                       BLOCK_T: tl.constexpr, E_P2: tl.constexpr, K_P2: tl.constexpr, R_P2: tl.constexpr,
                       SUM_ROWS: tl.constexpr):
    # Program p takes tokens [p * BLOCK_T, (p + 1) * BLOCK_T): a histogram of their expert ids,
    # their rank membership (written straight into is_token_in_rank) and its per-rank sum go to
    # scratch row p. The program arriving last sums the rows into the outputs, so one launch
    # needs neither atomics on the outputs nor a zeroing launch. Ids outside [-1, E) count nowhere
    # and are reported to the host mailbox.
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    tokens = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    ks = tl.arange(0, K_P2)
    in_t = tokens < num_tokens
    ids = tl.load(topk_ptr + tokens[:, None].to(tl.int64) * num_topk + ks[None, :],
                  mask=in_t[:, None] & (ks[None, :] < num_topk), other=-1)
    valid = (ids >= 0) & (ids < num_experts)
    experts = tl.histogram(tl.reshape(tl.where(valid, ids, 0).to(tl.int32), [BLOCK_T * K_P2]), E_P2,
                           mask=tl.reshape(valid, [BLOCK_T * K_P2]))
    ranks = tl.arange(0, R_P2)
    owner = tl.where(valid, ids // experts_per_rank, -1)
    member = tl.max((owner[:, :, None] == ranks[None, None, :]).to(tl.int32), axis=1)  # [BLOCK_T, R_P2]
    tl.store(in_rank_ptr + tokens[:, None].to(tl.int64) * num_ranks + ranks[None, :], member.to(tl.int8),
             mask=in_t[:, None] & (ranks[None, :] < num_ranks))
    row = partial_ptr + pid.to(tl.int64) * (E_P2 + R_P2)
    tl.store(row + tl.arange(0, E_P2), experts)
    tl.store(row + E_P2 + ranks, tl.sum(member, axis=0))
    dropped = tl.sum(((ids < -1) | (ids >= num_experts)).to(tl.int32), axis=None)
    if dropped > 0:
        report_dropped(mailbox_address, num_ranks, dropped)
    if arrive(state_ptr + sync.ARRIVE_LAYOUT, num_programs):
        cols = tl.arange(0, E_P2)
        expert_total = tl.zeros([E_P2], tl.int32)
        rank_total = tl.zeros([R_P2], tl.int32)
        for first in range(0, num_programs, SUM_ROWS):
            rows = first + tl.arange(0, SUM_ROWS)
            starts = partial_ptr + rows[:, None].to(tl.int64) * (E_P2 + R_P2)
            live = (rows < num_programs)[:, None]
            expert_total += tl.sum(tl.load(starts + cols[None, :], mask=live, other=0), axis=0)
            rank_total += tl.sum(tl.load(starts + E_P2 + ranks[None, :], mask=live, other=0), axis=0)
        tl.store(per_expert_ptr + cols, expert_total, mask=cols < num_experts)
        tl.store(per_rank_ptr + ranks, rank_total, mask=ranks < num_ranks)


LAYOUT = KernelSpec(ep_dispatch_layout, ["*i64", "*i32", "*i32", "*i8", "*i32", "*i64", "i64", "i32", "i32", "i32",
                                         "i32", "i32"])


# ====================================================================== notify (count exchange)
@triton.jit
def expert_receive_counts(first_count_ptr, row_len, local, num_local, num_ranks, expert_alignment):
    """Entries the local experts ``local`` ([BLOCK] ids) receive, summed over the ranks' count rows
    (``first_count_ptr``: rank 0's count of local expert 0; rows ``row_len`` words apart), and
    those totals rounded up to ``expert_alignment``: ``(total, aligned)``."""
    total = tl.zeros(local.shape, tl.int32)
    for i in range(0, num_ranks):
        total += tl.load(first_count_ptr + i * row_len + local, mask=local < num_local, other=0)
    return total, (total + expert_alignment - 1) // expert_alignment * expert_alignment


@triton.jit
def ep_notify_dispatch(normal_bases_ptr,  # [R] int64: each rank's workspace base (offsets below are from it)
              flag_bases_ptr,  # [R] int64: each rank's flag region
              state_ptr,  # [16] int64 local: epochs and arrival counters (sync.py)
              per_rank_ptr, per_expert_ptr,  # this rank's [R] / [E] int32 send counts
              prefix_ptr,  # out [R, R] int32 rank_prefix_matrix
              recv_info_ptr,  # out [2] int32 (device): rows received, most tokens any rank sends
              table_ptr,  # out [R + 2, L] int32 (write_table): the expert-major group table, below
              mailbox_address,  # host mailbox (sync.py)
              num_tokens, num_experts, rank, num_ranks, half_bytes, counts_offset, timeout_ns, sequence,
              expert_alignment, fp_offset, fp0, fp1, write_table,
              R_P2: tl.constexpr, BLOCK: tl.constexpr):
    # Program p: write this rank's count row (per-rank counts, per-expert counts, token count)
    # into row `rank` of peer p's count matrix (half = epoch % 2), and the call's fingerprint into
    # p's fingerprint row; RELEASE the epoch into p's flag; ACQUIRE p's flag here and check p's
    # fingerprint. The program arriving last then owns the complete matrix: it writes
    # rank_prefix_matrix, the receive sizes (device words and host mailbox) and, last, the mailbox
    # sequence number with a release — the host polls that word, then raises any disagreement.
    # With write_table, also the expert-major layout's group table for local expert e: row i < R
    # the first row of source i's entries (group start + entries of lower sources), row R the end
    # of the group's entries, row R + 1 the end of its padding (groups padded to expert_alignment).
    peer = tl.program_id(0)
    epoch = tl.load(state_ptr + sync.EPOCH_NORMAL) + 1
    half_offset = (epoch % 2) * half_bytes + counts_offset
    row_len = num_ranks + num_experts + 1
    dst = (tl.load(normal_bases_ptr + peer) + half_offset).to(tl.pointer_type(tl.int32)) + rank * row_len
    for start in range(0, row_len, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        value = tl.load(per_rank_ptr + offs, mask=offs < num_ranks, other=0)
        value += tl.load(per_expert_ptr + offs - num_ranks, mask=(offs >= num_ranks) & (offs < row_len - 1), other=0)
        value = tl.where(offs == row_len - 1, num_tokens, value)
        tl.store(dst + offs, value, mask=offs < row_len)
    peers = tl.arange(0, R_P2)
    one_peer = peers == peer
    fp_rows = fingerprint_half(fp_offset, epoch % 2, num_ranks)  # this signal's half of the set
    post_fingerprint(tl.load(flag_bases_ptr + peers, mask=one_peer, other=0) + fp_rows, rank, one_peer, fp0, fp1,
                     epoch)  # (ends with a CTA barrier: every thread's row stores precede the release)
    peer_flag = (tl.load(flag_bases_ptr + peer) + (sync.FLAGS_NORMAL * num_ranks + rank) * 8).to(tl.pointer_type(tl.int64))
    tl.atomic_xchg(peer_flag, epoch, sem="release", scope="sys")  # RELEASE: row, fingerprint -> peer
    # ACQUIRE: peer p's row in this rank's matrix (a timeout is flagged in the mailbox)
    my_base = tl.load(flag_bases_ptr + rank)
    my_flags = (my_base + sync.FLAGS_NORMAL * num_ranks * 8).to(tl.pointer_type(tl.int64))
    timeouts, _, agreement, notify = mailbox_words(mailbox_address, num_ranks)
    settled = fingerprints_settled(my_base + fp_rows, peers, one_peer, fp0, fp1, epoch)
    wait_peers(my_flags, num_ranks, tl.where(one_peer, epoch, 0), state_ptr, timeouts, timeout_ns,
               HAS_MASK=False, MASK_ON_TIMEOUT=False, R_P2=R_P2)
    check_fingerprints(my_base + fp_rows, peers, one_peer, settled, fp0, fp1, epoch, agreement, num_ranks)
    if arrive(state_ptr + sync.ARRIVE_NOTIFY, num_ranks):
        tl.store(state_ptr + sync.EPOCH_NORMAL, epoch)
        counts = (tl.load(normal_bases_ptr + rank) + half_offset).to(tl.pointer_type(tl.int32))
        src = tl.arange(0, R_P2)
        dst_r = tl.arange(0, R_P2)
        live = (src[:, None] < num_ranks) & (dst_r[None, :] < num_ranks)
        sends = tl.load(counts + src[:, None] * row_len + dst_r[None, :], mask=live, other=0)
        prefix = tl.cumsum(sends, axis=0)
        tl.store(prefix_ptr + src[:, None] * num_ranks + dst_r[None, :], prefix, mask=live)
        num_recv = tl.sum(tl.where((src[:, None] == num_ranks - 1) & (dst_r[None, :] == rank), prefix, 0), axis=None)
        max_tokens = tl.max(tl.load(counts + src * row_len + row_len - 1, mask=src < num_ranks, other=0), axis=0)
        tl.store(recv_info_ptr, num_recv)
        tl.store(recv_info_ptr + 1, max_tokens)
        num_local = num_experts // num_ranks
        group_start = 0  # of the expert-major groups
        for start in range(0, num_local, BLOCK):
            local = start + tl.arange(0, BLOCK)
            total, aligned = expert_receive_counts(counts + num_ranks + rank * num_local, row_len, local, num_local,
                                                   num_ranks, expert_alignment)
            tl.store(notify + 3 + local, aligned.to(tl.int64), mask=local < num_local)
            if write_table != 0:
                first = group_start + tl.cumsum(aligned, axis=0) - aligned
                for i in range(0, num_ranks):
                    tl.store(table_ptr + i * num_local + local, first, mask=local < num_local)
                    first += tl.load(counts + i * row_len + num_ranks + rank * num_local + local,
                                     mask=local < num_local, other=0)
                tl.store(table_ptr + num_ranks * num_local + local, first, mask=local < num_local)
                tl.store(table_ptr + (num_ranks + 1) * num_local + local, first - total + aligned,
                         mask=local < num_local)
                group_start += tl.sum(tl.where(local < num_local, aligned, 0), axis=0)
        tl.store(notify + 1, num_recv.to(tl.int64))
        tl.store(notify + 2, max_tokens.to(tl.int64))
        tl.debug_barrier()  # all mailbox words precede the sequence number
        store_release_sys(notify.to(tl.int64), sequence)  # RELEASE -> host


NOTIFY = KernelSpec(ep_notify_dispatch, ["*i64", "*i64", "*i64", "*i32", "*i32", "*i32", "*i32", "*i32", "i64",
                                "i32", "i32", "i32", "i32", "i64", "i64", "i64", "i64", "i32", "i64", "i64", "i64",
                                "i32"])


# ====================================================================== dispatch: stage
@triton.jit
def _expert_positions(topk_ptr, pos_address, pos_row_bytes, first, last, token_lo, num_topk, num_experts,
                      HIST_T: tl.constexpr, SUB: tl.constexpr, K_P2: tl.constexpr, E_P2: tl.constexpr):
    """For the entries (t, k) of tokens [first, last): the number of entries with the same expert
    before it in (token, k) order over this rank's batch — its place among the rows this rank sends
    that expert (the receiver adds the rows of lower ranks and the groups before: expert-major
    layout). Stored as int32 ``[K]`` at ``pos_address + (t - token_lo) * pos_row_bytes``.

        running[e] = entries of e in tokens [0, first)            (histograms, HIST_T tokens a step)
        for each SUB tokens:  hit[t, k, e] = (id[t, k] == e)
            before[t, e] = running[e] + entries of e in earlier tokens of the step   (cumsum over t)
            pos[t, k]    = before[t, id[t, k]] + #{k' < k : id[t, k'] == id[t, k]}
    """
    ks = tl.arange(0, K_P2)
    experts = tl.arange(0, E_P2)
    running = tl.zeros([E_P2], tl.int32)
    for start in range(0, first, HIST_T):
        t = start + tl.arange(0, HIST_T)
        ids = tl.load(topk_ptr + t[:, None].to(tl.int64) * num_topk + ks[None, :],
                      mask=(t < first)[:, None] & (ks < num_topk)[None, :], other=-1)
        valid = (ids >= 0) & (ids < num_experts)
        running += tl.histogram(tl.reshape(tl.where(valid, ids, 0).to(tl.int32), [HIST_T * K_P2]), E_P2,
                                mask=tl.reshape(valid, [HIST_T * K_P2]))
    for start in range(first, last, SUB):
        t = start + tl.arange(0, SUB)
        live = (t < last)[:, None] & (ks < num_topk)[None, :]
        ids = tl.load(topk_ptr + t[:, None].to(tl.int64) * num_topk + ks[None, :], mask=live, other=-1)
        ids = tl.where((ids >= 0) & (ids < num_experts), ids, -1).to(tl.int32)
        hit = ids[:, :, None] == experts[None, None, :]  # [SUB, K_P2, E_P2]
        per_token = tl.sum(hit.to(tl.int32), axis=1)  # [SUB, E_P2]
        before = running[None, :] + tl.cumsum(per_token, axis=0) - per_token
        pos = tl.sum(tl.where(hit, before[:, None, :], 0), axis=2)  # [SUB, K_P2]
        same = (ids[:, :, None] == ids[:, None, :]) & (ks[None, None, :] < ks[None, :, None])
        pos += tl.sum(same.to(tl.int32), axis=2)
        running += tl.sum(per_token, axis=0)
        rows = pos_address + (t - token_lo).to(tl.int64) * pos_row_bytes
        tl.store(rows.to(tl.pointer_type(tl.int32))[:, None] + ks[None, :], pos, mask=live & (ids >= 0))


@triton.jit
def ep_dispatch_stage(x_ptr,  # [T, x_bytes] bytes of x (bf16 or e4m3), rows 8-byte aligned
                      scales_ptr, scale_stride_t, scale_stride_c,  # [T, S] float32, any strides (FP8)
                      topk_ptr, weights_ptr,  # [T, K] int64 / float32 (full dispatch with top-k)
                      in_rank_ptr,  # [T, R] int8: is_token_in_rank (token lists)
                      per_rank_ptr, per_expert_ptr,  # [R] / [E] int32 the caller's counts (WRITE_LISTS)
                      normal_bases_ptr, flag_bases_ptr, state_ptr,
                      num_tokens, token_lo, token_hi, x_words, num_scales, num_topk, rank, num_ranks,
                      half_bytes, lists_offset, list_cap, x_offset, scales_offset, topk_offset, topk_row_bytes,
                      num_local, fp_offset, fp0, fp1, num_position_programs,
                      HAS_SCALES: tl.constexpr, HAS_TOPK: tl.constexpr, WRITE_LISTS: tl.constexpr,
                      BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr, S_P2: tl.constexpr, K_P2: tl.constexpr,
                      R_P2: tl.constexpr, LIST_BLOCK: tl.constexpr, L_P2: tl.constexpr, ALIGNED: tl.constexpr,
                      EXPERT_MAJOR: tl.constexpr, POSITION_TOKENS: tl.constexpr, POSITION_SUB: tl.constexpr,
                      E_P2: tl.constexpr):
    # Copy tokens [token_lo, token_hi) into this rank's staging half (local, HBM speed): x rows,
    # scales (row-major), and top-k rows [K int64 ids][K float32 weights]. With WRITE_LISTS the
    # first R programs write, for each destination j, the ascending list of tokens sent to j, and
    # check the caller's counts against what they summarise: the list's length against
    # num_tokens_per_rank[j], and (HAS_TOPK) the top-k entries of j's experts against
    # num_tokens_per_expert. Then arrive and RELEASE the epoch, with the call's fingerprint (its
    # abort field naming a count found wrong), to every rank: peers pull after acquiring it.
    # EXPERT_MAJOR: the next num_position_programs programs add each top-k entry's position
    # (_expert_positions) to the staged top-k rows. ALIGNED: x and its rows are 16-byte aligned (copy.py).
    pid = tl.program_id(0)
    x_words = multiple(x_words, 2, ALIGNED)
    num_programs = tl.num_programs(0)
    epoch = tl.load(state_ptr + sync.EPOCH_NORMAL) + 1
    half = tl.load(normal_bases_ptr + rank) + (epoch % 2) * half_bytes
    fp_rows = fingerprint_half(fp_offset, epoch % 2, num_ranks)
    if pid == 0:
        post_fingerprint_to_peers(flag_bases_ptr, fp_rows, rank, num_ranks, state_ptr, fp0, fp1, epoch, HAS_MASK=False,
                                  R_P2=R_P2)
    first_copy = 0
    if WRITE_LISTS:
        first_copy = num_ranks
        if pid < num_ranks:
            lists = (half + lists_offset).to(tl.pointer_type(tl.int32)) + pid.to(tl.int64) * list_cap
            running = 0
            per_expert = tl.zeros([L_P2], tl.int32)
            for start in range(0, num_tokens, LIST_BLOCK):
                tokens = start + tl.arange(0, LIST_BLOCK)
                member = tl.load(in_rank_ptr + tokens.to(tl.int64) * num_ranks + pid, mask=tokens < num_tokens,
                                 other=0) != 0
                position = running + tl.cumsum(member.to(tl.int32), axis=0) - 1
                tl.store(lists + position, tokens, mask=member)
                running += tl.sum(member.to(tl.int32), axis=0)
                if HAS_TOPK:  # the layout kernel's count: every valid entry of one of j's experts
                    k = tl.arange(0, K_P2)
                    ids = tl.load(topk_ptr + tokens[:, None].to(tl.int64) * num_topk + k[None, :],
                                  mask=(tokens < num_tokens)[:, None] & (k < num_topk)[None, :], other=-1)
                    local = ids - pid * num_local
                    mine = (ids >= 0) & (local >= 0) & (local < num_local)
                    per_expert += tl.histogram(tl.reshape(tl.where(mine, local, 0).to(tl.int32), [LIST_BLOCK * K_P2]),
                                               L_P2, mask=tl.reshape(mine, [LIST_BLOCK * K_P2]))
            if running != tl.load(per_rank_ptr + pid):
                tl.atomic_max(state_ptr + sync.COUNT_ERROR, agreement.ABORT_NUM_TOKENS_PER_RANK)
            if HAS_TOPK:
                experts = tl.arange(0, L_P2)
                given = tl.load(per_expert_ptr + pid * num_local + experts, mask=experts < num_local, other=0)
                if tl.max((given != per_expert).to(tl.int32), axis=0) != 0:
                    tl.atomic_max(state_ptr + sync.COUNT_ERROR, agreement.ABORT_NUM_TOKENS_PER_EXPERT)
    if EXPERT_MAJOR:
        first_position = first_copy
        first_copy += num_position_programs
        if (pid >= first_position) & (pid < first_copy):
            first = token_lo + (pid - first_position) * POSITION_TOKENS
            _expert_positions(topk_ptr, half + topk_offset + num_topk * 12, topk_row_bytes, first,
                              tl.minimum(first + POSITION_TOKENS, tl.minimum(token_hi, num_tokens)), token_lo,
                              num_topk, num_local * num_ranks, POSITION_HIST_ENTRIES // K_P2, POSITION_SUB, K_P2, E_P2)
    if pid >= first_copy:
        num_rows = tl.minimum(token_hi, num_tokens) - token_lo
        for block in range(pid - first_copy, tl.cdiv(num_rows, BLOCK_R), num_programs - first_copy):
            rows = block * BLOCK_R + tl.arange(0, BLOCK_R)  # staging row; token = token_lo + row
            live = rows < num_rows
            tokens = (token_lo + rows).to(tl.int64)
            src = x_ptr.to(tl.pointer_type(tl.int64), bitcast=True) + tokens * x_words
            dst = word_ptr(half + x_offset, ALIGNED) + rows.to(tl.int64) * x_words
            copy_rows(src, dst, live, x_words, BLOCK_W)
            if HAS_SCALES:
                s = tl.arange(0, S_P2)
                m = live[:, None] & (s < num_scales)[None, :]
                values = tl.load(scales_ptr + tokens[:, None] * scale_stride_t + s[None, :] * scale_stride_c, mask=m)
                sdst = (half + scales_offset).to(tl.pointer_type(tl.float32)) + rows.to(tl.int64) * num_scales
                tl.store(sdst[:, None] + s[None, :], values, mask=m)
            if HAS_TOPK:
                k = tl.arange(0, K_P2)
                m = live[:, None] & (k < num_topk)[None, :]
                ids = tl.load(topk_ptr + tokens[:, None] * num_topk + k[None, :], mask=m)
                weights = tl.load(weights_ptr + tokens[:, None] * num_topk + k[None, :], mask=m)
                row = half + topk_offset + rows.to(tl.int64) * topk_row_bytes
                tl.store(row.to(tl.pointer_type(tl.int64))[:, None] + k[None, :], ids, mask=m)
                tl.store((row + num_topk * 8).to(tl.pointer_type(tl.float32))[:, None] + k[None, :], weights, mask=m)
    if arrive(state_ptr + sync.ARRIVE_STAGE, num_programs):
        tl.store(state_ptr + sync.EPOCH_NORMAL, epoch)
        if WRITE_LISTS:  # acquired through the arrivals; posted again with the abort field set
            count_error = tl.load(state_ptr + sync.COUNT_ERROR)
            if count_error != 0:
                tl.store(state_ptr + sync.COUNT_ERROR, 0)
                post_fingerprint_to_peers(flag_bases_ptr, fp_rows, rank, num_ranks, state_ptr, fp0, fp1 | count_error,
                                          epoch, HAS_MASK=False, R_P2=R_P2)
        signal_peers(flag_bases_ptr, sync.FLAGS_NORMAL * num_ranks * 8, rank, num_ranks, epoch, state_ptr,
                     (state_ptr + sync.SPARE).to(tl.int64), HAS_MASK=False,
                     R_P2=R_P2)  # RELEASE: staged rows, lists, fingerprint -> every rank


STAGE = KernelSpec(ep_dispatch_stage, ["*i8", "*fp32", "i64", "i64", "*i64", "*fp32", "*i8", "*i32", "*i32", "*i64",
                                       "*i64", "*i64", "i32", "i32", "i32", "i32", "i32", "i32", "i32", "i32", "i64",
                                       "i64", "i64", "i64", "i64", "i64", "i64", "i32", "i64", "i64", "i64", "i32"],
                   aligned_if={"ALIGNED": ["x_ptr"]})


# ====================================================================== the receivers' wait
@triton.jit
def _acquire_and_agree(flag_bases_ptr, state_ptr, mailbox_address, epoch, rank, num_ranks, timeout_ns, fp_offset,
                       fp0, fp1, num_items, R_P2: tl.constexpr):
    """ACQUIRE every rank's signal of ``epoch`` (a timeout is flagged in the mailbox), then check
    the fingerprints they carried. Returns ``num_items``, or 0 when any rank's call differs: the
    caller then moves nothing, and the host raises (agreement.py)."""
    my_base = tl.load(flag_bases_ptr + rank)
    my_flags = (my_base + sync.FLAGS_NORMAL * num_ranks * 8).to(tl.pointer_type(tl.int64))
    timeouts, _, agreement, _ = mailbox_words(mailbox_address, num_ranks)
    peers = tl.arange(0, R_P2)
    fp_rows = my_base + fingerprint_half(fp_offset, epoch % 2, num_ranks)
    settled = fingerprints_settled(fp_rows, peers, peers < num_ranks, fp0, fp1, epoch)
    wait_peers(my_flags, num_ranks, epoch, state_ptr, timeouts, timeout_ns, HAS_MASK=False, MASK_ON_TIMEOUT=False,
               R_P2=R_P2)
    differ = check_fingerprints(fp_rows, peers, peers < num_ranks, settled, fp0, fp1, epoch, agreement, num_ranks)
    return tl.where(tl.max(differ.to(tl.int32), axis=0) == 0, num_items, 0)


# ====================================================================== dispatch: pull
@triton.jit
def ep_dispatch_pull(normal_bases_ptr, flag_bases_ptr, state_ptr,
                     prefix_ptr,  # [R, R] int32 rank_prefix_matrix (INDEX)
                     recv_info_ptr,  # [2] int32 (device): rows received (INDEX)
                     src_rank_ptr, src_idx_ptr,  # [N] int32: written with INDEX, read otherwise
                     recv_x_ptr,  # [N, x_bytes] bytes
                     recv_scales_ptr,  # [N, S] float32
                     recv_topk_ptr, recv_weights_ptr,  # [N, K] int64 local ids / float32 (expert-major: [M])
                     mailbox_address,
                     table_ptr,  # [R + 2, L] int32 (EXPERT_MAJOR): the notify's group table (ep_notify_dispatch)
                     dest_ptr,  # [N, K] int32 (EXPERT_MAJOR): each entry's expert-major row, written with HAS_TOPK
                     num_rows, rank, num_ranks, token_lo, token_hi, x_words, num_scales, num_topk, half_bytes,
                     lists_offset, list_cap, x_offset, scales_offset, topk_offset, topk_row_bytes, expert_lo,
                     num_local, timeout_ns, fp_offset, fp0, fp1, num_em_rows, zero_padding,
                     INDEX: tl.constexpr, HAS_SCALES: tl.constexpr, HAS_TOPK: tl.constexpr,
                     BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr, S_P2: tl.constexpr, K_P2: tl.constexpr,
                     R_P2: tl.constexpr, ALIGNED: tl.constexpr, EXPERT_MAJOR: tl.constexpr):
    # ACQUIRE every rank's staged rows for this epoch and check the ranks' fingerprints (on a
    # mismatch nothing moves: the host raises). Then for each received row r: its source
    # rank (from the prefix column: rows are grouped by source) and source token (read from the
    # source's token list for this rank) — with INDEX, written to the handle arrays; otherwise
    # read from them — and pull the parts of tokens in [token_lo, token_hi) from the source's
    # staging half. Top-k ids become local ids (-1 for other ranks' experts, weight 0). Rows past
    # the received total (num_worst_tokens padding) get source index -1 and top-k -1.
    # EXPERT_MAJOR: the outputs are the expert-major rows (expert_major.py): entry (r, k) of a
    # local expert e goes to row table[src][e] + its position on the source (_expert_positions) —
    # written to dest with HAS_TOPK, read from it in a cached dispatch — and each pulled row is
    # stored once per entry; with zero_padding the groups' padding rows are zeroed too.
    # ALIGNED: rows are a multiple of 16 bytes (copy.py; the buffers are aligned).
    pid = tl.program_id(0)
    x_words = multiple(x_words, 2, ALIGNED)
    num_programs = tl.num_programs(0)
    epoch = tl.load(state_ptr + sync.EPOCH_NORMAL)
    half_offset = (epoch % 2) * half_bytes
    num_rows = _acquire_and_agree(flag_bases_ptr, state_ptr, mailbox_address, epoch, rank, num_ranks, timeout_ns,
                                  fp_offset, fp0, fp1, num_rows, R_P2)  # ACQUIRE: staged rows and lists
    num_recv = num_rows
    if INDEX:
        num_recv = tl.load(recv_info_ptr)
    for block in range(pid, tl.cdiv(num_rows, BLOCK_R), num_programs):
        rows = block * BLOCK_R + tl.arange(0, BLOCK_R)
        in_out = rows < num_rows
        if INDEX:
            live = rows < num_recv
            src = tl.zeros([BLOCK_R], tl.int32)
            for i in range(0, num_ranks):
                src += (tl.load(prefix_ptr + i * num_ranks + rank) <= rows).to(tl.int32)
            src = tl.minimum(src, num_ranks - 1)
            start = tl.load(prefix_ptr + (src - 1) * num_ranks + rank, mask=live & (src > 0), other=0)
            lists = tl.load(normal_bases_ptr + src, mask=live, other=0) + half_offset + lists_offset
            entry = lists + ((rank * list_cap).to(tl.int64) + rows - start) * 4
            token = tl.load(entry.to(tl.pointer_type(tl.int32)), mask=live, other=-1)
            tl.store(src_rank_ptr + rows, tl.where(live, src, -1), mask=in_out)
            tl.store(src_idx_ptr + rows, token, mask=in_out)
        else:
            src = tl.load(src_rank_ptr + rows, mask=in_out, other=0)
            token = tl.load(src_idx_ptr + rows, mask=in_out, other=-1)
        move = in_out & (token >= token_lo) & (token < token_hi)
        staged = tl.load(normal_bases_ptr + src, mask=move, other=0) + half_offset
        srow = (token - token_lo).to(tl.int64)
        rows64 = rows.to(tl.int64)
        sx = word_ptr(staged + x_offset, ALIGNED) + srow * x_words
        if EXPERT_MAJOR:
            _pull_expert_major(staged, srow, src, rows64, move, sx, recv_x_ptr, recv_scales_ptr, recv_topk_ptr,
                               recv_weights_ptr, table_ptr, dest_ptr, x_words, num_scales, num_topk, scales_offset,
                               topk_offset, topk_row_bytes, expert_lo, num_local, num_em_rows, HAS_SCALES, HAS_TOPK,
                               BLOCK_W, S_P2, K_P2)
        else:
            dx = recv_x_ptr.to(tl.pointer_type(tl.int64), bitcast=True) + rows64 * x_words
            copy_rows(sx, dx, move, x_words, BLOCK_W)
            if HAS_SCALES:
                s = tl.arange(0, S_P2)
                m = move[:, None] & (s < num_scales)[None, :]
                ss = (staged + scales_offset).to(tl.pointer_type(tl.float32)) + srow * num_scales
                tl.store(recv_scales_ptr + rows64[:, None] * num_scales + s[None, :],
                         tl.load(ss[:, None] + s[None, :], mask=m), mask=m)
            if HAS_TOPK:
                k = tl.arange(0, K_P2)
                m = move[:, None] & (k < num_topk)[None, :]
                trow = staged + topk_offset + srow * topk_row_bytes
                ids = tl.load(trow.to(tl.pointer_type(tl.int64))[:, None] + k[None, :], mask=m, other=-1)
                weights = tl.load((trow + num_topk * 8).to(tl.pointer_type(tl.float32))[:, None] + k[None, :], mask=m,
                                  other=0.0)
                local = ids - expert_lo
                mine = (ids >= 0) & (local >= 0) & (local < num_local)
                out = rows64[:, None] * num_topk + k[None, :]
                write = (move[:, None] | (in_out & (token < 0))[:, None]) & (k < num_topk)[None, :]
                tl.store(recv_topk_ptr + out, tl.where(mine, local, -1), mask=write)
                tl.store(recv_weights_ptr + out, tl.where(mine, weights, 0.0), mask=write)
    if EXPERT_MAJOR:
        if zero_padding != 0:
            _zero_padding(table_ptr, recv_x_ptr, recv_scales_ptr, recv_topk_ptr, recv_weights_ptr, num_ranks, num_local,
                          num_em_rows, x_words, num_scales, HAS_SCALES, HAS_TOPK, BLOCK_R, BLOCK_W, S_P2)


@triton.jit
def _pull_expert_major(staged, srow, src, rows64, move, sx, recv_x_ptr, recv_scales_ptr, row_experts_ptr,
                       row_weights_ptr, table_ptr, dest_ptr, x_words, num_scales, num_topk, scales_offset, topk_offset,
                       topk_row_bytes, expert_lo, num_local, num_em_rows, HAS_SCALES: tl.constexpr,
                       HAS_TOPK: tl.constexpr, BLOCK_W: tl.constexpr, S_P2: tl.constexpr, K_P2: tl.constexpr):
    """ep_dispatch_pull's rows in the expert-major layout: each row read once from its source and
    stored to the row of each of its local entries."""
    if HAS_TOPK:  # this dispatch's rows: the source's position plus this rank's group table
        k = tl.arange(0, K_P2)
        entries = move[:, None] & (k < num_topk)[None, :]
        trow = staged + topk_offset + srow * topk_row_bytes
        ids = tl.load(trow.to(tl.pointer_type(tl.int64))[:, None] + k[None, :], mask=entries, other=-1)
        weights = tl.load((trow + num_topk * 8).to(tl.pointer_type(tl.float32))[:, None] + k[None, :], mask=entries,
                          other=0.0)
        position = tl.load((trow + num_topk * 12).to(tl.pointer_type(tl.int32))[:, None] + k[None, :], mask=entries,
                           other=0)
        local = ids - expert_lo
        mine = entries & (ids >= 0) & (local >= 0) & (local < num_local)
        dest = tl.load(table_ptr + src[:, None] * num_local + local, mask=mine, other=0) + position
        mine = mine & (dest >= 0) & (dest < num_em_rows)  # (the counts behind the table were checked on device)
        tl.store(dest_ptr + rows64[:, None] * num_topk + k[None, :], tl.where(mine, dest, -1), mask=entries)
        tl.store(row_experts_ptr + dest, local.to(tl.int64), mask=mine)
        tl.store(row_weights_ptr + dest, weights, mask=mine)
        tl.debug_barrier()  # the copies below read these rows back (CTA-wide visibility)
    # (a cached dispatch: the rows its handle's dispatch computed)
    dest_rows = dest_ptr + rows64 * num_topk
    copy_rows_to_each(sx, recv_x_ptr.to(tl.pointer_type(tl.int64), bitcast=True), dest_rows, move, num_topk, x_words,
                      BLOCK_W)
    if HAS_SCALES:
        ss = (staged + scales_offset).to(tl.pointer_type(tl.float32)) + srow * num_scales
        copy_rows_to_each(ss, recv_scales_ptr, dest_rows, move, num_topk, num_scales, S_P2)


@triton.jit
def _zero_padding(table_ptr, recv_x_ptr, recv_scales_ptr, row_experts_ptr, row_weights_ptr, num_ranks, num_local,
                  num_em_rows, x_words, num_scales, HAS_SCALES: tl.constexpr, HAS_TOPK: tl.constexpr,
                  BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr, S_P2: tl.constexpr):
    """Zero the padding rows of the expert-major groups this program owns (expert e: rows
    table[R][e] .. table[R + 1][e]); with HAS_TOPK their expert is -1 and weight 0."""
    pid = tl.program_id(0)
    x_rows = recv_x_ptr.to(tl.pointer_type(tl.int64), bitcast=True)
    cols = tl.arange(0, BLOCK_W)
    for expert in range(pid, num_local, tl.num_programs(0)):
        first = tl.maximum(tl.load(table_ptr + num_ranks * num_local + expert), 0)
        end = tl.minimum(tl.load(table_ptr + (num_ranks + 1) * num_local + expert), num_em_rows)
        for block in range(first, end, BLOCK_R):
            rows = block + tl.arange(0, BLOCK_R)
            live = rows < end
            rows64 = rows.to(tl.int64)
            for start in range(0, x_words, BLOCK_W):
                c = start + cols
                tl.store(x_rows + rows64[:, None] * x_words + c[None, :], tl.zeros([BLOCK_R, BLOCK_W], tl.int64),
                         mask=live[:, None] & (c < x_words)[None, :])
            if HAS_SCALES:
                s = tl.arange(0, S_P2)
                tl.store(recv_scales_ptr + rows64[:, None] * num_scales + s[None, :],
                         tl.zeros([BLOCK_R, S_P2], tl.float32), mask=live[:, None] & (s < num_scales)[None, :])
            if HAS_TOPK:
                tl.store(row_experts_ptr + rows64, tl.full([BLOCK_R], -1, tl.int64), mask=live)
                tl.store(row_weights_ptr + rows64, tl.zeros([BLOCK_R], tl.float32), mask=live)


PULL = KernelSpec(ep_dispatch_pull, ["*i64", "*i64", "*i64", "*i32", "*i32", "*i32", "*i32", "*i8", "*fp32", "*i64",
                                     "*fp32", "i64", "*i32", "*i32", "i32", "i32", "i32", "i32", "i32", "i32", "i32",
                                     "i32", "i64", "i64", "i64", "i64", "i64", "i64", "i64", "i32", "i32", "i64", "i64",
                                     "i64", "i64", "i32", "i32"],
                  aligned_if={"ALIGNED": ["recv_x_ptr"]})


# ====================================================================== combine: push
@triton.jit
def ep_combine_push(x_ptr,  # [N, x_bytes] bytes of the bf16 expert outputs (dispatch's row order; expert-major: [M])
                    weights_ptr,  # [N, K] float32 (HAS_WEIGHTS); expert-major: [M] float32 each row's weight
                    src_rank_ptr, src_idx_ptr,  # [N] int32: home rank and token of each row (-1 = padding)
                    dest_ptr,  # [N, K] int32 (EXPERT_MAJOR): expert-major row of entry (r, k), -1 = none
                    normal_bases_ptr, flag_bases_ptr, state_ptr,
                    num_rows, rank, num_ranks, token_lo, token_hi, x_words, num_topk, half_bytes, slots_x_offset,
                    slots_w_offset, fp_offset, fp0, fp1,
                    HAS_WEIGHTS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr, K_P2: tl.constexpr,
                    R_P2: tl.constexpr, ALIGNED: tl.constexpr, EXPERT_MAJOR: tl.constexpr):
    # Store row r into slot (token - token_lo, this rank) of its home's combine half (peer
    # stores), for tokens in [token_lo, token_hi); then arrive and RELEASE the epoch to every rank.
    # The slots are free: the home read them two barriers ago (double buffering, sync.py).
    # EXPERT_MAJOR: row r is first folded from the expert-major rows of its entries,
    # Σ_k weight · x[dest[r, k]] in float32 (expert_major.py, fold). ALIGNED: x and its rows are
    # 16-byte aligned (copy.py).
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    x_words = multiple(x_words, 2, ALIGNED)
    epoch = tl.load(state_ptr + sync.EPOCH_NORMAL) + 1
    half_offset = (epoch % 2) * half_bytes
    if pid == 0:
        post_fingerprint_to_peers(flag_bases_ptr, fingerprint_half(fp_offset, epoch % 2, num_ranks), rank, num_ranks,
                                  state_ptr, fp0, fp1, epoch, HAS_MASK=False, R_P2=R_P2)
    for block in range(pid, tl.cdiv(num_rows, BLOCK_R), num_programs):
        rows = block * BLOCK_R + tl.arange(0, BLOCK_R)
        in_out = rows < num_rows
        home = tl.load(src_rank_ptr + rows, mask=in_out, other=0)
        token = tl.load(src_idx_ptr + rows, mask=in_out, other=-1)
        move = in_out & (token >= token_lo) & (token < token_hi)
        slot = (token - token_lo).to(tl.int64) * num_ranks + rank
        base = tl.load(normal_bases_ptr + home, mask=move, other=0) + half_offset
        if EXPERT_MAJOR:
            _fold_expert_major(x_ptr.to(tl.pointer_type(tl.bfloat16), bitcast=True), weights_ptr, dest_ptr,
                               rows.to(tl.int64), move, ptr_at(base + slots_x_offset, tl.bfloat16, ALIGNED) +
                               slot * (x_words * 4), x_words * 4, num_topk, K_P2)
        else:
            sx = x_ptr.to(tl.pointer_type(tl.int64), bitcast=True) + rows.to(tl.int64) * x_words
            dx = word_ptr(base + slots_x_offset, ALIGNED) + slot * x_words
            copy_rows(sx, dx, move, x_words, BLOCK_W)
        if HAS_WEIGHTS:
            k = tl.arange(0, K_P2)
            m = move[:, None] & (k < num_topk)[None, :]
            w = tl.load(weights_ptr + rows.to(tl.int64)[:, None] * num_topk + k[None, :], mask=m)
            dw = (base + slots_w_offset).to(tl.pointer_type(tl.float32)) + slot * num_topk
            tl.store(dw[:, None] + k[None, :], w, mask=m)
    if arrive(state_ptr + sync.ARRIVE_PUSH, num_programs):
        tl.store(state_ptr + sync.EPOCH_NORMAL, epoch)
        signal_peers(flag_bases_ptr, sync.FLAGS_NORMAL * num_ranks * 8, rank, num_ranks, epoch, state_ptr,
                     (state_ptr + sync.SPARE).to(tl.int64), HAS_MASK=False,
                     R_P2=R_P2)  # RELEASE: pushed rows, fingerprint -> their homes


@triton.jit
def _fold_expert_major(y_ptr, row_weights_ptr, dest_ptr, rows64, move, dst, hidden, num_topk, K_P2: tl.constexpr):
    """dst[r] = Σ_k row_weights[d] · y[d] over d = dest[r, k] >= 0, in float32, k ascending, rounded
    to bf16 (``dst`` [BLOCK_R] bf16 row pointers; rows where ``move`` is False are skipped). The k
    loop is unrolled so that the K loads of a chunk are in flight together (narrow chunks keep
    them in registers)."""
    cols = tl.arange(0, FOLD_COLUMNS)
    for start in range(0, hidden, FOLD_COLUMNS):
        c = start + cols
        cm = c < hidden
        acc = tl.zeros([rows64.shape[0], FOLD_COLUMNS], tl.float32)
        for k in tl.static_range(K_P2):
            row = tl.load(dest_ptr + rows64 * num_topk + k, mask=move & (k < num_topk), other=-1)
            weight = tl.load(row_weights_ptr + row, mask=row >= 0, other=0.0)
            values = tl.load(y_ptr + row.to(tl.int64)[:, None] * hidden + c[None, :],
                             mask=(row >= 0)[:, None] & cm[None, :], other=0.0)
            acc += values.to(tl.float32) * weight[:, None]
        tl.store(dst[:, None] + c[None, :], acc.to(tl.bfloat16), mask=move[:, None] & cm[None, :])


PUSH = KernelSpec(ep_combine_push, ["*i8", "*fp32", "*i32", "*i32", "*i32", "*i64", "*i64", "*i64", "i32", "i32",
                                    "i32", "i32", "i32", "i32", "i32", "i64", "i64", "i64", "i64", "i64", "i64"],
                  aligned_if={"ALIGNED": ["x_ptr"]})


# ====================================================================== combine: reduce
@triton.jit
def ep_combine_reduce(in_rank_ptr,  # [T, R] int8 is_token_in_rank
                      out_ptr,  # [T, H] bf16
                      out_w_ptr,  # [T, K] float32 (HAS_WEIGHTS)
                      bias0_ptr, bias1_ptr,  # [T, H] bf16 (NUM_BIAS of them)
                      normal_bases_ptr, flag_bases_ptr, state_ptr, mailbox_address,
                      num_tokens, token_lo, token_hi, hidden, num_topk, rank, num_ranks, half_bytes,
                      slots_x_offset, slots_w_offset, timeout_ns, fp_offset, fp0, fp1,
                      NUM_BIAS: tl.constexpr, HAS_WEIGHTS: tl.constexpr, R_P2: tl.constexpr,
                      BLOCK_C: tl.constexpr, K_P2: tl.constexpr, ALIGNED: tl.constexpr):
    # ACQUIRE the rows pushed to this rank for this epoch (nothing is reduced when a rank's call
    # differs: the host raises), then for each token t of the round:
    # out[t] = Σ_j slot(t, j) over ranks j with is_token_in_rank[t, j], in float32, + biases.
    # ALIGNED: hidden % 8 == 0 and the biases are 16-byte aligned (copy.py).
    pid = tl.program_id(0)
    hidden = multiple(hidden, 8, ALIGNED)
    num_programs = tl.num_programs(0)
    epoch = tl.load(state_ptr + sync.EPOCH_NORMAL)
    token_hi = token_lo + _acquire_and_agree(flag_bases_ptr, state_ptr, mailbox_address, epoch, rank, num_ranks,
                                             timeout_ns, fp_offset, fp0, fp1, token_hi - token_lo,
                                             R_P2)  # ACQUIRE: rows pushed here
    half = tl.load(normal_bases_ptr + rank) + (epoch % 2) * half_bytes
    slots_x = ptr_at(half + slots_x_offset, tl.bfloat16, ALIGNED)
    slots_w = (half + slots_w_offset).to(tl.pointer_type(tl.float32))
    ranks = tl.arange(0, R_P2)
    cols = tl.arange(0, BLOCK_C)
    for token in range(token_lo + pid, tl.minimum(token_hi, num_tokens), num_programs):
        t64 = token.to(tl.int64)
        present = tl.load(in_rank_ptr + t64 * num_ranks + ranks, mask=ranks < num_ranks, other=0) != 0
        slot = (t64 - token_lo) * num_ranks + ranks
        for c0 in range(0, hidden, BLOCK_C):
            c = c0 + cols
            cm = c < hidden
            rows = tl.load(slots_x + slot[:, None] * hidden + c[None, :], mask=present[:, None] & cm[None, :], other=0.0)
            acc = tl.sum(rows.to(tl.float32), axis=0)
            if NUM_BIAS >= 1:
                acc += tl.load(bias0_ptr + t64 * hidden + c, mask=cm, other=0.0).to(tl.float32)
            if NUM_BIAS >= 2:
                acc += tl.load(bias1_ptr + t64 * hidden + c, mask=cm, other=0.0).to(tl.float32)
            tl.store(out_ptr + t64 * hidden + c, acc.to(tl.bfloat16), mask=cm)
        if HAS_WEIGHTS:
            k = tl.arange(0, K_P2)
            w = tl.load(slots_w + slot[:, None] * num_topk + k[None, :], mask=present[:, None] & (k < num_topk)[None, :],
                        other=0.0)
            tl.store(out_w_ptr + t64 * num_topk + k, tl.sum(w, axis=0), mask=k < num_topk)


REDUCE = KernelSpec(ep_combine_reduce, ["*i8", "*bf16", "*fp32", "*bf16", "*bf16", "*i64", "*i64", "*i64", "i64",
                                        "i32", "i32", "i32", "i32", "i32", "i32", "i32", "i64", "i64", "i64", "i64",
                                        "i64", "i64", "i64"],
                    aligned_if={"ALIGNED": ["out_ptr", "bias0_ptr", "bias1_ptr"]})


# ====================================================================== host side
@dataclass
class PullState:
    """What the nvlink backend keeps in ``DispatchHandle.backend_state``."""

    recv_src_rank: torch.Tensor  # [N] int32 source (home) rank of each received row, -1 = padding
    recv_info: torch.Tensor  # [2] int32 device: rows received, most tokens any rank sends
    max_tokens: int  # most tokens any rank sends (-1 when unknown: num_worst_tokens, one round)
    sequence: int  # the dispatch's notify sequence number: the same on every rank (fingerprints)
    expert_table: Optional[torch.Tensor] = None  # [R + 2, L] int32 expert-major group table (ep_notify_dispatch)
    # Addresses of the handle's tensors the kernels read, in this order: rank_prefix_matrix,
    # recv_info, recv_src_rank, recv_src_idx, expert table, expert-major dest, is_token_in_rank.
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
    pull_index: object  # BoundKernel: pull + receive index (round 0 of a full dispatch)
    pull: object
    fingerprint_full: Tuple[int, int]  # agreement.py: a full dispatch's words (num_experts, handle added)
    fingerprint_cached: Tuple[int, int]  # a cached dispatch's words (handle added)


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
    fingerprint: Tuple[int, int]  # agreement.py: the call's words (handle added)


class NormalMode:
    """Host orchestration of normal mode for one backend: per call, argument-derived scalars and
    2–3 bound launches; everything shape-dependent is computed once per shape (plans)."""

    def __init__(self, backend):
        self.b = backend
        ws = backend.ws
        self.ws = ws
        self.R = ws.num_ranks
        self.rank = ws.rank
        self.R_P2 = p2(self.R)
        self.dev_index = backend.device.index
        self.device = backend.device
        self.device_sms = torch.cuda.get_device_properties(backend.device).multi_processor_count
        # persistent tensors go to the launcher as plain addresses
        self.bases = ws.bases.data_ptr()
        self.state = backend.state.data_ptr()
        self.fingerprints = ws.fingerprint_set(FP_NORMAL)
        self._layout_plans = {}
        self._dispatch_plans = {}
        self._combine_plans = {}

    # ------------------------------------------------------------------ layout
    def dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int):
        R = self.R
        num_tokens, num_topk = topk_idx.shape
        key = (num_experts, num_topk)
        plan = self._layout_plans.get(key)
        if plan is None:
            e_p2 = p2(num_experts)
            kernel = LAYOUT.bind(num_warps=4, BLOCK_T=LAYOUT_BLOCK_T, E_P2=e_p2, K_P2=p2(num_topk), R_P2=self.R_P2,
                                 SUM_ROWS=min(64, p2(8192 // (e_p2 + self.R_P2) + 1) // 2))
            plan = self._layout_plans[key] = [kernel, None, e_p2, 0]
        kernel, scratch, e_p2, scratch_address = plan
        num_programs = max(1, cdiv(num_tokens, LAYOUT_BLOCK_T))
        if scratch is None or scratch.shape[0] < num_programs:
            scratch = plan[1] = torch.empty(max(num_programs, 64), e_p2 + self.R_P2, dtype=torch.int32,
                                            device=self.device)
            scratch_address = plan[3] = scratch.data_ptr()
        per_rank = torch.empty(R, dtype=torch.int32, device=self.device)
        per_expert = torch.empty(num_experts, dtype=torch.int32, device=self.device)
        in_rank = torch.empty((num_tokens, R), dtype=torch.bool, device=self.device)
        kernel.launch(num_programs, 1, current_stream(self.dev_index), topk_idx.data_ptr(), per_rank.data_ptr(),
                      per_expert.data_ptr(), in_rank.data_ptr(), scratch_address, self.state, self.b.mailbox.address,
                      num_tokens, num_topk, num_experts, R, num_experts // R)
        return per_rank, None, per_expert, in_rank

    # ------------------------------------------------------------------ dispatch
    def _dispatch_plan(self, x_bytes: int, num_scales: int, num_topk: int, expert_major_topk: int) -> DispatchPlan:
        """``num_topk``: top-k width staged (0 in a cached dispatch); ``expert_major_topk``: the
        width of the expert-major entries (0 = plain layout)."""
        if x_bytes % 8:
            raise EPInputError("x", f"the nvlink backend needs rows of a multiple of 8 bytes (got {x_bytes})")
        expert_major = expert_major_topk > 0
        # staged top-k row: [K] int64 ids, [K] float32 weights, expert-major [K] int32 positions
        topk_row_bytes = (num_topk * (16 if expert_major else 12) + 15) // 16 * 16
        row_bytes = (x_bytes,) + ((num_scales * 4,) if num_scales else ()) + ((topk_row_bytes,) if num_topk else ())
        offsets, round_tokens = self.ws.dispatch_round_tokens(row_bytes)
        offsets = (offsets[0], offsets[1] if num_scales else 0, offsets[-1] if num_topk else 0)
        block_r, block_w = copy_block_shape(x_bytes // 8)
        if expert_major:
            block_w = min(block_w, EXPERT_MAJOR_BLOCK_W)
        meta = dict(HAS_SCALES=num_scales > 0, HAS_TOPK=num_topk > 0, BLOCK_R=block_r, BLOCK_W=block_w,
                    S_P2=p2(num_scales), K_P2=p2(max(num_topk, expert_major_topk)), R_P2=self.R_P2)
        positions = dict(EXPERT_MAJOR=expert_major and num_topk > 0, POSITION_TOKENS=POSITION_TOKENS)
        rows_aligned = x_bytes % 16 == 0  # 16-byte accesses (copy.py) where x itself is aligned too
        words = dict(hidden=x_bytes if num_scales else x_bytes // 2, x=2 if num_scales else 1, num_topk=num_topk,
                     expert_major=int(expert_major))
        return DispatchPlan(x_bytes // 8, num_scales, num_topk, max(num_topk, expert_major_topk), topk_row_bytes,
                            offsets, round_tokens, block_r, rows_aligned, expert_major,
                            Specialisations(STAGE, ["ALIGNED", "L_P2", "E_P2", "POSITION_SUB"], COPY_WARPS,
                                            WRITE_LISTS=True, LIST_BLOCK=1024, **meta, **positions),
                            Specialisations(STAGE, ["ALIGNED", "E_P2", "POSITION_SUB"], COPY_WARPS, WRITE_LISTS=False,
                                            LIST_BLOCK=1024, L_P2=1, **meta, **positions),
                            PULL.bind(num_warps=COPY_WARPS, INDEX=True, ALIGNED=rows_aligned, EXPERT_MAJOR=expert_major,
                                      **meta),
                            PULL.bind(num_warps=COPY_WARPS, INDEX=False, ALIGNED=rows_aligned,
                                      EXPERT_MAJOR=expert_major, **meta),
                            agreement.pack(call=agreement.CALL_DISPATCH, **words),
                            agreement.pack(call=agreement.CALL_CACHED, **dict(words, num_topk=0)))

    def _dispatch_plan_of(self, args: DispatchArgs) -> DispatchPlan:
        x = args.x[0] if args.x.__class__ is tuple else args.x
        hidden = x.shape[1]
        handle = args.handle
        num_topk = args.topk_idx.shape[1] if handle is None and args.topk_idx is not None else 0
        expert_major_topk = 0 if not args.expert_major else num_topk if handle is None else \
            handle.expert_major.dest.shape[1]
        key = (hidden * x.element_size(), hidden // 128 if args.x.__class__ is tuple else 0, num_topk,
               expert_major_topk)
        plan = self._dispatch_plans.get(key)
        if plan is None:
            plan = self._dispatch_plans[key] = self._dispatch_plan(*key)
        return plan

    def check_dispatch(self, args: DispatchArgs) -> None:
        """This backend's limits (row sizes, buffer capacity, a handle of this backend): EPInputError."""
        plan = args.plan = self._dispatch_plan_of(args)
        if args.handle is not None:
            if args.handle.backend_state.__class__ is not PullState:
                raise EPInputError("handle", "was not made by the nvlink backend")
            return
        num_tokens = (args.x[0] if args.x.__class__ is tuple else args.x).shape[0]
        self.ws.check_notify(args.num_tokens_per_expert.shape[0], num_tokens)
        if args.num_worst_tokens and num_tokens > plan.round_tokens:
            raise EPInputError("num_worst_tokens", f"needs the batch to fit the buffer in one round: {num_tokens} "
                                                   f"tokens > {plan.round_tokens}; raise num_nvl_bytes")

    def dispatch(self, args: DispatchArgs) -> DispatchResult:
        """(Buffer called check_dispatch first.)"""
        b, ws, R, rank, dev = self.b, self.ws, self.R, self.rank, self.device
        handle = args.handle
        cached = handle is not None
        x = args.x
        is_fp8 = x.__class__ is tuple
        x, scales = x if is_fp8 else (x, x)
        x, x_aligned = for_word_copies(x)
        num_tokens, hidden = x.shape
        plan = args.plan if args.plan is not None else self._dispatch_plan_of(args)
        num_topk = plan.num_topk
        mapping = handle.expert_major if cached else None
        stream = current_stream(self.dev_index)
        round_tokens = plan.round_tokens
        num_local = 0 if cached else args.num_tokens_per_expert.shape[0] // R
        expert_major = plan.expert_major

        if cached:
            state: PullState = handle.backend_state
            num_rows, max_tokens = handle.num_recv_rows, state.max_tokens
            counts_list = None
            fp0, fp1 = plan.fingerprint_cached
            fp1 |= (state.sequence & agreement.HANDLE_MASK) << agreement.HANDLE_SHIFT
        else:
            num_experts = num_local * R
            prefix = torch.empty((R, R), dtype=torch.int32, device=dev)
            recv_info = torch.empty(2, dtype=torch.int32, device=dev)
            table = torch.empty((R + 2, num_local), dtype=torch.int32, device=dev) if expert_major else prefix
            mailbox = b.mailbox
            sequence = mailbox.next_sequence()
            fp0, fp1 = plan.fingerprint_full
            fp0 |= (num_experts & agreement.EXPERTS_MASK) << agreement.EXPERTS_SHIFT
            fp1 |= int(args.num_worst_tokens > 0) << agreement.WORST_SHIFT
            NOTIFY_BOUND[self.R_P2].launch(
                R, 1, stream, self.bases, self.bases, self.state, args.num_tokens_per_rank, args.num_tokens_per_expert,
                prefix, recv_info, table, mailbox.address, num_tokens, num_experts, rank, R, ws.normal_half_bytes,
                ws.counts_offset, b.timeout_ns, sequence, args.expert_alignment, self.fingerprints, fp0, fp1,
                int(expert_major))
            # Round 0 is staged before the host waits for the counts: the copy overlaps the wait.
            self._stage(plan, args, x, x_aligned, scales, 0, round_tokens, True, stream, fp0, fp1)
            if args.num_worst_tokens == 0:
                num_rows, max_tokens, per_expert = mailbox.wait_notify(sequence, rank, b.timeout_s)
                counts_list = per_expert[:num_local].tolist()
            else:
                num_rows, max_tokens, counts_list = args.num_worst_tokens, -1, []
            src_rank = torch.empty(num_rows, dtype=torch.int32, device=dev)
            src_idx = torch.empty(num_rows, dtype=torch.int32, device=dev)
            state = PullState(src_rank, recv_info, max_tokens, sequence, table if expert_major else None)
            if expert_major:
                mapping = ExpertMajor(torch.empty((num_rows, num_topk), dtype=torch.int32, device=dev),
                                      torch.empty(sum(counts_list), dtype=torch.int64, device=dev),
                                      torch.empty(sum(counts_list), dtype=torch.float32, device=dev),
                                      sum(counts_list), counts_list)
            state.addresses = (prefix.data_ptr(), recv_info.data_ptr(), src_rank.data_ptr(), src_idx.data_ptr(),
                               table.data_ptr(), (mapping.dest if expert_major else prefix).data_ptr(),
                               args.is_token_in_rank.data_ptr())
        num_rounds = 1 if max_tokens <= round_tokens else cdiv(max_tokens, round_tokens)

        out_rows = mapping.num_rows if expert_major else num_rows
        recv_x = torch.empty((out_rows, hidden), dtype=x.dtype, device=dev)
        recv_scales = torch.empty((out_rows, plan.num_scales), dtype=torch.float32, device=dev) if is_fp8 else recv_x
        if expert_major:
            recv_topk, recv_weights = mapping.row_experts, mapping.row_weights
        elif num_topk:
            recv_topk = torch.empty((num_rows, num_topk), dtype=torch.int64, device=dev)
            recv_weights = torch.empty((num_rows, num_topk), dtype=torch.float32, device=dev)
        else:
            recv_topk = recv_weights = recv_x
        prefix_address, recv_info_address, src_rank_address, src_idx_address, table_address, dest_address, _ = \
            state.addresses
        recv_x_address = recv_x.data_ptr()
        outputs = (recv_x_address, recv_scales.data_ptr() if is_fp8 else recv_x_address,
                   recv_topk.data_ptr() if num_topk else recv_x_address,
                   recv_weights.data_ptr() if num_topk else recv_x_address)
        num_local_rows = len(mapping.group_sizes) if expert_major else num_local
        num_sms = args.config.num_sms
        if expert_major:
            num_sms = min(num_sms * EXPERT_MAJOR_SM_FACTOR, max(self.device_sms, num_sms))
        pull_programs = max(1, min(num_sms, cdiv(num_rows, plan.block_r)))
        for round_idx in range(num_rounds):
            lo, hi = round_idx * round_tokens, (round_idx + 1) * round_tokens
            if cached or round_idx > 0:
                self._stage(plan, args, x, x_aligned, scales, lo, hi, False, stream, fp0, fp1)
            # Launched even with no rows: its wait is what makes the next call's writes safe (sync.py).
            (plan.pull_index if not cached and round_idx == 0 else plan.pull).launch(
                pull_programs, 1, stream, self.bases, self.bases, self.state, prefix_address, recv_info_address,
                src_rank_address, src_idx_address, *outputs, b.mailbox.address, table_address, dest_address, num_rows,
                rank, R, lo, hi, plan.x_words, plan.num_scales, plan.entry_topk,
                ws.normal_half_bytes, ws.lists_offset, ws.list_cap, plan.offsets[0], plan.offsets[1], plan.offsets[2],
                plan.topk_row_bytes, rank * num_local, num_local_rows, b.timeout_ns, self.fingerprints, fp0, fp1,
                out_rows, int(round_idx == 0))

        recv = (recv_x, recv_scales) if is_fp8 else recv_x
        if cached:
            return DispatchResult(recv, None, None, None, handle)
        num_recv_tokens = num_rows if max_tokens >= 0 else state.recv_info[0]
        handle = DispatchHandle(prefix, src_idx, args.is_token_in_rank, num_recv_tokens, num_rows, state, mapping)
        return DispatchResult(recv, recv_topk if num_topk else None, recv_weights if num_topk else None, counts_list,
                              handle)

    def _stage(self, plan: DispatchPlan, args: DispatchArgs, x, x_aligned: bool, scales, lo: int, hi: int,
               write_lists: bool, stream: int, fp0: int, fp1: int) -> None:
        num_tokens = x.shape[0]
        rows = max(0, min(hi, num_tokens) - lo)
        programs = max(1, min(args.config.num_sms, cdiv(rows, plan.block_r)))
        x_address = x.data_ptr()  # addresses, not tensors (PullState.addresses says why)
        scales_address = scales.data_ptr() if plan.num_scales else x_address
        topk, weights = (args.topk_idx.data_ptr(), args.topk_weights.data_ptr()) if plan.num_topk else \
            (x_address, x_address)
        aligned = plan.rows_aligned and x_aligned
        num_local = 0 if args.handle is not None else args.num_tokens_per_expert.shape[0] // self.R
        e_p2, sub, num_position_programs = 1, 1, 0
        if plan.expert_major and plan.num_topk:  # positions of the entries (expert-major layout)
            e_p2 = p2(num_local * self.R)
            sub = max(1, POSITION_ELEMENTS // (p2(plan.num_topk) * e_p2))
            num_position_programs = cdiv(rows, POSITION_TOKENS)
            programs += num_position_programs
        if write_lists:  # a full dispatch: the token lists and the count checks
            kernel = plan.stage_lists[aligned, p2(num_local), e_p2, sub]
            in_rank, per_rank, per_expert, programs = args.is_token_in_rank.data_ptr(), \
                args.num_tokens_per_rank.data_ptr(), args.num_tokens_per_expert.data_ptr(), programs + self.R
        else:
            kernel = plan.stage[aligned, e_p2, sub]
            in_rank = per_rank = per_expert = args.handle.backend_state.addresses[6] if args.handle is not None \
                else args.is_token_in_rank.data_ptr()
        kernel.launch(
            programs, 1, stream,
            x_address, scales_address, scales.stride(0) if plan.num_scales else 0,
            scales.stride(1) if plan.num_scales else 0,
            topk, weights, in_rank, per_rank, per_expert, self.bases, self.bases, self.state, num_tokens, lo, hi,
            plan.x_words, plan.num_scales, plan.num_topk, self.rank, self.R, self.ws.normal_half_bytes,
            self.ws.lists_offset, self.ws.list_cap, plan.offsets[0], plan.offsets[1], plan.offsets[2],
            plan.topk_row_bytes, num_local, self.fingerprints, fp0, fp1, num_position_programs)

    # ------------------------------------------------------------------ combine
    def _combine_plan(self, hidden: int, num_topk: int, num_bias: int, expert_major_topk: int) -> CombinePlan:
        x_bytes = hidden * 2
        if x_bytes % 8:
            raise EPInputError("x", f"the nvlink backend needs rows of a multiple of 8 bytes (hidden={hidden})")
        (slots_x, *rest), round_tokens = self.ws.combine_round_tokens((x_bytes,) + ((num_topk * 4,) if num_topk else ()))
        block_r, block_w = copy_block_shape(x_bytes // 8)
        block_c = min(p2(hidden), max(16384 // self.R_P2, 16))
        rows_aligned = hidden % 8 == 0  # 16-byte accesses (copy.py) where x / the biases are aligned too
        push = Specialisations(PUSH, ["ALIGNED"], COPY_WARPS, HAS_WEIGHTS=num_topk > 0, BLOCK_R=block_r,
                               BLOCK_W=block_w, K_P2=p2(max(num_topk, expert_major_topk)), R_P2=self.R_P2,
                               EXPERT_MAJOR=expert_major_topk > 0)
        reduce = Specialisations(REDUCE, ["ALIGNED"], 16 if self.R_P2 * block_c >= 8192 else 4, NUM_BIAS=num_bias,
                                 HAS_WEIGHTS=num_topk > 0, R_P2=self.R_P2, BLOCK_C=block_c, K_P2=p2(num_topk))
        return CombinePlan(slots_x, rest[0] if num_topk else 0, round_tokens, block_r, rows_aligned,
                           expert_major_topk > 0, push, reduce,
                           agreement.pack(call=agreement.CALL_COMBINE, hidden=hidden, x=1, num_topk=num_topk,
                                          expert_major=int(expert_major_topk > 0)))

    def _combine_plan_of(self, x: torch.Tensor, handle: DispatchHandle, topk_weights: Optional[torch.Tensor],
                         bias: Tuple[torch.Tensor, ...]) -> CombinePlan:
        mapping = handle.expert_major
        key = (x.shape[1], 0 if topk_weights is None else topk_weights.shape[1], len(bias),
               0 if mapping is None else mapping.dest.shape[1])
        plan = self._combine_plans.get(key)
        if plan is None:
            plan = self._combine_plans[key] = self._combine_plan(*key)
        return plan

    def check_combine(self, x: torch.Tensor, handle: DispatchHandle, topk_weights: Optional[torch.Tensor],
                      bias: Tuple[torch.Tensor, ...]) -> None:
        """This backend's limits (row sizes, buffer capacity, a handle of this backend): EPInputError."""
        if handle.backend_state.__class__ is not PullState:
            raise EPInputError("handle", "was not made by the nvlink backend")
        plan = self._combine_plan_of(x, handle, topk_weights, bias)
        if handle.backend_state.max_tokens < 0 and handle.is_token_in_rank.shape[0] > plan.round_tokens:
            raise EPInputError("handle", "comes from a num_worst_tokens dispatch: its combine must fit the buffer "
                                         "in one round; raise num_nvl_bytes")

    def combine(self, x: torch.Tensor, handle: DispatchHandle, topk_weights: Optional[torch.Tensor],
                bias: Tuple[torch.Tensor, ...], config) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(Buffer called check_combine first.)"""
        b, R, rank, dev = self.b, self.R, self.rank, self.device
        state = handle.backend_state
        num_tokens, hidden = handle.is_token_in_rank.shape[0], x.shape[1]
        num_rows = handle.num_recv_rows
        num_topk = topk_weights.shape[1] if topk_weights is not None else 0
        mapping = handle.expert_major  # x: the expert-major rows, folded by the push
        plan = self._combine_plan_of(x, handle, topk_weights, bias)
        round_tokens = plan.round_tokens
        max_tokens = state.max_tokens if state.max_tokens >= 0 else round_tokens
        num_rounds = 1 if max_tokens <= round_tokens else cdiv(max_tokens, round_tokens)
        combined = torch.empty((num_tokens, hidden), dtype=torch.bfloat16, device=dev)
        combined_w = torch.empty((num_tokens, num_topk), dtype=torch.float32, device=dev) if num_topk else None
        stream = current_stream(self.dev_index)
        # addresses, not tensors (PullState.addresses says why)
        _, _, src_rank_address, src_idx_address, _, dest_address, in_rank_address = state.addresses
        combined_address = combined.data_ptr()
        bias0 = bias[0].data_ptr() if len(bias) >= 1 else combined_address
        bias1 = bias[1].data_ptr() if len(bias) >= 2 else combined_address
        w_out = combined_w.data_ptr() if num_topk else combined_address
        dest = src_idx_address if mapping is None else dest_address
        num_sms = config.num_sms
        if mapping is not None:
            num_sms = min(num_sms * EXPERT_MAJOR_SM_FACTOR, max(self.device_sms, num_sms))
        push_programs = max(1, min(num_sms, cdiv(num_rows, plan.block_r)))
        half_bytes = self.ws.normal_half_bytes
        x, x_aligned = for_word_copies(x)
        x_address = x.data_ptr()
        w_in = topk_weights.data_ptr() if num_topk else x_address if mapping is None else mapping.row_weights.data_ptr()
        push = plan.push[plan.rows_aligned and x_aligned]
        reduce = plan.reduce[plan.rows_aligned and is_aligned(*bias)]
        fp0, fp1 = plan.fingerprint
        fp1 |= (state.sequence & agreement.HANDLE_MASK) << agreement.HANDLE_SHIFT
        for round_idx in range(num_rounds):
            lo, hi = round_idx * round_tokens, (round_idx + 1) * round_tokens
            push.launch(push_programs, 1, stream, x_address, w_in, src_rank_address, src_idx_address, dest, self.bases,
                        self.bases, self.state, num_rows, rank, R, lo, hi, hidden // 4,
                        num_topk if mapping is None else mapping.dest.shape[1], half_bytes,
                        plan.slots_x, plan.slots_w, self.fingerprints, fp0, fp1)
            reduce.launch(max(1, min(4 * config.num_sms, min(hi, num_tokens) - lo)), 1, stream,
                          in_rank_address, combined_address, w_out, bias0, bias1, self.bases, self.bases,
                          self.state, b.mailbox.address, num_tokens, lo, hi, hidden, num_topk, rank, R,
                          half_bytes, plan.slots_x, plan.slots_w, b.timeout_ns, self.fingerprints, fp0, fp1)
        return combined, combined_w


class _NotifyKernels(dict):
    """NOTIFY bound per R_P2, looked up without keyword building."""

    def __missing__(self, r_p2):
        self[r_p2] = NOTIFY.bind(num_warps=4, R_P2=r_p2, BLOCK=256)
        return self[r_p2]


NOTIFY_BOUND = _NotifyKernels()
