"""Dispatch, "stage and pull": ``ep_dispatch_stage`` copies this rank's tokens (x, scales, top-k,
expert-major positions) into its own workspace half and lists, per destination, the tokens it
sends; ``ep_dispatch_pull`` has every receiver acquire the sources' releases and pull its rows
straight into ``recv_x`` at rank-prefix offsets (package docstring: the order)."""
from __future__ import annotations

import triton
import triton.language as tl

from ... import agreement, sync
from ...copy import (NAN_BF16_WORD, NAN_E4M3_WORD, copy_rows, copy_rows_to_each, fill_nan, fill_rows, multiple,
                     word_ptr)
from ...agreement import acquire_and_agree
from ...launch import KernelSpec
from ...sync import arrive, fingerprint_half, now_ns, post_call_to_peers, post_fingerprint_to_peers, signal_peers
from .schedule import advance_round, item_block, source_blocks, trace_item

POSITION_TOKENS = 32  # tokens per program of the expert-major positions (_expert_positions)
POSITION_HIST_ENTRIES = tl.constexpr(4096)  # top-k entries per histogram step of _expert_positions
POSITION_ELEMENTS = 16384  # the positions' [SUB, K, E] one-hot tile: SUB = this // (K * E), at least 1


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


# ep_dispatch_stage: this rank's tokens into its own workspace half; grid = [R list programs] +
# [position programs] + copy programs (at most num_sms in all).
#
#   epoch = EPOCH_NORMAL + 1;  half = my workspace half (epoch % 2)
#   program 0:          post the call's fingerprint and board word on every peer
#   list programs j<R:  (WRITE_LISTS) half.lists[j] = ascending tokens with is_token_in_rank[t, j];
#                       list_index[t, j] = t's index in that list (kept with the handle: the
#                       overlapped combine's reduce finds by it which of j's pushed blocks holds t)
#                       count check: len(list j) != num_tokens_per_rank[j], or (HAS_TOPK) j's experts'
#                       entries != num_tokens_per_expert -> COUNT_ERROR (an abort code)
#   position programs:  (EXPERT_MAJOR) each entry's place among the rows sent to its expert
#   copy programs:      for t in [token_lo, token_hi): half.x[t], half.scales[t], half.topk[t] = ...
#   last to arrive:     EPOCH_NORMAL = epoch; COUNT_ERROR set -> fingerprint again with the abort field
#                       RELEASE epoch to every peer's flag: who acquires it (ep_dispatch_pull) sees
#                       the staged rows, the lists and the fingerprint
@triton.jit
def ep_dispatch_stage(
        # the call's tensors
        x_ptr: "*i8",  # [T, x_bytes] bytes of x (bf16 or e4m3), rows 8-byte aligned
        scales_ptr: "*fp32",  # [T, S] float32, any strides (FP8)
        topk_ptr: "*i64", weights_ptr: "*fp32",  # [T, K] int64 / float32 (full dispatch with top-k)
        in_rank_ptr: "*i8",  # [T, R] int8: is_token_in_rank (token lists)
        list_index_ptr: "*i32",  # [T, R] int32 (WRITE_LISTS): each token's index in each list it is on
        per_rank_ptr: "*i32", per_expert_ptr: "*i32",  # [R] / [E] int32 the caller's counts (WRITE_LISTS)
        # sizes and strides: this round's tokens [token_lo, token_hi) of num_tokens
        num_tokens: "i32", token_lo: "i32", token_hi: "i32", x_words: "i32", num_scales: "i32",
        scale_stride_t: "i64", scale_stride_c: "i64", num_topk: "i32", num_local: "i32",
        num_position_programs: "i32",
        # this rank and the workspaces (offsets are from a workspace half)
        rank: "i32", num_ranks: "i32", normal_bases_ptr: "*i64", flag_bases_ptr: "*i64", state_ptr: "*i64",
        half_bytes: "i64", lists_offset: "i64", list_cap: "i64", x_offset: "i64", scales_offset: "i64",
        topk_offset: "i64", topk_row_bytes: "i64",
        # the call's identity: its fingerprint, and its word on the call board (gpu/call_board.py)
        fp_offset: "i64", fp0: "i64", fp1: "i64",
        board_bases_ptr: "*i64",  # [R] int64: each rank's call board
        call_tag: "i64",  # this call's number and Buffer on the board (0: not posted)
        # meta-parameters
        HAS_SCALES: tl.constexpr, HAS_TOPK: tl.constexpr, WRITE_LISTS: tl.constexpr,
        BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr, S_P2: tl.constexpr, K_P2: tl.constexpr,
        R_P2: tl.constexpr, LIST_BLOCK: tl.constexpr, L_P2: tl.constexpr, ALIGNED: tl.constexpr,
        EXPERT_MAJOR: tl.constexpr, POSITION_TOKENS: tl.constexpr, POSITION_SUB: tl.constexpr,
        E_P2: tl.constexpr):
    # Staging is local (HBM speed): x rows, scales (row-major), top-k rows [K int64 ids][K float32
    # weights] (+ [K int32] positions, EXPERT_MAJOR). ALIGNED: x and its rows are 16-byte aligned (copy.py).
    pid = tl.program_id(0)
    x_words = multiple(x_words, 2, ALIGNED)
    num_programs = tl.num_programs(0)
    epoch = tl.load(state_ptr + sync.EPOCH_NORMAL) + 1
    half = tl.load(normal_bases_ptr + rank) + (epoch % 2) * half_bytes
    fp_rows = fingerprint_half(fp_offset, epoch % 2, num_ranks)
    if pid == 0:
        post_fingerprint_to_peers(flag_bases_ptr, fp_rows, rank, num_ranks, state_ptr, fp0, fp1, epoch, HAS_MASK=False,
                                  R_P2=R_P2)
        post_call_to_peers(board_bases_ptr, rank, num_ranks, call_tag, fp0, tl.arange(0, R_P2) < num_ranks, R_P2)
    # -- list programs: token lists per destination, and the caller's counts checked against them
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
                tl.store(list_index_ptr + tokens.to(tl.int64) * num_ranks + pid, position, mask=member)
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
    # -- position programs: expert-major places of the top-k entries
    if EXPERT_MAJOR:
        first_position = first_copy
        first_copy += num_position_programs
        if (pid >= first_position) & (pid < first_copy):
            first = token_lo + (pid - first_position) * POSITION_TOKENS
            _expert_positions(topk_ptr, half + topk_offset + num_topk * 12, topk_row_bytes, first,
                              tl.minimum(first + POSITION_TOKENS, tl.minimum(token_hi, num_tokens)), token_lo,
                              num_topk, num_local * num_ranks, POSITION_HIST_ENTRIES // K_P2, POSITION_SUB, K_P2, E_P2)
    # -- copy programs: the rows of [token_lo, token_hi) into the staging half
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
    # -- the last program to arrive releases the epoch
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


STAGE = KernelSpec(ep_dispatch_stage, aligned_if={"ALIGNED": ["x_ptr"]})


# ====================================================================== dispatch: pull
# ep_dispatch_pull: every receiver pulls its rows from the sources' staging halves; grid = num_sms.
#
#   epoch = EPOCH_NORMAL (the stage's);  ACQUIRE every source's flag == epoch (a timeout, or a source
#           the call board shows in another call, goes to the mailbox), then compare the sources'
#           fingerprints with this call's: any difference (an abort too) -> num_rows = 0, the host raises
#   received rows are grouped by source in rank order (rank_prefix_matrix's column), source token
#   order within; they are taken in blocks of one source, every source at once (schedule.py):
#   for each block (src, rows [first, end)) of this program:
#       INDEX:  token = src.lists[rank][r - start of src]  -> src_rank[r], src_idx[r]
#               (a cached dispatch reads src_idx back instead)
#       if token in [token_lo, token_hi):                 (this round's part of the source's batch)
#           recv_x[r], recv_scales[r] <- src.half.x[token], src.half.scales[token]
#           recv_topk[r] <- local expert id or -1 (weight 0 for other ranks' experts)
#       EXPERT_MAJOR: the row goes to table[src][e] + its position, once per local entry (e)
#   rows past the received total (num_worst_tokens padding): src_rank, src_idx -1, top-k -1
@triton.jit
def ep_dispatch_pull(
        # the call's tensors: the notify's results in, the received rows out
        prefix_ptr: "*i32",  # [R, R] int32 rank_prefix_matrix: where each source's rows start here
        src_rank_ptr: "*i32", src_idx_ptr: "*i32",  # [N] int32: written with INDEX, read otherwise
        recv_x_ptr: "*i8",  # [N, x_bytes] bytes
        recv_scales_ptr: "*fp32",  # [N, S] float32
        recv_topk_ptr: "*i64", recv_weights_ptr: "*fp32",  # [N, K] int64 local ids / float32 (expert-major: [M])
        table_ptr: "*i32",  # [R + 2, L] int32 (EXPERT_MAJOR): the notify's group table (ep_notify_dispatch)
        dest_ptr: "*i32",  # [N, K] int32 (EXPERT_MAJOR): each entry's expert-major row, written with HAS_TOPK
        # sizes: this round's tokens [token_lo, token_hi) of the sources, num_rows rows here
        num_rows: "i32", token_lo: "i32", token_hi: "i32", x_words: "i32", num_scales: "i32", num_topk: "i32",
        expert_lo: "i32", num_local: "i32", num_em_rows: "i32", zero_padding: "i32",
        # this rank and the workspaces (offsets are from a workspace half)
        rank: "i32", num_ranks: "i32", normal_bases_ptr: "*i64", flag_bases_ptr: "*i64", state_ptr: "*i64",
        half_bytes: "i64", lists_offset: "i64", list_cap: "i64", x_offset: "i64", scales_offset: "i64",
        topk_offset: "i64", topk_row_bytes: "i64",
        # the host: its mailbox (sync.py), the timeout of a wait
        mailbox_address: "i64", timeout_ns: "i64",
        # the call's identity: its fingerprint, and its word on the call board (gpu/call_board.py)
        fp_offset: "i64", fp0: "i64", fp1: "i64",
        board_bases_ptr: "*i64",  # [R] int64: each rank's call board
        call_tag: "i64",  # this call's number and Buffer on the board (0: not checked)
        trace_ptr: "*i64",  # TRACE: the schedule's trace buffer (schedule.py)
        # meta-parameters
        INDEX: tl.constexpr, HAS_SCALES: tl.constexpr, HAS_TOPK: tl.constexpr,
        BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr, S_P2: tl.constexpr, K_P2: tl.constexpr,
        R_P2: tl.constexpr, ALIGNED: tl.constexpr, EXPERT_MAJOR: tl.constexpr, EVERY_PEER: tl.constexpr,
        TRACE: tl.constexpr, PIPELINE: tl.constexpr):
    # EXPERT_MAJOR: entry (r, k)'s row (expert_major.py) is written to dest with HAS_TOPK and read
    # from it in a cached dispatch; with zero_padding the groups' padding rows are zeroed too.
    # PIPELINE (an experiment, off by default; plain layout, rows of one BLOCK_W chunk): an item's x
    # rows are stored only after the next item's loads are issued, so a program has a remote load in
    # flight while it stores (the plan halves BLOCK_R to keep two tiles in the same registers).
    # ALIGNED: rows are a multiple of 16 bytes (copy.py; the buffers are aligned).
    pid = tl.program_id(0)
    x_words = multiple(x_words, 2, ALIGNED)
    num_programs = tl.num_programs(0)
    epoch = tl.load(state_ptr + sync.EPOCH_NORMAL)
    half_offset = (epoch % 2) * half_bytes
    expected = num_rows
    num_rows = acquire_and_agree(flag_bases_ptr, state_ptr, mailbox_address, epoch, rank, num_ranks, timeout_ns,
                                  fp_offset, fp0, fp1, num_rows, tl.load(board_bases_ptr + rank), call_tag,
                                  R_P2)  # ACQUIRE: staged rows and lists
    if num_rows < expected:  # the wait gave up, or a source is in another call: no row arrived
        if EXPERT_MAJOR:
            expected = num_em_rows
        _missing_rows(recv_x_ptr, recv_scales_ptr, recv_weights_ptr, expected, x_words, num_scales, num_topk,
                      HAS_SCALES, HAS_TOPK, EXPERT_MAJOR, BLOCK_R, BLOCK_W)
    # -- each program takes its blocks: one source's rows each, every source at once (schedule.py)
    starts, ends, blocks = source_blocks(prefix_ptr, rank, num_ranks, num_rows, BLOCK_R, R_P2)
    num_items = tl.where(num_rows > 0, tl.sum(blocks, axis=0), 0)  # (0: the agreement failed)
    round_idx = 0
    round_start = 0
    round_size = tl.sum((blocks > 0).to(tl.int32), axis=0)
    if PIPELINE:  # the previous item's x rows, not yet stored: values, destination rows, which are live
        cols = tl.arange(0, BLOCK_W)
        held = tl.zeros([BLOCK_R, BLOCK_W], tl.int64)
        held_rows = tl.zeros([BLOCK_R], tl.int64)
        held_live = tl.arange(0, BLOCK_R) < 0
    for item in range(pid, num_items, num_programs):
        if TRACE:
            started = now_ns()
        round_idx, round_start, round_size = advance_round(item, round_idx, round_start, round_size, blocks)
        src, first, end, src_start = item_block(item, round_idx, round_start, rank, num_ranks, starts, ends, blocks,
                                                BLOCK_R, R_P2, EVERY_PEER)
        rows = first + tl.arange(0, BLOCK_R)
        in_out = rows < end
        staged = tl.load(normal_bases_ptr + src) + half_offset
        if INDEX:
            entry = staged + lists_offset + ((rank * list_cap).to(tl.int64) + rows - src_start) * 4
            token = tl.load(entry.to(tl.pointer_type(tl.int32)), mask=in_out, other=-1)
            tl.store(src_rank_ptr + rows, tl.zeros([BLOCK_R], tl.int32) + src, mask=in_out)
            tl.store(src_idx_ptr + rows, token, mask=in_out)
        else:
            token = tl.load(src_idx_ptr + rows, mask=in_out, other=-1)
        move = in_out & (token >= token_lo) & (token < token_hi)
        srow = (token - token_lo).to(tl.int64)
        rows64 = rows.to(tl.int64)
        sx = word_ptr(staged + x_offset, ALIGNED) + srow * x_words
        if EXPERT_MAJOR:
            _pull_expert_major(staged, srow, src, rows64, move, sx, recv_x_ptr, recv_scales_ptr, recv_topk_ptr,
                               recv_weights_ptr, table_ptr, dest_ptr, x_words, num_scales, num_topk, scales_offset,
                               topk_offset, topk_row_bytes, expert_lo, num_local, num_em_rows, HAS_SCALES, HAS_TOPK,
                               BLOCK_W, S_P2, K_P2)
        else:
            recv_words = recv_x_ptr.to(tl.pointer_type(tl.int64), bitcast=True)
            if PIPELINE:  # load this item's rows, then store the previous item's (no ordering: local outputs)
                cm = cols < x_words
                loaded = tl.load(sx[:, None] + cols[None, :], mask=move[:, None] & cm[None, :])
                tl.store(recv_words + held_rows[:, None] * x_words + cols[None, :], held,
                         mask=held_live[:, None] & cm[None, :])
                held, held_rows, held_live = loaded, rows64, move
            else:
                copy_rows(sx, recv_words + rows64 * x_words, move, x_words, BLOCK_W)
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
                tl.store(recv_topk_ptr + out, tl.where(mine, local, -1), mask=m)
                tl.store(recv_weights_ptr + out, tl.where(mine, weights, 0.0), mask=m)
        if TRACE:
            trace_item(trace_ptr, src, end - first, started)
    if PIPELINE:  # the last item's rows
        tl.store(recv_x_ptr.to(tl.pointer_type(tl.int64), bitcast=True) + held_rows[:, None] * x_words + cols[None, :],
                 held, mask=held_live[:, None] & (cols < x_words)[None, :])
    # -- rows past the received total: num_worst_tokens padding (a full dispatch marks them)
    if INDEX:
        num_recv = tl.max(ends, axis=0)
        for block in range(pid, tl.cdiv(num_rows - num_recv, BLOCK_R), num_programs):
            rows = num_recv + block * BLOCK_R + tl.arange(0, BLOCK_R)
            pad = rows < num_rows
            tl.store(src_rank_ptr + rows, tl.full([BLOCK_R], -1, tl.int32), mask=pad)
            tl.store(src_idx_ptr + rows, tl.full([BLOCK_R], -1, tl.int32), mask=pad)
            if HAS_TOPK:
                if not EXPERT_MAJOR:
                    k = tl.arange(0, K_P2)
                    out = rows.to(tl.int64)[:, None] * num_topk + k[None, :]
                    m = pad[:, None] & (k < num_topk)[None, :]
                    tl.store(recv_topk_ptr + out, tl.full([BLOCK_R, K_P2], -1, tl.int64), mask=m)
                    tl.store(recv_weights_ptr + out, tl.zeros([BLOCK_R, K_P2], tl.float32), mask=m)
    if EXPERT_MAJOR:
        if zero_padding != 0:
            _zero_padding(table_ptr, recv_x_ptr, recv_scales_ptr, recv_topk_ptr, recv_weights_ptr, num_ranks, num_local,
                          num_em_rows, x_words, num_scales, HAS_SCALES, HAS_TOPK, BLOCK_R, BLOCK_W, S_P2)


@triton.jit
def _missing_rows(recv_x_ptr, recv_scales_ptr, recv_weights_ptr, num_rows, x_words, num_scales, num_topk,
                  HAS_SCALES: tl.constexpr, HAS_TOPK: tl.constexpr, EXPERT_MAJOR: tl.constexpr,
                  BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr):
    """A pull whose wait gave up returns no plausible rows (DESIGN section 5): every output row NaN —
    x (bf16, or e4m3 with scales), its scales and its weights (float32); the host raises the error
    at the next call. ``num_rows``: the outputs' rows (expert-major: its rows, one weight each)."""
    program, num_programs = tl.program_id(0), tl.num_programs(0)
    fill_rows(recv_x_ptr.to(tl.pointer_type(tl.int64), bitcast=True), num_rows, x_words,
              NAN_E4M3_WORD if HAS_SCALES else NAN_BF16_WORD, program, num_programs, BLOCK_R, BLOCK_W)
    if HAS_SCALES:
        fill_nan(recv_scales_ptr, num_rows * num_scales, program, num_programs, 1024)
    if HAS_TOPK:
        fill_nan(recv_weights_ptr, num_rows if EXPERT_MAJOR else num_rows * num_topk, program, num_programs, 1024)


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
        dest = tl.load(table_ptr + src * num_local + local, mask=mine, other=0) + position
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


PULL = KernelSpec(ep_dispatch_pull, aligned_if={"ALIGNED": ["recv_x_ptr"]})
