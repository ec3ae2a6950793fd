"""The receive index gathered before the pull's items (receive_index.py, GATHER_INDEX:
``list_entries_of_rows``), run by Triton's interpreter on the CPU: run as ``TRITON_INTERPRET=1
python tests/gather_index_cases.py`` (test_schedule.py runs it).

Each source's list of the tokens it sends the receiver holds ``1000 * source + i`` at entry i (and
-7 past its count): in the source's workspace (row ``rank`` of its list area), or with ``pushed``
in the receiver's (row ``source`` of the receiver's: PUSHED_LISTS, receive_index.list_of). With
``written``, ``list_of`` places the entries, called as the stage's list programs call it (each
source its own half and the receiver's, itself, the receiver), so the reader must find them
where the writer put them. The kernel takes the received rows in chunks, as ``gather_index`` does (whose
barrier, in PTX, the interpreter cannot run), and writes each row's entry to ``src_idx``. One JSON
line per case: the case and src_idx."""
import json
import sys

import torch
import triton
import triton.language as tl

from epcomm.backends.gpu.normal.one_node.receive_index import list_entries_of_rows, list_of
from epcomm.backends.gpu.normal.one_node.schedule import source_blocks


@triton.jit
def _gather(prefix_ptr, bases_ptr, src_idx_ptr, rank, num_ranks, num_rows, half_offset, list_cap,
            CHUNK: tl.constexpr, R_P2: tl.constexpr, PUSHED_LISTS: tl.constexpr):
    pid = tl.program_id(0)
    starts, ends, _ = source_blocks(prefix_ptr, rank, num_ranks, num_rows, 1, R_P2)
    peers = tl.arange(0, R_P2)
    num_recv = tl.max(tl.where(peers < num_ranks, ends, 0), axis=0)
    for chunk in range(pid, tl.cdiv(num_recv, CHUNK), tl.num_programs(0)):
        rows = chunk * CHUNK + tl.arange(0, CHUNK)
        live = rows < num_recv
        tl.store(src_idx_ptr + rows, list_entries_of_rows(rows, live, starts, ends, rank, num_ranks, bases_ptr,
                                                          half_offset, 16, list_cap, R_P2, PUSHED_LISTS), mask=live)


@triton.jit
def _write(counts_ptr, bases_ptr, rank, half_offset, list_cap, PUSHED_LISTS: tl.constexpr):
    source = tl.program_id(0)  # (as stage._stage: list_of(its half, the receiver's, itself, the receiver))
    lists = list_of(tl.load(bases_ptr + source) + half_offset, tl.load(bases_ptr + rank) + half_offset, source, rank,
                    16, list_cap, PUSHED_LISTS)
    i = tl.arange(0, 128)
    tl.store(lists + i, 1000 * source + i, mask=i < tl.load(counts_ptr + source))


def gather(rows_per_source, rank, programs, chunk, num_rows=None, pushed=False, written=False):
    R = len(rows_per_source)
    prefix = torch.zeros(R, R, dtype=torch.int32)
    prefix[:, rank] = torch.tensor(rows_per_source, dtype=torch.int32).cumsum(0)
    total = int(prefix[-1, rank])
    list_cap = max(rows_per_source + [1])
    half_offset = 64  # bytes before the lists of this half: the kernel must add it (and lists_offset, 16)
    areas = [torch.full((half_offset // 4 + 4 + R * list_cap,), -7, dtype=torch.int32) for _ in range(R)]
    bases = torch.tensor([t.data_ptr() for t in areas], dtype=torch.int64)
    if written:
        _write[(R,)](torch.tensor(rows_per_source, dtype=torch.int32), bases, rank, half_offset, list_cap,
                     PUSHED_LISTS=pushed)
    for source, count in enumerate(rows_per_source if not written else []):
        owner, row = (rank, source) if pushed else (source, rank)
        first = half_offset // 4 + 4 + row * list_cap
        areas[owner][first:first + count] = 1000 * source + torch.arange(count, dtype=torch.int32)
    src_idx = torch.full((total + 3,), -9, dtype=torch.int32)
    _gather[(programs,)](prefix, bases, src_idx, rank, R, total if num_rows is None else num_rows, half_offset,
                         list_cap, CHUNK=chunk, R_P2=triton.next_power_of_2(R), PUSHED_LISTS=pushed)
    return src_idx.tolist()


CASES = [
    dict(rows_per_source=[40, 40, 40, 40], rank=0, programs=3, chunk=16),
    dict(rows_per_source=[33, 0, 7, 100, 1, 64, 0, 15], rank=5, programs=4, chunk=32),
    dict(rows_per_source=[0, 0, 0], rank=1, programs=2, chunk=16),
    dict(rows_per_source=[9, 9, 9], rank=2, programs=5, chunk=4, num_rows=20),
    dict(rows_per_source=[100, 0, 0, 0, 0, 0, 0, 0], rank=0, programs=24, chunk=8),
    dict(rows_per_source=[33, 0, 7, 100, 1, 64, 0, 15], rank=5, programs=4, chunk=32, pushed=True),
    dict(rows_per_source=[9, 9, 9], rank=2, programs=5, chunk=4, num_rows=20, pushed=True),
    dict(rows_per_source=[33, 0, 7, 100, 1, 64, 0, 15], rank=5, programs=4, chunk=32, written=True),
    dict(rows_per_source=[33, 0, 7, 100, 1, 64, 0, 15], rank=5, programs=4, chunk=32, pushed=True, written=True),
]

if __name__ == "__main__":
    for case in CASES:
        print(json.dumps(dict(case=case, src_idx=gather(**case))))
    sys.stdout.flush()
