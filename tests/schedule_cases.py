"""The one-node schedule's device functions (gpu/normal/one_node/schedule.py) run by Triton's
interpreter on the CPU: run as ``TRITON_INTERPRET=1 python tests/schedule_cases.py`` (the
interpreter must be chosen before Triton is imported, hence its own process; test_schedule.py runs it).

For each case it prints one JSON line: every program's items in the order it takes them, as
(source, first row, end row)."""
import json
import sys

import torch
import triton
import triton.language as tl

from epcomm.backends.gpu.normal.one_node.schedule import advance_round, item_block, source_blocks


@triton.jit
def _walk(prefix_ptr, out_ptr, rank, num_ranks, num_rows, max_items, BLOCK_R: tl.constexpr, R_P2: tl.constexpr,
          EVERY_PEER: tl.constexpr):
    pid = tl.program_id(0)
    starts, ends, blocks = source_blocks(prefix_ptr, rank, num_ranks, num_rows, BLOCK_R, R_P2)
    round_idx = 0
    round_start = 0
    round_size = tl.sum((blocks > 0).to(tl.int32), axis=0)
    n = 0
    for item in range(pid, tl.sum(blocks, axis=0), tl.num_programs(0)):
        round_idx, round_start, round_size = advance_round(item, round_idx, round_start, round_size, blocks)
        source, first, end, _ = item_block(item, round_idx, round_start, round_size, rank, num_ranks, starts, ends,
                                           blocks, BLOCK_R, R_P2, EVERY_PEER)
        record = out_ptr + (pid * max_items + n) * 3
        tl.store(record, source)
        tl.store(record + 1, first)
        tl.store(record + 2, end)
        n += 1


def walk(rows_per_source, rank, programs, block_r, every_peer, num_rows=None):
    """Each program's items for a receiver with ``rows_per_source[s]`` rows from source s."""
    R = len(rows_per_source)
    prefix = torch.zeros(R, R, dtype=torch.int32)
    prefix[:, rank] = torch.tensor(rows_per_source, dtype=torch.int32).cumsum(0)
    total = int(prefix[-1, rank])
    max_items = sum((n + block_r - 1) // block_r for n in rows_per_source) + 1
    out = torch.full((programs, max_items, 3), -1, dtype=torch.int32)
    _walk[(programs,)](prefix, out, rank, R, total if num_rows is None else num_rows, max_items, BLOCK_R=block_r,
                       R_P2=triton.next_power_of_2(R), EVERY_PEER=every_peer)
    return [[tuple(item) for item in items.tolist() if item[0] >= 0] for items in out]


CASES = [
    dict(rows_per_source=[40, 40, 40, 40], rank=0, programs=4, block_r=8, every_peer=True),
    dict(rows_per_source=[40, 40, 40, 40], rank=0, programs=4, block_r=8, every_peer=False),
    dict(rows_per_source=[33, 0, 7, 100, 1, 64, 0, 15], rank=5, programs=3, block_r=8, every_peer=True),
    dict(rows_per_source=[33, 0, 7, 100, 1, 64, 0, 15], rank=5, programs=3, block_r=8, every_peer=False),
    dict(rows_per_source=[16] * 8, rank=3, programs=24, block_r=2, every_peer=True),
    dict(rows_per_source=[0, 0, 0], rank=1, programs=2, block_r=4, every_peer=True),
    dict(rows_per_source=[9, 9, 9], rank=2, programs=5, block_r=4, every_peer=True, num_rows=20),
    # rounds of one item (one source: kernels_alone.py --lanes 8), jumped over P at a time
    dict(rows_per_source=[100, 0, 0, 0, 0, 0, 0, 0], rank=0, programs=24, block_r=2, every_peer=True),
    # block counts 32, 4, 4, 20, 0: rounds of four, then two, then one source
    dict(rows_per_source=[64, 8, 7, 40, 0], rank=4, programs=5, block_r=2, every_peer=True),
]

if __name__ == "__main__":
    for case in CASES:
        print(json.dumps(dict(case=case, items=walk(**case))))
    sys.stdout.flush()
