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

from typing import Dict, List, Sequence

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


def _routing(buffer, seed: int, num_tokens: int, hidden: int, num_experts: int, num_topk: int):
    """``(x, topk_idx, weights, layout)`` on this rank's GPU at DeepEP's routing (scores' top-k);
    ``layout``: get_dispatch_layout's num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert."""
    device = torch.device("cuda", torch.cuda.current_device())
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(num_tokens, hidden, device=device, generator=g).to(torch.bfloat16)
    scores = torch.randn(num_tokens, num_experts, device=device, generator=g).abs() + 1
    topk_idx = scores.topk(num_topk, dim=-1).indices
    weights = torch.rand(num_tokens, num_topk, device=device, generator=g)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, num_experts)
    return x, topk_idx, weights, (per_rank, in_rank, per_expert)


def _traced(normal, calls) -> Dict[str, List[List[int]]]:
    """``{name: records}`` of each of ``calls`` (name -> a call), each alone after a sync and a
    barrier, into the trace buffer ``normal.trace`` emptied first."""
    traced = {}
    for name, call in calls:
        torch.cuda.synchronize()
        dist.barrier()
        normal.trace.zero_()
        normal.trace[1] = TRACE_CAPACITY
        call()
        torch.cuda.synchronize()
        traced[name] = _records(normal.trace)
    return traced


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
    x, topk_idx, weights, (per_rank, in_rank, per_expert) = _routing(buffer, 100 + rank, num_tokens, hidden,
                                                                      num_experts, num_topk)
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
        result[order] = _traced(normal, (("pull", lambda: buffer.dispatch(x, handle=handle, config=config)),
                                         ("push", lambda: buffer.combine(recv_x, handle, config=config))))
    normal.trace = None
    normal.every_peer = True
    buffer.destroy()
    return result


def _shares(load: List[float]) -> List[float]:
    total = sum(load)
    return [v / total for v in load] if total else []


def schedule_table(per_rank: List[Dict[str, Dict[str, List[List[int]]]]], quarters: int = 4):
    """``(lines, largest)``. Per order and kernel, two views of the peers' shares of the work:

    - by progress: each rank's items in the order they started, cut into quarters; a quarter's
      share of peer p is the rows of p's items in that quarter of every rank. This is the schedule
      itself, whatever the ranks' timing; ``largest[(order, kernel)]`` holds, per quarter, its
      largest share times R (1 = even);
    - by time: quarters of the kernel's span over all ranks (first start to last end), each peer's
      share of the item-time in flight then (ranks sharing one GPU start their kernels at different
      moments: a quarter in which no rank worked shows "-").

    Also the peer each rank's program 0 started on."""
    R = len(per_rank)
    largest = {}
    lines = [f"R={R} schedule: each peer GPU's share of the work, by quarter (even = {1 / R:.2f} each)"]
    for order in per_rank[0]:
        for kernel in per_rank[0][order]:
            progress = [[0.0] * R for _ in range(quarters)]
            for result in per_rank:
                recs = sorted(result[order][kernel], key=lambda rec: rec[3])
                for i, (_, peer, rows, _, _) in enumerate(recs):
                    progress[i * quarters // len(recs)][peer] += rows
            by_progress = [_shares(load) for load in progress]
            largest[(order, kernel)] = [max(shares) * R if shares else 0.0 for shares in by_progress]
            items = [rec for result in per_rank for rec in result[order][kernel]]
            t0, t1 = min(rec[3] for rec in items), max(rec[4] for rec in items)
            span = max(t1 - t0, 1)
            by_time = []
            for q in range(quarters):
                lo, hi = t0 + span * q / quarters, t0 + span * (q + 1) / quarters
                load = [0.0] * R
                for _, peer, _, start, end in items:
                    load[peer] += max(0.0, min(end, hi) - max(start, lo))
                by_time.append(_shares(load))
            first = []
            for result in per_rank:
                recs = sorted((rec for rec in result[order][kernel] if rec[0] == 0), key=lambda rec: rec[3])
                first.append(str(recs[0][1]) if recs else "-")

            def cells(rows):
                return " | ".join("/".join(f"{v:.2f}" for v in shares) if shares else "-" for shares in rows)
            lines.append(f"R={R} {order:10s} {kernel}: largest share x R by progress quarter "
                         f"{' '.join(f'{w:.2f}' for w in largest[(order, kernel)])}; program 0 of each rank "
                         f"started on peer {','.join(first)}; span {span / 1e3:.1f} us")
            lines.append(f"R={R}   by progress (peer 0/1/...): {cells(by_progress)}")
            lines.append(f"R={R}   by time:                  {cells(by_time)}")
    return lines, largest


def trace_dispatch_items(num_tokens: int = 4096, hidden: int = 7168, num_experts: int = 256, num_topk: int = 8,
                         num_nvl_bytes: int = 1 << 30, variants: Sequence[str] = ()) -> Dict[str, List[List[int]]]:
    """On every rank: ``{call: records}`` (:func:`_records`) of one traced full dispatch (its pull in
    turn, ``ep_dispatch_pull`` with the receive index) and one traced cached dispatch (the pull
    programs of the one launch ``ep_dispatch``, whose items also wait for each block as it is
    staged), at DeepEP's routing with the default Config and kernel choices; each call after a
    barrier and a sync. An item's time is from the program taking it to its rows stored, waits
    included: what sets the pace of each pull (the full dispatch's pull in turn took 535 µs against
    the one launch's 491 on 4 H200s, 2026-11-28f). ``variants``: names of bench.NORMAL_VARIANTS, each
    a further traced full dispatch ("full dispatch, NAME") with that variant set, after the defaults'."""
    from epcomm.tools.bench import normal_variants, use_normal_variants
    normal_variants(",".join(variants))  # (a misspelt name: a ValueError before any work)
    buffer = epcomm.Buffer(dist.group.WORLD, num_nvl_bytes=num_nvl_bytes)
    normal = buffer._backend.normal
    x, topk_idx, weights, (per_rank, in_rank, per_expert) = _routing(buffer, 200 + dist.get_rank(), num_tokens,
                                                                      hidden, num_experts, num_topk)
    normal.trace = _trace_buffer(torch.device("cuda", torch.cuda.current_device()))

    def full():
        return buffer.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                               num_tokens_per_expert=per_expert, topk_idx=topk_idx, topk_weights=weights)[4]
    handle = full()  # (compiles the traced kernels: one untimed call each)
    buffer.dispatch(x, handle=handle)
    traced = _traced(normal, (("full dispatch", full), ("cached dispatch", lambda: buffer.dispatch(x, handle=handle))))
    for name in variants:
        use_normal_variants(normal, [name])  # (drops the plans, keeps the trace: the next call compiles, untimed)
        full()
        traced.update(_traced(normal, ((f"full dispatch, {name}", full),)))
        use_normal_variants(normal, [])
    normal.trace = None
    buffer.destroy()
    return traced


def item_table(per_rank: List[Dict[str, List[List[int]]]]) -> List[str]:
    """Per call and rank, from :func:`trace_dispatch_items`' records: items and programs; the span
    (the first item's start to the last one's end, µs); the median item time from this rank's own
    rows and from its peers' (µs); the programs' busy share of the span (their items' time over
    programs x span); how far apart the programs took their first items and ended their last
    (µs); and the rate of rows into this rank (rows per µs of span)."""
    lines = ["call              rank  items  progs   span  item local  item remote  busy  first spread  "
             "end spread  rows/us"]
    for call in per_rank[0]:
        for rank, result in enumerate(per_rank):
            recs = result[call]
            if not recs:
                lines.append(f"{call:17s} {rank:4d}  (no items)")
                continue
            programs = {}
            for program, _, _, start, end in recs:
                first, last, busy = programs.get(program, (start, end, 0))
                programs[program] = (min(first, start), max(last, end), busy + end - start)
            t0, t1 = min(rec[3] for rec in recs), max(rec[4] for rec in recs)
            span = max(t1 - t0, 1)

            def median_us(items):
                times = sorted(end - start for _, _, _, start, end in items)
                return f"{times[len(times) // 2] / 1e3:.2f}" if times else "-"
            local = [rec for rec in recs if rec[1] == rank]
            remote = [rec for rec in recs if rec[1] != rank]
            busy = sum(b for _, _, b in programs.values()) / (len(programs) * span)
            firsts, lasts = [f for f, _, _ in programs.values()], [last for _, last, _ in programs.values()]
            rows = sum(rec[2] for rec in recs)
            lines.append(f"{call:17s} {rank:4d} {len(recs):6d} {len(programs):6d} {span / 1e3:6.1f} {median_us(local):>11s}"
                         f" {median_us(remote):>12s} {busy:5.2f} {(max(firsts) - min(firsts)) / 1e3:13.1f}"
                         f" {(max(lasts) - min(lasts)) / 1e3:11.1f} {rows * 1e3 / span:8.1f}")
    return lines
