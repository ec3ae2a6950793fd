"""Combine, "push and reduce": the push stores every received row into slot ``(token, own rank)``
of the token's home (expert-major rows folded first); the reduce sums the slots present in
``is_token_in_rank`` in float32 at home.

Two ways to run them (the host picks, mode.py):

- **overlapped** (``ep_combine``, one launch): the push programs release a flag per block of rows
  they store, and the reduce programs of the same launch sum each chunk of tokens as soon as the
  blocks holding its contributions have landed — the reduce runs while the pushes (this rank's and
  the peers') are still in flight, instead of after a barrier (issue "every link busy");
- **in turn** (``ep_combine_push`` ; ``ep_combine_reduce``): a barrier between them; for combines
  of several rounds, and for side-by-side measurements.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ... import sync
from ...agreement import acquire_and_agree
from ...copy import copy_rows, fill_nan, multiple, ptr_at, word_ptr
from ...expert_major_kernels import fold_expert_major_rows
from ...launch import KernelSpec
from ...sync import (all_landed, arrive, fingerprint_half, gave_up_here, mailbox_words, now_ns, poll_epochs,
                     poll_epochs_or_other_call, post_call_to_peers, post_fingerprint_to_peers,
                     publish_from_one_thread, record_elsewhere, report_late, signal_peers)
from ...warps import cta_any, store_from_every_warp, vote_any
from .schedule import advance_round, item_block, source_blocks, trace_item


# ====================================================================== combine: push
# The push: every received row back to its home, into slot (token, this rank).
#
#   epoch = EPOCH_NORMAL + 1;  program 0: post the call's fingerprint and board word on every peer
#   the rows are the dispatch's, grouped by home in rank order (rank_prefix_matrix's column); they
#   are taken in blocks of one home, every home at once (schedule.py):
#   for each block b (home, rows [first, end)) of this program, each row r with token = src_idx[r]
#   in [token_lo, token_hi):
#       home.half(epoch % 2).slots_x[token - token_lo, rank] <- x[r]     (NVLink stores)
#           EXPERT_MAJOR: x[r] = Σ_k weight · y[dest[r, k]] first (float32, the fold)
#       home.half.slots_w[token - token_lo, rank] <- topk_weights[r]    (HAS_WEIGHTS)
#       OVERLAP: RELEASE home.block_flags[rank][b] = epoch (one thread, after a CTA barrier): the
#                home's reduce programs that acquire it see the block's rows
#   last to arrive:  (in turn: EPOCH_NORMAL = epoch;)  RELEASE epoch to every peer's flag: the home
#                    that acquires it sees every row stored for it (and, through the chain of
#                    sync.py, that this rank is done reading its own half of two calls ago)
#   (the slots are free: the home read this half two barriers ago; halves alternate, sync.py)
@triton.jit
def _push(pid, num_programs, epoch,
          x_ptr, weights_ptr, prefix_ptr, src_idx_ptr, dest_ptr,
          num_rows, token_lo, token_hi, x_words, num_topk,
          rank, num_ranks, normal_bases_ptr, flag_bases_ptr, state_ptr, half_bytes, slots_x_offset, slots_w_offset,
          block_flags_offset, block_flag_cap,
          fp_offset, fp0, fp1, board_bases_ptr, call_tag, trace_ptr,
          HAS_WEIGHTS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr, K_P2: tl.constexpr,
          R_P2: tl.constexpr, ALIGNED: tl.constexpr, EXPERT_MAJOR: tl.constexpr, EVERY_PEER: tl.constexpr,
          TRACE: tl.constexpr, OVERLAP: tl.constexpr):
    x_words = multiple(x_words, 2, ALIGNED)
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
        home, first, end, home_start = item_block(item, round_idx, round_start, round_size, rank, num_ranks, starts,
                                                  ends, blocks, BLOCK_R, R_P2, EVERY_PEER)
        rows = first + tl.arange(0, BLOCK_R)
        in_out = rows < end
        token = tl.load(src_idx_ptr + rows, mask=in_out, other=-1)
        move = in_out & (token >= token_lo) & (token < token_hi)
        slot = (token - token_lo).to(tl.int64) * num_ranks + rank
        home_base = tl.load(normal_bases_ptr + home)
        base = home_base + half_offset
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
        if OVERLAP:  # RELEASE: this block's rows -> the home's reduce programs (which ACQUIRE the word)
            block = (first - home_start) // BLOCK_R
            publish_from_one_thread(home_base + block_flags_offset + (rank.to(tl.int64) * block_flag_cap + block) * 8,
                                    epoch)
        if TRACE:
            trace_item(trace_ptr, pid, home, end - first, started)
    # -- the last program to arrive releases the epoch
    if arrive(state_ptr + sync.ARRIVE_PUSH, num_programs):
        if not OVERLAP:  # (overlapped: the reduce's last program stores it, once every program has read it)
            tl.store(state_ptr + sync.EPOCH_NORMAL, epoch)
        signal_peers(flag_bases_ptr, sync.FLAGS_NORMAL * num_ranks * 8, rank, num_ranks, epoch, state_ptr,
                     (state_ptr + sync.SPARE).to(tl.int64), HAS_MASK=False,
                     R_P2=R_P2)  # RELEASE: pushed rows, fingerprint -> their homes


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
    # The push alone (the combine in turn); grid = num_sms. EXPERT_MAJOR: the fold is expert_major.py's.
    # ALIGNED: x and its rows are 16-byte aligned (copy.py).
    _push(tl.program_id(0), tl.num_programs(0), tl.load(state_ptr + sync.EPOCH_NORMAL) + 1,
          x_ptr, weights_ptr, prefix_ptr, src_idx_ptr, dest_ptr, num_rows, token_lo, token_hi, x_words, num_topk,
          rank, num_ranks, normal_bases_ptr, flag_bases_ptr, state_ptr, half_bytes, slots_x_offset, slots_w_offset,
          0, 0, fp_offset, fp0, fp1, board_bases_ptr, call_tag, trace_ptr,
          HAS_WEIGHTS, BLOCK_R, BLOCK_W, K_P2, R_P2, ALIGNED, EXPERT_MAJOR, EVERY_PEER, TRACE, OVERLAP=False)


PUSH = KernelSpec(ep_combine_push, aligned_if={"ALIGNED": ["x_ptr"]})


# ====================================================================== combine: reduce
@triton.jit
def _reduce_token(token, in_rank_ptr, out_ptr, out_w_ptr, bias0_ptr, bias1_ptr, slots_x, slots_w, token_lo, hidden,
                  num_topk, num_ranks, NUM_BIAS: tl.constexpr, HAS_WEIGHTS: tl.constexpr, R_P2: tl.constexpr,
                  BLOCK_C: tl.constexpr, K_P2: tl.constexpr, RANK_LOOP: tl.constexpr):
    """out[token] = bf16(Σ float32 slots present in is_token_in_rank + biases), column block by
    block; out_w[token] = Σ slots_w (HAS_WEIGHTS). The slots were acquired by the caller.

    RANK_LOOP (the default, NormalMode.rank_loop_reduce): the sum over ranks one [BLOCK_C] row at
    a time, in rank order, unrolled so every rank's loads are in flight at once. Every warp then
    holds columns of each row and nothing meets the other warps. Without it the [R_P2, BLOCK_C]
    tile splits its ranks over two warps from R_P2 = 8 on (BLOCK_C = 16384 / R_P2), so its sum,
    the store and the weights' sum go through shared memory, with barriers, per token: the
    one-launch combine took 697 µs against 146 with RANK_LOOP, compiled for 8 ranks' lanes on one
    H100 (108 at one rank's). The sums' float32 order differs (rank order, against the tile's tree)."""
    ranks = tl.arange(0, R_P2)
    cols = tl.arange(0, BLOCK_C)
    t64 = token.to(tl.int64)
    present = tl.load(in_rank_ptr + t64 * num_ranks + ranks, mask=ranks < num_ranks, other=0) != 0
    slot = (t64 - token_lo) * num_ranks + ranks
    first_slot = (t64 - token_lo) * num_ranks
    for c0 in range(0, hidden, BLOCK_C):
        c = c0 + cols
        cm = c < hidden
        if RANK_LOOP:
            acc = tl.zeros([BLOCK_C], tl.float32)
            for j in tl.static_range(R_P2):
                here = tl.load(in_rank_ptr + t64 * num_ranks + j, mask=j < num_ranks, other=0) != 0
                acc += tl.load(slots_x + (first_slot + j) * hidden + c, mask=cm & here, other=0.0).to(tl.float32)
        else:
            rows = tl.load(slots_x + slot[:, None] * hidden + c[None, :], mask=present[:, None] & cm[None, :],
                           other=0.0)
            acc = tl.sum(rows.to(tl.float32), axis=0)
        if NUM_BIAS >= 1:
            acc += tl.load(bias0_ptr + t64 * hidden + c, mask=cm, other=0.0).to(tl.float32)
        if NUM_BIAS >= 2:
            acc += tl.load(bias1_ptr + t64 * hidden + c, mask=cm, other=0.0).to(tl.float32)
        tl.store(out_ptr + t64 * hidden + c, acc.to(tl.bfloat16), mask=cm)
    if HAS_WEIGHTS:
        k = tl.arange(0, K_P2)
        if RANK_LOOP:
            w = tl.zeros([K_P2], tl.float32)
            for j in tl.static_range(R_P2):
                here = tl.load(in_rank_ptr + t64 * num_ranks + j, mask=j < num_ranks, other=0) != 0
                w += tl.load(slots_w + (first_slot + j) * num_topk + k, mask=(k < num_topk) & here, other=0.0)
        else:
            w = tl.sum(tl.load(slots_w + slot[:, None] * num_topk + k[None, :],
                               mask=present[:, None] & (k < num_topk)[None, :], other=0.0), axis=0)
        tl.store(out_w_ptr + t64 * num_topk + k, w, mask=k < num_topk)


@triton.jit
def _nan_outputs(out_ptr, out_w_ptr, token_lo, num_missing, hidden, num_topk, program, num_programs,
                 HAS_WEIGHTS: tl.constexpr, BLOCK_C: tl.constexpr):
    """NaN into out rows [token_lo, token_lo + num_missing) (and out_w's): rows the call knows are
    missing get no plausible data (DESIGN section 5); the host raises at the next call."""
    fill_nan(out_ptr + token_lo.to(tl.int64) * hidden, num_missing * hidden, program, num_programs, BLOCK_C)
    if HAS_WEIGHTS:
        fill_nan(out_w_ptr + token_lo.to(tl.int64) * num_topk, num_missing * num_topk, program, num_programs, 1024)


# ep_combine_reduce (the combine in turn): each token's slots summed at home; grid = programs striding over tokens.
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
        BLOCK_C: tl.constexpr, K_P2: tl.constexpr, ALIGNED: tl.constexpr, RANK_LOOP: tl.constexpr):
    # ALIGNED: hidden % 8 == 0 and the biases are 16-byte aligned (copy.py). RANK_LOOP: _reduce_token.
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
        _nan_outputs(out_ptr, out_w_ptr, token_lo, missing, hidden, num_topk, pid, num_programs, HAS_WEIGHTS, BLOCK_C)
    half = tl.load(normal_bases_ptr + rank) + (epoch % 2) * half_bytes
    slots_x = ptr_at(half + slots_x_offset, tl.bfloat16, ALIGNED)
    slots_w = (half + slots_w_offset).to(tl.pointer_type(tl.float32))
    # -- each program takes tokens pid, pid + P, ...: sum the present slots, column block by block
    for token in range(token_lo + pid, tl.minimum(token_hi, num_tokens), num_programs):
        _reduce_token(token, in_rank_ptr, out_ptr, out_w_ptr, bias0_ptr, bias1_ptr, slots_x, slots_w, token_lo,
                      hidden, num_topk, num_ranks, NUM_BIAS, HAS_WEIGHTS, R_P2, BLOCK_C, K_P2, RANK_LOOP)


REDUCE = KernelSpec(ep_combine_reduce, aligned_if={"ALIGNED": ["out_ptr", "bias0_ptr", "bias1_ptr"]})


# ====================================================================== combine: overlapped
# ep_combine: push and reduce in one launch; grid = num_push push programs (the lowest program ids:
# the hardware starts them first, so waiting reduce programs never hold the SMs they need), then
# reduce programs. The reduce programs take chunks of BLOCK_R tokens c = q, q + Q, ... (tokens
# ascending, as the pushes land: every pusher stores a home's rows in ascending token order, round
# by round — schedule.py):
#
#   epoch = EPOCH_NORMAL + 1 (the push's, read by every program before the last reduce stores it)
#   push programs:   the push above, with a RELEASE per block (OVERLAP)
#   reduce program q, for each chunk [t0, t0 + BLOCK_R) of its tokens:
#       for each pusher p the chunk has tokens of: the chunk's tokens on p's list are consecutive
#       (list_index[t, p], kept with the handle), so they lie in p's blocks
#       list_index[first] // BLOCK_R .. list_index[last] // BLOCK_R: at most two
#       ACQUIRE block_flags[p][b] >= epoch for those blocks (a timeout, or p on the call board in
#           another call: reported, this program's chunks from then on are NaN, GAVE_UP = epoch
#           stops the others' waits); decided by the program's vote, or (WARPS_APART, below) by
#           each warp's for its own columns
#       sum the chunk's tokens (the reduce above)
#   last reduce program to arrive:
#       ACQUIRE every rank's end-of-push epoch and compare fingerprints (acquire_and_agree): the
#           half-reuse chain of sync.py needs every peer's signal, not only the blocks with rows
#           here, and the check is the call's verdict: a difference, or a wait that gave up,
#           NaNs the whole output (rows are already written)
#       EPOCH_NORMAL = epoch
@triton.jit
def chunk_blocks(in_rank_ptr, list_index_ptr, t0, num_tokens, num_ranks, BLOCK_R: tl.constexpr, R_P2: tl.constexpr,
                 BY_TOKEN: tl.constexpr):
    """Per pusher ([R_P2] lanes): the first and last of its blocks holding a contribution to tokens
    [t0, t0 + BLOCK_R) (a token's index in a pusher's list, // BLOCK_R), or 1 << 30 and -1 where
    none does. BY_TOKEN reads the chunk token by token on [R_P2] lanes, every warp holding them
    whole; the [BLOCK_R, R_P2] tile's column reductions may come out in a layout whose later
    reductions meet the other warps through shared memory (what ep_combine's WARPS_APART avoids)."""
    peers = tl.arange(0, R_P2)
    if BY_TOKEN:
        first_block = tl.full([R_P2], 1 << 30, tl.int32)
        last_block = tl.full([R_P2], -1, tl.int32)
        for i in tl.static_range(BLOCK_R):
            lane = (peers < num_ranks) & (t0 + i < num_tokens)
            cell = tl.cast(t0 + i, tl.int64) * num_ranks + peers  # (tl.cast: a plain int under the interpreter)
            here = (tl.load(in_rank_ptr + cell, mask=lane, other=0) != 0) & lane
            block = tl.load(list_index_ptr + cell, mask=here, other=0) // BLOCK_R
            first_block = tl.minimum(first_block, tl.where(here, block, 1 << 30))
            last_block = tl.maximum(last_block, tl.where(here, block, -1))
    else:
        tokens = t0 + tl.arange(0, BLOCK_R)
        lanes = (tokens < num_tokens)[:, None] & (peers < num_ranks)[None, :]
        cells = tokens.to(tl.int64)[:, None] * num_ranks + peers[None, :]
        present = (tl.load(in_rank_ptr + cells, mask=lanes, other=0) != 0) & lanes
        block = tl.load(list_index_ptr + cells, mask=present, other=0) // BLOCK_R
        first_block = tl.min(tl.where(present, block, 1 << 30), axis=0)
        last_block = tl.max(tl.where(present, block, -1), axis=0)
    return first_block, last_block


@triton.jit
def ep_combine(
        # the call's tensors
        x_ptr: "*i8",  # [N, x_bytes] bytes of the bf16 expert outputs (dispatch's row order; expert-major: [M])
        weights_ptr: "*fp32",  # [N, K] float32 (HAS_WEIGHTS); expert-major: [M] float32 each row's weight
        prefix_ptr: "*i32",  # [R, R] int32 the dispatch's rank_prefix_matrix: where each home's rows start
        src_idx_ptr: "*i32",  # [N] int32: token of each row at its home (-1 = padding)
        dest_ptr: "*i32",  # [N, K] int32 (EXPERT_MAJOR): expert-major row of entry (r, k), -1 = none
        in_rank_ptr: "*i8",  # [T, R] int8 is_token_in_rank
        list_index_ptr: "*i32",  # [T, R] int32 each token's index in the list of each rank it went to
        out_ptr: "*bf16",  # [T, H] bf16
        out_w_ptr: "*fp32",  # [T, K] float32 (HAS_WEIGHTS)
        bias0_ptr: "*bf16", bias1_ptr: "*bf16",  # [T, H] bf16 (NUM_BIAS of them)
        # sizes: one round: the homes' tokens are below round_tokens, this rank's are [0, num_tokens)
        num_rows: "i32", round_tokens: "i32", num_tokens: "i32", x_words: "i32", hidden: "i32", num_topk: "i32",
        num_push: "i32",
        # this rank and the workspaces (offsets are from a workspace half; block flags from a workspace)
        rank: "i32", num_ranks: "i32", normal_bases_ptr: "*i64", flag_bases_ptr: "*i64", state_ptr: "*i64",
        half_bytes: "i64", slots_x_offset: "i64", slots_w_offset: "i64", block_flags_offset: "i64",
        block_flag_cap: "i64",
        # the host: its mailbox (sync.py), the timeout of a wait
        mailbox_address: "i64", timeout_ns: "i64",
        # the call's identity: its fingerprint, and its word on the call board (gpu/call_board.py)
        fp_offset: "i64", fp0: "i64", fp1: "i64",
        board_bases_ptr: "*i64",  # [R] int64: each rank's call board
        call_tag: "i64",  # this call's number and Buffer on the board (0: not posted, not checked)
        trace_ptr: "*i64",  # TRACE: the schedule's trace buffer (schedule.py)
        # meta-parameters
        HAS_WEIGHTS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr, K_P2: tl.constexpr,
        R_P2: tl.constexpr, ALIGNED: tl.constexpr, EXPERT_MAJOR: tl.constexpr, EVERY_PEER: tl.constexpr,
        TRACE: tl.constexpr, NUM_BIAS: tl.constexpr, BLOCK_C: tl.constexpr, OUT_ALIGNED: tl.constexpr,
        RANK_LOOP: tl.constexpr, WARPS_APART: tl.constexpr):
    # ALIGNED: x and its rows are 16-byte aligned; OUT_ALIGNED: hidden % 8 == 0 and out, the biases
    # are 16-byte aligned (copy.py).
    # WARPS_APART (an experiment, off by default: NormalMode.reduce_warps_apart): each warp of a
    # reduce program decides its chunks' waits alone (warps.warp_all / warp_any), so the chunk loop
    # holds no barrier and the warps run their chunks apart, as the overlapped pull's items do
    # (dispatch.py). Only where nothing in the loop meets the other warps: RANK_LOOP's sums (each
    # warp its own columns of every row) and a chunk head of at most 64 [token, rank] lanes, which
    # every warp holds whole (tests/test_kernel_votes.py compiles both sides). A warp that gives up
    # stores GAVE_UP from every warp and skips its share; the verdict then NaNs the whole output.
    WARP_WAITS: tl.constexpr = WARPS_APART and RANK_LOOP and (BLOCK_R * R_P2 <= 64)
    pid = tl.program_id(0)
    epoch = tl.load(state_ptr + sync.EPOCH_NORMAL) + 1
    if pid < num_push:
        _push(pid, num_push, epoch,
              x_ptr, weights_ptr, prefix_ptr, src_idx_ptr, dest_ptr, num_rows, 0, round_tokens, x_words, num_topk,
              rank, num_ranks, normal_bases_ptr, flag_bases_ptr, state_ptr, half_bytes, slots_x_offset,
              slots_w_offset, block_flags_offset, block_flag_cap, fp_offset, fp0, fp1, board_bases_ptr, call_tag,
              trace_ptr, HAS_WEIGHTS, BLOCK_R, BLOCK_W, K_P2, R_P2, ALIGNED, EXPERT_MAJOR, EVERY_PEER, TRACE,
              OVERLAP=True)
    else:
        hidden = multiple(hidden, 8, OUT_ALIGNED)
        q = pid - num_push
        num_reduce = tl.num_programs(0) - num_push
        my_base = tl.load(flag_bases_ptr + rank)
        my_block_flags = (my_base + block_flags_offset).to(tl.pointer_type(tl.int64))
        half = tl.load(normal_bases_ptr + rank) + (epoch % 2) * half_bytes
        slots_x = ptr_at(half + slots_x_offset, tl.bfloat16, OUT_ALIGNED)
        slots_w = (half + slots_w_offset).to(tl.pointer_type(tl.float32))
        timeouts, _dropped, agreement, _notify = mailbox_words(mailbox_address, num_ranks)
        board_address = tl.load(board_bases_ptr + rank)
        peers = tl.arange(0, R_P2)
        # A pusher that aborted, or is in a combine of other arguments, never stores the blocks
        # awaited: its fingerprint row ends the wait for it — other words in this call's half, or
        # an abort row covering this call in either half (the abort leaves the half of its last
        # call alone, and stamps the flags, not these blocks: agreement.ep_abort) — and the
        # verdict at the end NaNs the output; one in another call: the call board (elsewhere).
        sender_rows = (my_base + fingerprint_half(fp_offset, epoch % 2, num_ranks)).to(tl.pointer_type(tl.int64)) + \
            peers * (sync.FP_ROW // 8)
        other_rows = (my_base + fingerprint_half(fp_offset, 1 - epoch % 2, num_ranks)).to(tl.pointer_type(tl.int64)) + \
            peers * (sync.FP_ROW // 8)
        chunk = tl.arange(0, BLOCK_R)
        gave_up = 0
        for t0 in range(q * BLOCK_R, num_tokens, num_reduce * BLOCK_R):
            tokens = t0 + chunk
            first_block, last_block = chunk_blocks(in_rank_ptr, list_index_ptr, t0, num_tokens, num_ranks, BLOCK_R,
                                                   R_P2, BY_TOKEN=WARP_WAITS)
            needed = last_block >= 0
            for which in tl.static_range(2):
                if gave_up == 0:
                    b = tl.where(needed, first_block if which == 0 else last_block, 0)
                    words = my_block_flags + peers * block_flag_cap + tl.minimum(b, block_flag_cap - 1)
                    if all_landed(words, needed, epoch, WARP_WAITS) == 0:  # ACQUIRE: the blocks. rows (or wait)
                        gave_up = gave_up_here(state_ptr, epoch, tokens, WARP_WAITS)  # another program gave up: stop
                        if gave_up == 0:
                            _words, _waited, late, elsewhere = poll_epochs_or_other_call(  # ACQUIRE: the blocks' rows
                                words, needed, epoch, timeout_ns, sender_rows, other_rows, fp0, fp1, board_address,
                                call_tag, EPOCH_SHIFT=0, CHECK_ROWS=True, CHECK_BOARD=True)
                            report_late(late, peers, state_ptr, timeouts, MASK_ON_TIMEOUT=False)
                            record_elsewhere(board_address, peers, elsewhere, call_tag, fp0, agreement, num_ranks)
                            # (a vote: the warps' clocks may disagree; its barrier, the warp's with WARP_WAITS,
                            # orders the polls before the loads of the slots, as all_landed's does on the fast path)
                            if vote_any(tl.max((late | elsewhere).to(tl.int32), axis=0), WARP_WAITS) != 0:
                                gave_up = 1
                                if WARP_WAITS:  # (a plain store of one lane is the first warp's alone)
                                    store_from_every_warp((state_ptr + sync.GAVE_UP + peers * 0).to(tl.int64),
                                                          tl.zeros([R_P2], tl.int64) + epoch, peers == 0, WIDE=True)
                                else:
                                    tl.store(state_ptr + sync.GAVE_UP, epoch)
            chunk_end = tl.minimum(t0 + BLOCK_R, num_tokens)
            if gave_up != 0:  # a contribution is missing: no plausible data
                if not WARP_WAITS:  # (a warp alone skips its share: the verdict NaNs every row)
                    _nan_outputs(out_ptr, out_w_ptr, t0, chunk_end - t0, hidden, num_topk, 0, 1, HAS_WEIGHTS,
                                 BLOCK_C)
            else:
                for token in range(t0, chunk_end):
                    _reduce_token(token, in_rank_ptr, out_ptr, out_w_ptr, bias0_ptr, bias1_ptr, slots_x, slots_w, 0,
                                  hidden, num_topk, num_ranks, NUM_BIAS, HAS_WEIGHTS, R_P2, BLOCK_C, K_P2, RANK_LOOP)
        # -- the last reduce program: the call's verdict, and the epoch
        if arrive(state_ptr + sync.ARRIVE_RECEIVE, num_reduce):
            failed = cta_any(tl.load(state_ptr + sync.GAVE_UP, volatile=True) == epoch) != 0  # (one reading for all)
            if failed:  # (no second timeout: wait only for this rank's own push, which reads the epoch)
                poll_epochs((my_base + sync.NORMAL_FLAG_SET * num_ranks * 8).to(tl.pointer_type(tl.int64)) + peers,
                            peers == rank, epoch, timeout_ns, EPOCH_SHIFT=0)
            else:
                failed = acquire_and_agree(flag_bases_ptr, state_ptr, mailbox_address, epoch, rank, num_ranks,
                                           timeout_ns, fp_offset, fp0, fp1, 1, board_address, call_tag,
                                           R_P2) == 0  # ACQUIRE: every rank's end of push
            if failed:
                _nan_outputs(out_ptr, out_w_ptr, q * 0, num_tokens, hidden, num_topk, 0, 1, HAS_WEIGHTS, BLOCK_C)
            tl.store(state_ptr + sync.EPOCH_NORMAL, epoch)


PUSH_REDUCE = KernelSpec(ep_combine, aligned_if={"ALIGNED": ["x_ptr"],
                                                 "OUT_ALIGNED": ["out_ptr", "bias0_ptr", "bias1_ptr"]})
