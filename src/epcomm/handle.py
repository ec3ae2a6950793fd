"""Handles returned by dispatch and consumed by combine (and by cached dispatch), laid out as DeepEP's.

DeepEP returns its handles as plain tuples, and code reads their fields by position (DeepEP's own
tests read ``handle[0]``, the rank prefix matrix, on one node, and ``handle[-4]``, the received
rank prefix sum, across nodes). epcomm's handles hold the same fields at the same positions:

- normal mode on one node, 6 fields: ``(rank_prefix_matrix, channel_prefix_matrix,
  recv_channel_prefix_matrix, recv_src_idx, is_token_in_rank, send_head)``;
- normal mode across nodes (``Buffer.num_nodes > 1``: the nvshmem backend, or torch_dist with
  ``ranks_per_node`` < group size), 10 fields: ``(is_token_in_rank, rdma_channel_prefix_matrix,
  gbl_channel_prefix_matrix, recv_rdma_channel_prefix_matrix, recv_rdma_rank_prefix_sum,
  recv_gbl_channel_prefix_matrix, recv_gbl_rank_prefix_sum, recv_src_meta, send_rdma_head,
  send_nvl_head)``;
- low-latency mode, 5 fields: ``(recv_src_info, recv_layout_range,
  num_max_dispatch_tokens_per_rank, hidden, num_experts)``.

epcomm's own extras (``num_recv_tokens``, ``backend_state``, ``expert_major``, ...) are
attributes, never extra fields, so unpacking a handle into DeepEP's names works too.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import torch

INTRANODE_FIELDS = ("rank_prefix_matrix", "channel_prefix_matrix", "recv_channel_prefix_matrix", "recv_src_idx",
                    "is_token_in_rank", "send_head")
INTERNODE_FIELDS = ("is_token_in_rank", "rdma_channel_prefix_matrix", "gbl_channel_prefix_matrix",
                    "recv_rdma_channel_prefix_matrix", "recv_rdma_rank_prefix_sum", "recv_gbl_channel_prefix_matrix",
                    "recv_gbl_rank_prefix_sum", "recv_src_meta", "send_rdma_head", "send_nvl_head")
LOW_LATENCY_FIELDS = ("recv_src_info", "recv_layout_range", "num_max_dispatch_tokens_per_rank", "hidden",
                      "num_experts")


def _channel_bounds(num_tokens: int, num_channels: int):
    """DeepEP's split of a batch into channels: channel ``c`` sends tokens
    ``[c * n, min((c + 1) * n, T))`` with ``n = ceil(T / C)``. Returns ``(n, padded T)``."""
    per = max(1, -(-num_tokens // num_channels))
    return per, per * num_channels


def channel_prefix(in_dest: torch.Tensor, num_channels: int) -> torch.Tensor:
    """``[X, C]`` int32: for each destination column of ``in_dest [T, X] bool``, how many of the
    tokens of channels ``0..c`` go there (DeepEP's sender-side channel prefix matrix, inclusive)."""
    T, X = in_dest.shape
    per, padded = _channel_bounds(T, num_channels)
    counts = torch.zeros(padded, X, dtype=torch.int32, device=in_dest.device)
    counts[:T] = in_dest.to(torch.int32)
    return counts.view(num_channels, per, X).sum(1, dtype=torch.int32).cumsum(0, dtype=torch.int32).t().contiguous()


def channel_slots(in_dest: torch.Tensor, num_channels: int) -> torch.Tensor:
    """``[T, X]`` int32: each token's index among the tokens of its channel that go to that column,
    ``-1`` where it does not go (DeepEP's ``send_head`` / ``send_rdma_head``)."""
    T, X = in_dest.shape
    per, padded = _channel_bounds(T, num_channels)
    sent = torch.zeros(padded, X, dtype=torch.int32, device=in_dest.device)
    sent[:T] = in_dest.to(torch.int32)
    slots = sent.view(num_channels, per, X).cumsum(1, dtype=torch.int32).view(padded, X)[:T] - 1
    return torch.where(in_dest, slots, torch.full_like(slots, -1))


class DeviceCount:
    """A count the kernels write into a device tensor, ``words[index]``, not yet read as a tensor:
    :attr:`DispatchHandle.num_recv_tokens` makes its 0-dim view on the first read. A plain object
    (not a closure), so a copy or a pickle of the handle carries its own ``words``."""

    __slots__ = ("words", "index")

    def __init__(self, words: torch.Tensor, index: int):
        self.words, self.index = words, index


class DispatchHandle(Sequence):
    """Layout of one normal-mode dispatch, enough to repeat it (cached mode) or to combine.

    A sequence of DeepEP's fields (module docstring: 6 on one node, 10 across nodes), computed on
    first read where epcomm does not keep them; fields that depend on the other ranks' channel
    splits or on a forwarding rank's traffic (DeepEP's kernels' own bookkeeping, which epcomm's
    kernels do not have) are ``None``:

    - one node: ``[0]`` rank_prefix_matrix, ``[1]`` channel_prefix_matrix ``[R, C]`` int32 (this
      rank's tokens per destination over channels 0..c), ``[2]`` None, ``[3]`` recv_src_idx,
      ``[4]`` is_token_in_rank, ``[5]`` send_head ``[T, R]`` int32 (index within the channel's
      tokens for that rank, -1 if not sent);
    - across nodes: ``[0]`` is_token_in_rank, ``[1]`` rdma_channel_prefix_matrix ``[N, C]``, ``[2]``
      gbl_channel_prefix_matrix ``[R, C]``, ``[3]``-``[5]`` None, ``[6]`` recv_gbl_rank_prefix_sum
      ``[R]`` int32 (rows received from ranks 0..i), ``[7]`` recv_src_meta ``[rows, 8]`` uint8
      (int32 source node, int32 bit of this rank within its node), ``[8]`` send_rdma_head ``[T, N]``,
      ``[9]`` None.

    ``C`` is the dispatch's ``config.num_sms // 2``, of the Config the caller gave (DeepEP's channels,
    also where epcomm caps the grids of ranks sharing a GPU). Attributes (epcomm's; constructor order):

    Args:
        rank_prefix_matrix: ``[R, R]`` int32; ``[i][j]`` = tokens ranks ``0..i`` send to rank ``j``.
        recv_src_idx: ``[num_recv_rows]`` int32; for each received row, the token's index on its
            source rank (``-1`` for padding rows when ``num_worst_tokens`` was used).
        is_token_in_rank: ``[T, R]`` bool, the sender-side routing this dispatch used.
        num_recv_tokens: rows actually received (an int, or a 0-dim int tensor on the device when
            no host synchronisation was allowed). A backend may give a :class:`DeviceCount`
            instead, which makes that tensor on the first read (a view costs ~1.5 µs of host time
            on every call that returns a handle, and few callers read it).
        num_recv_rows: rows of ``recv_x`` (``num_worst_tokens`` when padding was asked for).
        backend_state: backend-private data (queue offsets, etc.); ``None`` for ``torch_dist``.
        expert_major: the row mapping when dispatched with ``expert_major=True`` (see
            :mod:`epcomm.expert_major`), else ``None``.
        rank, ranks_per_node, num_channels: where the handle was made (Buffer sets them, see
            :meth:`laid_out`); until then one node of ``R`` ranks and one channel.
    """

    __slots__ = ("rank_prefix_matrix", "recv_src_idx", "is_token_in_rank", "_num_recv_tokens", "num_recv_rows",
                 "backend_state", "expert_major", "rank", "ranks_per_node", "num_channels", "_derived")
    _fields = ("rank_prefix_matrix", "recv_src_idx", "is_token_in_rank", "num_recv_tokens", "num_recv_rows",
               "backend_state", "expert_major")

    def __init__(self, rank_prefix_matrix: torch.Tensor, recv_src_idx: torch.Tensor, is_token_in_rank: torch.Tensor,
                 num_recv_tokens: Any, num_recv_rows: int, backend_state: Optional[Any] = None,
                 expert_major: Optional[Any] = None, *, rank: Optional[int] = None,
                 ranks_per_node: Optional[int] = None, num_channels: int = 1):
        self.rank_prefix_matrix = rank_prefix_matrix
        self.recv_src_idx = recv_src_idx
        self.is_token_in_rank = is_token_in_rank
        self._num_recv_tokens = num_recv_tokens
        self.num_recv_rows = num_recv_rows
        self.backend_state = backend_state
        self.expert_major = expert_major
        self.rank = rank
        self.ranks_per_node = ranks_per_node
        self.num_channels = num_channels
        self._derived = None  # DeepEP fields computed on first read (_field)

    @property
    def num_recv_tokens(self) -> Any:
        """Rows actually received: an int, or a 0-dim int tensor on the device (see the class)."""
        count = self._num_recv_tokens
        if count.__class__ is DeviceCount:  # (made on the first read, then kept)
            count = self._num_recv_tokens = count.words.select(0, count.index)
        return count

    @num_recv_tokens.setter
    def num_recv_tokens(self, count: Any) -> None:
        self._num_recv_tokens = count

    def laid_out(self, rank: int, ranks_per_node: int, num_channels: int) -> "DispatchHandle":
        """Record where this handle was made (Buffer calls it on every dispatch's handle): it is
        this rank's, of nodes of ``ranks_per_node`` ranks, its dispatch ran ``num_channels``
        channels. The first call decides (a cached dispatch keeps the layout it was given)."""
        if self.rank is None:
            self.rank, self.ranks_per_node, self.num_channels = rank, ranks_per_node, max(1, num_channels)
        return self

    def _replace(self, **changes) -> "DispatchHandle":
        values = {name: getattr(self, name) for name in self._fields}
        values.update(changes)
        return DispatchHandle(**values, rank=self.rank, ranks_per_node=self.ranks_per_node,
                              num_channels=self.num_channels)

    # ------------------------------------------------------------------ DeepEP's fields
    @property
    def num_nodes(self) -> int:
        R = self.is_token_in_rank.shape[1]
        return R // (self.ranks_per_node or R)

    @property
    def deep_ep_fields(self) -> tuple:
        """The names of this handle's DeepEP fields, in DeepEP's order."""
        return INTERNODE_FIELDS if self.num_nodes > 1 else INTRANODE_FIELDS

    def __len__(self) -> int:
        return len(self.deep_ep_fields)

    def __getitem__(self, index):
        names = self.deep_ep_fields
        if isinstance(index, slice):
            return tuple(self._field(name) for name in names[index])
        return self._field(names[index])

    def __iter__(self):
        return (self._field(name) for name in self.deep_ep_fields)

    def __repr__(self) -> str:
        return (f"DispatchHandle(num_recv_rows={self.num_recv_rows}, fields={self.deep_ep_fields}, "
                f"backend_state={type(self.backend_state).__name__})")

    def _field(self, name: str):
        if name in self._fields:
            return getattr(self, name)
        if self._derived is None:
            self._derived = {}
        if name not in self._derived:
            self._derived[name] = self._derive(name)
        return self._derived[name]

    def _derive(self, name: str):
        in_rank, C = self.is_token_in_rank, self.num_channels
        if name in ("channel_prefix_matrix", "gbl_channel_prefix_matrix"):
            return channel_prefix(in_rank, C)
        if name == "send_head":
            return channel_slots(in_rank, C)
        if name in ("rdma_channel_prefix_matrix", "send_rdma_head"):
            T, R = in_rank.shape
            in_node = in_rank.view(T, R // self.ranks_per_node, self.ranks_per_node).any(-1)
            return channel_prefix(in_node, C) if name.startswith("rdma") else channel_slots(in_node, C)
        if name == "recv_gbl_rank_prefix_sum":
            return self.rank_prefix_matrix[:, self.rank].contiguous()
        if name == "recv_src_meta":
            ends = self.rank_prefix_matrix[:, self.rank].to(torch.int64)
            rows = torch.arange(self.recv_src_idx.shape[0], device=ends.device)
            source = torch.searchsorted(ends, rows, right=True).clamp_max(ends.shape[0] - 1)
            meta = torch.empty(rows.shape[0], 2, dtype=torch.int32, device=ends.device)
            meta[:, 0] = (source // self.ranks_per_node).to(torch.int32)
            meta[:, 1] = 1 << (self.rank % self.ranks_per_node)
            return meta.view(torch.uint8)
        return None  # DeepEP's kernels' own bookkeeping of other ranks' channels and forwarders


class LowLatencyHandle(tuple):
    """Layout of one low-latency dispatch: DeepEP's 5-tuple, the same fields in the same order.

    Fields (also attributes):
        recv_src_info: ``[E_local, R*M]`` int32; token index on the source rank of each packed row.
        recv_layout_range: ``[E_local, R]`` int64; ``(offset << 32) | count`` of each source's rows.
        num_max_dispatch_tokens_per_rank: ``M``.
        hidden: ``H``.
        num_experts: ``E`` (global).

    ``backend_state`` (the sixth constructor argument; ``None`` for ``torch_dist``) is an
    attribute, not a field.
    """

    _fields = LOW_LATENCY_FIELDS

    def __new__(cls, recv_src_info: torch.Tensor, recv_layout_range: torch.Tensor,
                num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int,
                backend_state: Optional[Any] = None):
        self = super().__new__(cls, (recv_src_info, recv_layout_range, num_max_dispatch_tokens_per_rank, hidden,
                                     num_experts))
        self.backend_state = backend_state
        return self

    def __getnewargs__(self):
        return tuple(self) + (self.backend_state,)

    recv_src_info = property(lambda self: self[0])
    recv_layout_range = property(lambda self: self[1])
    num_max_dispatch_tokens_per_rank = property(lambda self: self[2])
    hidden = property(lambda self: self[3])
    num_experts = property(lambda self: self[4])

    def _replace(self, **changes) -> "LowLatencyHandle":
        values = dict(zip(self._fields, self))
        values["backend_state"] = self.backend_state
        values.update(changes)
        return LowLatencyHandle(**values)

    def __repr__(self) -> str:
        return (f"LowLatencyHandle(M={self[2]}, hidden={self[3]}, num_experts={self[4]}, "
                f"backend_state={type(self.backend_state).__name__})")
