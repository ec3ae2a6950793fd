"""Rank bodies of tests/test_handles.py: handles a Buffer makes, read the way DeepEP's tests read them."""
from __future__ import annotations

import torch
import torch.distributed as dist

import epcomm
from epcomm.testing import reference_dispatch
from epcomm.testing.sweeps import make_routing, world


def normal_handles(ranks_per_node: int, hidden: int = 128):
    """One node: ``handle[0]`` is rank_prefix_matrix and ``handle[4]`` is_token_in_rank (6 fields);
    virtual nodes (``ranks_per_node`` < group size): ``handle[0]`` is is_token_in_rank and
    ``handle[-4]`` recv_gbl_rank_prefix_sum (10 fields), whose steps are the rows from each rank as
    DeepEP's test_internode checks them; the handle serves a cached dispatch and combine either way."""
    R, rank = world()
    buffer = epcomm.Buffer(dist.group.WORLD, ranks_per_node=ranks_per_node)
    num_experts = 2 * R
    xs, topks, weights = make_routing(71, "uniform", R, num_experts, 2, 9, hidden)
    # every row says which rank sent it (DeepEP's test data)
    xs = [torch.full_like(x, float(i)) for i, x in enumerate(xs)]
    per_rank, per_rdma, per_expert, in_rank, _ = buffer.get_dispatch_layout(topks[rank], num_experts)
    config = epcomm.Config(num_sms=6)
    recv_x, _, _, _, handle, _ = buffer.dispatch(xs[rank], num_tokens_per_rank=per_rank,
                                                num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank,
                                                num_tokens_per_expert=per_expert, topk_idx=topks[rank],
                                                topk_weights=weights[rank], config=config)
    want = reference_dispatch(xs, topks, weights, num_experts)[rank]
    if ranks_per_node == R:
        assert len(handle) == 6
        rank_prefix_matrix = handle[0]
        assert torch.equal(rank_prefix_matrix, want["rank_prefix_matrix"]) and handle[4] is in_rank
        assert torch.equal(handle[3], want["recv_src_idx"])
        assert handle[1].shape == (R, config.num_sms // 2) and handle[1][:, -1].tolist() == per_rank.tolist()
        ends = rank_prefix_matrix[:, rank]
    else:
        assert len(handle) == 10 and handle[0] is in_rank
        ends = handle[-4]  # recv_gbl_rank_prefix_sum
        assert handle[2][:, -1].tolist() == per_rank.tolist() and handle[1][:, -1].tolist() == per_rdma.tolist()
        assert handle[7].shape == (recv_x.shape[0], 8)
    start = 0
    for i in range(R):  # DeepEP's check_data: rows [ends[i-1], ends[i]) came from rank i
        assert (recv_x[start:int(ends[i])] == i).all()
        start = int(ends[i])
    assert start == recv_x.shape[0]
    again, *_ = buffer.dispatch(xs[rank] * 2, handle=handle, config=config)
    assert torch.equal(again, recv_x * 2)
    combined, _, _ = buffer.combine(recv_x, handle)
    assert torch.equal(combined, xs[rank] * in_rank.sum(1, keepdim=True).to(torch.bfloat16))
    return True


def low_latency_handle(hidden: int = 128, M: int = 4):
    """DeepEP's 5-tuple: (recv_src_info, recv_layout_range, M, hidden, num_experts), unpacked by
    position as DeepEP's low_latency_combine does, and taken back by low_latency_combine."""
    R, rank = world()
    buffer = epcomm.Buffer(dist.group.WORLD, low_latency_mode=True)
    num_experts = 2 * R
    xs, topks, weights = make_routing(72, "uniform", R, num_experts, 2, M, hidden, fixed_tokens=M)
    recv_x, recv_count, handle, _, _ = buffer.low_latency_dispatch(xs[rank], topks[rank], M, num_experts,
                                                                   use_fp8=False)
    src_info, layout_range, num_max, h, e = handle
    assert len(handle) == 5 and isinstance(handle, tuple)
    assert (num_max, h, e) == (M, hidden, num_experts) and src_info is handle.recv_src_info
    counts = (layout_range & 0xFFFFFFFF).sum(1)
    assert counts.tolist() == recv_count.tolist()
    combined, _, _ = buffer.low_latency_combine(recv_x, topks[rank], weights[rank], handle)
    want = xs[rank].float() * torch.where(topks[rank] >= 0, weights[rank], torch.zeros_like(weights[rank])).sum(1, keepdim=True)
    torch.testing.assert_close(combined.float(), want, rtol=2e-2, atol=2e-2)
    return True
