"""The two-level layout of a normal-mode dispatch across nodes (DESIGN section 6, seed 000).

Ranks form nodes of ``ranks_per_node`` consecutive ranks: rank ``r`` is GPU ``r % k`` of node
``r // k``. A token crosses the network **once per destination node** that hosts one of its experts,
to the GPU of the same local index there (its *rail* peer, the token's *forwarder* on that node),
which forwards it over NVLink to the node's ranks that need it. Combine mirrors the path: each
rank returns its rows to the forwarder, the forwarder sums them (one partial row per token and
node) and sends that partial home, where the partials are summed.

Dispatch of the tokens of source rank ``s = (m, l)``, for every destination node ``n``::

    hop 1 (network, puts)           s -> forwarder f = (n, l)
        block m of f's receive area: the tokens t of s with is_token_in_node[t, n], ascending;
        row b of the block carries x[t], its scales / top-k / weights, t, and in_node_mask[t, n]
        (bit j: rank (n, j) needs t). Block m starts at recv_rdma_rank_prefix_sum[m - 1] there.
    hop 2 (NVLink, peer loads)      f -> every rank d = (n, j) whose bit is set
        d takes the rows of block m of f with bit j, in block order, to recv_x rows starting at
        recv_gbl_rank_prefix_sum[s - 1] (= rank_prefix_matrix[s - 1, d]): the same rows, in the
        same order, as a one-level dispatch delivers (source rank order, source token order).

For ``n == m`` hop 1 is a local copy (the source is its own forwarder on its own node).

Everything here is pure torch on one rank's tensors: the executable statement of what the
multi-node kernels compute, tested against the one-level reference (``testing.two_level``
simulates every rank with these functions). Shapes use ``T`` tokens, ``R`` ranks, ``N`` nodes,
``k`` ranks per node, ``C`` channels.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch

from .....errors import EPInputError
from .....layout import tokens_to_nodes

MAX_RANKS_PER_NODE = 32  # in-node masks are int32 bit sets


@dataclass(frozen=True)
class Topology:
    """``num_ranks`` ranks in nodes of ``ranks_per_node`` consecutive ranks."""

    num_ranks: int
    ranks_per_node: int

    def __post_init__(self):
        if self.num_ranks < 1 or self.ranks_per_node < 1:
            raise EPInputError("ranks_per_node", f"needs positive sizes, got {self.num_ranks} ranks in nodes of "
                                                 f"{self.ranks_per_node}")
        if self.num_ranks % self.ranks_per_node:
            raise EPInputError("ranks_per_node", f"{self.ranks_per_node} does not divide the group size "
                                                 f"{self.num_ranks}")
        if self.ranks_per_node > MAX_RANKS_PER_NODE:
            raise EPInputError("ranks_per_node", f"at most {MAX_RANKS_PER_NODE} ranks per node, got "
                                                 f"{self.ranks_per_node}")

    @property
    def num_nodes(self) -> int:
        return self.num_ranks // self.ranks_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def local_of(self, rank: int) -> int:
        return rank % self.ranks_per_node

    def rank_of(self, node: int, local: int) -> int:
        return node * self.ranks_per_node + local

    def rail(self, rank: int) -> List[int]:
        """The ranks of ``rank``'s local index on every node, node order (its network peers)."""
        return [self.rank_of(n, self.local_of(rank)) for n in range(self.num_nodes)]

    def node_ranks(self, node: int) -> List[int]:
        return list(range(node * self.ranks_per_node, (node + 1) * self.ranks_per_node))


# ---------------------------------------------------------------------------------------- sender side
def node_membership(is_token_in_rank: torch.Tensor, topology: Topology) -> torch.Tensor:
    """``is_token_in_node [T, N] bool``: a rank of node n needs token t."""
    return tokens_to_nodes(is_token_in_rank, topology.ranks_per_node)


def in_node_masks(is_token_in_rank: torch.Tensor, topology: Topology) -> torch.Tensor:
    """``[T, N] int32``: bit j of ``[t, n]`` set when rank ``(n, j)`` needs token t (the mask a token
    carries on hop 1 to node n, read by the forwarder's node peers on hop 2)."""
    T, k = is_token_in_rank.shape[0], topology.ranks_per_node
    bits = (1 << torch.arange(k, dtype=torch.int64, device=is_token_in_rank.device))
    per_node = is_token_in_rank.view(T, topology.num_nodes, k).to(torch.int64) * bits
    return per_node.sum(-1).to(torch.int32)  # k <= 32: bit 31 wraps to the sign bit, as intended


def node_blocks(is_token_in_node: torch.Tensor) -> List[torch.Tensor]:
    """Per destination node, the source's tokens on hop 1, ascending (its block there, in order)."""
    return [is_token_in_node[:, n].nonzero().flatten() for n in range(is_token_in_node.shape[1])]


def channel_bounds(num_tokens: int, num_channels: int) -> torch.Tensor:
    """``[C + 1] int64``: channel c sends tokens ``[bounds[c], bounds[c + 1])`` — contiguous ranges of
    ``ceil(T / C)`` tokens, the last ones shorter or empty (DeepEP's channel task ranges)."""
    if num_channels < 1:
        raise EPInputError("num_channels", f"must be positive, got {num_channels}")
    per_channel = -(-num_tokens // num_channels)
    return torch.clamp(torch.arange(num_channels + 1, dtype=torch.int64, device="cpu") * per_channel, max=num_tokens)


def channel_prefix_matrix(membership: torch.Tensor, num_channels: int,
                          bounds: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``[D, C] int32``: ``[d, c]`` = tokens of channels ``0..c`` that go to destination d (an
    inclusive prefix over channels: channel c's rows to d end there). ``membership`` is ``[T, D]``
    bool: ``is_token_in_node`` gives DeepEP's ``rdma_channel_prefix_matrix``, ``is_token_in_rank``
    its ``gbl_channel_prefix_matrix``. ``bounds``: :func:`channel_bounds` already on the device
    (a GPU caller keeps it, instead of a host-to-device copy per call)."""
    if bounds is None:
        bounds = channel_bounds(membership.shape[0], num_channels).to(membership.device)
    prefix = torch.cat([membership.new_zeros(1, membership.shape[1], dtype=torch.int64),
                        membership.to(torch.int64).cumsum(0)])
    return prefix[bounds[1:]].t().contiguous().to(torch.int32)


@dataclass
class SendLayout:
    """One source rank's two-level send plan (what its kernels derive from ``is_token_in_rank``).

    Fields:
        is_token_in_node: ``[T, N]`` bool.
        num_tokens_per_rdma_rank: ``[N]`` int32, rows of hop 1 per destination node (its own node
            included: that block is a local copy).
        in_node_masks: ``[T, N]`` int32 (:func:`in_node_masks`).
        rdma_channel_prefix_matrix: ``[N, C]`` int32; gbl_channel_prefix_matrix: ``[R, C]`` int32.
    """

    is_token_in_node: torch.Tensor
    num_tokens_per_rdma_rank: torch.Tensor
    in_node_masks: torch.Tensor
    rdma_channel_prefix_matrix: torch.Tensor
    gbl_channel_prefix_matrix: torch.Tensor


def send_layout(is_token_in_rank: torch.Tensor, topology: Topology, num_channels: int,
                bounds: Optional[torch.Tensor] = None) -> SendLayout:
    in_node = node_membership(is_token_in_rank, topology)
    return SendLayout(in_node, in_node.sum(0, dtype=torch.int32), in_node_masks(is_token_in_rank, topology),
                      channel_prefix_matrix(in_node, num_channels, bounds),
                      channel_prefix_matrix(is_token_in_rank, num_channels, bounds))


def network_rows(num_tokens_per_rdma_rank: torch.Tensor, rank: int, topology: Topology) -> int:
    """Rows a source puts over the network in one dispatch (or receives back in combine): its hop-1
    blocks for the other nodes."""
    node = topology.node_of(rank)
    return int(num_tokens_per_rdma_rank.sum()) - int(num_tokens_per_rdma_rank[node])


def min_network_rows(is_token_in_rank: torch.Tensor, rank: int, topology: Topology) -> int:
    """The least any scheme can send: one row per (token, other node hosting one of its experts)."""
    in_node = node_membership(is_token_in_rank, topology)
    others = torch.ones(topology.num_nodes, dtype=torch.bool, device="cpu")
    others[topology.node_of(rank)] = False
    return int(in_node[:, others].sum())


# ---------------------------------------------------------------------------------------- receive side
def inclusive_prefix(counts: torch.Tensor) -> torch.Tensor:
    """``[n] int32`` inclusive prefix sum of ``counts``: item i's rows end at ``prefix[i]``."""
    return counts.to(torch.int64).cumsum(0).to(torch.int32)


def recv_rdma_rank_prefix_sum(rail_counts: torch.Tensor) -> torch.Tensor:
    """At a forwarder: ``[N] int32``, block m (from the rail peer on node m) of its receive area ends
    at ``[m]``. ``rail_counts[m]`` is ``num_tokens_per_rdma_rank[this node]`` of that peer."""
    return inclusive_prefix(rail_counts)


def recv_gbl_rank_prefix_sum(send_counts_to_me: torch.Tensor) -> torch.Tensor:
    """At a destination: ``[R] int32``, source s's rows of recv_x end at ``[s]`` (column ``rank`` of
    ``rank_prefix_matrix``). ``send_counts_to_me[s]`` is ``num_tokens_per_rank[rank]`` of source s."""
    return inclusive_prefix(send_counts_to_me)


def forward_rows(block_masks: torch.Tensor, local_rank: int) -> torch.Tensor:
    """Hop 2 at a destination: of one forwarder block's rows (their in-node masks, ``[rows] int32``),
    those that rank ``local_rank`` of the node takes, ascending (``[n] int64`` block row indices)."""
    return ((block_masks >> local_rank) & 1).nonzero().flatten()
