"""Which rows a program of the pull (dispatch) or the push (combine) takes next: every peer at once.

The rows a rank receives in a dispatch — and so the rows it sends back in the combine — are grouped
by source rank in rank order (``rank_prefix_matrix``'s column of this rank says where each source's
rows start). Walked in that order by programs taking blocks ``pid, pid + P, ...``, every rank reads
source 0 first, then source 1, ...: at 4 ranks three receivers queue on one GPU's links while the
others idle (the 4 × H200 table in docs/PERFORMANCE.md). DESIGN's scale rule asks instead that at
every moment each GPU's links carry traffic to or from all its peers.

So each source's rows are cut into blocks of ``BLOCK_R`` rows (a block never spans two sources) and
the blocks are dealt out in rounds: round ``j`` holds block ``j`` of every source that has one,
in the rotated order ``rank + 1 + j, rank + 2 + j, ...`` (mod R). Program ``p`` takes items
``p, p + P, p + 2P, ...``, so at any moment a rank's ``P`` programs work on ``P`` consecutive items:
spread over every source (P >= R, P / R programs each) or over ``P`` different sources (P < R), the
rotation starting each rank, and each round, on a different source. A source with more rows simply
has blocks in more rounds, so skewed routings keep every program busy::

    blocks[s] = ceil(rows of source s / BLOCK_R);  S(j) = sum_s min(blocks[s], j)  (items before round j)
    item v  ->  round j with S(j) <= v < S(j + 1)
                source: the (v - S(j))-th source with blocks[s] > j, counting from (rank + 1 + j) mod R
                rows:   start[s] + j * BLOCK_R  ...  min(start[s] + (j + 1) * BLOCK_R, end[s])

``EVERY_PEER=False`` keeps the old rank-order walk (source 0's blocks, then source 1's, ...) for
side-by-side measurements; nothing else differs. A program's items only increase, so the round is
carried from one item to the next instead of searched (:func:`advance_round`).

With ``TRACE`` the kernels record each item (:func:`trace_item`): program, source, rows and its
``%globaltimer`` start and end, for tests/schedule_trace_cases.py (the bed's schedule table) and
scripts/trace_items.py (the pulls' items across GPUs).
"""
from __future__ import annotations

import triton
import triton.language as tl

from ...sync import now_ns

# The trace buffer (int64): [count, capacity], then `capacity` records of (program << 32 | source),
# rows, start ns, end ns.
TRACE_HEADER_WORDS = tl.constexpr(2)
TRACE_RECORD_WORDS = tl.constexpr(4)


@triton.jit
def source_blocks(prefix_ptr, rank, num_ranks, num_rows, BLOCK_R: tl.constexpr, R_P2: tl.constexpr):
    """Per source ``s`` (a [R_P2] vector each): the first and end row of its rows here (ends clipped
    to ``num_rows``, the rows the outputs have), and its number of blocks. ``prefix_ptr``: the
    [R, R] int32 rank_prefix_matrix (entry [s, d]: rows sources 0..s send rank d)."""
    peers = tl.arange(0, R_P2)
    live = peers < num_ranks
    ends = tl.minimum(tl.load(prefix_ptr + peers * num_ranks + rank, mask=live, other=0), num_rows)
    starts = tl.minimum(tl.load(prefix_ptr + (peers - 1) * num_ranks + rank, mask=live & (peers > 0), other=0),
                        num_rows)
    blocks = tl.where(live, (ends - starts + BLOCK_R - 1) // BLOCK_R, 0)
    return starts, ends, blocks


@triton.jit
def advance_round(item, round_idx, round_start, round_size, blocks):
    """The round of ``item``, from the round of an earlier item: ``(round_idx, round_start,
    round_size)`` = (j, S(j), sources with blocks > j). Callers keep ``item`` below the total.

    Rounds j, j + 1, ... hold the same sources until the one with the fewest blocks among them
    runs out (round ``last``), so they are skipped together: one step per distinct block count at
    most, not one per round. (Round by round, a program stepped P / R rounds per item at R ranks,
    and at a skewed routing — one source, rounds of one item — P rounds: a [R_P2] sum each.)"""
    while (item >= round_start + round_size) & (round_size > 0):
        last = tl.min(tl.where(blocks > round_idx, blocks, 1 << 30), axis=0)
        span = (last - round_idx) * round_size  # the items of rounds round_idx .. last - 1
        if item < round_start + span:  # in one of them: skip the whole rounds before it
            skipped = (item - round_start) // round_size
            round_start += skipped * round_size
            round_idx += skipped
        else:
            round_start += span
            round_idx = last
            round_size = tl.sum((blocks > round_idx).to(tl.int32), axis=0)
    return round_idx, round_start, round_size


@triton.jit
def item_block(item, round_idx, round_start, round_size, rank, num_ranks, starts, ends, blocks,
               BLOCK_R: tl.constexpr, R_P2: tl.constexpr, EVERY_PEER: tl.constexpr):
    """``(source, first row, end row, source's first row)`` of ``item`` (its round from
    :func:`advance_round`; unused without EVERY_PEER)."""
    peers = tl.arange(0, R_P2)
    if EVERY_PEER:
        first = (rank + 1 + round_idx) % num_ranks
        active = (blocks > round_idx).to(tl.int32)
        # earlier[p]: active sources before p in the rotation. From prefix counts over [R_P2] alone (a
        # [R_P2, R_P2] comparison would go through shared memory and a barrier of the whole program per
        # item: the overlapped pull's warps run their items apart, schedule.py's callers say why)
        below = tl.cumsum(active, axis=0) - active  # active sources below p in rank order
        below_first = tl.sum(tl.where(peers < first, active, 0), axis=0)
        earlier = tl.where(peers >= first, below - below_first, below + round_size - below_first)  # (size: Σ active)
        source = tl.sum(tl.where((active != 0) & (earlier == item - round_start), peers, 0), axis=0)
        block = round_idx
    else:  # rank order: source s's blocks are items [sum of blocks before s, ... + blocks[s])
        before = tl.cumsum(blocks, axis=0)  # inclusive
        source = tl.sum((before <= item).to(tl.int32), axis=0)
        block = item - tl.sum(tl.where(peers == source, before - blocks, 0), axis=0)
    start = tl.sum(tl.where(peers == source, starts, 0), axis=0)
    end = tl.sum(tl.where(peers == source, ends, 0), axis=0)
    first_row = start + block * BLOCK_R
    return source, first_row, tl.minimum(first_row + BLOCK_R, end), start


@triton.jit
def trace_item(trace_ptr, program, source, rows, started):
    """Record one item: (program << 32 | source), rows, start and end ``%globaltimer`` (ns); ``program``:
    the program's index among the kernel's (or, in one launch, its phase's) programs. Items past the
    buffer's capacity are counted, not stored."""
    tl.debug_barrier()  # every thread's loads of the item are done: the end time follows them
    slot = tl.atomic_add(trace_ptr, 1)
    if slot < tl.load(trace_ptr + 1):
        record = trace_ptr + TRACE_HEADER_WORDS + slot.to(tl.int64) * TRACE_RECORD_WORDS
        tl.store(record, (program.to(tl.int64) << 32) | source.to(tl.int64))
        tl.store(record + 1, rows.to(tl.int64))
        tl.store(record + 2, started)
        tl.store(record + 3, now_ns())
