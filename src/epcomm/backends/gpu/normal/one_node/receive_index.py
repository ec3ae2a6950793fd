"""A full dispatch's receive index gathered before the pull's items (dispatch.py, GATHER_INDEX, an
experiment off by default): ``recv_src_idx[r]``, the token each received row is at its source,
read from the sources' lists by every program of the pull at once, GATHER_ROWS rows at a time, then
a barrier of the launch — so that the items read their entries locally, as a cached dispatch does,
instead of one dependent remote round trip per item before the rows they name. Also where a list
lives (``list_of``): at its source, or (PUSHED_LISTS) stored into its receiver's workspace, where
"from the sources" below reads "from this rank's list area"."""
from __future__ import annotations

import triton
import triton.language as tl

from ... import sync
from ...sync import arrive, poll_epochs, publish_from_one_thread

# How long a program waits for the others at the barrier before it reads its entries from the sources
# as the pull did before (the same values): the programs run at once, the gather takes microseconds,
# and a launch whose programs do not all fit at once (kernels of other streams on the SMs) must not
# stall on it for the call's timeout.
GATHER_WAIT_NS = tl.constexpr(100_000)

GATHER_ROWS = tl.constexpr(1024)  # rows whose list entries one program loads at once (GATHER_INDEX)


@triton.jit
def list_of(source_half, dest_half, source, dest, lists_offset, list_cap, PUSHED_LISTS: tl.constexpr):
    """int32 pointer to entry 0 of ``source``'s list of the tokens it sends ``dest``, given the
    byte addresses of both ranks' workspace half (``source`` may be a tensor of ranks, with
    ``source_half`` per element). The one place that says where a list lives: in the source's
    workspace, written there by its stage and read remotely by the receiver's pull; or
    (PUSHED_LISTS, the default: choices.py) in the receiver's, stored there remotely by the source's stage so
    that the pull reads its entries locally. Either way a half's list area is [R, list_cap] int32:
    the lists a rank writes, or the lists written to it. (The half a branch does not use is never
    loaded: the compiler drops it.)"""
    if PUSHED_LISTS:
        return (dest_half + lists_offset).to(tl.pointer_type(tl.int32)) + source.to(tl.int64) * list_cap
    else:
        return (source_half + lists_offset).to(tl.pointer_type(tl.int32)) + dest.to(tl.int64) * list_cap


@triton.jit
def list_entries_of_rows(rows, live, starts, ends, rank, num_ranks, normal_bases_ptr, half_offset, lists_offset,
                         list_cap, R_P2: tl.constexpr, PUSHED_LISTS: tl.constexpr):
    """int32 per row of ``rows`` (received rows, where ``live``; -1 elsewhere): the token it is at
    its source — entry ``row - start`` of the source's list of the tokens it sends here, the source
    being the one whose [start, end) holds the row (rows are grouped by source in rank order)."""
    peers = tl.arange(0, R_P2)
    inside = (rows[:, None] >= starts[None, :]) & (rows[:, None] < ends[None, :]) & (peers < num_ranks)[None, :]
    src = tl.sum(tl.where(inside, peers[None, :], 0), axis=1)  # (0 for rows not live: a real rank)
    start = tl.sum(tl.where(inside, starts[None, :], 0), axis=1)
    staged = tl.load(normal_bases_ptr + src, mask=live, other=0) + half_offset
    here = tl.load(normal_bases_ptr + rank) + half_offset
    entry = list_of(staged, here, src, rank, lists_offset, list_cap, PUSHED_LISTS) + (rows - start)
    return tl.load(entry, mask=live, other=-1)


@triton.jit
def gather_index(pid, num_programs, epoch, starts, ends, rank, num_ranks, normal_bases_ptr, half_offset, lists_offset,
                 list_cap, src_idx_ptr, state_ptr, agreed, R_P2: tl.constexpr, PUSHED_LISTS: tl.constexpr):
    """GATHER_INDEX: recv_src_idx of every received row, the programs taking GATHER_ROWS rows at a
    time, then a barrier of the launch. Returns 1 in a thread that saw every program's entries
    stored (the ACQUIRE of INDEX_GATHERED), 0 where the barrier timed out or a program found the
    call failed (``agreed`` 0: its acquire_and_agree gave up, it gathered nothing) — the thread then
    reads its entries from the sources. Rows are grouped by source in rank order: a row's source is
    the one whose [start, end) holds it, its entry ``row - start`` of that source's list for here."""
    peers = tl.arange(0, R_P2)
    num_recv = tl.max(tl.where(peers < num_ranks, ends, 0), axis=0)
    for chunk in range(pid, tl.cdiv(num_recv, GATHER_ROWS), num_programs):
        rows = chunk * GATHER_ROWS + tl.arange(0, GATHER_ROWS)
        live = rows < num_recv
        tl.store(src_idx_ptr + rows, list_entries_of_rows(rows, live, starts, ends, rank, num_ranks, normal_bases_ptr,
                                                          half_offset, lists_offset, list_cap, R_P2, PUSHED_LISTS),
                 mask=live)
    # The launch's barrier: each program's stores precede its arrival (arrive: a CTA barrier, then
    # acq_rel at gpu scope); the last to arrive acquired them all and RELEASEs the epoch; every thread
    # ACQUIREs it before it reads src_idx rows another program wrote.
    # A program that gathered nothing (its agreement failed) leaves -epoch, so the barrier never opens
    # for this call (the others read from the sources; the call raises at the next one anyway).
    flag = (state_ptr + sync.INDEX_GATHERED).to(tl.int64)
    if agreed == 0:
        tl.store(state_ptr + sync.INDEX_GATHERED, -epoch.to(tl.int64))  # (before the arrival: the last one sees it)
    if arrive(state_ptr + sync.ARRIVE_RECEIVE, num_programs):
        if tl.load(state_ptr + sync.INDEX_GATHERED) != -epoch.to(tl.int64):
            publish_from_one_thread(flag, epoch.to(tl.int64))
    _words, _waited, late = poll_epochs((state_ptr + sync.INDEX_GATHERED + peers * 0), peers == 0, epoch,
                                        GATHER_WAIT_NS, EPOCH_SHIFT=0)
    return 1 - tl.max(late.to(tl.int32), axis=0)
