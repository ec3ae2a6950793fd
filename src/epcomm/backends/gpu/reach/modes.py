"""How the kernels reach a peer's memory: the ``REMOTE`` constexpr of every kernel that reaches peers
beyond stores (low-latency, abort, and the two-level normal-mode kernels), and its library spec.

On one node (the nvlink backend, ``PEERS_BY_STORES``) every peer's workspace is mapped here and
all hand-offs are plain stores plus a release (sync.py). Across nodes (the nvshmem backend) a
rank's stores reach only its own node — nodes are blocks of ``ranks_per_node`` consecutive
ranks; bytes for a far peer are staged in symmetric memory and put there (``FAR_BY_NVSHMEM``,
gpu/reach/nvshmem.py), or, in the one-GPU tests, copied by the loopback transport
(``FAR_BY_LOOPBACK``). The helpers here take both paths lane by lane; with ``REMOTE == 0`` the far
path compiles away and the kernels are exactly the single-node ones.

Ordering for far peers: a program completes its puts and signals (``complete_sends``) before it
arrives (sync.py, step 2), so the last arriver's signals (step 3 over the network: an NVSHMEM
SET of the word) are issued after every byte of the call has landed.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .nvshmem import NVSHMEM, complete_sends, deliver, send_bytes, set_words
from ..sync import (BOARD_RING, FP_ROW, RESYNC_TAG, board_slot, board_word, live_peers, post_call_to_peers,
                    post_fingerprint, post_fingerprint_to_peers, publish)

PEERS_BY_STORES, FAR_BY_NVSHMEM, FAR_BY_LOOPBACK = 0, 1, 2
LOOPBACK_MODE = tl.constexpr(FAR_BY_LOOPBACK)  # (the kernels' name for it)
# The KernelSpec keywords of every kernel with a REMOTE constexpr: NVSHMEM is linked (and each
# module set up for it) only in the specialisations that reach far peers through it.
FAR_LIBRARY = dict(library=NVSHMEM, library_if=("REMOTE", FAR_BY_NVSHMEM))


@triton.jit
def same_node(ranks, rank, ranks_per_node, REMOTE: tl.constexpr):
    """Which of ``ranks`` this rank reaches with stores: those of its own node (all without REMOTE)."""
    if REMOTE:
        return (ranks // ranks_per_node) == (rank // ranks_per_node)
    return ranks == ranks


@triton.jit
def release_words(bases_ptr, offsets, receivers, values, live, spare_address, rank, ranks_per_node, spare_word,
                  REMOTE: tl.constexpr):
    """Step 3 (sync.py) for int64 words at byte ``offsets`` from each receiver's workspace: a
    release store to near receivers (dead lanes store to ``spare_address``, a local scratch word),
    an NVSHMEM SET to far ones (dead lanes SET ``spare_word``, this rank's symmetric scratch word)."""
    near = same_node(receivers, rank, ranks_per_node, REMOTE)
    publish(tl.load(bases_ptr + receivers, mask=live & near, other=0) + offsets, values, live & near, spare_address)
    if REMOTE:
        set_words(tl.load(bases_ptr + rank) + offsets, values, receivers, live & (near == 0), spare_word, bases_ptr,
                  rank, REMOTE == LOOPBACK_MODE)


@triton.jit
def post_fingerprint_any(bases_ptr, fp_rows, rank, num_ranks, mask_ptr, fp0, fp1, epoch, ranks_per_node, spare_word,
                         R_P2: tl.constexpr, REMOTE: tl.constexpr):
    """sync.post_fingerprint_to_peers, with far peers' rows SET by signals (the kernel completes
    them, like its puts, before the releasing program signals)."""
    if REMOTE:
        peers, live = live_peers(mask_ptr, num_ranks, HAS_MASK=True, R_P2=R_P2)
        far = live & (same_node(peers, rank, ranks_per_node, REMOTE) == 0)
        post_fingerprint(tl.load(bases_ptr + peers, mask=live & (far == 0), other=0) + fp_rows, rank,
                         live & (far == 0), fp0, fp1, epoch)
        set_row(tl.load(bases_ptr + rank) + fp_rows, peers, far, fp0, fp1, epoch, bases_ptr, rank, spare_word, R_P2,
                REMOTE)
    else:
        post_fingerprint_to_peers(bases_ptr, fp_rows, rank, num_ranks, mask_ptr, fp0, fp1, epoch, HAS_MASK=True,
                                  R_P2=R_P2)


@triton.jit
def post_call_any(board_bases_ptr, rank, num_ranks, call_tag, fp0, ranks_per_node, R_P2: tl.constexpr,
                  REMOTE: tl.constexpr):
    """sync.post_call_to_peers on every rank, far peers' words SET by signals (the board lies in
    symmetric memory; the word after its rows is this rank's scratch word for dead lanes). The SETs
    need not complete before anything: the board publishes nothing."""
    peers = tl.arange(0, R_P2)
    live = peers < num_ranks
    near = same_node(peers, rank, ranks_per_node, REMOTE)
    post_call_to_peers(board_bases_ptr, rank, num_ranks, call_tag, fp0, near, R_P2)
    if REMOTE:
        if call_tag != 0:
            my_row = tl.load(board_bases_ptr + rank) + rank * BOARD_RING * 8
            spare = tl.load(board_bases_ptr + rank) + R_P2 * BOARD_RING * 8
            word = tl.zeros([R_P2], tl.int64) + board_word(call_tag, fp0)
            first = tl.where(call_tag == RESYNC_TAG, 0, board_slot(call_tag))
            for slot in range(first, first + tl.where(call_tag == RESYNC_TAG, BOARD_RING, 1)):
                set_words(tl.zeros([R_P2], tl.int64) + my_row + slot * 8, word, peers, live & (near == 0), spare,
                          board_bases_ptr, rank, REMOTE == LOOPBACK_MODE)


@triton.jit
def set_row(rows_address, peers, far, fp0, fp1, epoch, bases_ptr, rank, spare_word, LANES: tl.constexpr,
            REMOTE: tl.constexpr):
    """Row ``rank`` of the fingerprint rows at ``rows_address`` (this rank's symmetric address of
    the set's half) on each ``far`` peer: its words, then (after a completion: ordered) its epoch."""
    row = tl.zeros([LANES], tl.int64) + rows_address + rank * FP_ROW
    zeros = tl.zeros([LANES], tl.int64)
    set_words(row, zeros + fp0, peers, far, spare_word, bases_ptr, rank, REMOTE == LOOPBACK_MODE)
    set_words(row + 8, zeros + fp1, peers, far, spare_word, bases_ptr, rank, REMOTE == LOOPBACK_MODE)
    complete_sends(REMOTE == LOOPBACK_MODE)
    set_words(row + 16, zeros + epoch, peers, far, spare_word, bases_ptr, rank, REMOTE == LOOPBACK_MODE)


@triton.jit
def set_row_epoch_first(rows_address, peers, far, fp0, fp1, epoch, bases_ptr, rank, spare_word, LANES: tl.constexpr,
                        REMOTE: tl.constexpr):
    """:func:`set_row` the other way round: the epoch field, then (after a completion: ordered) the
    words — a reader that acquires the words reads the epoch field they came with (an abort's row,
    which may land in a half a reader a call late is still checking: agreement.check_rows)."""
    row = tl.zeros([LANES], tl.int64) + rows_address + rank * FP_ROW
    zeros = tl.zeros([LANES], tl.int64)
    set_words(row + 16, zeros + epoch, peers, far, spare_word, bases_ptr, rank, REMOTE == LOOPBACK_MODE)
    complete_sends(REMOTE == LOOPBACK_MODE)
    set_words(row, zeros + fp0, peers, far, spare_word, bases_ptr, rank, REMOTE == LOOPBACK_MODE)
    set_words(row + 8, zeros + fp1, peers, far, spare_word, bases_ptr, rank, REMOTE == LOOPBACK_MODE)


# ---------------------------------------------------------------- far peers (REMOTE != PEERS_BY_STORES)
@triton.jit
def far_deliver(dst, src, nbytes, signal_word, value, pe, peer_bases_ptr, rank, REMOTE: tl.constexpr):
    """``nbytes`` from ``src`` to ``dst`` on far peer ``pe``, then its ``signal_word`` SET to
    ``value``, ordered (nvshmem.deliver: a put with signal, or the loopback's stores)."""
    deliver(dst, src, nbytes, signal_word, value, pe, peer_bases_ptr, rank, REMOTE == LOOPBACK_MODE)


@triton.jit
def far_send_bytes(dst, src, nbytes, pe, peer_bases_ptr, rank, REMOTE: tl.constexpr):
    """``nbytes`` to far peer ``pe``, not yet complete (nvshmem.send_bytes); :func:`far_complete`
    waits for this program's sends."""
    send_bytes(dst, src, nbytes, pe, peer_bases_ptr, rank, REMOTE == LOOPBACK_MODE)


@triton.jit
def far_complete(REMOTE: tl.constexpr):
    """This program's sends to far peers have landed (nvshmem.complete_sends: a quiet)."""
    complete_sends(REMOTE == LOOPBACK_MODE)


__all__ = ["PEERS_BY_STORES", "FAR_BY_NVSHMEM", "FAR_BY_LOOPBACK", "LOOPBACK_MODE", "FAR_LIBRARY", "same_node", "release_words",
           "post_fingerprint_any", "post_call_any", "set_row", "set_row_epoch_first", "far_deliver", "far_send_bytes",
           "far_complete"]
