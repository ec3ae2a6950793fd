"""A single-process model of the two-level (multi-node) dispatch and combine of
:mod:`epcomm.backends.gpu.normal.two_level.hierarchy`: every rank's hops simulated with tensors, from all ranks' inputs at once.

It states what the multi-node kernels must compute, step by step, with the layout functions they
mirror; the tests compare it with the one-level reference (:mod:`.reference`) and count the rows
that cross the network against the minimum. Kept in the package beside the reference: it is the
executable statement of the plan that the two-level kernels' docstrings cite
(backends/gpu/normal/two_level), a multi-node reference a user's tests can compare with too.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import torch

from ..backends.gpu.normal.two_level import hierarchy as hy
from ..layout import local_expert_ids, tokens_to_ranks


@dataclass
class ForwarderArea:
    """A forwarder's hop-1 receive area: blocks from its rail peers, node order.

    ``prefix`` is recv_rdma_rank_prefix_sum ``[N]``; the other fields are per row: ``x``, ``scales``
    (or None), ``topk_idx`` (global ids) / ``topk_weights`` (or None), ``src_token`` (index on the
    source), ``masks`` (in-node mask).
    """

    prefix: torch.Tensor
    x: torch.Tensor
    scales: Optional[torch.Tensor]
    topk_idx: torch.Tensor
    topk_weights: Optional[torch.Tensor]
    src_token: torch.Tensor
    masks: torch.Tensor

    def block(self, node: int) -> slice:
        return slice(0 if node == 0 else int(self.prefix[node - 1]), int(self.prefix[node]))


@dataclass
class TwoLevelDispatch:
    """Every rank's view of one two-level dispatch.

    Fields (lists indexed by rank):
        results: per destination, the dict :func:`.reference.reference_dispatch` returns.
        areas: per forwarder, its :class:`ForwarderArea`.
        sources: per destination, ``[rows, 2] int64``: each received row's (forwarder rank, area row)
            — what combine sends each row back to.
        network_rows: per source, rows it put over the network (hop 1 to other nodes).
        min_network_rows: per source, one per (token, other node needing it).
    """

    topology: hy.Topology
    num_experts: int
    results: List[Dict] = field(default_factory=list)
    areas: List[ForwarderArea] = field(default_factory=list)
    sources: List[torch.Tensor] = field(default_factory=list)
    network_rows: List[int] = field(default_factory=list)
    min_network_rows: List[int] = field(default_factory=list)
    home_blocks: List[List[torch.Tensor]] = field(default_factory=list)  # per source, per node: its tokens there


def two_level_dispatch(xs: Sequence, topk_idxs: Sequence[torch.Tensor], topk_weights: Sequence[Optional[torch.Tensor]],
                       num_experts: int, ranks_per_node: int, num_channels: int = 4) -> TwoLevelDispatch:
    """Dispatch every rank's tokens through forwarders (hop 1) and NVLink (hop 2).

    Args as :func:`.reference.reference_dispatch` (bf16 ``[T_i, H]`` or FP8 ``(values, scales)``
    per rank), plus ``ranks_per_node``.
    """
    R = len(xs)
    topology = hy.Topology(R, ranks_per_node)
    k, N = ranks_per_node, topology.num_nodes
    in_rank = [tokens_to_ranks(t.cpu(), num_experts, R) for t in topk_idxs]
    sends = [hy.send_layout(m, topology, num_channels) for m in in_rank]
    blocks = [hy.node_blocks(s.is_token_in_node) for s in sends]
    values = [x[0].cpu() if isinstance(x, (tuple, list)) else x.cpu() for x in xs]
    scales = [x[1].cpu() if isinstance(x, (tuple, list)) else None for x in xs]
    model = TwoLevelDispatch(topology, num_experts, home_blocks=blocks)
    model.network_rows = [hy.network_rows(s.num_tokens_per_rdma_rank, r, topology) for r, s in enumerate(sends)]
    model.min_network_rows = [hy.min_network_rows(m, r, topology) for r, m in enumerate(in_rank)]

    # hop 1: each forwarder (n, l) receives block m from rail peer (m, l)
    for f in range(R):
        node = topology.node_of(f)
        rail = topology.rail(f)
        counts = torch.stack([sends[s].num_tokens_per_rdma_rank[node] for s in rail])
        parts = [(s, blocks[s][node]) for s in rail]
        cat = lambda get: torch.cat([get(s, t) for s, t in parts])  # noqa: E731
        model.areas.append(ForwarderArea(
            prefix=hy.recv_rdma_rank_prefix_sum(counts),
            x=cat(lambda s, t: values[s][t]),
            scales=cat(lambda s, t: scales[s][t]) if scales[0] is not None else None,
            topk_idx=cat(lambda s, t: topk_idxs[s].cpu()[t]),
            topk_weights=cat(lambda s, t: topk_weights[s].cpu()[t]) if topk_weights[0] is not None else None,
            src_token=cat(lambda s, t: t.to(torch.int32)),
            masks=cat(lambda s, t: sends[s].in_node_masks[t, node])))

    # hop 2: destination d = (n, j) takes, per source s = (m, l'), block m of forwarder (n, l')
    send_counts = torch.stack([m.sum(0, dtype=torch.int32) for m in in_rank])  # [source, destination]
    prefix_matrix = hy.inclusive_prefix(send_counts)
    per_rank = num_experts // R
    for d in range(R):
        node, j = topology.node_of(d), topology.local_of(d)
        gbl_prefix = hy.recv_gbl_rank_prefix_sum(send_counts[:, d])
        pieces, origin = [], []
        for s in range(R):
            f = topology.rank_of(node, topology.local_of(s))
            area = model.areas[f]
            block = area.block(topology.node_of(s))
            rows = hy.forward_rows(area.masks[block], j) + block.start
            start = 0 if s == 0 else int(gbl_prefix[s - 1])
            assert start == sum(len(p) for p in pieces), "hop-2 rows must land at recv_gbl_rank_prefix_sum"
            pieces.append(rows)
            origin.append(torch.stack([torch.full_like(rows, f), rows], 1))
        model.sources.append(torch.cat(origin) if origin else torch.empty(0, 2, dtype=torch.int64))

        def gather(get):
            return torch.cat([get(model.areas[int(o[0, 0])])[o[:, 1]] for o in origin if len(o)] or
                             [get(model.areas[0])[:0]])

        local_ids = local_expert_ids(gather(lambda a: a.topk_idx), d, per_rank)
        recv_x = gather(lambda a: a.x)
        if scales[0] is not None:
            recv_x = (recv_x, gather(lambda a: a.scales))
        weights = None
        if topk_weights[0] is not None:
            weights = torch.where(local_ids >= 0, gather(lambda a: a.topk_weights), 0.0)
        model.results.append({"recv_x": recv_x, "recv_topk_idx": local_ids, "recv_topk_weights": weights,
                              "recv_src_idx": gather(lambda a: a.src_token), "rank_prefix_matrix": prefix_matrix})
    return model


def two_level_combine(model: TwoLevelDispatch, ys: Sequence[torch.Tensor], num_tokens: Sequence[int]) -> List[torch.Tensor]:
    """Combine the rows ``ys[d]`` (``[rows of d, H]`` bf16, dispatch order) back home: each row to
    its forwarder (NVLink), a float32 sum per area row over the node's ranks there, rounded to bf16
    (the one row per token and node that crosses the network), and at home a float32 sum over nodes
    in node order, rounded to bf16. Returns ``[T_s, H]`` bf16 per rank."""
    topology = model.topology
    R, hidden = topology.num_ranks, ys[0].shape[1]
    partial = [torch.zeros(len(a.masks), hidden, dtype=torch.float32) for a in model.areas]
    for d in range(R):
        for (f, row), y in zip(model.sources[d].tolist(), ys[d].float()):
            partial[f][row] += y  # ranks arrive in local order: d ascending within the node
    partial = [p.to(torch.bfloat16) for p in partial]
    out = []
    for s in range(R):
        acc = torch.zeros(num_tokens[s], hidden, dtype=torch.float32)
        for node in range(topology.num_nodes):  # the partial of node n comes from forwarder (n, l)
            f = topology.rank_of(node, topology.local_of(s))
            acc[model.home_blocks[s][node]] += partial[f][model.areas[f].block(topology.node_of(s))].float()
        out.append(acc.to(torch.bfloat16))
    return out
