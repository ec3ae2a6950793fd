"""Dispatch, "stage and pull": the stage (stage.py) copies this rank's tokens (x, scales, top-k,
expert-major positions) into its own workspace half and lists, per destination, the tokens it sends; the pull
has every receiver acquire the sources' releases and pull its rows straight into ``recv_x`` at
rank-prefix offsets (package docstring: the order).

Two ways to run them (the host picks, mode.py):

- **overlapped** (``ep_dispatch``, one launch; a one-round dispatch in the plain layout): the stage
  programs release each list and each block of staged rows on its own, and the pull programs of
  the same launch start on a source's rows as soon as their blocks are staged — instead of after
  a barrier (issue "every link busy");
- **in turn** (``ep_dispatch_stage`` ; ``ep_dispatch_pull``): a barrier between them; for several
  rounds, the expert-major layout, and side-by-side measurements.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ... import sync
from ...copy import (NAN_BF16_WORD, NAN_E4M3_WORD, copy_rows, fill_nan, fill_rows, fill_value, multiple, ptr_at,
                    word_ptr)
from ...agreement import acquire_and_agree
from ...launch import KernelSpec
from ...sync import (DOORBELL_WORDS, RING_GO, all_landed, arrive, await_doorbell, fingerprint_half, gave_up_here,
                     load_acquire_sys, mailbox_words, now_ns, poll_epochs, poll_from_senders, record_elsewhere,
                     report_late)
from ...warps import cta_any, store_from_every_warp, vote_all, vote_any
from .expert_major_rows import pull_expert_major, staged_topk, zero_padding_rows
from .receive_index import gather_index, list_of
from .notify import _notify, await_notified
from .stage import _stage
from .schedule import advance_round, item_block, source_blocks, trace_item


# The overlapped pull looks at every source's end of stage once every this many items it waited for.
STAGE_END_EVERY = tl.constexpr(4)


# ====================================================================== dispatch: pull
# ep_dispatch_pull: every receiver pulls its rows from the sources' staging halves; grid =
# NormalMode.pull_programs_per_sm x num_sms (choices.py, PULL_PROGRAMS_PER_SM).
#
#   epoch = EPOCH_NORMAL (the stage's);  ACQUIRE every source's flag == epoch (a timeout, or a source
#           the call board shows in another call, goes to the mailbox), then compare the sources'
#           fingerprints with this call's: any difference (an abort too) -> num_rows = 0, the host raises
#   received rows are grouped by source in rank order (rank_prefix_matrix's column), source token
#   order within; they are taken in blocks of one source, every source at once (schedule.py):
#   for each block (src, rows [first, end)) of this program:
#       INDEX:  token = src.lists[rank][r - start of src]  -> src_idx[r]
#               (PUSHED_LISTS: my.lists[src][...], stored here by src: receive_index.list_of)
#               (a cached dispatch reads src_idx back instead)
#       if token in [token_lo, token_hi):                 (this round's part of the source's batch)
#           recv_x[r], recv_scales[r] <- src.half.x[token], src.half.scales[token]
#           recv_topk[r] <- local expert id or -1 (weight 0 for other ranks' experts)
#       EXPERT_MAJOR: the row goes to table[src][e] + its position, once per local entry (e)
#   rows past the received total (num_worst_tokens padding): src_idx -1, top-k -1
@triton.jit
def _pull(pid, num_programs, epoch,
          prefix_ptr, src_idx_ptr, recv_x_ptr, recv_scales_ptr, recv_topk_ptr, recv_weights_ptr,
          table_ptr, dest_ptr,
          num_rows, token_lo, token_hi, x_words, num_scales, num_topk, expert_lo, num_local, num_em_rows,
          zero_padding,
          rank, num_ranks, normal_bases_ptr, flag_bases_ptr, state_ptr, half_bytes, lists_offset, list_cap, x_offset,
          scales_offset, topk_offset, topk_row_bytes, block_flags_offset, block_flag_cap,
          mailbox_address, timeout_ns, fp_offset, fp0, fp1, board_bases_ptr, call_tag, trace_ptr,
          INDEX: tl.constexpr, HAS_SCALES: tl.constexpr, HAS_TOPK: tl.constexpr,
          BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr, S_P2: tl.constexpr, K_P2: tl.constexpr,
          R_P2: tl.constexpr, ALIGNED: tl.constexpr, EXPERT_MAJOR: tl.constexpr, EVERY_PEER: tl.constexpr,
          TRACE: tl.constexpr, PIPELINE: tl.constexpr, OVERLAP: tl.constexpr, SIDE_FIRST: tl.constexpr,
          GATHER_INDEX: tl.constexpr, PUSHED_LISTS: tl.constexpr):
    # GATHER_INDEX (an experiment, off by default; a full dispatch's pull in turn): the receive
    # index is gathered before the items — every program a share of the rows, GATHER_ROWS list
    # entries in flight at once — then each item reads its entries here, as a
    # cached dispatch does, instead of from the source before the rows they name (two dependent
    # remote round trips per item: the full pull took 640-652 µs across 4 H200s, about the whole
    # cached dispatch in one launch; receive_index.py). A thread that finds the launch's barrier timed out reads its
    # entries from the source as before: the same values, so no outcome depends on the barrier.
    # SIDE_FIRST (the default; plain layout): an item's scales and top-k rows are loaded before its
    # x rows, not after them. After them, a warp issues those loads only once its x rows arrived and
    # were stored: a second remote round trip per item in an FP8 or a full dispatch (4 H200s,
    # T=4096: the FP8 cached dispatch 344-362 µs after, 301-307 before). Before them, both are in
    # flight together. Nothing else changes: the same loads after the same acquires, the same stores
    # to the same outputs.
    # EXPERT_MAJOR: entry (r, k)'s row (expert_major.py) is written to dest with HAS_TOPK and read
    # from it in a cached dispatch; with zero_padding the groups' padding rows are zeroed too.
    # PIPELINE (an experiment, off by default; plain layout, rows of one BLOCK_W chunk): an item's x
    # rows are stored only after the next item's loads are issued, so a program has a remote load in
    # flight while it stores (the plan halves BLOCK_R to keep two tiles in the same registers).
    # PUSHED_LISTS (the default: choices.py): the sources stored their lists for this rank
    # into its own workspace (receive_index.list_of), so INDEX reads each item's entries locally —
    # no remote round trip before the rows they name — after the same acquires (the stage's end,
    # or with OVERLAP the list's word: both released by the source after its remote list stores).
    # ALIGNED: rows are a multiple of 16 bytes (copy.py; the buffers are aligned).
    # OVERLAP (ep_dispatch, plain layout): no barrier first; each item waits for the blocks its rows
    # were staged in (and, INDEX, for its source's list), and the last program gives the verdict.
    # Where every warp holds an item's row lanes whole (BLOCK_R <= 32 rows, R_P2 <= 32 peers: every
    # real hidden size), each warp decides its waits alone (warps.warp_all / warp_any) and the item
    # loop holds no barrier, so a warp starts its next item's loads while others finish this one's.
    # With more rows the lanes span the warps, their reductions meet through shared memory, and the
    # decisions are the program's votes (tests/test_kernel_votes.py compiles both sides).
    WARP_WAITS: tl.constexpr = (BLOCK_R <= 32) and (R_P2 <= 32)
    x_words = multiple(x_words, 2, ALIGNED)
    half_offset = (epoch % 2) * half_bytes
    expected = num_rows
    peers = tl.arange(0, R_P2)
    if OVERLAP:  # what the waits for blocks need: this rank's block flags, the senders' fingerprint rows
        my_base = tl.load(flag_bases_ptr + rank)
        my_flags = (my_base + block_flags_offset).to(tl.pointer_type(tl.int64))
        rows_here = (my_base + fingerprint_half(fp_offset, epoch % 2, num_ranks)).to(tl.pointer_type(tl.int64))
        rows_other = (my_base + fingerprint_half(fp_offset, 1 - epoch % 2, num_ranks)).to(tl.pointer_type(tl.int64))
        board_address = tl.load(board_bases_ptr + rank)
        lists_seen = tl.zeros([R_P2], tl.int64)  # per source: the list word acquired ((epoch << 32) | entries)
        gave_up = 0
        staged_all = 0  # 1 once a vote found every source's stage ended: the later items wait for nothing
        waited_items = 0
    else:
        num_rows = acquire_and_agree(flag_bases_ptr, state_ptr, mailbox_address, epoch, rank, num_ranks, timeout_ns,
                                      fp_offset, fp0, fp1, num_rows, tl.load(board_bases_ptr + rank), call_tag,
                                      R_P2)  # ACQUIRE: staged rows and lists
        agreed = (num_rows >= expected).to(tl.int32)
        if num_rows < expected:  # the wait gave up, or a source is in another call: no row arrived
            if EXPERT_MAJOR:
                expected = num_em_rows
            _missing_rows(recv_x_ptr, recv_scales_ptr, recv_weights_ptr, expected, x_words, num_scales, num_topk, pid,
                          num_programs, HAS_SCALES, HAS_TOPK, EXPERT_MAJOR, BLOCK_R, BLOCK_W)
    # -- each program takes its blocks: one source's rows each, every source at once (schedule.py)
    here = tl.load(normal_bases_ptr + rank) + half_offset  # (PUSHED_LISTS: the lists, read here)
    starts, ends, blocks = source_blocks(prefix_ptr, rank, num_ranks, num_rows, BLOCK_R, R_P2)
    num_items = tl.where(num_rows > 0, tl.sum(blocks, axis=0), 0)  # (0: the agreement failed)
    round_idx = 0
    round_start = 0
    round_size = tl.sum((blocks > 0).to(tl.int32), axis=0)
    gathered = 0
    if GATHER_INDEX and INDEX and not OVERLAP:  # (every list was acquired above: acquire_and_agree)
        gathered = gather_index(pid, num_programs, epoch, starts, ends, rank, num_ranks, normal_bases_ptr, half_offset,
                                lists_offset, list_cap, src_idx_ptr, state_ptr, agreed,
                                R_P2, PUSHED_LISTS)  # (TRACE: the items' times leave the gather out)
    if PIPELINE:  # the previous item's x rows, not yet stored: values, destination rows, which are live
        cols = tl.arange(0, BLOCK_W)
        held = tl.zeros([BLOCK_R, BLOCK_W], tl.int64)
        held_rows = tl.zeros([BLOCK_R], tl.int64)
        held_live = tl.arange(0, BLOCK_R) < 0
    for item in range(pid, num_items, num_programs):
        if TRACE:
            started = now_ns()
        round_idx, round_start, round_size = advance_round(item, round_idx, round_start, round_size, blocks)
        src, first, end, src_start = item_block(item, round_idx, round_start, round_size, rank, num_ranks, starts, ends,
                                                blocks, BLOCK_R, R_P2, EVERY_PEER)
        rows = first + tl.arange(0, BLOCK_R)
        in_out = rows < end
        staged = tl.load(normal_bases_ptr + src) + half_offset
        if OVERLAP:
            if INDEX:  # the source's list, up to this item's entries (it grows as the source writes it)
                listed = (epoch.to(tl.int64) << 32) | (end - src_start)
                # (waited for even after every stage ended: a source in another call may have signalled
                # this epoch, and only the list's own word says its entries are this call's tokens)
                if tl.max(tl.where(peers == src, lists_seen, 0), axis=0) < listed:
                    if gave_up == 0:  # another program gave up: the verdict NaNs everything, stop waiting
                        gave_up = gave_up_here(state_ptr, epoch, rows, WARP_WAITS)
                    if gave_up == 0:
                        gave_up = _wait_blocks(my_flags + peers * block_flag_cap + block_flag_cap - 1, peers == src,
                                               src, listed, epoch, timeout_ns, rows_here, rows_other, fp0, fp1,
                                               board_address, call_tag, state_ptr, mailbox_address, num_ranks,
                                               R_P2, WARP_WAITS)  # ACQUIRE: the list
                    lists_seen = tl.where(peers == src, listed, lists_seen)
                    # (the wait ends in a vote: the polling threads' acquires precede the loads that follow)
        if INDEX:
            entry = list_of(staged, here, src, rank, lists_offset, list_cap, PUSHED_LISTS) + (rows - src_start)
            if GATHER_INDEX and not OVERLAP:  # gathered: here already (local); else from the list, as below
                token = tl.where(gathered != 0, tl.load(src_idx_ptr + rows, mask=in_out & (gathered != 0), other=-1),
                                 tl.load(entry, mask=in_out & (gathered == 0), other=-1))
            else:
                token = tl.load(entry, mask=in_out, other=-1)
                tl.store(src_idx_ptr + rows, token, mask=in_out)
        else:
            token = tl.load(src_idx_ptr + rows, mask=in_out, other=-1)
        move = in_out & (token >= token_lo) & (token < token_hi)
        srow = (token - token_lo).to(tl.int64)
        if OVERLAP:  # the source's blocks that hold these rows (its tokens ascend: one or two blocks)
            if (gave_up == 0) & (staged_all == 0):
                block = tl.minimum(tl.where(move, srow // BLOCK_R, 0), block_flag_cap - 2)
                flags = my_flags + src * block_flag_cap + block
                if all_landed(flags, move, epoch, WARP_WAITS) == 0:  # ACQUIRE: the staged rows (usually there)
                    gave_up = gave_up_here(state_ptr, epoch, rows, WARP_WAITS)  # another program gave up: stop
                    if gave_up == 0:
                        gave_up = _wait_blocks(flags, move, src, epoch, epoch, timeout_ns, rows_here, rows_other, fp0,
                                               fp1, board_address, call_tag, state_ptr, mailbox_address, num_ranks,
                                               R_P2, WARP_WAITS)  # ACQUIRE: the staged rows
                # Every few items: has every source's stage ended? ACQUIRE the ends, then a vote: this
                # item's loads and every later one follow them, so the later items skip their waits —
                # a flag poll less per item once the stage is behind the pull. (An abort's
                # stamp, >= ABORT_EPOCH, is not taken for an end: the waits above handle a source
                # that aborted.)
                waited_items += 1
                if (gave_up == 0) & (waited_items % STAGE_END_EVERY == 0):
                    # each source's end of stage here (signal_peers: its last stage program's RELEASE,
                    # after every one of its programs arrived, covers all its staged rows and lists)
                    ended = load_acquire_sys(my_base + (sync.NORMAL_FLAG_SET * num_ranks + peers) * 8)
                    staged_all = vote_all(tl.min((((ended >= epoch) & (ended < sync.ABORT_EPOCH)) |
                                                  (peers >= num_ranks)).to(tl.int32), axis=0), WARP_WAITS)
            move &= gave_up == 0  # (the waits end in votes: the polling threads' acquires precede the loads of
            # the rows; with WARP_WAITS a warp that gave up skips its share, and the verdict NaNs every row)
        rows64 = rows.to(tl.int64)
        sx = word_ptr(staged + x_offset, ALIGNED) + srow * x_words
        if EXPERT_MAJOR:
            pull_expert_major(staged, srow, src, rows64, move, sx, recv_x_ptr, recv_scales_ptr, recv_topk_ptr,
                               recv_weights_ptr, table_ptr, dest_ptr, x_words, num_scales, num_topk, scales_offset,
                               topk_offset, topk_row_bytes, expert_lo, num_local, num_em_rows, HAS_SCALES, HAS_TOPK,
                               BLOCK_W, S_P2, K_P2)
        else:
            recv_words = recv_x_ptr.to(tl.pointer_type(tl.int64), bitcast=True)
            if SIDE_FIRST:  # (the same loads as below, issued before the rows')
                if HAS_SCALES:
                    s, m_s, ss = _staged_scales(staged, srow, move, scales_offset, num_scales, S_P2)
                    scale_values = tl.load(ss[:, None] + s[None, :], mask=m_s)
                if HAS_TOPK:
                    k, m, ids, weights = staged_topk(staged, srow, move, topk_offset, topk_row_bytes, num_topk, K_P2)
            if PIPELINE:  # load this item's rows, then store the previous item's (no ordering: local outputs)
                cm = cols < x_words
                loaded = tl.load(sx[:, None] + cols[None, :], mask=move[:, None] & cm[None, :])
                tl.store(recv_words + held_rows[:, None] * x_words + cols[None, :], held,
                         mask=held_live[:, None] & cm[None, :])
                held, held_rows, held_live = loaded, rows64, move
            else:
                copy_rows(sx, recv_words + rows64 * x_words, move, x_words, BLOCK_W)
            if HAS_SCALES:
                if SIDE_FIRST:
                    tl.store(recv_scales_ptr + rows64[:, None] * num_scales + s[None, :], scale_values, mask=m_s)
                else:
                    s, m_s, ss = _staged_scales(staged, srow, move, scales_offset, num_scales, S_P2)
                    tl.store(recv_scales_ptr + rows64[:, None] * num_scales + s[None, :],
                             tl.load(ss[:, None] + s[None, :], mask=m_s), mask=m_s)
            if HAS_TOPK:
                if not SIDE_FIRST:
                    k, m, ids, weights = staged_topk(staged, srow, move, topk_offset, topk_row_bytes, num_topk, K_P2)
                local = ids - expert_lo
                mine = (ids >= 0) & (local >= 0) & (local < num_local)
                out = rows64[:, None] * num_topk + k[None, :]
                tl.store(recv_topk_ptr + out, tl.where(mine, local, -1), mask=m)
                tl.store(recv_weights_ptr + out, tl.where(mine, weights, 0.0), mask=m)
        if TRACE:
            trace_item(trace_ptr, pid, src, end - first, started)
    if PIPELINE:  # the last item's rows
        tl.store(recv_x_ptr.to(tl.pointer_type(tl.int64), bitcast=True) + held_rows[:, None] * x_words + cols[None, :],
                 held, mask=held_live[:, None] & (cols < x_words)[None, :])
    # -- rows past the received total: num_worst_tokens padding (a full dispatch marks them)
    if INDEX:
        num_recv = tl.max(ends, axis=0)
        for block in range(pid, tl.cdiv(num_rows - num_recv, BLOCK_R), num_programs):
            rows = num_recv + block * BLOCK_R + tl.arange(0, BLOCK_R)
            pad = rows < num_rows
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
            zero_padding_rows(table_ptr, recv_x_ptr, recv_scales_ptr, recv_topk_ptr, recv_weights_ptr, num_ranks, num_local,
                          num_em_rows, x_words, num_scales, HAS_SCALES, HAS_TOPK, BLOCK_R, BLOCK_W, S_P2)
    # -- OVERLAP: the last program to arrive gives the call's verdict, and stores the epoch
    if OVERLAP:
        if arrive(state_ptr + sync.ARRIVE_RECEIVE, num_programs):
            failed = cta_any(tl.load(state_ptr + sync.GAVE_UP, volatile=True) == epoch) != 0  # (one reading for all)
            if failed:
                _await_own_stage(my_base, rank, num_ranks, epoch, timeout_ns, R_P2)
            else:
                # ACQUIRE every source's end of stage and compare fingerprints: the half-reuse chain of
                # sync.py needs every source's signal (not only the blocks with rows here), and the
                # check is the call's verdict: rows are already written, so a failure NaNs them all
                failed = acquire_and_agree(flag_bases_ptr, state_ptr, mailbox_address, epoch, rank, num_ranks,
                                           timeout_ns, fp_offset, fp0, fp1, 1, board_address, call_tag, R_P2) == 0
            if failed:
                _missing_rows(recv_x_ptr, recv_scales_ptr, recv_weights_ptr, expected, x_words, num_scales, num_topk,
                              0, 1, HAS_SCALES, HAS_TOPK, EXPERT_MAJOR, BLOCK_R, BLOCK_W)
            tl.store(state_ptr + sync.EPOCH_NORMAL, epoch)


@triton.jit
def _await_own_stage(my_base, rank, num_ranks, epoch, timeout_ns, R_P2: tl.constexpr):
    """A failed verdict's wait before it stores the epoch: for this rank's own stage to end (its
    programs read EPOCH_NORMAL first), bounded by ``timeout_ns`` and reporting nothing (the call
    already failed, reported where it did)."""
    peers = tl.arange(0, R_P2)
    poll_epochs((my_base + sync.NORMAL_FLAG_SET * num_ranks * 8).to(tl.pointer_type(tl.int64)) + peers,
                peers == rank, epoch, timeout_ns, EPOCH_SHIFT=0)


@triton.jit
def _pull_without_notify(program, num_programs, epoch, recv_x_ptr, recv_scales_ptr, recv_topk_ptr, recv_weights_ptr,
                         src_idx_ptr, recv_info_ptr, num_rows, x_words, num_scales, num_topk, rank, num_ranks,
                         flag_bases_ptr, state_ptr, timeout_ns, HAS_SCALES: tl.constexpr, HAS_TOPK: tl.constexpr,
                         BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr, R_P2: tl.constexpr):
    """Pull program ``program`` of ``num_programs`` of ep_dispatch with NOTIFY whose wait for
    NOTIFIED gave up (await_notified reported this rank late): rank_prefix_matrix was never
    written, so it pulls nothing. Its share of the index outputs gets -1 (recv_src_idx, the top-k
    ids) and recv_info's count 0 (the handle's num_recv_tokens): a caller that indexes by them
    before its next call raises stays in bounds. It marks the call given up (GAVE_UP =
    ``epoch``: the pull programs that did get NOTIFIED stop waiting, as after a wait of their own
    gave up) and arrives as every pull program does, so the last to arrive still gives the verdict
    (every row NaN, padding included) and stores the epoch: the receive counter stays whole for
    the calls queued after this one. (A stage program that gave up does not arrive: stage.py's
    counter is left short where some of its programs got NOTIFIED and others did not, as in
    ep_dispatch_notify_stage; the timeout is sticky, and only a new Buffer, whose state words are
    zero, dispatches again.)"""
    fill_value(src_idx_ptr, num_rows, -1, program, num_programs, 1024)
    if HAS_TOPK:
        fill_value(recv_topk_ptr, num_rows * num_topk, -1, program, num_programs, 1024)
    if program == 0:
        tl.store(recv_info_ptr, 0)
    peers = tl.arange(0, R_P2)
    store_from_every_warp((state_ptr + sync.GAVE_UP + peers * 0).to(tl.int64), tl.zeros([R_P2], tl.int64) + epoch,
                          peers == 0, WIDE=True)
    if arrive(state_ptr + sync.ARRIVE_RECEIVE, num_programs):  # (acq_rel: every program's GAVE_UP store first)
        _await_own_stage(tl.load(flag_bases_ptr + rank), rank, num_ranks, epoch, timeout_ns, R_P2)
        _missing_rows(recv_x_ptr, recv_scales_ptr, recv_weights_ptr, num_rows, x_words, num_scales, num_topk, 0, 1,
                      HAS_SCALES, HAS_TOPK, False, BLOCK_R, BLOCK_W)
        tl.store(state_ptr + sync.EPOCH_NORMAL, epoch)


@triton.jit
def _staged_scales(staged, srow, move, scales_offset, num_scales, S_P2: tl.constexpr):
    """``(columns, mask, rows)``: the float32 scales of staged rows ``srow`` are at ``rows[:, None]
    + columns[None, :]``, loaded where ``mask`` (the caller loads them, before or after the x rows:
    SIDE_FIRST)."""
    s = tl.arange(0, S_P2)
    mask = move[:, None] & (s < num_scales)[None, :]
    return s, mask, (staged + scales_offset).to(tl.pointer_type(tl.float32)) + srow * num_scales


@triton.jit
def _wait_blocks(words, live, src, targets, epoch, timeout_ns, rows_here, rows_other, fp0, fp1, board_address,
                 call_tag, state_ptr, mailbox_address, num_ranks, R_P2: tl.constexpr, WARP: tl.constexpr):
    """The overlapped pull's ACQUIRE of block flags (int64 pointers ``words``, lanes where ``live``,
    all written by source ``src``) >= ``targets`` (``epoch``, or a list's tagged count). A source
    that aborted, or is in another call of this Buffer, ends the wait through its fingerprint row
    (``rows_here`` / ``rows_other``: this rank's rows of this call's half and the other one; the
    verdict then NaNs the output); one the call board shows in another call, or a timeout, is
    recorded in the mailbox, and GAVE_UP = ``epoch`` stops the launch's other programs. Returns 1
    when this wait gave up, else 0.

    The outcome is a vote (warps.vote_any), which also orders the polling threads' acquires before
    the loads of the rows. With ``WARP`` each warp decides alone and the pull's warps run their
    items apart: nothing here may meet the other warps — every warp holds the lanes whole (its
    reductions are shuffles), and the reports and GAVE_UP are stored from every warp (warps.py);
    tests/test_kernel_votes.py checks that the item loop then holds no barrier."""
    row_words = sync.FP_ROW // 8
    senders = tl.zeros_like(live.to(tl.int32)) + src
    _words, _waited, late, elsewhere = poll_from_senders(
        words, live, senders, targets, epoch, timeout_ns, rows_here + senders * row_words,
        rows_other + senders * row_words, fp0, fp1, board_address, call_tag, EPOCH_SHIFT=0, CHECK_ROWS=True,
        CHECK_BOARD=True)
    peers = tl.arange(0, R_P2)
    late_here = vote_any(tl.max(late.to(tl.int32), axis=0), WARP)  # (the threads' clocks may disagree)
    elsewhere_here = vote_any(tl.max(elsewhere.to(tl.int32), axis=0), WARP)
    timeouts, _dropped, agreement_ptr, _notify = mailbox_words(mailbox_address, num_ranks)
    report_late((peers == src) & (late_here != 0), peers, state_ptr, timeouts, MASK_ON_TIMEOUT=False)
    record_elsewhere(board_address, peers, (peers == src) & (elsewhere_here != 0), call_tag, fp0, agreement_ptr,
                     num_ranks)
    failed = late_here | elsewhere_here
    store_from_every_warp((state_ptr + sync.GAVE_UP + peers * 0).to(tl.int64), tl.zeros([R_P2], tl.int64) + epoch,
                          (peers == 0) & (failed != 0), WIDE=True)
    return failed


@triton.jit
def ep_dispatch_pull(
        # the call's tensors: the notify's results in, the received rows out
        prefix_ptr: "*i32",  # [R, R] int32 rank_prefix_matrix: where each source's rows start here
        src_idx_ptr: "*i32",  # [N] int32 recv_src_idx: written with INDEX, read otherwise
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
        TRACE: tl.constexpr, PIPELINE: tl.constexpr, SIDE_FIRST: tl.constexpr, GATHER_INDEX: tl.constexpr,
        PUSHED_LISTS: tl.constexpr):
    # The pull alone (the dispatch in turn): every source's stage acquired first.
    _pull(tl.program_id(0), tl.num_programs(0), tl.load(state_ptr + sync.EPOCH_NORMAL),
          prefix_ptr, src_idx_ptr, recv_x_ptr, recv_scales_ptr, recv_topk_ptr, recv_weights_ptr,
          table_ptr, dest_ptr, num_rows, token_lo, token_hi, x_words, num_scales, num_topk, expert_lo, num_local,
          num_em_rows, zero_padding, rank, num_ranks, normal_bases_ptr, flag_bases_ptr, state_ptr, half_bytes,
          lists_offset, list_cap, x_offset, scales_offset, topk_offset, topk_row_bytes, 0, 0,
          mailbox_address, timeout_ns, fp_offset, fp0, fp1, board_bases_ptr, call_tag, trace_ptr,
          INDEX, HAS_SCALES, HAS_TOPK, BLOCK_R, BLOCK_W, S_P2, K_P2, R_P2, ALIGNED, EXPERT_MAJOR, EVERY_PEER, TRACE,
          PIPELINE, OVERLAP=False, SIDE_FIRST=SIDE_FIRST, GATHER_INDEX=GATHER_INDEX, PUSHED_LISTS=PUSHED_LISTS)



# ====================================================================== dispatch: overlapped
# ep_dispatch: stage and pull in one launch; grid = num_stage stage programs (the lowest program ids:
# the hardware starts them first, so waiting pull programs never hold the SMs they need), then pull
# programs. Block flags: this rank's row at a receiver, word b = the epoch whose block b of staged
# rows (tokens [b * BLOCK_R, (b + 1) * BLOCK_R)) is there; its last word = (epoch << 32) | how many
# entries of the list for that receiver are written.
#
#   epoch = EPOCH_NORMAL + 1 (read by every program before the pull's last one stores it)
#   NOTIFY (a num_worst_tokens dispatch: no host wait, so its count exchange goes in too; grid = R
#       notify programs first, then the rest):
#       programs p < R:  ep_notify_dispatch's program p (notify.py) with epoch e = EPOCH_NORMAL + 1;
#                        the last to arrive RELEASEs NOTIFIED = e once it has stored
#                        rank_prefix_matrix and read the count rows (gpu scope)
#       the others:      ACQUIRE NOTIFIED >= e (the stage: its half is no longer read by the
#                        peers' previous pulls, the chain in notify.py; the pull: rank_prefix_matrix
#                        is there), then as below with epoch e + 1
#       past 3 x timeout_ns without NOTIFIED (the notify programs never ran; this rank reported
#       late): a stage program stages nothing and does not arrive, as in ep_dispatch_notify_stage
#       (the timeout is sticky: the next call raises, a new Buffer zeroes the state words); a pull
#       program marks the call given up and arrives (_pull_without_notify), so the verdict still
#       NaNs every row and stores the epoch
#   stage programs:  the stage (stage.py, _stage), with a RELEASE per list (to its receiver) and per block of
#                    staged rows (to every rank) into the receivers' block flags (OVERLAP)
#   DOORBELL (a full dispatch launched before the host's count wait; the outputs do not exist yet):
#       the first pull program polls the mailbox's doorbell (sync.await_doorbell; ACQUIRE) and
#       hands the answer and the outputs' addresses to the others (RELEASE / ACQUIRE, state words)
#       go:     num_rows and the outputs from the doorbell; the pull below
#       cancel: (the group needs more rounds, or the host raised) the pull below with no rows:
#               its last program still gives the verdict and stores the epoch, and the host pulls
#               in turn after it (ep_dispatch_pull reads the epoch as its stage's)
#   pull program q, for each of its items (source s, one block of s's rows here):
#       INDEX: ACQUIRE block_flags[s][last] >= (epoch << 32) | the item's last entry + 1 (s's list
#           for this rank, as far as this item's rows)
#       ACQUIRE block_flags[s][b] >= epoch for the blocks b its tokens were staged in (ascending:
#           one or two; a timeout, or s on the call board in another call: reported, GAVE_UP =
#           epoch, every program stops waiting) — each warp reads them, then a vote: each warp's
#           alone (warps.warp_all) where it holds the item's row lanes whole (BLOCK_R <= 32): the
#           item loop then holds no barrier, so the warps run their items apart; else the program's
#       every STAGE_END_EVERY items waited for: ACQUIRE every source's end of stage, a vote; once
#           all have ended, the later items skip the block waits (the list waits stay)
#       the rows, as the pull above (a warp that gave up skips its share: the verdict NaNs all rows)
#   last pull program to arrive:
#       ACQUIRE every rank's end-of-stage epoch and compare fingerprints (acquire_and_agree): the
#           half-reuse chain of sync.py needs every source's signal, not only the blocks with rows
#           here, and the check is the call's verdict: a difference, or a wait that gave up, NaNs
#           every received row (rows are already written)
#       EPOCH_NORMAL = epoch
# (The block flags are epoch-tagged and never reset; the combine's blocks share them: a word a
# rank writes with epoch e' >= e is written after its whole launch of e, stream order, so either
# meaning tells a waiter of e that what it waits for is there.)
@triton.jit
def ep_dispatch(
        # the call's tensors: in (the stage's), the notify's results, out (the pull's)
        x_ptr: "*i8",  # [T, x_bytes] bytes of x (bf16 or e4m3), rows 8-byte aligned
        scales_ptr: "*fp32",  # [T, S] float32, any strides (FP8)
        topk_ptr: "*i64", weights_ptr: "*fp32",  # [T, K] int64 / float32 (full dispatch with top-k)
        in_rank_ptr: "*i8",  # [T, R] int8: is_token_in_rank (token lists)
        list_index_ptr: "*i32",  # [T, R] int32 (WRITE_LISTS): each token's index in each list it is on
        per_rank_ptr: "*i32", per_expert_ptr: "*i32",  # [R] / [E] int32 the caller's counts (WRITE_LISTS)
        prefix_ptr: "*i32",  # [R, R] int32 rank_prefix_matrix: where each source's rows start here (NOTIFY: out)
        recv_info_ptr: "*i32",  # out [2] int32 (NOTIFY): rows received, most tokens any rank sends
        src_idx_ptr: "*i32",  # [N] int32 recv_src_idx: written with INDEX, read otherwise
        recv_x_ptr: "*i8",  # [N, x_bytes] bytes
        recv_scales_ptr: "*fp32",  # [N, S] float32
        recv_topk_ptr: "*i64", recv_weights_ptr: "*fp32",  # [N, K] int64 local ids / float32
        # sizes: one round, this rank's tokens [0, num_tokens), num_rows rows here; NOTIFY: the
        # mailbox's per-expert counts padded to expert_alignment (ep_notify_dispatch)
        num_tokens: "i32", x_words: "i32", num_scales: "i32", scale_stride_t: "i64", scale_stride_c: "i64",
        num_topk: "i32", num_local: "i32", num_rows: "i32", num_stage: "i32", expert_alignment: "i32",
        # this rank and the workspaces (offsets are from a workspace half; block flags and, NOTIFY,
        # the count rows from a workspace or its half)
        rank: "i32", num_ranks: "i32", normal_bases_ptr: "*i64", flag_bases_ptr: "*i64", state_ptr: "*i64",
        half_bytes: "i64", lists_offset: "i64", list_cap: "i64", x_offset: "i64", scales_offset: "i64",
        topk_offset: "i64", topk_row_bytes: "i64", block_flags_offset: "i64", block_flag_cap: "i64",
        counts_offset: "i64",
        # the host: its mailbox (sync.py), the timeout of a wait; DOORBELL: the doorbell's address in
        # the mailbox; DOORBELL or NOTIFY: the full dispatch's notify sequence number (the doorbell's
        # tag carries it; NOTIFY: the mailbox's sequence word)
        mailbox_address: "i64", timeout_ns: "i64", doorbell_address: "i64", sequence: "i64",
        # the call's identity: its fingerprint, and its word on the call board (gpu/call_board.py)
        fp_offset: "i64", fp0: "i64", fp1: "i64",
        board_bases_ptr: "*i64",  # [R] int64: each rank's call board
        call_tag: "i64",  # this call's number and Buffer on the board (0: not posted, not checked)
        trace_ptr: "*i64",  # TRACE: the schedule's trace buffer (schedule.py)
        # meta-parameters
        INDEX: tl.constexpr, HAS_SCALES: tl.constexpr, HAS_TOPK: tl.constexpr, WRITE_LISTS: tl.constexpr,
        BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr, S_P2: tl.constexpr, K_P2: tl.constexpr,
        R_P2: tl.constexpr, LIST_BLOCK: tl.constexpr, L_P2: tl.constexpr, ALIGNED: tl.constexpr,
        OUT_ALIGNED: tl.constexpr, EVERY_PEER: tl.constexpr, TRACE: tl.constexpr, DOORBELL: tl.constexpr,
        SIDE_FIRST: tl.constexpr, PUSHED_LISTS: tl.constexpr, NOTIFY: tl.constexpr, NOTIFY_BLOCK: tl.constexpr):
    # ALIGNED: x and its rows are 16-byte aligned; OUT_ALIGNED: rows are a multiple of 16 bytes (copy.py).
    # INDEX and WRITE_LISTS: a full dispatch (the lists are written and read); neither: a cached one.
    # DOORBELL (a full dispatch): num_rows and the outputs' pointers are placeholders, the doorbell's count.
    # NOTIFY (a num_worst_tokens dispatch; not with DOORBELL): the count exchange in the first R programs.
    tl.static_assert(not (NOTIFY and DOORBELL), "ep_dispatch: NOTIFY and DOORBELL exclude each other")
    # PUSHED_LISTS (the default: choices.py): where the lists live (receive_index.list_of).
    # pid, num_programs: of the stage's and the pull's programs (NOTIFY: after the notify's R).
    # (Set under a constexpr branch, not a runtime one: merged values at a runtime branch's end
    # would stay live in registers through the pull's loop.)
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    # The previous call's last epoch: read by every program before the pull's last one stores this
    # call's (it waits for this rank's whole stage; the stage and pull, NOTIFY, for NOTIFIED, which
    # the notify's last program releases after every notify program arrived).
    last_epoch = tl.load(state_ptr + sync.EPOCH_NORMAL)
    epoch = last_epoch + 1
    staging = 1  # 0: a notify program, or one whose wait for the notify gave up (NOTIFY)
    if NOTIFY:  # the notify takes last_epoch + 1 (its half's count rows), the stage and pull the next
        epoch = last_epoch + 2
        pid -= num_ranks
        num_programs -= num_ranks
        if pid < 0:
            _notify(pid + num_ranks, per_rank_ptr, per_expert_ptr, prefix_ptr, recv_info_ptr, prefix_ptr, num_tokens,
                    num_local * num_ranks, expert_alignment, 0, rank, num_ranks, normal_bases_ptr, flag_bases_ptr,
                    state_ptr, half_bytes, counts_offset, mailbox_address, sequence, timeout_ns, fp_offset, fp0, fp1,
                    board_bases_ptr, call_tag, R_P2, NOTIFY_BLOCK, WITH_STAGE=True)
            staging = 0
        # ACQUIRE NOTIFIED: the stage writes the half its peers' previous pulls read (the chain in
        # notify.py's outline: their signals, acquired by the notify programs); the pull reads
        # rank_prefix_matrix, which the notify's last program stored before its release
        elif await_notified(state_ptr, last_epoch, timeout_ns, rank, mailbox_address, R_P2) != 0:
            staging = 0  # (reported late)
            if pid >= num_stage:
                _pull_without_notify(pid - num_stage, num_programs - num_stage, epoch, recv_x_ptr, recv_scales_ptr,
                                     recv_topk_ptr, recv_weights_ptr, src_idx_ptr, recv_info_ptr, num_rows, x_words,
                                     num_scales, num_topk, rank, num_ranks, flag_bases_ptr, state_ptr, timeout_ns,
                                     HAS_SCALES, HAS_TOPK, BLOCK_R, BLOCK_W, R_P2)
    if staging != 0:
        if pid < num_stage:
            _stage(pid, num_stage, epoch,
                   x_ptr, scales_ptr, topk_ptr, weights_ptr, in_rank_ptr, list_index_ptr, per_rank_ptr,
                   per_expert_ptr, num_tokens, 0, num_tokens, x_words, num_scales, scale_stride_t, scale_stride_c,
                   num_topk, num_local, 0,
                   rank, num_ranks, normal_bases_ptr, flag_bases_ptr, state_ptr, half_bytes, lists_offset, list_cap,
                   x_offset, scales_offset, topk_offset, topk_row_bytes, block_flags_offset, block_flag_cap,
                   fp_offset, fp0, fp1, board_bases_ptr, call_tag,
                   HAS_SCALES, HAS_TOPK, WRITE_LISTS, BLOCK_R, BLOCK_W, S_P2, K_P2, R_P2, LIST_BLOCK, L_P2, ALIGNED,
                   EXPERT_MAJOR=False, POSITION_TOKENS=1, POSITION_SUB=1, E_P2=1, OVERLAP=True,
                   PUSHED_LISTS=PUSHED_LISTS)
        else:
            if DOORBELL:  # the rows and the outputs the host allocated after its count wait (none: cancel)
                answer, words = await_doorbell(doorbell_address, sequence, epoch, state_ptr, 2 * timeout_ns,
                                               pid == num_stage, mailbox_address, rank)
                word = tl.arange(0, DOORBELL_WORDS)
                go = answer == RING_GO
                num_rows = tl.where(go, tl.sum(tl.where(word == 1, words, 0), axis=0), 0).to(tl.int32)
                recv_x_ptr = ptr_at(tl.sum(tl.where(word == 2, words, 0), axis=0), tl.int8, OUT_ALIGNED)
                recv_scales_ptr = ptr_at(tl.sum(tl.where(word == 3, words, 0), axis=0), tl.float32, False)
                recv_topk_ptr = ptr_at(tl.sum(tl.where(word == 4, words, 0), axis=0), tl.int64, False)
                recv_weights_ptr = ptr_at(tl.sum(tl.where(word == 5, words, 0), axis=0), tl.float32, False)
                src_idx_ptr = ptr_at(tl.sum(tl.where(word == 6, words, 0), axis=0), tl.int32, False)
            # (a source's tokens are below the group's most tokens; the host keeps that within one round)
            _pull(pid - num_stage, num_programs - num_stage, epoch,
                  prefix_ptr, src_idx_ptr, recv_x_ptr, recv_scales_ptr, recv_topk_ptr, recv_weights_ptr,
                  prefix_ptr, prefix_ptr, num_rows, 0, 1 << 30, x_words, num_scales, num_topk, rank * num_local,
                  num_local, 0, 0, rank, num_ranks, normal_bases_ptr, flag_bases_ptr, state_ptr, half_bytes,
                  lists_offset, list_cap, x_offset, scales_offset, topk_offset, topk_row_bytes, block_flags_offset,
                  block_flag_cap, mailbox_address, timeout_ns, fp_offset, fp0, fp1, board_bases_ptr, call_tag,
                  trace_ptr,
                  INDEX, HAS_SCALES, HAS_TOPK, BLOCK_R, BLOCK_W, S_P2, K_P2, R_P2, OUT_ALIGNED, EXPERT_MAJOR=False,
                  EVERY_PEER=EVERY_PEER, TRACE=TRACE, PIPELINE=False, OVERLAP=True,
                  SIDE_FIRST=SIDE_FIRST, GATHER_INDEX=False,
                  PUSHED_LISTS=PUSHED_LISTS)  # (the lists are waited for item by item here)


STAGE_PULL = KernelSpec(ep_dispatch, aligned_if={"ALIGNED": ["x_ptr"], "OUT_ALIGNED": ["recv_x_ptr"]})
# (DOORBELL: recv_x_ptr is a placeholder, the host passes an aligned one; the kernel marks the real one)


@triton.jit
def _missing_rows(recv_x_ptr, recv_scales_ptr, recv_weights_ptr, num_rows, x_words, num_scales, num_topk, program,
                  num_programs, HAS_SCALES: tl.constexpr, HAS_TOPK: tl.constexpr, EXPERT_MAJOR: tl.constexpr,
                  BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr):
    """A pull whose wait gave up returns no plausible rows (DESIGN section 5): every output row NaN —
    x (bf16, or e4m3 with scales), its scales and its weights (float32); the host raises the error
    at the next call. ``num_rows``: the outputs' rows (expert-major: its rows, one weight each);
    ``program`` of ``num_programs`` fills its share."""
    fill_rows(recv_x_ptr.to(tl.pointer_type(tl.int64), bitcast=True), num_rows, x_words,
              NAN_E4M3_WORD if HAS_SCALES else NAN_BF16_WORD, program, num_programs, BLOCK_R, BLOCK_W)
    if HAS_SCALES:
        fill_nan(recv_scales_ptr, num_rows * num_scales, program, num_programs, 1024)
    if HAS_TOPK:
        fill_nan(recv_weights_ptr, num_rows if EXPERT_MAJOR else num_rows * num_topk, program, num_programs, 1024)


PULL = KernelSpec(ep_dispatch_pull, aligned_if={"ALIGNED": ["recv_x_ptr"]})
