"""The dispatch's stage (dispatch.py's docstring: "stage and pull"): this rank's tokens (x, scales,
top-k, expert-major positions) copied into its own workspace half, and per destination the list of
the tokens it sends — alone in turn (``ep_dispatch_stage``), or as the first programs of the
one-launch ``ep_dispatch`` (dispatch.py), which calls :func:`_stage` with OVERLAP."""
from __future__ import annotations

import triton
import triton.language as tl

from ... import agreement, sync
from ...copy import copy_rows, multiple, word_ptr
from ...launch import KernelSpec
from ...sync import (arrive, fingerprint_half, post_call_to_peers, post_fingerprint_to_peers, publish_from_one_thread,
                     publish_to_peers_from_one_thread, signal_peers)
from .expert_major_rows import POSITION_HIST_ENTRIES, expert_positions
from .receive_index import list_of


# ====================================================================== dispatch: stage
# ep_dispatch_stage: this rank's tokens into its own workspace half; grid = [R list programs] +
# [position programs] + copy programs (in turn at most NormalMode.stage_programs_per_sm x num_sms; in
# ep_dispatch at most num_sms).
#
#   epoch = EPOCH_NORMAL + 1;  half = my workspace half (epoch % 2)
#   program 0:          post the call's fingerprint and board word on every peer
#   list programs j<R:  (WRITE_LISTS) half.lists[j] = ascending tokens with is_token_in_rank[t, j]
#                       (PUSHED_LISTS: into j's half, as j.half.lists[rank]: remote stores);
#                       list_index[t, j] = t's index in that list (kept with the handle: the
#                       overlapped combine's reduce finds by it which of j's pushed blocks holds t)
#                       count check: len(list j) != num_tokens_per_rank[j], or (HAS_TOPK) j's experts'
#                       entries != num_tokens_per_expert -> COUNT_ERROR (an abort code)
#   position programs:  (EXPERT_MAJOR) each entry's place among the rows sent to its expert
#   copy programs:      for t in [token_lo, token_hi): half.x[t], half.scales[t], half.topk[t] = ...
#   OVERLAP:            after each LIST_BLOCK tokens of list j: RELEASE j.block_flags[rank][last] =
#                       (epoch << 32) | entries listed so far; after each block b of staged rows:
#                       RELEASE p.block_flags[rank][b] = epoch on every rank p (one thread, after a
#                       CTA barrier: the program's stores of the list or the block)
#   last to arrive:     (in turn) EPOCH_NORMAL = epoch; COUNT_ERROR set -> fingerprint again with the abort field
#                       RELEASE epoch to every peer's flag: who acquires it (ep_dispatch_pull) sees
#                       the staged rows, the lists and the fingerprint
@triton.jit
def _expert_entries(topk_ptr, tokens, num_tokens, num_topk, dest, num_local, K_P2: tl.constexpr, L_P2: tl.constexpr,
                    LIST_BLOCK: tl.constexpr):
    """[L_P2] int32: the valid top-k entries of ``tokens`` that name each of rank ``dest``'s local
    experts (the layout kernel's count, block by block)."""
    k = tl.arange(0, K_P2)
    ids = tl.load(topk_ptr + tokens[:, None].to(tl.int64) * num_topk + k[None, :],
                  mask=(tokens < num_tokens)[:, None] & (k < num_topk)[None, :], other=-1)
    local = ids - dest * num_local
    mine = (ids >= 0) & (local >= 0) & (local < num_local)
    return tl.histogram(tl.reshape(tl.where(mine, local, 0).to(tl.int32), [LIST_BLOCK * K_P2]), L_P2,
                        mask=tl.reshape(mine, [LIST_BLOCK * K_P2]))


@triton.jit
def _check_expert_counts(per_expert, per_expert_ptr, dest, num_local, state_ptr, L_P2: tl.constexpr):
    """The caller's num_tokens_per_expert for ``dest``'s experts against ``per_expert`` counted from
    topk_idx: a difference sets COUNT_ERROR (the stage's end turns it into the call's abort)."""
    experts = tl.arange(0, L_P2)
    given = tl.load(per_expert_ptr + dest * num_local + experts, mask=experts < num_local, other=0)
    if tl.max((given != per_expert).to(tl.int32), axis=0) != 0:
        # RELEASE (acq_rel, and this program's arrival after it): the abort code -> the stage's last
        # arriver, which reads COUNT_ERROR and posts the fingerprint again with it
        tl.atomic_max(state_ptr + sync.COUNT_ERROR, agreement.ABORT_NUM_TOKENS_PER_EXPERT)


@triton.jit
def _stage(pid, num_programs, epoch,
           x_ptr, scales_ptr, topk_ptr, weights_ptr, in_rank_ptr, list_index_ptr, per_rank_ptr, per_expert_ptr,
           num_tokens, token_lo, token_hi, x_words, num_scales, scale_stride_t, scale_stride_c, num_topk, num_local,
           num_position_programs,
           rank, num_ranks, normal_bases_ptr, flag_bases_ptr, state_ptr, half_bytes, lists_offset, list_cap, x_offset,
           scales_offset, topk_offset, topk_row_bytes, block_flags_offset, block_flag_cap,
           fp_offset, fp0, fp1, board_bases_ptr, call_tag,
           HAS_SCALES: tl.constexpr, HAS_TOPK: tl.constexpr, WRITE_LISTS: tl.constexpr,
           BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr, S_P2: tl.constexpr, K_P2: tl.constexpr,
           R_P2: tl.constexpr, LIST_BLOCK: tl.constexpr, L_P2: tl.constexpr, ALIGNED: tl.constexpr,
           EXPERT_MAJOR: tl.constexpr, POSITION_TOKENS: tl.constexpr, POSITION_SUB: tl.constexpr,
           E_P2: tl.constexpr, OVERLAP: tl.constexpr, PUSHED_LISTS: tl.constexpr):
    # Staging is local (HBM speed): x rows, scales (row-major), top-k rows [K int64 ids][K float32
    # weights] (+ [K int32] positions, EXPERT_MAJOR). ALIGNED: x and its rows are 16-byte aligned (copy.py).
    # OVERLAP (ep_dispatch): each list and each block of staged rows is released on its own, to the
    # receivers' block flags, so their pull programs of the same launch start on it at once.
    x_words = multiple(x_words, 2, ALIGNED)
    half = tl.load(normal_bases_ptr + rank) + (epoch % 2) * half_bytes
    fp_rows = fingerprint_half(fp_offset, epoch % 2, num_ranks)
    if pid == 0:
        post_fingerprint_to_peers(flag_bases_ptr, fp_rows, rank, num_ranks, state_ptr, fp0, fp1, epoch, HAS_MASK=False,
                                  R_P2=R_P2)
        post_call_to_peers(board_bases_ptr, rank, num_ranks, call_tag, fp0, tl.arange(0, R_P2) < num_ranks, R_P2)
    my_flag_row = block_flags_offset + rank.to(tl.int64) * block_flag_cap * 8  # (OVERLAP) this rank's row at a peer
    # -- list programs: token lists per destination, and the caller's counts checked against them
    first_copy = 0
    if WRITE_LISTS:
        first_copy = num_ranks
        if pid < num_ranks:
            # this rank's list for rank pid: here, or (PUSHED_LISTS) stored into pid's workspace
            # (receive_index.list_of), covered by the same releases as a list kept here
            lists = list_of(half, tl.load(normal_bases_ptr + pid) + (epoch % 2) * half_bytes, rank, pid, lists_offset,
                            list_cap, PUSHED_LISTS)
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
                if OVERLAP:  # RELEASE: the list's first `running` entries -> rank pid's pull programs
                    publish_from_one_thread(tl.load(flag_bases_ptr + pid) + my_flag_row + (block_flag_cap - 1) * 8,
                                            (epoch.to(tl.int64) << 32) | running)
                if HAS_TOPK:
                    per_expert += _expert_entries(topk_ptr, tokens, num_tokens, num_topk, pid, num_local, K_P2, L_P2,
                                                  LIST_BLOCK)
            if running != tl.load(per_rank_ptr + pid):  # RELEASE: as in _check_expert_counts, to the last arriver
                tl.atomic_max(state_ptr + sync.COUNT_ERROR, agreement.ABORT_NUM_TOKENS_PER_RANK)
            if HAS_TOPK:
                _check_expert_counts(per_expert, per_expert_ptr, pid, num_local, state_ptr, L_P2)
    # -- position programs: expert-major places of the top-k entries
    if EXPERT_MAJOR:
        first_position = first_copy
        first_copy += num_position_programs
        if (pid >= first_position) & (pid < first_copy):
            first = token_lo + (pid - first_position) * POSITION_TOKENS
            expert_positions(topk_ptr, half + topk_offset + num_topk * 12, topk_row_bytes, first,
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
            if OVERLAP:  # RELEASE: this block's rows -> every receiver's pull programs (word `block` of this row)
                publish_to_peers_from_one_thread(flag_bases_ptr, my_flag_row + block * 8, num_ranks, epoch)
    # -- the last program to arrive releases the epoch
    if arrive(state_ptr + sync.ARRIVE_STAGE, num_programs):
        if not OVERLAP:  # (overlapped: the pull's last program stores it, once every program has read it)
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
        E_P2: tl.constexpr, PUSHED_LISTS: tl.constexpr):
    # The stage alone (the dispatch in turn, and every dispatch but a one-round plain one).
    _stage(tl.program_id(0), tl.num_programs(0), tl.load(state_ptr + sync.EPOCH_NORMAL) + 1,
           x_ptr, scales_ptr, topk_ptr, weights_ptr, in_rank_ptr, list_index_ptr, per_rank_ptr, per_expert_ptr,
           num_tokens, token_lo, token_hi, x_words, num_scales, scale_stride_t, scale_stride_c, num_topk, num_local,
           num_position_programs, rank, num_ranks, normal_bases_ptr, flag_bases_ptr, state_ptr, half_bytes,
           lists_offset, list_cap, x_offset, scales_offset, topk_offset, topk_row_bytes, 0, 0,
           fp_offset, fp0, fp1, board_bases_ptr, call_tag,
           HAS_SCALES, HAS_TOPK, WRITE_LISTS, BLOCK_R, BLOCK_W, S_P2, K_P2, R_P2, LIST_BLOCK, L_P2, ALIGNED,
           EXPERT_MAJOR, POSITION_TOKENS, POSITION_SUB, E_P2, OVERLAP=False, PUSHED_LISTS=PUSHED_LISTS)


STAGE = KernelSpec(ep_dispatch_stage, aligned_if={"ALIGNED": ["x_ptr"]})
