"""get_dispatch_layout on the GPU: ``ep_dispatch_layout``, one launch, no exchange — the counts
per rank, per node (multi-node) and per expert, and ``is_token_in_rank``, from ``topk_idx``.
:class:`LayoutKernel` is its host side, shared by both shapes of normal mode, as is
``expert_receive_counts`` (what the local experts receive, from the exchanged count rows)."""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from .. import sync
from ..launch import KernelSpec, cdiv, current_stream, p2
from ..sync import arrive, report_dropped

LAYOUT_BLOCK_T = 128  # tokens per program of the layout kernel


@triton.jit
def expert_receive_counts(first_count_ptr, row_len, local, num_local, num_ranks, expert_alignment):
    """Entries the local experts ``local`` ([BLOCK] ids) receive, summed over the ranks' count rows
    (``first_count_ptr``: rank 0's count of local expert 0; rows ``row_len`` words apart), and
    those totals rounded up to ``expert_alignment``: ``(total, aligned)``."""
    total = tl.zeros(local.shape, tl.int32)
    for i in range(0, num_ranks):
        total += tl.load(first_count_ptr + i * row_len + local, mask=local < num_local, other=0)
    return total, (total + expert_alignment - 1) // expert_alignment * expert_alignment


# ====================================================================== get_dispatch_layout
@triton.jit
def ep_dispatch_layout(topk_ptr: "*i64",  # [T, K] int64 global expert ids (-1 = none)
                       per_rank_ptr: "*i32",  # out [R] int32: tokens sent to each rank
                       per_node_ptr: "*i32",  # out [N] int32: tokens sent to each node (HAS_NODES)
                       per_expert_ptr: "*i32",  # out [E] int32: tokens choosing each expert
                       in_rank_ptr: "*i8",  # out [T, R] int8 (bool): token t goes to rank j
                       partial_ptr: "*i32",  # scratch [programs, E_P2 + R_P2 + N_P2] int32: each program's counts
                       state_ptr: "*i64",  # [16] int64 local (arrival counter)
                       mailbox_address: "i64",  # host mailbox (mailbox.py): count of ids outside [-1, E)
                       num_tokens: "i32", num_topk: "i32", num_experts: "i32", num_ranks: "i32",
                       experts_per_rank: "i32", ranks_per_node: "i32",
                       BLOCK_T: tl.constexpr, E_P2: tl.constexpr, K_P2: tl.constexpr, R_P2: tl.constexpr,
                       N_P2: tl.constexpr, HAS_NODES: tl.constexpr, SUM_ROWS: tl.constexpr):
    # Program p takes tokens [p * BLOCK_T, (p + 1) * BLOCK_T): a histogram of their expert ids,
    # their rank membership (written straight into is_token_in_rank), its per-rank sum and (nodes)
    # the per-node sum of their node membership go to scratch row p. The program arriving last
    # sums the rows into the outputs, so one launch needs neither atomics on the outputs nor a
    # zeroing launch. Ids outside [-1, E) count nowhere and are reported to the host mailbox.
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    tokens = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    ks = tl.arange(0, K_P2)
    in_t = tokens < num_tokens
    ids = tl.load(topk_ptr + tokens[:, None].to(tl.int64) * num_topk + ks[None, :],
                  mask=in_t[:, None] & (ks[None, :] < num_topk), other=-1)
    valid = (ids >= 0) & (ids < num_experts)
    experts = tl.histogram(tl.reshape(tl.where(valid, ids, 0).to(tl.int32), [BLOCK_T * K_P2]), E_P2,
                           mask=tl.reshape(valid, [BLOCK_T * K_P2]))
    ranks = tl.arange(0, R_P2)
    owner = tl.where(valid, ids // experts_per_rank, -1)
    member = tl.max((owner[:, :, None] == ranks[None, None, :]).to(tl.int32), axis=1)  # [BLOCK_T, R_P2]
    tl.store(in_rank_ptr + tokens[:, None].to(tl.int64) * num_ranks + ranks[None, :], member.to(tl.int8),
             mask=in_t[:, None] & (ranks[None, :] < num_ranks))
    row = partial_ptr + pid.to(tl.int64) * (E_P2 + R_P2 + N_P2)
    tl.store(row + tl.arange(0, E_P2), experts)
    tl.store(row + E_P2 + ranks, tl.sum(member, axis=0))
    nodes = tl.arange(0, N_P2)
    if HAS_NODES:  # a token counts once per node that hosts any of its experts
        owner_node = tl.where(valid, owner // ranks_per_node, -1)
        in_node = tl.max((owner_node[:, :, None] == nodes[None, None, :]).to(tl.int32), axis=1)  # [BLOCK_T, N_P2]
        tl.store(row + E_P2 + R_P2 + nodes, tl.sum(in_node, axis=0))
    dropped = tl.sum(((ids < -1) | (ids >= num_experts)).to(tl.int32), axis=None)
    if dropped > 0:
        report_dropped(mailbox_address, num_ranks, dropped)
    if arrive(state_ptr + sync.ARRIVE_LAYOUT, num_programs):  # (acq_rel: every program's row is seen)
        cols = tl.arange(0, E_P2)
        expert_total = tl.zeros([E_P2], tl.int32)
        rank_total = tl.zeros([R_P2], tl.int32)
        node_total = tl.zeros([N_P2], tl.int32)
        for first in range(0, num_programs, SUM_ROWS):
            rows = first + tl.arange(0, SUM_ROWS)
            starts = partial_ptr + rows[:, None].to(tl.int64) * (E_P2 + R_P2 + N_P2)
            live = (rows < num_programs)[:, None]
            expert_total += tl.sum(tl.load(starts + cols[None, :], mask=live, other=0), axis=0)
            rank_total += tl.sum(tl.load(starts + E_P2 + ranks[None, :], mask=live, other=0), axis=0)
            if HAS_NODES:
                node_total += tl.sum(tl.load(starts + E_P2 + R_P2 + nodes[None, :], mask=live, other=0), axis=0)
        tl.store(per_expert_ptr + cols, expert_total, mask=cols < num_experts)
        tl.store(per_rank_ptr + ranks, rank_total, mask=ranks < num_ranks)
        if HAS_NODES:
            tl.store(per_node_ptr + nodes, node_total, mask=nodes < num_ranks // ranks_per_node)


LAYOUT = KernelSpec(ep_dispatch_layout)


class LayoutKernel:
    """The host side of :func:`ep_dispatch_layout` for one backend: a bound kernel per
    ``(num_experts, num_topk)`` and a scratch area that grows with the token count.

    Args:
        num_ranks, ranks_per_node: the group and its nodes (``ranks_per_node == num_ranks``: one
            node, no per-node counts).
        state: the backend's device state words (the arrival counter); mailbox_address: its host
            mailbox (ids outside ``[-1, num_experts)`` are reported there: the next call raises).
    """

    def __init__(self, num_ranks: int, ranks_per_node: int, device: torch.device, state: torch.Tensor,
                 mailbox_address: int):
        self.R, self.ranks_per_node, self.device = num_ranks, ranks_per_node, device
        self.num_nodes = num_ranks // ranks_per_node
        self.R_P2, self.N_P2 = p2(num_ranks), p2(self.num_nodes)
        # The kernel gets only the address: holding the tensor keeps the caching allocator from
        # handing its words to another tensor (a caller may pass a temporary).
        self.state_words = state
        self.state, self.mailbox_address = state.data_ptr(), mailbox_address
        self._plans = {}

    def __call__(self, topk_idx: torch.Tensor, num_experts: int
                 ) -> Tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor, torch.Tensor]:
        """``(num_tokens_per_rank [R], num_tokens_per_rdma_rank [N] or None, num_tokens_per_expert
        [E], is_token_in_rank [T, R] bool)``, int32 counts; ``topk_idx`` ``[T, K]`` int64."""
        R = self.R
        num_tokens, num_topk = topk_idx.shape
        key = (num_experts, num_topk)
        plan = self._plans.get(key)
        if plan is None:
            e_p2 = p2(num_experts)
            width = e_p2 + self.R_P2 + self.N_P2
            kernel = LAYOUT.bind(num_warps=4, BLOCK_T=LAYOUT_BLOCK_T, E_P2=e_p2, K_P2=p2(num_topk), R_P2=self.R_P2,
                                 N_P2=self.N_P2, HAS_NODES=self.num_nodes > 1,
                                 SUM_ROWS=min(64, p2(8192 // width + 1) // 2))
            plan = self._plans[key] = [kernel, None, width, 0]
        kernel, scratch, width, scratch_address = plan
        num_programs = max(1, cdiv(num_tokens, LAYOUT_BLOCK_T))
        if scratch is None or scratch.shape[0] < num_programs:
            scratch = plan[1] = torch.empty(max(num_programs, 64), width, dtype=torch.int32, device=self.device)
            scratch_address = plan[3] = scratch.data_ptr()
        # (new_empty on topk_idx, which the Buffer checked is on this device: no device argument to
        # parse, about 1 µs less per allocation on a GPU machine's host; one_node/mode.py's dispatch)
        per_rank = topk_idx.new_empty(R, dtype=torch.int32)
        per_node = topk_idx.new_empty(self.num_nodes, dtype=torch.int32) if self.num_nodes > 1 else None
        per_expert = topk_idx.new_empty(num_experts, dtype=torch.int32)
        in_rank = topk_idx.new_empty((num_tokens, R), dtype=torch.bool)
        per_rank_address = per_rank.data_ptr()
        kernel.launch(num_programs, 1, current_stream(self.device.index), topk_idx.data_ptr(), per_rank_address,
                      per_rank_address if per_node is None else per_node.data_ptr(), per_expert.data_ptr(),
                      in_rank.data_ptr(), scratch_address, self.state, self.mailbox_address, num_tokens, num_topk,
                      num_experts, R, num_experts // R, self.ranks_per_node)
        return per_rank, per_node, per_expert, in_rank
