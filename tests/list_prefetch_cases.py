"""The full dispatch's pull loading each item's list entries one item ahead (dispatch.py,
PREFETCH_INDEX, ``_list_entries``), run by Triton's interpreter on the CPU: run as
``TRITON_INTERPRET=1 python tests/list_prefetch_cases.py`` (test_schedule.py runs it).

Each source's list of the tokens it sends the receiver holds ``1000 * source + i`` at entry i. The
kernel walks the pull's items as the pull does — the first item's entries before the loop, each
next item's from the current item's round state — and records, per item, its block (source, first
row, end row) and the tokens it was handed. One JSON line per case."""
import json
import sys

import torch
import triton
import triton.language as tl

from epcomm.backends.gpu.normal.one_node.dispatch import _list_entries
from epcomm.backends.gpu.normal.one_node.schedule import advance_round, item_block, source_blocks


@triton.jit
def _prefetched_walk(prefix_ptr, bases_ptr, out_ptr, rank, num_ranks, num_rows, list_cap, max_items,
                     BLOCK_R: tl.constexpr, R_P2: tl.constexpr, EVERY_PEER: tl.constexpr):
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    starts, ends, blocks = source_blocks(prefix_ptr, rank, num_ranks, num_rows, BLOCK_R, R_P2)
    num_items = tl.sum(blocks, axis=0)
    round_idx = 0
    round_start = 0
    round_size = tl.sum((blocks > 0).to(tl.int32), axis=0)
    next_token = _list_entries(pid, num_items, round_idx, round_start, round_size, rank, num_ranks, starts, ends,
                               blocks, bases_ptr, 0, 0, list_cap, BLOCK_R, R_P2, EVERY_PEER)
    n = 0
    for item in range(pid, num_items, num_programs):
        round_idx, round_start, round_size = advance_round(item, round_idx, round_start, round_size, blocks)
        source, first, end, _ = item_block(item, round_idx, round_start, round_size, rank, num_ranks, starts, ends,
                                           blocks, BLOCK_R, R_P2, EVERY_PEER)
        token = next_token
        next_token = _list_entries(item + num_programs, num_items, round_idx, round_start, round_size, rank,
                                   num_ranks, starts, ends, blocks, bases_ptr, 0, 0, list_cap, BLOCK_R, R_P2,
                                   EVERY_PEER)
        record = out_ptr + (pid * max_items + n) * (3 + BLOCK_R)
        tl.store(record, source)
        tl.store(record + 1, first)
        tl.store(record + 2, end)
        tl.store(record + 3 + tl.arange(0, BLOCK_R), token)
        n += 1
    # past the last item: nothing is read, the entries are -1
    tl.store(out_ptr + (pid * max_items + n) * (3 + BLOCK_R) + 3 + tl.arange(0, BLOCK_R), next_token)


def walk(rows_per_source, rank, programs, block_r, every_peer, num_rows=None):
    R = len(rows_per_source)
    prefix = torch.zeros(R, R, dtype=torch.int32)
    prefix[:, rank] = torch.tensor(rows_per_source, dtype=torch.int32).cumsum(0)
    total = int(prefix[-1, rank])
    list_cap = max(rows_per_source + [1])
    lists = [torch.full((R * list_cap,), -7, dtype=torch.int32) for _ in range(R)]
    for source, count in enumerate(rows_per_source):
        lists[source][rank * list_cap:rank * list_cap + count] = 1000 * source + torch.arange(count, dtype=torch.int32)
    bases = torch.tensor([t.data_ptr() for t in lists], dtype=torch.int64)
    max_items = sum((n + block_r - 1) // block_r for n in rows_per_source) + 2
    out = torch.full((programs, max_items, 3 + block_r), -9, dtype=torch.int32)
    _prefetched_walk[(programs,)](prefix, bases, out, rank, R, total if num_rows is None else num_rows, list_cap,
                                  max_items, BLOCK_R=block_r, R_P2=triton.next_power_of_2(R), EVERY_PEER=every_peer)
    return [[item for item in items.tolist() if item[0] != -9 or item[3] != -9] for items in out]


CASES = [
    dict(rows_per_source=[40, 40, 40, 40], rank=0, programs=4, block_r=8, every_peer=True),
    dict(rows_per_source=[40, 40, 40, 40], rank=2, programs=3, block_r=8, every_peer=False),
    dict(rows_per_source=[33, 0, 7, 100, 1, 64, 0, 15], rank=5, programs=3, block_r=8, every_peer=True),
    dict(rows_per_source=[0, 0, 0], rank=1, programs=2, block_r=4, every_peer=True),
    dict(rows_per_source=[9, 9, 9], rank=2, programs=5, block_r=4, every_peer=True, num_rows=20),
    dict(rows_per_source=[100, 0, 0, 0, 0, 0, 0, 0], rank=0, programs=24, block_r=2, every_peer=True),
    dict(rows_per_source=[64, 8, 7, 40, 0], rank=4, programs=5, block_r=2, every_peer=True),
]

if __name__ == "__main__":
    for case in CASES:
        print(json.dumps(dict(case=case, items=walk(**case))))
    sys.stdout.flush()
