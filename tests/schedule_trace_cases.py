"""Which peer each rank's pull and push work on, when: the one-node kernels' schedule traced from
``%globaltimer`` (gpu/normal/one_node/schedule.py, ``TRACE``), on ranks that share one GPU (the
bed of tests/test_shared_gpu.py, nvlink backend) or on a machine of several GPUs.

:func:`trace_calls` runs on every rank: a cached dispatch and a combine at DeepEP's routing, once
with the rank-order walk and once with every peer at once, each kernel's items recorded. The
driver then gives every rank's records to :func:`schedule_table`, which says, per quarter of each
kernel's span, how the items in flight were spread over the GPUs they read or wrote (a share of 1/R
each is even). The ranks of the bed share one ``%globaltimer``, so their records line up; on
several GPUs the clocks of different GPUs agree only roughly, so read the per-rank columns.
"""
from __future__ import annotations

from typing import Dict, List

import torch
import torch.distributed as dist

import epcomm
from epcomm.backends.gpu.normal.one_node.schedule import TRACE_HEADER_WORDS, TRACE_RECORD_WORDS

TRACE_CAPACITY = 1 << 15  # items per traced call


def _trace_buffer(device) -> torch.Tensor:
    trace = torch.zeros(int(TRACE_HEADER_WORDS) + TRACE_CAPACITY * int(TRACE_RECORD_WORDS), dtype=torch.int64,
                        device=device)
    trace[1] = TRACE_CAPACITY
    return trace


def _records(trace: torch.Tensor) -> List[List[int]]:
    """[program, peer, rows, start ns, end ns] per item of one traced call."""
    count = min(int(trace[0]), TRACE_CAPACITY)
    words = trace[int(TRACE_HEADER_WORDS):int(TRACE_HEADER_WORDS) + count * int(TRACE_RECORD_WORDS)]
    out = []
    for program_peer, rows, start, end in words.view(-1, int(TRACE_RECORD_WORDS)).tolist():
        out.append([program_peer >> 32, program_peer & 0xFFFFFFFF, rows, start, end])
    return out


def trace_calls(num_tokens: int = 1024, hidden: int = 7168, num_experts: int = 256, num_topk: int = 8,
                num_sms: int = 0, num_nvl_bytes: int = 1 << 30) -> Dict[str, Dict[str, List[List[int]]]]:
    """On every rank of the group: ``{order: {"pull": records, "push": records}}`` for the orders
    "rank order" and "every peer" (records as :func:`_records` gives them). ``num_sms``: the
    Config's programs (0: the Buffer's default)."""
    rank, R = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device())
    buffer = epcomm.Buffer(dist.group.WORLD, num_nvl_bytes=num_nvl_bytes)  # (one round at the default sizes)
    normal = buffer._backend.normal
    config = epcomm.Config(num_sms or epcomm.Buffer.get_dispatch_config(R).num_sms, 8, 256)
    g = torch.Generator(device=device).manual_seed(100 + rank)
    x = torch.randn(num_tokens, hidden, device=device, generator=g).to(torch.bfloat16)
    scores = torch.randn(num_tokens, num_experts, device=device, generator=g).abs() + 1
    topk_idx = scores.topk(num_topk, dim=-1).indices
    weights = torch.rand(num_tokens, num_topk, device=device, generator=g)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, num_experts)
    result = {}
    for order, every_peer in (("rank order", False), ("every peer", True)):
        normal.every_peer = every_peer
        normal.trace = None
        recv_x, _, _, _, handle, _ = buffer.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                     num_tokens_per_expert=per_expert, topk_idx=topk_idx,
                                                     topk_weights=weights, config=config)
        normal.trace = _trace_buffer(device)  # (compiles the traced kernels: one untimed call each)
        buffer.dispatch(x, handle=handle, config=config)
        buffer.combine(recv_x, handle, config=config)
        traced = {}
        for kernel, call in (("pull", lambda: buffer.dispatch(x, handle=handle, config=config)),
                             ("push", lambda: buffer.combine(recv_x, handle, config=config))):
            torch.cuda.synchronize()
            dist.barrier()
            normal.trace.zero_()
            normal.trace[1] = TRACE_CAPACITY
            call()
            torch.cuda.synchronize()
            traced[kernel] = _records(normal.trace)
        result[order] = traced
    normal.trace = None
    normal.every_peer = True
    buffer.destroy()
    return result


def schedule_table(per_rank: List[Dict[str, Dict[str, List[List[int]]]]], quarters: int = 4):
    """``(lines, largest)``: lines of a table — per order and kernel, for each quarter of the
    kernel's span (first item start to last item end, over all ranks), the share of the items'
    time spent on each peer GPU (all ranks together), and the peer each rank's program 0 started
    on — and ``largest[(order, kernel)]``: per quarter the largest share times R (1 = even)."""
    R = len(per_rank)
    largest = {}
    lines = [f"R={R} schedule: share of item-time per peer GPU, by quarter of the kernel's span (even = {1 / R:.2f})"]
    for order in per_rank[0]:
        for kernel in per_rank[0][order]:
            items = [(rank, *rec) for rank, result in enumerate(per_rank) for rec in result[order][kernel]]
            if not items:
                continue
            t0 = min(it[4] for it in items)
            t1 = max(it[5] for it in items)
            span = max(t1 - t0, 1)
            worst = []
            cells = []
            for q in range(quarters):
                lo, hi = t0 + span * q / quarters, t0 + span * (q + 1) / quarters
                load = [0.0] * R
                for _, _, peer, _, start, end in items:
                    load[peer] += max(0.0, min(end, hi) - max(start, lo))
                total = sum(load) or 1.0
                shares = [v / total for v in load]
                worst.append(max(shares) * R)
                cells.append("/".join(f"{s:.2f}" for s in shares))
            largest[(order, kernel)] = worst
            first = []
            for rank, result in enumerate(per_rank):
                recs = sorted((rec for rec in result[order][kernel] if rec[0] == 0), key=lambda rec: rec[3])
                first.append(str(recs[0][1]) if recs else "-")
            lines.append(f"R={R} {order:10s} {kernel}: span {span / 1e3:8.1f} us, largest share x R per quarter "
                         f"{' '.join(f'{w:.2f}' for w in worst)}; first peer by rank {','.join(first)}")
            lines.append(f"R={R}   shares per quarter (peer 0/1/...): {' | '.join(cells)}")
    return lines, largest
