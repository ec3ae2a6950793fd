"""The low-latency combine's receive reduce (gpu/low_latency/combine.py, _reduce_tokens) run by
Triton's interpreter on the CPU: the sum of a token's weighted rows one entry's row at a time. Run
as ``TRITON_INTERPRET=1 python
tests/ll_reduce_cases.py`` (the interpreter must be chosen before Triton is imported, hence its own
process; test_low_latency_reduce.py runs it and compares).

It prints one JSON line per case: the case, and the bits of the kernel's bf16 rows and of a float32
reference (NaN rows where a contribution is lost)."""
import json
import sys

import torch
import triton
import triton.language as tl

from epcomm.backends.gpu.low_latency.combine import _reduce_tokens


@triton.jit
def _reduce(topk_ptr, weights_ptr, mask_ptr, out_ptr, slots_ptr, gone_ptr, num_tokens, hidden, num_topk,
            num_local, num_ranks, shrink, K_P2: tl.constexpr, BLOCK_C: tl.constexpr, R_P2: tl.constexpr):
    ranks = tl.arange(0, R_P2)
    gone = tl.load(gone_ptr + ranks, mask=ranks < num_ranks, other=0) != 0
    any_gone = tl.max(gone.to(tl.int32), axis=0) != 0
    slots_address = slots_ptr.to(tl.int64)  # (the kernel takes the slots' address, as its launch passes it)
    _reduce_tokens(tl.program_id(0), tl.num_programs(0), topk_ptr, weights_ptr, mask_ptr, out_ptr, slots_address,
                   num_tokens, hidden, num_topk, num_local, num_ranks, shrink, gone, any_gone, K_P2, BLOCK_C)


# K below K_P2 (masked lanes), several column blocks, invalid ids (-1), a masked rank with and
# without shrink (without: a late rank, its tokens' rows NaN), a rank in another call (gone)
CASES = [dict(ranks=4, num_topk=2, hidden=64, block_c=32),
         dict(ranks=4, num_topk=6, hidden=96, block_c=32, masked=[2], shrink=1),
         dict(ranks=4, num_topk=6, hidden=96, block_c=64, masked=[2], shrink=0),
         dict(ranks=8, num_topk=8, hidden=128, block_c=128, gone=[5])]


def run(ranks, num_topk, hidden, block_c, masked=(), shrink=0, gone=(), tokens=6, num_local=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    num_experts = ranks * num_local
    topk = torch.stack([torch.randperm(num_experts, generator=g)[:num_topk] for _ in range(tokens)])
    topk[1, 0] = -1  # an entry with no expert: nothing added
    weights = torch.rand(tokens, num_topk, generator=g)
    mask = torch.zeros(ranks, dtype=torch.int32)
    mask[list(masked)] = 1
    gone_lanes = torch.zeros(ranks, dtype=torch.int32)
    gone_lanes[list(gone)] = 1
    slots = torch.randn(tokens * num_topk, hidden, generator=g).to(torch.bfloat16)
    valid = topk >= 0
    owner = torch.where(valid, topk // num_local, 0)
    present = valid & (mask[owner] == 0)
    # the slots of entries not received hold whatever an earlier call left (NaN here): never read
    slots[~present.reshape(-1)] = float("nan")
    out = torch.zeros(tokens, hidden, dtype=torch.bfloat16)
    _reduce[(2,)](topk, weights, mask, out, slots, gone_lanes, tokens, hidden, num_topk, num_local,
                  ranks, shrink, K_P2=triton.next_power_of_2(num_topk), BLOCK_C=block_c,
                  R_P2=triton.next_power_of_2(ranks))
    results = {"kernel": out.view(torch.int16).tolist()}
    # the reference: float32 sums of the weighted rows of valid entries on unmasked ranks; NaN rows
    # for a token with an entry on a rank gone, or masked without shrink
    lost = valid & ((gone_lanes[owner] != 0) | ((mask[owner] != 0) & (shrink == 0)))
    rows = slots.float().reshape(tokens, num_topk, hidden).nan_to_num()
    want = (rows * (weights * present).unsqueeze(-1)).sum(1)
    want[lost.any(1)] = float("nan")
    results["reference"] = want.to(torch.bfloat16).view(torch.int16).tolist()
    return results


if __name__ == "__main__":
    for case in CASES:
        print(json.dumps(dict(case=case, results=run(**case))))
    sys.stdout.flush()
