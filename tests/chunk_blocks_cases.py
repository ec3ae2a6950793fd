"""The one-launch combine's chunk head (gpu/normal/one_node/combine.py, chunk_blocks) run by Triton's
interpreter on the CPU, in both forms: the [BLOCK_R, R_P2] tile and the token-by-token reading
(BY_TOKEN, what WARPS_APART uses). Run as ``TRITON_INTERPRET=1 python tests/chunk_blocks_cases.py``
(test_schedule.py runs it). Prints one JSON line per case: each form's first and last blocks per
pusher for every chunk, and a reference computed in Python."""
import json
import sys

import torch
import triton
import triton.language as tl

from epcomm.backends.gpu.normal.one_node.combine import chunk_blocks


@triton.jit
def _blocks(in_rank_ptr, list_index_ptr, out_ptr, num_tokens, num_ranks, BLOCK_R: tl.constexpr, R_P2: tl.constexpr,
            BY_TOKEN: tl.constexpr):
    chunk = tl.program_id(0)
    first, last = chunk_blocks(in_rank_ptr, list_index_ptr, chunk * BLOCK_R, num_tokens, num_ranks, BLOCK_R, R_P2,
                               BY_TOKEN)
    peers = tl.arange(0, R_P2)
    tl.store(out_ptr + (chunk * 2) * R_P2 + peers, first)
    tl.store(out_ptr + (chunk * 2 + 1) * R_P2 + peers, last)


# (ranks, tokens, BLOCK_R): R_P2 above the ranks (6 of 8), a last chunk cut short, a token on no rank
CASES = [dict(ranks=2, tokens=20, block_r=8), dict(ranks=6, tokens=37, block_r=4), dict(ranks=8, tokens=16, block_r=8)]


def run(ranks, tokens, block_r, seed=0):
    g = torch.Generator().manual_seed(seed)
    in_rank = (torch.rand(tokens, ranks, generator=g) < 0.5).to(torch.int8)
    in_rank[3] = 0
    list_index = (in_rank.to(torch.int32).cumsum(0) - 1).clamp_min(0).to(torch.int32)  # each pusher's list order
    r_p2 = triton.next_power_of_2(ranks)
    chunks = -(-tokens // block_r)
    results = {}
    for by_token in (False, True):
        out = torch.zeros(chunks, 2, r_p2, dtype=torch.int32)
        _blocks[(chunks,)](in_rank, list_index, out, tokens, ranks, BLOCK_R=block_r, R_P2=r_p2, BY_TOKEN=by_token)
        results[str(by_token)] = out[:, :, :ranks].tolist()
    want = []
    for c in range(chunks):
        rows = range(c * block_r, min((c + 1) * block_r, tokens))
        blocks = [[int(list_index[t, p]) // block_r for t in rows if in_rank[t, p]] for p in range(ranks)]
        want.append([[min(b) if b else 1 << 30 for b in blocks], [max(b) if b else -1 for b in blocks]])
    results["reference"] = want
    return results


if __name__ == "__main__":
    for case in CASES:
        print(json.dumps(dict(case=case, results=run(**case))))
    sys.stdout.flush()
