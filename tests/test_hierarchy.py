"""The two-level (multi-node) layout math against hand-written loops and the one-level reference."""
import pytest
import torch

from epcomm import EPInputError, fp8, layout
from epcomm.backends.gpu.normal.two_level import hierarchy as hy
from epcomm.testing import (random_weights, reference_combine, reference_dispatch, single_rank_topk, skewed_topk,
                            uniform_topk, with_holes)
from epcomm.testing.two_level import two_level_combine, two_level_dispatch


def test_topology():
    topo = hy.Topology(8, 4)
    assert topo.num_nodes == 2 and topo.node_of(5) == 1 and topo.local_of(5) == 1 and topo.rank_of(1, 1) == 5
    assert topo.rail(5) == [1, 5] and topo.node_ranks(1) == [4, 5, 6, 7]
    assert hy.Topology(4, 1).rail(2) == [0, 1, 2, 3]
    for bad in ((8, 3), (8, 0), (64, 64)):
        with pytest.raises(EPInputError, match="ranks_per_node"):
            hy.Topology(*bad)


def test_channel_prefix_matrix_matches_loops():
    g = torch.Generator().manual_seed(1)
    for T, C in ((0, 3), (1, 4), (10, 3), (37, 5), (8, 8), (5, 16)):
        membership = torch.rand(T, 6, generator=g) < 0.4
        bounds = hy.channel_bounds(T, C).tolist()
        per = -(-T // C)
        assert bounds == [min(c * per, T) for c in range(C + 1)]
        got = hy.channel_prefix_matrix(membership, C)
        assert got.shape == (6, C) and got.dtype == torch.int32
        for d in range(6):
            running = 0
            for c in range(C):
                running += int(membership[bounds[c]:bounds[c + 1], d].sum())
                assert got[d, c] == running
    with pytest.raises(EPInputError, match="num_channels"):
        hy.channel_bounds(4, 0)


def test_in_node_masks_and_forward_rows():
    topo = hy.Topology(64, 32)  # bit 31 is the int32 sign bit
    in_rank = torch.zeros(3, 64, dtype=torch.bool)
    in_rank[0, [0, 31]] = True
    in_rank[1, [33, 63]] = True
    in_rank[2, 5] = True
    masks = hy.in_node_masks(in_rank, topo)
    assert masks.dtype == torch.int32
    for t in range(3):
        for n in range(2):
            want = [j for j in range(32) if in_rank[t, n * 32 + j]]
            assert [j for j in range(32) if (int(masks[t, n]) >> j) & 1] == want
    assert hy.forward_rows(masks[:, 0], 31).tolist() == [0]
    assert hy.forward_rows(masks[:, 1], 31).tolist() == [1]
    assert hy.forward_rows(masks[:, 0], 5).tolist() == [2]


def test_send_layout_counts_nodes_once():
    topk = torch.tensor([[0, 5], [2, 3], [-1, -1], [7, 6], [1, 2]])
    in_rank = layout.tokens_to_ranks(topk, 8, 4)  # experts 2 per rank, ranks 2 per node
    plan = hy.send_layout(in_rank, hy.Topology(4, 2), num_channels=2)
    assert plan.num_tokens_per_rdma_rank.tolist() == [3, 2]
    assert plan.is_token_in_node.tolist() == [[True, True], [True, False], [False, False], [False, True],
                                              [True, False]]
    assert plan.in_node_masks.tolist() == [[1, 1], [2, 0], [0, 0], [0, 2], [3, 0]]
    assert plan.rdma_channel_prefix_matrix.tolist() == [[2, 3], [1, 2]]  # channels: tokens 0-2, 3-4
    assert plan.gbl_channel_prefix_matrix.tolist() == [[1, 2], [1, 2], [1, 1], [0, 1]]
    assert layout.dispatch_layout(topk, 8, 4, num_ranks_per_node=2)[1].tolist() == [3, 2]
    assert hy.network_rows(plan.num_tokens_per_rdma_rank, 0, hy.Topology(4, 2)) == 2
    assert hy.min_network_rows(in_rank, 0, hy.Topology(4, 2)) == 2


def _routing(seed, R, E, K, T, kind, hidden=64):
    g = torch.Generator().manual_seed(seed)
    topks = []
    for rank in range(R):
        t = T if kind != "some_empty" or rank % 2 else 0
        if kind == "skewed":
            topk = skewed_topk(t, E, K, generator=g)
        elif kind == "one_rank":
            topk = single_rank_topk(t, E, K, target_rank=R - 1, num_ranks=R, generator=g)
        else:
            topk = uniform_topk(t, E, K, generator=g)
        if kind in ("holes", "some_empty"):
            topk = with_holes(topk, 0.3, generator=g)
        topks.append(topk)
    xs = [torch.randn(len(t), hidden, generator=g).to(torch.bfloat16) for t in topks]
    return xs, topks, [random_weights(t, generator=g) for t in topks]


CASES = [(R, k, kind) for R, k in ((2, 1), (4, 1), (4, 2), (8, 2), (8, 4), (16, 4), (16, 8))
         for kind in ("uniform", "skewed", "holes", "one_rank", "some_empty")]


@pytest.mark.parametrize("R,k,kind", CASES)
def test_two_level_dispatch_and_combine_equal_one_level(R, k, kind):
    E, K, T = 4 * R, min(6, 4 * R), 40
    xs, topks, weights = _routing(R * 100 + k, R, E, K, T, kind)
    model = two_level_dispatch(xs, topks, weights, E, ranks_per_node=k)
    want = reference_dispatch(xs, topks, weights, E)
    for rank in range(R):
        got = model.results[rank]
        for key in ("recv_x", "recv_topk_idx", "recv_topk_weights", "recv_src_idx", "rank_prefix_matrix"):
            assert torch.equal(got[key], want[rank][key]), (rank, key)
    # each (token, other node) pair crosses the network exactly once
    assert model.network_rows == model.min_network_rows
    # and never more often than a one-level dispatch would send it there (once per rank)
    topo = hy.Topology(R, k)
    for rank in range(R):
        in_rank = layout.tokens_to_ranks(topks[rank], E, R)
        other = [r for r in range(R) if topo.node_of(r) != topo.node_of(rank)]
        assert model.network_rows[rank] <= int(in_rank[:, other].sum())

    def rank_fn(j, rows):  # a different function per receiving rank, as expert outputs differ
        return (rows.float() * (j + 1) / R).to(torch.bfloat16)

    ys = [rank_fn(d, model.results[d]["recv_x"]) for d in range(R)]
    combined = two_level_combine(model, ys, [len(t) for t in topks])
    for rank in range(R):
        torch.testing.assert_close(combined[rank], reference_combine(xs[rank], topks[rank], E, R, rank_fn),
                                   rtol=1e-2, atol=1e-2)
        # the reference told the node size rounds each node's partial as the kernels do: bit for bit
        assert torch.equal(combined[rank], reference_combine(xs[rank], topks[rank], E, R, rank_fn, ranks_per_node=k))


def test_two_level_fp8_rows_and_dedup_saves_network_rows():
    R, k, E, K, T = 8, 4, 64, 8, 200
    xs, topks, weights = _routing(7, R, E, K, T, "uniform", hidden=256)
    xs = [fp8.per_token_cast_to_fp8(x) for x in xs]
    model = two_level_dispatch(xs, topks, weights, E, ranks_per_node=k)
    want = reference_dispatch(xs, topks, weights, E)
    for rank in range(R):
        assert torch.equal(model.results[rank]["recv_x"][0].view(torch.uint8), want[rank]["recv_x"][0].view(torch.uint8))
        assert torch.equal(model.results[rank]["recv_x"][1], want[rank]["recv_x"][1])
    topo = hy.Topology(R, k)
    flat = sum(int(layout.tokens_to_ranks(topks[r], E, R)[:, [d for d in range(R) if topo.node_of(d) != topo.node_of(r)]]
                   .sum()) for r in range(R))
    assert sum(model.network_rows) < 0.6 * flat  # K=8 over 4 ranks a node: most tokens need several there


def test_model_legs_match_the_two_level_model():
    from epcomm.tools.internode_model import rank_legs
    R, k, E, K = 8, 2, 32, 4
    xs, topks, weights = _routing(11, R, E, K, 50, "holes")
    model = two_level_dispatch(xs, topks, weights, E, ranks_per_node=k)
    legs = rank_legs(topks, E, k)
    topo = hy.Topology(R, k)
    for r, leg in enumerate(legs):
        assert leg.network_out == model.network_rows[r] == leg.min_network_out
        assert leg.network_out <= leg.one_level_network_out
        # the rows r receives: from its own forwarder area (local) and from its node peers' (NVLink)
        sources = model.sources[r]
        from_self = int((sources[:, 0] == r).sum())
        assert (leg.local, leg.nvlink_in) == (from_self, len(sources) - from_self)
        area = model.areas[r]
        assert leg.network_in == sum(area.block(n).stop - area.block(n).start for n in range(topo.num_nodes)
                                     if n != topo.node_of(r))


def test_model_command_prints_a_table(capsys):
    from epcomm.tools.cli import main
    assert main(["model", "--nodes", "2", "--ranks-per-node", "2", "--tokens", "64", "--experts", "16"]) == 0
    out = capsys.readouterr().out
    assert "| 2 x 2 | dispatch FP8 |" in out and "| 2 x 2 | combine BF16 |" in out
    assert "| 2 x 2 | LL dispatch FP8 |" in out and "| 2 x 2 | LL combine BF16 |" in out


def test_low_latency_model_counts_messages_to_other_nodes():
    """One message per (token, expert): the network carries those whose expert is on another node
    (not deduplicated: at least one per (token, other node)); NVLink those for the node's others."""
    from epcomm.tools.internode_model import estimate_low_latency, low_latency_message_bytes
    nodes, k, T, H, K, E = 2, 2, 64, 1024, 4, 16
    dispatch, combine = estimate_low_latency(nodes, k, T, H, K, E, nic_gbps=50.0, nvlink_gbps=400.0, latency_us=10.0)
    per_msg = low_latency_message_bytes(H, True)
    assert per_msg % 16 == 0 and per_msg >= 16 + H + H // 128 * 4
    for e, size in ((dispatch, per_msg), (combine, 2 * H)):
        assert e.one_level_network_mb == e.network_mb_out >= e.min_network_mb > 0
        assert round(e.network_mb_out * 1e6) % size == 0  # whole messages
        assert e.us > 10.0 and e.bound in ("network out", "network in", "NVLink in")
    # every message of a token goes to distinct experts: at most K per token leave the node
    assert round(dispatch.network_mb_out * 1e6) // per_msg <= T * K


def test_multinode_row_and_count_row_layouts():
    from epcomm.backends.gpu.normal.two_level.rows import CombineRow, MetaRow, RowLayout
    meta = MetaRow(num_ranks=16, num_experts=256, num_nodes=2, num_channels=12)
    parts = [(meta.per_rank, 16), (meta.per_expert, 256), (meta.per_node, 2), (meta.num_tokens, 1),
             (meta.gbl_prefix, 16 * 12), (meta.rdma_prefix, 2 * 12), (meta.abort, 1)]
    assert [start for start, _ in parts] == [sum(n for _, n in parts[:i]) for i in range(len(parts))]
    assert meta.length == sum(n for _, n in parts)
    for x_bytes, scales, topk in ((14336, 0, 8), (7168, 56, 8), (8, 0, 0), (7168, 56, 0)):
        row = RowLayout(x_bytes, scales, topk)
        assert row.ids % 8 == 0 and row.ids >= x_bytes + 4 * scales
        assert row.weights == row.ids + 8 * topk and row.mask == row.src + 4
        assert row.row_bytes % 16 == 0 and row.row_bytes >= row.mask + 4
    combine_row = CombineRow(hidden=7168, num_topk=8)
    assert (combine_row.x_bytes, combine_row.weights, combine_row.row_bytes) == (14336, 14336, 14368)
    assert CombineRow(hidden=4, num_topk=0).row_bytes == 16


# ---------------------------------------------------------------- the multi-node workspace layout
@pytest.mark.parametrize("ranks,per_node,hidden,fp8,topk", [(16, 8, 7168, False, 8), (16, 8, 7168, True, 8),
                                                            (4, 2, 2048, False, 0), (2, 1, 512, True, 4)])
def test_multinode_workspace_areas_fit_without_overlap(ranks, per_node, hidden, fp8, topk):
    """The fixed signal areas, then a dispatch's or a combine's areas over the same data region:
    aligned, disjoint, inside the workspace, with the largest token capacity that fits."""
    from epcomm.backends.gpu.normal.two_level.areas import (ALIGN, MAX_CHANNELS, STEP_ROW_BYTES, combine_layout,
                                                   dispatch_layout, preamble)
    total = 256 << 20
    N, k, C = ranks // per_node, per_node, 12
    fixed = preamble(ranks, per_node)
    fixed_sizes = {"step_rows": ranks * STEP_ROW_BYTES, "fingerprint": STEP_ROW_BYTES, "notify_signals": ranks * 8,
                   "dispatch_signals": N * MAX_CHANNELS * 8, "push_flags": N * MAX_CHANNELS * k * 8,
                   "home_signals": N * MAX_CHANNELS * 8}
    d = dispatch_layout(total, ranks, per_node, 256, C, hidden if fp8 else 2 * hidden, hidden // 128 if fp8 else 0,
                        topk)
    c = combine_layout(total, ranks, per_node, hidden, topk)
    d_sizes = {"table": ranks * d.meta.length * 4, "count_row": d.meta.length * 4,
               "send": N * d.token_cap * d.row.row_bytes, "recv": N * d.token_cap * d.row.row_bytes}
    c_sizes = {"slots": N * c.token_cap * k * c.row.row_bytes, "partials": N * c.token_cap * c.row.row_bytes,
               "home": N * c.token_cap * c.row.row_bytes}
    for layout, sizes in ((d, d_sizes), (c, c_sizes)):
        spans = sorted([(getattr(fixed, name), getattr(fixed, name) + size) for name, size in fixed_sizes.items()] +
                       [(getattr(layout, name), getattr(layout, name) + size) for name, size in sizes.items()])
        assert all(start % ALIGN == 0 for start, _ in spans)
        assert all(end <= next_start for (_, end), (next_start, _) in zip(spans, spans[1:]))
        assert spans[-1][1] <= layout.end <= total
        assert min(getattr(layout, name) for name in sizes) >= fixed.data
        # the token capacity is the largest that fits (up to the areas' alignment padding)
        per_token = sum(size // layout.token_cap for name, size in sizes.items() if name not in ("table", "count_row"))
        assert layout.end + per_token > total - 4 * ALIGN


def test_multinode_workspace_size_for_a_batch_and_the_error_when_too_small():
    from epcomm.backends.gpu.normal.two_level.areas import MAX_CHANNELS, bytes_for_tokens, combine_layout, dispatch_layout
    from epcomm.errors import EPInputError
    need = bytes_for_tokens(4096, 16, 8, 256, 7168, 8)
    assert dispatch_layout(need, 16, 8, 256, MAX_CHANNELS, 14336, 0, 8).token_cap >= 4096
    assert combine_layout(need, 16, 8, 7168, 8).token_cap >= 4096
    assert dispatch_layout(need, 16, 8, 256, 12, 7168, 56, 8).token_cap >= 4096  # FP8 rows fit too
    short = need - 16 * 8 * (14336 + 64)  # less than one token's slots and partials
    assert min(dispatch_layout(short, 16, 8, 256, MAX_CHANNELS, 14336, 0, 8).token_cap,
               combine_layout(short, 16, 8, 7168, 8).token_cap) < 4096
    for make in (lambda: dispatch_layout(1 << 16, 16, 8, 256, 12, 14336, 0, 8),
                 lambda: combine_layout(1 << 16, 16, 8, 7168, 8)):
        with pytest.raises(EPInputError) as err:
            make()
        assert err.value.argument == "num_rdma_bytes"


@pytest.mark.parametrize("ranks,per_node,channels", [(16, 8, 12), (4, 2, 3), (2, 1, 1), (8, 4, 5)])
def test_count_row_and_node_token_lists(ranks, per_node, channels):
    """What a rank puts into the count exchange and the per-node token lists its send kernel reads,
    against hierarchy.py's functions (which the two-level model checks against the reference)."""
    from epcomm.backends.gpu.normal.two_level.rows import MetaRow, count_row, node_tokens
    topology = hy.Topology(ranks, per_node)
    T, E = 37, 4 * ranks
    topk = with_holes(uniform_topk(T, E, 4, torch.Generator().manual_seed(ranks)),
                      generator=torch.Generator().manual_seed(1))
    in_rank = layout.tokens_to_ranks(topk, E, ranks)
    plan = hy.send_layout(in_rank, topology, channels)
    meta = MetaRow(ranks, E, topology.num_nodes, channels)
    row = count_row(meta, in_rank.sum(0, dtype=torch.int32), layout.tokens_per_expert(topk, E),
                    plan.num_tokens_per_rdma_rank, plan.gbl_channel_prefix_matrix, plan.rdma_channel_prefix_matrix, T)
    assert row.dtype == torch.int32 and row.numel() == meta.length
    assert torch.equal(row[meta.per_rank:meta.per_expert], in_rank.sum(0, dtype=torch.int32))
    assert torch.equal(row[meta.per_node:meta.num_tokens], plan.num_tokens_per_rdma_rank)
    assert int(row[meta.num_tokens]) == T
    assert torch.equal(row[meta.gbl_prefix:meta.rdma_prefix].view(ranks, channels), plan.gbl_channel_prefix_matrix)
    assert torch.equal(row[meta.rdma_prefix:meta.abort].view(topology.num_nodes, channels),
                       plan.rdma_channel_prefix_matrix)
    assert int(row[meta.abort]) == 0
    lists = node_tokens(plan.is_token_in_node)
    for n, block in enumerate(hy.node_blocks(plan.is_token_in_node)):
        assert torch.equal(lists[n, :len(block)].long(), block)
        assert sorted(lists[n].tolist()) == list(range(T))
