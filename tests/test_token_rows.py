"""``x``, ``topk_idx`` and ``topk_weights`` hold one row per token: a call given different row counts
raises EPInputError naming the tensor whose rows differ and both counts (``x`` with 7 rows beside
``topk_idx`` with 8 was reported as a shape error of ``is_token_in_rank``), and the Buffer stays
usable."""
import pytest
import torch
import torch.distributed as dist

import epcomm

H, E, K, M = 128, 8, 2, 16


def _routing(tokens: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    topk = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(tokens)])
    return topk, torch.rand(tokens, K, generator=g)


def mismatched_call(case: str):
    """On a rank: one call whose rows disagree; returns ``(argument, message)`` of the EPInputError,
    after a valid round trip on the same Buffer."""
    rank = dist.get_rank()
    normal = epcomm.Buffer(dist.group.WORLD)
    low_latency = epcomm.Buffer(dist.group.WORLD, low_latency_mode=True)
    x7 = torch.randn(7, H).to(torch.bfloat16)
    topk8, weights8 = _routing(8, rank)
    topk7, weights7 = _routing(7, rank)
    try:
        if case in ("topk_idx", "topk_weights", "is_token_in_rank"):
            topk = topk8 if case == "topk_idx" else topk7
            weights = weights8 if case != "is_token_in_rank" else weights7
            per_rank, _, per_expert, in_rank, _ = normal.get_dispatch_layout(topk8 if case != "topk_weights" else topk7,
                                                                            E)
            if case == "is_token_in_rank":  # no top-k: only the layout of another batch disagrees with x
                normal.dispatch(x7, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                num_tokens_per_expert=per_expert)
            else:
                normal.dispatch(x7, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                num_tokens_per_expert=per_expert, topk_idx=topk, topk_weights=weights)
        elif case == "low_latency_dispatch":
            low_latency.low_latency_dispatch(x7, topk8, M, E, use_fp8=False)
        else:  # low_latency_combine: topk_weights of another batch
            recv, _, handle, _, _ = low_latency.low_latency_dispatch(x7, topk7, M, E, use_fp8=False)
            low_latency.low_latency_combine(recv, topk7, weights8, handle)
        raise AssertionError(f"{case}: no EPInputError")
    except epcomm.EPInputError as err:
        said = (err.argument, str(err))
    per_rank, _, per_expert, in_rank, _ = normal.get_dispatch_layout(topk7, E)
    recv = normal.dispatch(x7, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                           topk_idx=topk7, topk_weights=weights7)
    normal.combine(recv[0], recv[4])
    return said


@pytest.mark.parametrize("case, argument, message", [
    ("topk_idx", "topk_idx", "has 8 rows but x has 7"),
    ("topk_weights", "topk_weights", "has 8 rows but x has 7"),
    ("is_token_in_rank", "is_token_in_rank", "has 8 rows but x has 7"),
    ("low_latency_dispatch", "topk_idx", "has 8 rows but x has 7"),
    ("low_latency_combine", "topk_weights", "has 8 rows but topk_idx has 7"),
])
def test_rows_that_differ_are_named_as_such(pools, case, argument, message):
    for named, said in pools.get(2).run(mismatched_call, case):
        assert named == argument and message in said and "one row per token" in said, said
