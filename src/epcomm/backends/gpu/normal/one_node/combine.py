"""Combine, "push and reduce": ``ep_combine_push`` stores every received row into slot
``(token, own rank)`` of the token's home (expert-major rows folded first), ``ep_combine_reduce``
sums the slots present in ``is_token_in_rank`` in float32 at home."""
from __future__ import annotations

import triton
import triton.language as tl

from ... import sync
from ...copy import copy_rows, fill_nan, multiple, ptr_at, word_ptr
from ...expert_major_kernels import fold_expert_major_rows
from ...launch import KernelSpec
from ...sync import (acquire_and_agree, arrive, fingerprint_half, now_ns, post_call_to_peers,
                     post_fingerprint_to_peers, signal_peers)
from .schedule import advance_round, item_block, source_blocks, trace_item


# ====================================================================== combine: push
# ep_combine_push: every received row back to its home, into slot (token, this rank); grid = num_sms.
#
#   epoch = EPOCH_NORMAL + 1;  program 0: post the call's fingerprint and board word on every peer
#   the rows are the dispatch's, grouped by home in rank order (rank_prefix_matrix's column); they
#   are taken in blocks of one home, every home at once (schedule.py):
#   for each block (home, rows [first, end)) of this program, each row r with token = src_idx[r]
#   in [token_lo, token_hi):
#       home.half(epoch % 2).slots_x[token - token_lo, rank] <- x[r]     (NVLink stores)
#           EXPERT_MAJOR: x[r] = Σ_k weight · y[dest[r, k]] first (float32, the fold)
#       home.half.slots_w[token - token_lo, rank] <- topk_weights[r]    (HAS_WEIGHTS)
#   last to arrive:  EPOCH_NORMAL = epoch;  RELEASE epoch to every peer's flag: the home that
#                    acquires it (ep_combine_reduce) sees the rows stored for it
#   (the slots are free: the home read this half two barriers ago; halves alternate, sync.py)
@triton.jit
def ep_combine_push(
        # the call's tensors
        x_ptr: "*i8",  # [N, x_bytes] bytes of the bf16 expert outputs (dispatch's row order; expert-major: [M])
        weights_ptr: "*fp32",  # [N, K] float32 (HAS_WEIGHTS); expert-major: [M] float32 each row's weight
        prefix_ptr: "*i32",  # [R, R] int32 the dispatch's rank_prefix_matrix: where each home's rows start
        src_idx_ptr: "*i32",  # [N] int32: token of each row at its home (-1 = padding)
        dest_ptr: "*i32",  # [N, K] int32 (EXPERT_MAJOR): expert-major row of entry (r, k), -1 = none
        # sizes: this round's tokens [token_lo, token_hi) of the homes
        num_rows: "i32", token_lo: "i32", token_hi: "i32", x_words: "i32", num_topk: "i32",
        # this rank and the workspaces (offsets are from a workspace half)
        rank: "i32", num_ranks: "i32", normal_bases_ptr: "*i64", flag_bases_ptr: "*i64", state_ptr: "*i64",
        half_bytes: "i64", slots_x_offset: "i64", slots_w_offset: "i64",
        # the call's identity: its fingerprint, and its word on the call board (gpu/call_board.py)
        fp_offset: "i64", fp0: "i64", fp1: "i64",
        board_bases_ptr: "*i64",  # [R] int64: each rank's call board
        call_tag: "i64",  # this call's number and Buffer on the board (0: not posted, not checked)
        trace_ptr: "*i64",  # TRACE: the schedule's trace buffer (schedule.py)
        # meta-parameters
        HAS_WEIGHTS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr, K_P2: tl.constexpr,
        R_P2: tl.constexpr, ALIGNED: tl.constexpr, EXPERT_MAJOR: tl.constexpr, EVERY_PEER: tl.constexpr,
        TRACE: tl.constexpr):
    # EXPERT_MAJOR: the fold is expert_major.py's. ALIGNED: x and its rows are 16-byte aligned (copy.py).
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    x_words = multiple(x_words, 2, ALIGNED)
    epoch = tl.load(state_ptr + sync.EPOCH_NORMAL) + 1
    half_offset = (epoch % 2) * half_bytes
    if pid == 0:
        post_fingerprint_to_peers(flag_bases_ptr, fingerprint_half(fp_offset, epoch % 2, num_ranks), rank, num_ranks,
                                  state_ptr, fp0, fp1, epoch, HAS_MASK=False, R_P2=R_P2)
        post_call_to_peers(board_bases_ptr, rank, num_ranks, call_tag, fp0, tl.arange(0, R_P2) < num_ranks, R_P2)
    # -- each program takes its blocks: one home's rows each, every home at once (schedule.py)
    starts, ends, blocks = source_blocks(prefix_ptr, rank, num_ranks, num_rows, BLOCK_R, R_P2)
    round_idx = 0
    round_start = 0
    round_size = tl.sum((blocks > 0).to(tl.int32), axis=0)
    for item in range(pid, tl.sum(blocks, axis=0), num_programs):
        if TRACE:
            started = now_ns()
        round_idx, round_start, round_size = advance_round(item, round_idx, round_start, round_size, blocks)
        home, first, end, _ = item_block(item, round_idx, round_start, rank, num_ranks, starts, ends, blocks, BLOCK_R,
                                         R_P2, EVERY_PEER)
        rows = first + tl.arange(0, BLOCK_R)
        in_out = rows < end
        token = tl.load(src_idx_ptr + rows, mask=in_out, other=-1)
        move = in_out & (token >= token_lo) & (token < token_hi)
        slot = (token - token_lo).to(tl.int64) * num_ranks + rank
        base = tl.load(normal_bases_ptr + home) + half_offset
        if EXPERT_MAJOR:
            fold_expert_major_rows(x_ptr.to(tl.pointer_type(tl.bfloat16), bitcast=True), weights_ptr, dest_ptr,
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
        if TRACE:
            trace_item(trace_ptr, home, end - first, started)
    # -- the last program to arrive releases the epoch
    if arrive(state_ptr + sync.ARRIVE_PUSH, num_programs):
        tl.store(state_ptr + sync.EPOCH_NORMAL, epoch)
        signal_peers(flag_bases_ptr, sync.FLAGS_NORMAL * num_ranks * 8, rank, num_ranks, epoch, state_ptr,
                     (state_ptr + sync.SPARE).to(tl.int64), HAS_MASK=False,
                     R_P2=R_P2)  # RELEASE: pushed rows, fingerprint -> their homes


PUSH = KernelSpec(ep_combine_push, aligned_if={"ALIGNED": ["x_ptr"]})


# ====================================================================== combine: reduce
# ep_combine_reduce: each token's slots summed at home; grid = programs striding over tokens.
#
#   epoch = EPOCH_NORMAL (the push's);  ACQUIRE every rank's flag == epoch and compare fingerprints
#           (any difference, a timeout, a rank elsewhere on the board: nothing is reduced, the round's
#           out rows are NaN, the host raises at the next call)
#   for t in [token_lo, token_hi):
#       out[t]   = bf16( Σ_{j: is_token_in_rank[t, j]} float32(slots_x[t - token_lo, j]) + biases[t] )
#       out_w[t] = Σ_j slots_w[t - token_lo, j]                          (HAS_WEIGHTS)
@triton.jit
def ep_combine_reduce(
        # the call's tensors
        in_rank_ptr: "*i8",  # [T, R] int8 is_token_in_rank
        out_ptr: "*bf16",  # [T, H] bf16
        out_w_ptr: "*fp32",  # [T, K] float32 (HAS_WEIGHTS)
        bias0_ptr: "*bf16", bias1_ptr: "*bf16",  # [T, H] bf16 (NUM_BIAS of them)
        # sizes: this round's tokens [token_lo, token_hi) of num_tokens
        num_tokens: "i32", token_lo: "i32", token_hi: "i32", hidden: "i32", num_topk: "i32",
        # this rank and the workspaces (offsets are from a workspace half)
        rank: "i32", num_ranks: "i32", normal_bases_ptr: "*i64", flag_bases_ptr: "*i64", state_ptr: "*i64",
        half_bytes: "i64", slots_x_offset: "i64", slots_w_offset: "i64",
        # the host: its mailbox (sync.py), the timeout of a wait
        mailbox_address: "i64", timeout_ns: "i64",
        # the call's identity: its fingerprint, and its word on the call board (gpu/call_board.py)
        fp_offset: "i64", fp0: "i64", fp1: "i64",
        board_bases_ptr: "*i64",  # [R] int64: each rank's call board
        call_tag: "i64",  # this call's number and Buffer on the board (0: not checked)
        # meta-parameters
        NUM_BIAS: tl.constexpr, HAS_WEIGHTS: tl.constexpr, R_P2: tl.constexpr,
        BLOCK_C: tl.constexpr, K_P2: tl.constexpr, ALIGNED: tl.constexpr):
    # ALIGNED: hidden % 8 == 0 and the biases are 16-byte aligned (copy.py).
    pid = tl.program_id(0)
    hidden = multiple(hidden, 8, ALIGNED)
    num_programs = tl.num_programs(0)
    epoch = tl.load(state_ptr + sync.EPOCH_NORMAL)
    expected_hi = token_hi
    token_hi = token_lo + acquire_and_agree(flag_bases_ptr, state_ptr, mailbox_address, epoch, rank, num_ranks,
                                             timeout_ns, fp_offset, fp0, fp1, token_hi - token_lo,
                                             tl.load(board_bases_ptr + rank), call_tag,
                                             R_P2)  # ACQUIRE: rows pushed here
    if token_hi < expected_hi:  # the wait gave up, or a rank is in another call: no contribution is known
        missing = tl.maximum(tl.minimum(expected_hi, num_tokens) - token_lo, 0)  # (to NaN: no plausible data)
        fill_nan(out_ptr + token_lo.to(tl.int64) * hidden, missing * hidden, pid, num_programs, BLOCK_C)
        if HAS_WEIGHTS:
            fill_nan(out_w_ptr + token_lo.to(tl.int64) * num_topk, missing * num_topk, pid, num_programs, 1024)
    half = tl.load(normal_bases_ptr + rank) + (epoch % 2) * half_bytes
    slots_x = ptr_at(half + slots_x_offset, tl.bfloat16, ALIGNED)
    slots_w = (half + slots_w_offset).to(tl.pointer_type(tl.float32))
    ranks = tl.arange(0, R_P2)
    cols = tl.arange(0, BLOCK_C)
    # -- each program takes tokens pid, pid + P, ...: sum the present slots, column block by block
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


REDUCE = KernelSpec(ep_combine_reduce, aligned_if={"ALIGNED": ["out_ptr", "bias0_ptr", "bias1_ptr"]})
