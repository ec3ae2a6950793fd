"""The one-node combine's per-token reduce (gpu/normal/one_node/combine.py, _reduce_token) run by
Triton's interpreter on the CPU, in both forms: the [R_P2, BLOCK_C] tile summed over its rows, and
RANK_LOOP's sum one rank's row at a time. Run as ``TRITON_INTERPRET=1 python
tests/reduce_token_cases.py`` (the interpreter must be chosen before Triton is imported, hence its
own process; test_one_node_reduce.py runs it and compares).

It prints one JSON line per case: the case, and the bits of each form's bf16 rows and float32 weights."""
import json
import sys

import torch
import triton
import triton.language as tl

from epcomm.backends.gpu.normal.one_node.combine import _reduce_token


@triton.jit
def _reduce(in_rank_ptr, out_ptr, out_w_ptr, bias0_ptr, slots_x, slots_w, num_tokens, hidden, num_topk, num_ranks,
            NUM_BIAS: tl.constexpr, R_P2: tl.constexpr, BLOCK_C: tl.constexpr, K_P2: tl.constexpr,
            RANK_LOOP: tl.constexpr):
    token = tl.program_id(0)  # (one program per token: the interpreter's loop counters are Python ints)
    if token < num_tokens:
        _reduce_token(token, in_rank_ptr, out_ptr, out_w_ptr, bias0_ptr, bias0_ptr, slots_x, slots_w, 0, hidden,
                      num_topk, num_ranks, NUM_BIAS, True, R_P2, BLOCK_C, K_P2, RANK_LOOP)


# (ranks, hidden, BLOCK_C, biases): R_P2 above the ranks (6 of 8: masked lanes), several column blocks
CASES = [dict(ranks=2, hidden=64, block_c=32, num_bias=0), dict(ranks=6, hidden=96, block_c=64, num_bias=1),
         dict(ranks=8, hidden=128, block_c=128, num_bias=0)]


def run(ranks, hidden, block_c, num_bias, tokens=5, topk=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    in_rank = (torch.rand(tokens, ranks, generator=g) < 0.6).to(torch.int8)
    in_rank[0] = 0  # a token on no rank: zeros (plus its bias)
    slots_x = torch.randn(tokens * ranks, hidden, generator=g).to(torch.bfloat16)
    slots_w = torch.rand(tokens * ranks, topk, generator=g)
    bias = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)
    results = {}
    for rank_loop in (False, True):
        out = torch.full((tokens, hidden), float("nan"), dtype=torch.bfloat16)
        out_w = torch.full((tokens, topk), float("nan"))
        _reduce[(tokens,)](in_rank, out, out_w, bias, slots_x, slots_w, tokens, hidden, topk, ranks, NUM_BIAS=num_bias,
                      R_P2=triton.next_power_of_2(ranks), BLOCK_C=block_c, K_P2=triton.next_power_of_2(topk),
                      RANK_LOOP=rank_loop)
        results[str(rank_loop)] = dict(out=out.view(torch.int16).tolist(), out_w=out_w.view(torch.int32).tolist())
    # the reference: float32 sums of the present ranks' rows (and the bias), rounded to bf16 once
    present = in_rank.bool().reshape(tokens, ranks, 1)
    rows = slots_x.float().reshape(tokens, ranks, hidden)
    want = (rows * present).sum(1) + (bias.float() if num_bias else 0)
    want_w = (slots_w.reshape(tokens, ranks, topk) * present).sum(1)
    results["reference"] = dict(out=want.to(torch.bfloat16).view(torch.int16).tolist(),
                                out_w=want_w.view(torch.int32).tolist())
    return results


if __name__ == "__main__":
    for case in CASES:
        print(json.dumps(dict(case=case, results=run(**case))))
    sys.stdout.flush()
