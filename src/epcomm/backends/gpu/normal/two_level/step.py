"""The step barrier every multi-node call starts with, and the abort of a rejected call.

Each call (full or cached dispatch, combine) gets the next epoch ``e`` (a host counter: all ranks
make the same calls, so theirs agree) and starts with the step barrier (:func:`_step_barrier`,
launched as ``ml_dispatch_step`` or ``ml_combine_step``: profiler tools count a call's kernels by
those words in their names)::

    rank A:  ... call e-1 kernels | step e: put (fp, e) to every rank; wait for every rank's (fp, e) | call e kernels
    rank B:  ... call e-1 kernels ------------> | step e ...
                                  (B's step runs after its call e-1 kernels: stream order)

Passing step ``e`` means every rank has finished the kernels of call ``e - 1``, so call ``e`` may
overwrite any area of any workspace: one region serves every call, without the halves the nvlink
backend alternates (areas.py). The price is one all-to-all
signal round per call on the critical path (a few µs; the count exchange of a full dispatch is
another). The fingerprint words ride on the same puts: a rank whose call differs (another call
kind, other shapes) is recorded in the host mailbox by every rank, which raises at its next look
there (gpu/agreement.py decodes the words).

A rank that rejects its own input does not make the call; :func:`ml_abort` puts the abort words
with an epoch no wait can be ahead of (sync.ABORT_EPOCH) into its step row on every rank and
sets every signal word it would have set in the call, so its peers' waits end at once and they
raise naming the argument.

A step barrier that finds another call's words (or an abort's) in a row, or a rank late, stores
the epoch into the state word CALL_FAILED, and every later kernel of the call returns at once
(:func:`gpu.sync.call_failed`): the rows its peers would send were laid out for another call (another row
size, another count table), so reading them could index anything. Every rank that passes the
barrier finds the same mismatch (each compares every row with its own words), so all of them skip
the same kernels and nobody waits on a signal a peer skipped; the host raises (mailbox).
"""
from __future__ import annotations

import triton
import triton.language as tl

from ...launch import KernelSpec
from ...sync import (ABORT_EPOCH, check_fingerprints, mailbox_words, poll_epochs_or_other_call, record_elsewhere,
                     report_late)
from ...reach.modes import FAR_LIBRARY, far_complete, far_deliver, post_call_any
from ...walk import peer_after
from ...warps import cta_any
from .channels import SIGNAL_STRIDE


@triton.jit
def _post_step_row(workspace, step_rows_offset, fingerprint_offset, peer_bases_ptr, fp0, fp1, epoch, rank, pe,
                   REMOTE: tl.constexpr):
    """Row ``rank`` of ``pe``'s step rows := (fp0, fp1, epoch): the words from this rank's
    fingerprint row (every program stores the same two words there), the epoch as the signal."""
    mine = (workspace + fingerprint_offset).to(tl.pointer_type(tl.int64))
    tl.store(mine, fp0)
    tl.store(mine + 1, fp1)
    tl.debug_barrier()  # the source words precede the put
    row = workspace + step_rows_offset + (rank * 32).to(tl.int64)
    far_deliver(row, workspace + fingerprint_offset, 16, row + 16, epoch, pe, peer_bases_ptr, rank, REMOTE)


@triton.jit
def _step_barrier(peer_bases_ptr,  # [R] int64: each rank's workspace (where gpu/reach maps them)
                  workspace,  # int64: this rank's workspace (symmetric)
                  step_rows_offset, fingerprint_offset,  # bytes from a workspace to its step rows / own fingerprint row
                  mailbox_address,  # host mailbox (gpu/mailbox.py)
                  failed_ptr,  # int64 state word CALL_FAILED (local)
                  fp0, fp1, epoch, timeout_ns, rank, num_ranks,
                  board_bases_ptr,  # [R] int64: each rank's call board (gpu/call_board.py)
                  call_tag,  # this call's number and Buffer on the board (0: not posted, not checked)
                  REMOTE: tl.constexpr, R_P2: tl.constexpr):
    # Program i, for rank p = peer_after(i, rank, R) (from the rank after this one: the ranks'
    # first puts go to R different ranks, not all to rank 0): deliver (fp0, fp1, epoch) to row
    # `rank` of p's step rows (the epoch word is the put's signal: seeing it means seeing the
    # words), then ACQUIRE row p of this rank's step rows (bounded: a late rank is flagged in the
    # mailbox) and compare its words with this call's (a mismatch is recorded in the mailbox; the
    # host raises). The kernel ends when every rank
    # has posted step `epoch` — after its kernels of the previous call. Program 0 also posts the
    # call on every rank's call board; a rank p the board shows in another call (another Buffer's,
    # or a call this rank skipped) ends the wait for it and fails the call like a mismatch.
    p = peer_after(tl.program_id(0), rank, num_ranks)
    if tl.program_id(0) == 0:
        post_call_any(board_bases_ptr, rank, num_ranks, call_tag, fp0, 1, R_P2, REMOTE)
    _post_step_row(workspace, step_rows_offset, fingerprint_offset, peer_bases_ptr, fp0, fp1, epoch, rank, p,
                   REMOTE)
    lanes = tl.arange(0, R_P2)
    sender = lanes == p
    rows = workspace + step_rows_offset
    timeouts, _, agreement, _ = mailbox_words(mailbox_address, num_ranks)
    board = tl.load(board_bases_ptr + rank)
    row_words = (rows + lanes * 32 + 16).to(tl.pointer_type(tl.int64))
    _, _, late, elsewhere = poll_epochs_or_other_call(row_words, sender, epoch, timeout_ns, row_words, row_words, fp0,
                                                      0, board, call_tag, EPOCH_SHIFT=0, CHECK_ROWS=False,
                                                      CHECK_BOARD=True)  # ACQUIRE: rank p's row
    report_late(late, lanes, timeouts, timeouts, MASK_ON_TIMEOUT=False)
    record_elsewhere(board, lanes, elsewhere, call_tag, fp0, agreement, num_ranks)
    differ = check_fingerprints(rows, lanes, sender & (late == 0) & (elsewhere == 0), tl.zeros_like(lanes), fp0, fp1,
                                epoch, agreement, num_ranks)
    # (a vote: at the deadline the warps' readings may differ, and the store below is issued by the
    # first warp only)
    if cta_any(tl.max((differ | elsewhere | (late != 0)).to(tl.int32), axis=0)) != 0:
        tl.store(failed_ptr, epoch)  # the call's later kernels return at once (call_failed)


# The same barrier under the name of the call it starts (the kernels' names are all that differs).
@triton.jit
def ml_dispatch_step(peer_bases_ptr: "*i64", workspace: "i64", step_rows_offset: "i64", fingerprint_offset: "i64",
                     mailbox_address: "i64", failed_ptr: "*i64", fp0: "i64",
                     fp1: "i64", epoch: "i64", timeout_ns: "i64", rank: "i32", num_ranks: "i32",
                     board_bases_ptr: "*i64", call_tag: "i64", REMOTE: tl.constexpr, R_P2: tl.constexpr):
    _step_barrier(peer_bases_ptr, workspace, step_rows_offset, fingerprint_offset, mailbox_address, failed_ptr, fp0,
                  fp1, epoch, timeout_ns, rank, num_ranks, board_bases_ptr, call_tag, REMOTE, R_P2)


@triton.jit
def ml_combine_step(peer_bases_ptr: "*i64", workspace: "i64", step_rows_offset: "i64", fingerprint_offset: "i64",
                    mailbox_address: "i64", failed_ptr: "*i64", fp0: "i64",
                    fp1: "i64", epoch: "i64", timeout_ns: "i64", rank: "i32", num_ranks: "i32",
                    board_bases_ptr: "*i64", call_tag: "i64", REMOTE: tl.constexpr, R_P2: tl.constexpr):
    _step_barrier(peer_bases_ptr, workspace, step_rows_offset, fingerprint_offset, mailbox_address, failed_ptr, fp0,
                  fp1, epoch, timeout_ns, rank, num_ranks, board_bases_ptr, call_tag, REMOTE, R_P2)


STEPS = {kind: KernelSpec(kernel, **FAR_LIBRARY)
         for kind, kernel in (("dispatch", ml_dispatch_step), ("combine", ml_combine_step))}
STEP = STEPS["dispatch"]


@triton.jit
def ml_abort(peer_bases_ptr: "*i64", workspace: "i64", step_rows_offset: "i64", fingerprint_offset: "i64",
             notify_signals_offset: "i64",
             dispatch_signals_offset: "i64", push_flags_offset: "i64", home_signals_offset: "i64", fp0: "i64",
             fp1: "i64", rank: "i32", num_ranks: "i32", ranks_per_node: "i32",
             board_bases_ptr: "*i64", call_tag: "i64",  # the call board; the aborted call's tag (0: not posted)
             REMOTE: tl.constexpr, R_P2: tl.constexpr):
    # Program p, for rank p: the abort row, then ABORT_EPOCH into each signal word this rank sets on
    # p in a call: its count row's signal (any p), block signals [node][*] and home signals [node][*]
    # (p a rail peer: this rank as source / as forwarder), push flags [*][*][local] (p on this node).
    p = tl.program_id(0)
    if p == 0:  # (peers waiting in another Buffer's call of this number stop waiting: call_board.py)
        post_call_any(board_bases_ptr, rank, num_ranks, call_tag, fp0, 1, R_P2, REMOTE)
    _post_step_row(workspace, step_rows_offset, fingerprint_offset, peer_bases_ptr, fp0, fp1, ABORT_EPOCH, rank, p,
                   REMOTE)
    node, local = rank // ranks_per_node, rank % ranks_per_node
    num_nodes = num_ranks // ranks_per_node
    far_deliver(workspace, workspace, 0, workspace + notify_signals_offset + rank * 8, ABORT_EPOCH, p,
                    peer_bases_ptr, rank, REMOTE)
    if p % ranks_per_node == local:
        for c in range(0, SIGNAL_STRIDE):
            word = ((node * SIGNAL_STRIDE + c) * 8).to(tl.int64)
            far_deliver(workspace, workspace, 0, workspace + dispatch_signals_offset + word, ABORT_EPOCH, p,
                            peer_bases_ptr, rank, REMOTE)
            far_deliver(workspace, workspace, 0, workspace + home_signals_offset + word, ABORT_EPOCH, p,
                            peer_bases_ptr, rank, REMOTE)
    if p // ranks_per_node == node:
        for m in range(0, num_nodes):
            for c in range(0, SIGNAL_STRIDE):
                word = (((m * SIGNAL_STRIDE + c) * ranks_per_node + local) * 8).to(tl.int64)
                far_deliver(workspace, workspace, 0, workspace + push_flags_offset + word, ABORT_EPOCH, p,
                                peer_bases_ptr, rank, REMOTE)
    far_complete(REMOTE)  # every signal has landed when the kernel ends: none can land after a resync zeroed


ABORT = KernelSpec(ml_abort, **FAR_LIBRARY)
