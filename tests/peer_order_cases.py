"""The peer orders of the low-latency kernels and of the two-level mode's hops (DESIGN's scale
rule), run by Triton's interpreter on the CPU: run as ``TRITON_INTERPRET=1 python
tests/peer_order_cases.py`` (the interpreter must be chosen before Triton is imported, hence its own
process; test_peer_order.py runs it). The kernels' own device functions: ``peer_after``
(gpu/walk.py, the walk both packages take), the low-latency count release's ``expert_after``, and
the hop-2 kernels' ``hop2_program``.

Prints one JSON object: per case, what each rank's programs map to."""
import json
import sys

import torch
import triton
import triton.language as tl

from epcomm.backends.gpu.low_latency.dispatch import expert_after
from epcomm.backends.gpu.normal.two_level.channels import hop2_program
from epcomm.backends.gpu.walk import peer_after


@triton.jit
def _walks(out_ptr, n, steps, I_P2: tl.constexpr):
    """Program ``me``: the first ``steps`` places of its walk."""
    me = tl.program_id(0)
    i = tl.arange(0, I_P2)
    tl.store(out_ptr + me * steps + i, peer_after(i, me, n), mask=i < steps)


@triton.jit
def _experts(out_ptr, num_local, num_ranks, BLOCK_E: tl.constexpr):
    """Program ``rank``: the experts of its count release's walk, BLOCK_E at a time (as _publish_counts)."""
    rank = tl.program_id(0)
    num_experts = num_local * num_ranks
    for start in range(0, num_experts, BLOCK_E):
        walk = start + tl.arange(0, BLOCK_E)
        tl.store(out_ptr + rank * num_experts + walk, expert_after(walk, rank, num_local, num_ranks),
                 mask=walk < num_experts)


@triton.jit
def _hop2(peer_bases_ptr, out_ptr, rank, ranks_per_node):
    """Program (x, c) of a hop-2 kernel at ``rank``: (s, c, j, m, base) at row c * R + x."""
    s, c, j, m, base = hop2_program(peer_bases_ptr, rank, ranks_per_node)
    row = out_ptr + (tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)) * 5
    tl.store(row, s.to(tl.int64))
    tl.store(row + 1, c.to(tl.int64))
    tl.store(row + 2, j.to(tl.int64))
    tl.store(row + 3, m.to(tl.int64))
    tl.store(row + 4, base)


def walks(n, steps):
    out = torch.full((n, steps), -1, dtype=torch.int32)
    _walks[(n,)](out, n, steps, I_P2=triton.next_power_of_2(steps))
    return out.tolist()


def experts(num_local, num_ranks, block_e):
    out = torch.full((num_ranks, num_local * num_ranks), -1, dtype=torch.int32)
    _experts[(num_ranks,)](out, num_local, num_ranks, BLOCK_E=block_e)
    return out.tolist()


def hop2(num_ranks, ranks_per_node, channels):
    """Per rank: per program (x, c), c-major, its (s, c, j, m, base); bases are 1000 * (rank + 1)."""
    bases = torch.tensor([1000 * (r + 1) for r in range(num_ranks)], dtype=torch.int64)
    per_rank = []
    for rank in range(num_ranks):
        out = torch.full((channels * num_ranks, 5), -1, dtype=torch.int64)
        _hop2[(num_ranks, channels)](bases, out, rank, ranks_per_node)
        per_rank.append(out.tolist())
    return per_rank


WALKS = [dict(n=n, steps=steps) for n in (1, 2, 3, 8) for steps in (n, 3 * n)]
EXPERTS = [dict(num_local=2, num_ranks=4, block_e=4), dict(num_local=8, num_ranks=16, block_e=32),
           dict(num_local=3, num_ranks=5, block_e=8)]
HOP2 = [dict(num_ranks=8, ranks_per_node=4, channels=2), dict(num_ranks=16, ranks_per_node=8, channels=1),
        dict(num_ranks=4, ranks_per_node=1, channels=2), dict(num_ranks=6, ranks_per_node=3, channels=3),
        dict(num_ranks=2, ranks_per_node=2, channels=1)]

if __name__ == "__main__":
    print(json.dumps(dict(walks=[dict(case=c, walks=walks(**c)) for c in WALKS],
                          experts=[dict(case=c, experts=experts(**c)) for c in EXPERTS],
                          hop2=[dict(case=c, programs=hop2(**c)) for c in HOP2])))
    sys.stdout.flush()
