"""The channel geometry both multi-node normal-mode directions share (dispatch: dispatch.py,
combine: combine.py): where a channel's rows lie in the count table, which program serves which
source, where a node's block starts in a forwarder's area, and the hand-off of a channel's rows to
a peer (stores through a mapping, or gpu/reach's sends, with the signal that releases them).
"""
from __future__ import annotations

import triton
import triton.language as tl

from ...reach.modes import far_complete, far_deliver, far_send_bytes
from ...sync import arrive, store_release_sys
from ...walk import peer_after
from .areas import MAX_CHANNELS

# Signal and flag words are indexed [node][channel] with this stride whatever the call's channel
# count, so they keep fixed places for the buffer's life (workspace.py; ml_abort sets them all).
SIGNAL_STRIDE = tl.constexpr(MAX_CHANNELS)


@triton.jit
def channel_range(prefix_row, c):
    """``[lo, hi)`` of channel ``c`` from an inclusive prefix row over channels."""
    lo = tl.load(prefix_row + c - 1, mask=c > 0, other=0)
    return lo, tl.load(prefix_row + c)


@triton.jit
def hop2_program(peer_bases_ptr, rank, ranks_per_node):
    """Program (x, c) of a hop-2 kernel at d = (node, j): ``(s, c, j, m, base)`` — source s on node
    m, and the NVLink base of s's forwarder on d's node, f = (node, local(s)). Programs take the
    sources node by node (m = x // k) and, within a node, the forwarders from the one after d
    (local(s) = :func:`peer_after` (x % k, j, k)): at every moment the node's k ranks read from (the
    dispatch) or store into (the combine) k different forwarders, instead of all of them
    forwarder (node, 0) first. Only which program takes a source changes: each (s, c) is still
    taken by exactly one program, and writes the same rows."""
    x = tl.program_id(0)
    c = tl.program_id(1)
    node = rank // ranks_per_node
    j = rank % ranks_per_node
    local = peer_after(x % ranks_per_node, j, ranks_per_node)
    s = x - x % ranks_per_node + local
    return s, c, j, s // ranks_per_node, tl.load(peer_bases_ptr + node * ranks_per_node + local)


@triton.jit
def node_block_start(meta_ptr, meta_len, per_node_at, node, dest_node, local, ranks_per_node):
    """Where block ``node`` starts in the receive area of forwarder ``(dest_node, local)``: the rows
    its rail peers on nodes ``0..node-1`` send to ``dest_node`` (recv_rdma_rank_prefix_sum[node - 1])."""
    start = 0
    for m in range(0, node):
        start += tl.load(meta_ptr + (m * ranks_per_node + local) * meta_len + per_node_at + dest_node)
    return start


@triton.jit
def part_rows(lo, hi, part, parts):
    """Rows ``[lo, hi)`` of a channel, slice ``part`` of ``parts`` (contiguous, sizes within one)."""
    return lo + (hi - lo) * part // parts, lo + (hi - lo) * (part + 1) // parts


@triton.jit
def peer_reach(pe, rank, p2p, peer_bases_ptr):
    """``(direct, shift)`` for a hand-off to ``pe``: ``direct`` when this program stores the rows
    straight into ``pe``'s area — ``pe`` is this rank, or (``p2p`` != 0) ``pe``'s workspace is
    mapped into this process (``peer_bases[pe]`` != 0: a peer over NVLink, or a test rank; a
    peer on another host is 0) — and ``shift``, the bytes from this rank's address of symmetric
    memory to that mapping (0 for this rank). Otherwise the rows are staged and put."""
    peer_base = tl.load(peer_bases_ptr + pe)
    direct = (pe == rank) | ((p2p != 0) & (peer_base != 0))
    return direct, peer_base - tl.load(peer_bases_ptr + rank)


@triton.jit
def hand_off(dst, src, row_bytes, lo, hi, part_lo, part_hi, direct, shift, signal_word, epoch, pe, parts,
              counter_ptr, peer_bases_ptr, rank, REMOTE: tl.constexpr):
    """Rows ``[lo, hi)`` of a channel are ready (this program wrote rows ``[part_lo, part_hi)``:
    at ``dst + shift`` when ``direct`` (:func:`peer_reach`), else staged at ``src``; both are row-0
    addresses) and are handed to ``pe``, whose readers ACQUIRE ``signal_word`` (SET to ``epoch``)
    before reading them. Call after a CTA barrier that orders the program's row writes.

    One program per channel (``parts == 1``): direct, a RELEASE of the signal through the same
    mapping (st.release.sys: the rows, stored before it, are seen with it); else one put with
    signal (the bytes land before the signal). Several: each program puts its own slice and
    completes it (quiet) before it arrives at ``counter_ptr`` (a direct slice needs no
    completion: the arrival orders it); the last to arrive (acq_rel: it has seen every slice)
    RELEASEs the signal, or SETs it alone on ``pe``."""
    if parts == 1:
        if direct:
            store_release_sys(signal_word + shift, epoch)
        else:
            far_deliver(dst + lo.to(tl.int64) * row_bytes, src + lo.to(tl.int64) * row_bytes,
                            (hi - lo).to(tl.int64) * row_bytes, signal_word, epoch, pe, peer_bases_ptr, rank, REMOTE)
    else:
        if not direct:
            if part_hi > part_lo:  # (a slice may be empty: the channel has fewer rows than parts)
                far_send_bytes(dst + part_lo.to(tl.int64) * row_bytes, src + part_lo.to(tl.int64) * row_bytes,
                                   (part_hi - part_lo).to(tl.int64) * row_bytes, pe, peer_bases_ptr, rank, REMOTE)
            far_complete(REMOTE)  # this slice has landed before this program arrives
        if arrive(counter_ptr, parts):
            if direct:
                store_release_sys(signal_word + shift, epoch)
            else:  # the signal alone, after every slice landed
                far_deliver(signal_word, signal_word, 0, signal_word, epoch, pe, peer_bases_ptr, rank, REMOTE)
