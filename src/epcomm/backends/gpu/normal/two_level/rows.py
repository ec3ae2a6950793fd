"""What one row of each multi-node area holds (byte and word offsets; no GPU code, so CPU tests
cover them): the count row every rank sends in the count exchange, the dispatched row that crosses
both hops, and the combine row (slots and partials).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

ROW_ALIGN = 16


@dataclass(frozen=True)
class MetaRow:
    """Offsets (int32 words) within one rank's count row."""

    num_ranks: int
    num_experts: int
    num_nodes: int
    num_channels: int

    @property
    def per_rank(self) -> int:
        return 0

    @property
    def per_expert(self) -> int:
        return self.num_ranks

    @property
    def per_node(self) -> int:
        return self.num_ranks + self.num_experts

    @property
    def num_tokens(self) -> int:
        return self.per_node + self.num_nodes

    @property
    def gbl_prefix(self) -> int:
        return self.num_tokens + 1

    @property
    def rdma_prefix(self) -> int:
        return self.gbl_prefix + self.num_ranks * self.num_channels

    @property
    def abort(self) -> int:
        """Nonzero when the sender's caller-given counts did not summarise its routing (the code
        gpu/agreement.py's aborts use: 1 num_tokens_per_rank, 2 num_tokens_per_expert)."""
        return self.rdma_prefix + self.num_nodes * self.num_channels

    @property
    def length(self) -> int:
        return self.abort + 1


@dataclass(frozen=True)
class RowLayout:
    """Byte offsets within one packed row; ``row_bytes`` is a multiple of 16."""

    x_bytes: int  # a multiple of 8 (Buffer's checks: rows of whole words)
    num_scales: int
    num_topk: int

    @property
    def scales(self) -> int:
        return self.x_bytes

    @property
    def ids(self) -> int:
        return -(-(self.scales + 4 * self.num_scales) // 8) * 8

    @property
    def weights(self) -> int:
        return self.ids + 8 * self.num_topk

    @property
    def src(self) -> int:
        return self.weights + 4 * self.num_topk

    @property
    def mask(self) -> int:
        return self.src + 4

    @property
    def row_bytes(self) -> int:
        return -(-(self.mask + 4) // ROW_ALIGN) * ROW_ALIGN


@dataclass(frozen=True)
class CombineRow:
    """Byte offsets within one slot / partial row."""

    hidden: int
    num_topk: int  # 0 when no top-k weights are combined

    @property
    def x_bytes(self) -> int:
        return 2 * self.hidden

    @property
    def weights(self) -> int:
        return self.x_bytes  # a multiple of 8: Buffer's checks ask for rows of whole words

    @property
    def row_bytes(self) -> int:
        return -(-(self.weights + 4 * self.num_topk) // ROW_ALIGN) * ROW_ALIGN


def count_row(meta: MetaRow, num_tokens_per_rank: torch.Tensor, num_tokens_per_expert: torch.Tensor,
              num_tokens_per_rdma_rank: torch.Tensor, gbl_channel_prefix_matrix: torch.Tensor,
              rdma_channel_prefix_matrix: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """This rank's count row (``[meta.length] int32``, :class:`MetaRow`'s order) from its layout:
    ``[R]``, ``[E]``, ``[N]`` int32 counts and the ``[R, C]`` / ``[N, C]`` int32 channel prefix
    matrices (hierarchy.send_layout)."""
    token_count = torch.full((1,), num_tokens, dtype=torch.int32, device=num_tokens_per_rank.device)
    row = torch.cat([num_tokens_per_rank, num_tokens_per_expert, num_tokens_per_rdma_rank, token_count,
                     gbl_channel_prefix_matrix.flatten(), rdma_channel_prefix_matrix.flatten(),
                     torch.zeros_like(token_count)]).to(torch.int32)
    if row.numel() != meta.length:
        raise ValueError(f"count row of {row.numel()} words, the layout says {meta.length}")
    return row


def node_tokens(is_token_in_node: torch.Tensor) -> torch.Tensor:
    """``[N, T] int32``: row n starts with the tokens that go to node n, ascending (the order of the
    block there; ml_dispatch_send reads its first ``num_tokens_per_rdma_rank[n]`` entries), then
    the others. One stable sort, so it runs where the routing is."""
    return torch.sort((~is_token_in_node).to(torch.int8), dim=0, stable=True).indices.t().to(torch.int32).contiguous()
