"""Routing → layout against hand-counted loops."""
import pytest
import torch

import ep_cases

import epcomm
from epcomm import layout
from epcomm.testing import skewed_topk, uniform_topk, with_holes


def _loop_layout(topk_idx, num_experts, num_ranks):
    per = num_experts // num_ranks
    in_rank = torch.zeros(topk_idx.shape[0], num_ranks, dtype=torch.bool)
    per_expert = torch.zeros(num_experts, dtype=torch.int32)
    for t, row in enumerate(topk_idx.tolist()):
        for e in row:
            if e >= 0:
                in_rank[t, e // per] = True
                per_expert[e] += 1
    return in_rank.sum(0, dtype=torch.int32), per_expert, in_rank


def test_layout_matches_loops():
    g = torch.Generator().manual_seed(0)
    for num_ranks in (1, 2, 4, 8):
        for maker in (uniform_topk, skewed_topk):
            topk = with_holes(maker(50, 16 * num_ranks, 6, generator=g), 0.2, generator=g)
            per_rank, per_rdma, per_expert, in_rank = layout.dispatch_layout(topk, 16 * num_ranks, num_ranks)
            want = _loop_layout(topk, 16 * num_ranks, num_ranks)
            assert per_rdma is None
            assert torch.equal(per_rank, want[0]) and torch.equal(per_expert, want[1]) and torch.equal(in_rank, want[2])
            assert per_rank.dtype == per_expert.dtype == torch.int32 and in_rank.dtype == torch.bool


def test_tokens_per_rdma_rank_counts_nodes():
    topk = torch.tensor([[0, 5], [2, 3], [-1, -1], [7, 6]])
    _, per_node, _, _ = layout.dispatch_layout(topk, 8, 4, num_ranks_per_node=2)
    assert per_node.tolist() == [2, 2]


def test_empty_and_all_holes():
    per_rank, _, per_expert, in_rank = layout.dispatch_layout(torch.empty(0, 4, dtype=torch.int64), 8, 2)
    assert per_rank.tolist() == [0, 0] and per_expert.sum() == 0 and in_rank.shape == (0, 2)
    per_rank, _, _, _ = layout.dispatch_layout(torch.full((3, 2), -1), 8, 2)
    assert per_rank.tolist() == [0, 0]


def test_rank_prefix_matrix_and_local_ids():
    counts = torch.tensor([[1, 2], [3, 4]])
    assert layout.rank_prefix_matrix(counts).tolist() == [[1, 2], [4, 6]]
    topk = torch.tensor([[0, 3, 4, -1]])
    assert layout.local_expert_ids(topk, rank=1, num_local_experts=2).tolist() == [[-1, 1, -1, -1]]
    assert layout.align_up(5, 4) == 8 and layout.align_up(8, 4) == 8


def test_public_names():
    assert epcomm.topk_idx_t is torch.int64
    from epcomm.compat import deep_ep
    # DeepEP's Buffer is epcomm's with DeepEP's device rule (CUDA whenever it is available)
    assert issubclass(deep_ep.Buffer, epcomm.Buffer) and deep_ep.Config is epcomm.Config
    assert deep_ep.EventOverlap is epcomm.EventOverlap and deep_ep.topk_idx_t is torch.int64


def test_backend_choice_on_cpu(pools):
    assert pools.get(2).run(ep_cases.backend_choice) == [("torch_dist", False)] * 2



def test_unpack_rows_with_one_row():
    """One received row whose parts do not start at 8-byte offsets (found by the fuzz)."""
    import torch
    from epcomm.backends.packed_rows import pack_rows, spec_of, unpack_rows
    parts = [torch.randn(1, 141).to(torch.bfloat16), torch.arange(3, dtype=torch.int64).view(1, 3),
             torch.rand(1, 3)]
    for got, want in zip(unpack_rows(pack_rows(parts), [spec_of(p) for p in parts]), parts):
        assert torch.equal(got, want)


@pytest.mark.parametrize("world_size,ranks_per_node", [(4, 2), (4, 1), (4, 4), (8, 4)])
def test_virtual_nodes_layout(pools, world_size, ranks_per_node):
    assert all(pools.get(world_size).run(ep_cases.virtual_nodes, ranks_per_node))


def test_ranks_per_host_blocks():
    """The nvshmem backend's default nodes: equal blocks of consecutive ranks per host, else a
    clear error asking for ranks_per_node."""
    from epcomm.backends import ranks_per_block
    from epcomm.errors import EPError
    assert ranks_per_block(["a"] * 8) == 8
    assert ranks_per_block(["a", "a", "b", "b", "c", "c"]) == 2
    assert ranks_per_block(["a", "b"]) == 1
    for hosts in (["a", "b", "a", "b"], ["a", "a", "b"], ["a", "a", "a", "b", "b", "c"], ["a", "a", "b", "b", "a", "a"]):
        with pytest.raises(EPError, match="ranks_per_node"):
            ranks_per_block(hosts)


def _expert_major_by_loops(topk_idx, weights, group_sizes):
    """The expert-major mapping entry by entry: groups in expert order, plain (row, k) order inside."""
    num_rows = sum(group_sizes)
    dest = torch.full(topk_idx.shape, -1, dtype=torch.int32)
    row_experts = torch.full((num_rows,), -1, dtype=torch.int64)
    row_weights = torch.zeros(num_rows)
    start = 0
    for expert, size in enumerate(group_sizes):
        next_row = start
        for r in range(topk_idx.shape[0]):
            for k in range(topk_idx.shape[1]):
                if topk_idx[r, k] == expert:
                    dest[r, k], row_experts[next_row], row_weights[next_row] = next_row, expert, weights[r, k]
                    next_row += 1
        start += size
    return dest, row_experts, row_weights


def test_expert_major_plan_matches_loops():
    """expert_major.plan (sorts and scatters, no host sync) against the entry-by-entry mapping:
    empty batches, no local entries, repeated experts in a row, padding to 1, 4 and 8."""
    from epcomm import expert_major
    g = torch.Generator().manual_seed(0)
    for case in range(60):
        N, K, L = (int(torch.randint(0, hi, (1,), generator=g)) + lo for lo, hi in ((0, 40), (1, 8), (1, 8)))
        topk_idx = torch.randint(-1, L, (N, K), generator=g)
        if case % 7 == 0:
            topk_idx[:] = -1
        weights = torch.rand(N, K, generator=g)
        align = (1, 4, 8)[case % 3]
        sizes = [-(-c // align) * align for c in torch.bincount(topk_idx[topk_idx >= 0], minlength=L).tolist()]
        mapping = expert_major.plan(topk_idx, weights, sizes)
        dest, row_experts, row_weights = _expert_major_by_loops(topk_idx, weights, sizes)
        assert torch.equal(mapping.dest, dest) and torch.equal(mapping.row_experts, row_experts), case
        assert torch.equal(mapping.row_weights, row_weights) and mapping.num_rows == sum(sizes), case
