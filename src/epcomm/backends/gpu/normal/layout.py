"""get_dispatch_layout on the GPU: ``ep_dispatch_layout``, one launch, no exchange (the counts
per rank and per expert, and ``is_token_in_rank``, from ``topk_idx``)."""
from __future__ import annotations

import triton
import triton.language as tl

from .. import sync
from ..launch import KernelSpec
from ..sync import arrive, report_dropped

LAYOUT_BLOCK_T = 128  # tokens per program of the layout kernel


# ====================================================================== get_dispatch_layout
@triton.jit
def ep_dispatch_layout(topk_ptr,  # [T, K] int64 global expert ids (-1 = none)
                       per_rank_ptr,  # out [R] int32: tokens sent to each rank
                       per_expert_ptr,  # out [E] int32: tokens choosing each expert
                       in_rank_ptr,  # out [T, R] int8 (bool): token t goes to rank j
                       partial_ptr,  # scratch [programs, E_P2 + R_P2] int32: each program's counts
                       state_ptr,  # [16] int64 local (arrival counter)
                       mailbox_address,  # host mailbox (sync.py): count of ids outside [-1, E)
                       num_tokens, num_topk, num_experts, num_ranks, experts_per_rank,
                       BLOCK_T: tl.constexpr, E_P2: tl.constexpr, K_P2: tl.constexpr, R_P2: tl.constexpr,
                       SUM_ROWS: tl.constexpr):
    # Program p takes tokens [p * BLOCK_T, (p + 1) * BLOCK_T): a histogram of their expert ids,
    # their rank membership (written straight into is_token_in_rank) and its per-rank sum go to
    # scratch row p. The program arriving last sums the rows into the outputs, so one launch
    # needs neither atomics on the outputs nor a zeroing launch. Ids outside [-1, E) count nowhere
    # and are reported to the host mailbox.
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
    row = partial_ptr + pid.to(tl.int64) * (E_P2 + R_P2)
    tl.store(row + tl.arange(0, E_P2), experts)
    tl.store(row + E_P2 + ranks, tl.sum(member, axis=0))
    dropped = tl.sum(((ids < -1) | (ids >= num_experts)).to(tl.int32), axis=None)
    if dropped > 0:
        report_dropped(mailbox_address, num_ranks, dropped)
    if arrive(state_ptr + sync.ARRIVE_LAYOUT, num_programs):
        cols = tl.arange(0, E_P2)
        expert_total = tl.zeros([E_P2], tl.int32)
        rank_total = tl.zeros([R_P2], tl.int32)
        for first in range(0, num_programs, SUM_ROWS):
            rows = first + tl.arange(0, SUM_ROWS)
            starts = partial_ptr + rows[:, None].to(tl.int64) * (E_P2 + R_P2)
            live = (rows < num_programs)[:, None]
            expert_total += tl.sum(tl.load(starts + cols[None, :], mask=live, other=0), axis=0)
            rank_total += tl.sum(tl.load(starts + E_P2 + ranks[None, :], mask=live, other=0), axis=0)
        tl.store(per_expert_ptr + cols, expert_total, mask=cols < num_experts)
        tl.store(per_rank_ptr + ranks, rank_total, mask=ranks < num_ranks)


LAYOUT = KernelSpec(ep_dispatch_layout, ["*i64", "*i32", "*i32", "*i8", "*i32", "*i64", "i64", "i32", "i32", "i32",
                                         "i32", "i32"])
