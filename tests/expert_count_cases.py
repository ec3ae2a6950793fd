"""The stage's per-expert count check (gpu/normal/one_node/stage.py: ``_expert_entries`` counted
block by block, then ``_check_expert_counts``), run by Triton's interpreter on the CPU: run as
``TRITON_INTERPRET=1 python tests/expert_count_cases.py`` (test_stage_count_check.py runs it). The
list programs run these helpers inside their token loop.

One program per destination rank counts the valid top-k entries that name each of its local
experts and checks them against the given num_tokens_per_expert. One JSON line per case: the case,
the counts per destination ([R][L]) and the COUNT_ERROR word the check left."""
import json
import sys

import torch
import triton
import triton.language as tl

from epcomm.backends.gpu import sync
from epcomm.backends.gpu.normal.one_node.stage import _check_expert_counts, _expert_entries


@triton.jit
def _count(topk_ptr, per_expert_ptr, state_ptr, counts_ptr, num_tokens, num_topk, num_local,
           K_P2: tl.constexpr, L_P2: tl.constexpr, LIST_BLOCK: tl.constexpr):
    dest = tl.program_id(0)
    per_expert = tl.zeros([L_P2], tl.int32)
    for start in range(0, num_tokens, LIST_BLOCK):
        per_expert += _expert_entries(topk_ptr, start + tl.arange(0, LIST_BLOCK), num_tokens, num_topk, dest, num_local,
                                      K_P2, L_P2, LIST_BLOCK)
    tl.store(counts_ptr + dest * L_P2 + tl.arange(0, L_P2), per_expert)
    _check_expert_counts(per_expert, per_expert_ptr, dest, num_local, state_ptr, L_P2)


def count(ranks, experts, tokens, topk, block, seed, skew=None):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, experts, (tokens, topk), generator=g)
    ids[torch.rand(tokens, topk, generator=g) < 0.2] = -1  # dropped entries (-1) count for no one
    per_expert = torch.bincount(ids[ids >= 0], minlength=experts).to(torch.int32)
    if skew is not None:  # the caller's counts off by one: the check must catch it
        per_expert[skew] += 1
    num_local = experts // ranks
    l_p2 = triton.next_power_of_2(num_local)
    state = torch.zeros(sync.NUM_STATE_WORDS, dtype=torch.int64)
    counts = torch.full((ranks, l_p2), -5, dtype=torch.int32)
    _count[(ranks,)](ids, per_expert, state, counts, tokens, topk, num_local, K_P2=triton.next_power_of_2(topk),
                     L_P2=l_p2, LIST_BLOCK=block)
    return counts[:, :num_local].tolist(), int(state[sync.COUNT_ERROR]), ids.tolist()


CASES = [
    dict(ranks=4, experts=32, tokens=100, topk=8, block=32, seed=1),
    dict(ranks=3, experts=12, tokens=37, topk=3, block=16, seed=2),  # K_P2 above K, L_P2 above L
    dict(ranks=4, experts=32, tokens=64, topk=8, block=64, seed=3, skew=13),
]

if __name__ == "__main__":
    for case in CASES:
        counts, error, ids = count(**case)
        print(json.dumps(dict(case=case, counts=counts, error=error, ids=ids)))
    sys.stdout.flush()
