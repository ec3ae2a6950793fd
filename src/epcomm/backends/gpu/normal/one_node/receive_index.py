"""A full dispatch's receive index gathered before the pull's items (dispatch.py, GATHER_INDEX, an
experiment off by default): ``recv_src_idx[r]``, the token each received row is at its source,
read from the sources' lists by every program of the pull at once, GATHER_ROWS rows at a time, then
a barrier of the launch — so that the items read their entries locally, as a cached dispatch does,
instead of one dependent remote round trip per item before the rows they name."""
from __future__ import annotations

import triton
import triton.language as tl

from ... import sync
from ...sync import arrive, poll_epochs, publish_from_one_thread

GATHER_ROWS = tl.constexpr(1024)  # rows whose list entries one program loads at once (GATHER_INDEX)


@triton.jit
def list_entries_of_rows(rows, live, starts, ends, rank, num_ranks, normal_bases_ptr, half_offset, lists_offset,
                         list_cap, R_P2: tl.constexpr):
    """int32 per row of ``rows`` (received rows, where ``live``; -1 elsewhere): the token it is at
    its source — entry ``row - start`` of the source's list of the tokens it sends here, the source
    being the one whose [start, end) holds the row (rows are grouped by source in rank order)."""
    peers = tl.arange(0, R_P2)
    inside = (rows[:, None] >= starts[None, :]) & (rows[:, None] < ends[None, :]) & (peers < num_ranks)[None, :]
    src = tl.sum(tl.where(inside, peers[None, :], 0), axis=1)
    start = tl.sum(tl.where(inside, starts[None, :], 0), axis=1)
    staged = tl.load(normal_bases_ptr + src, mask=live, other=0) + half_offset
    entry = staged + lists_offset + ((rank * list_cap).to(tl.int64) + rows - start) * 4
    return tl.load(entry.to(tl.pointer_type(tl.int32)), mask=live, other=-1)


@triton.jit
def gather_index(pid, num_programs, epoch, starts, ends, rank, num_ranks, normal_bases_ptr, half_offset, lists_offset,
                 list_cap, src_idx_ptr, state_ptr, timeout_ns, R_P2: tl.constexpr):
    """GATHER_INDEX: recv_src_idx of every received row, the programs taking GATHER_ROWS rows at a
    time, then a barrier of the launch. Returns 1 in a thread that saw every program's entries
    stored (the ACQUIRE of INDEX_GATHERED), 0 where the barrier timed out (the thread then reads its
    entries from the sources). Rows are grouped by source in rank order: a row's source is the one
    whose [start, end) holds it, its entry ``row - start`` of that source's list of tokens for here."""
    peers = tl.arange(0, R_P2)
    num_recv = tl.max(tl.where(peers < num_ranks, ends, 0), axis=0)
    for chunk in range(pid, tl.cdiv(num_recv, GATHER_ROWS), num_programs):
        rows = chunk * GATHER_ROWS + tl.arange(0, GATHER_ROWS)
        live = rows < num_recv
        tl.store(src_idx_ptr + rows, list_entries_of_rows(rows, live, starts, ends, rank, num_ranks, normal_bases_ptr,
                                                          half_offset, lists_offset, list_cap, R_P2), mask=live)
    # The launch's barrier: each program's stores precede its arrival (arrive: a CTA barrier, then
    # acq_rel at gpu scope); the last to arrive acquired them all and RELEASEs the epoch; every thread
    # ACQUIREs it before it reads src_idx rows another program wrote.
    flag = (state_ptr + sync.INDEX_GATHERED).to(tl.int64)
    if arrive(state_ptr + sync.ARRIVE_RECEIVE, num_programs):
        publish_from_one_thread(flag, epoch.to(tl.int64))
    _words, _waited, late = poll_epochs((state_ptr + sync.INDEX_GATHERED + peers * 0), peers == 0, epoch, timeout_ns,
                                        EPOCH_SHIFT=0)
    return 1 - tl.max(late.to(tl.int32), axis=0)
