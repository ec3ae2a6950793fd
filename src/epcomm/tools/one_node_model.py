"""``epcomm model-one-node``: one-node normal-mode time from byte counts, link rate, per-program rates
and the kernels' phases, for the schedule the kernels use and the rank-order walk they replaced.

The rows are exact for the routing given (DeepEP's test routing, :func:`uniform_topk`, for every
rank); the rates are inputs. A call is its kernels one after the other (``|``), and a kernel that
moves rows between GPUs is bound by the slower of its programs and its links::

    cached dispatch = fixed + stage | pull        full dispatch = cached + count exchange and host wait
    combine         = fixed + push  | reduce
    stage  = T rows copied locally                       (local copy rate)
    reduce = the rows sent back read, T rows written     (local reduce rate)
    pull, push (every peer at once, gpu/normal/one_node/schedule.py):
        max( local / (P * r_local) + remote / (P * r_remote),   the programs: P of them, each at
                                                                its rate per byte kind
             remote bytes in / duplex link,  remote bytes out / duplex link )  each GPU's links, each
                                                                way while they carry both ways
    overlapped (the phases through per-block flags, one launch: ep_dispatch for a cached dispatch,
        ep_combine): max(stage, pull), max(push, reduce), the push on push_programs_per_sm x P
        programs; the full dispatch stays in turn (its stage runs during the host's count wait), its
        pull on pull_programs_per_sm x P programs
    pull, push (rank order, the walk before): each receiver takes source 0, 1, ... in turn, at
        P * r_local from itself, else min(P * r_remote, link / receivers now on that source) — a fluid
        queue (at 2 ranks the two receivers pair up; from 4 on they crowd one GPU's links)

Defaults: the per-program rates fitted to the measured one-GPU kernels (scripts/kernels_alone.py)
and 2-rank calls on 2 × H200 (docs/PERFORMANCE.md). Two link rates: one way (the rank-order queue,
whose sources mostly send: 18 NVLinks' 478 GB/s reproduced its 4-rank figures), and each way while
every GPU sends and receives as much (every peer at once): fitted to the first multi-GPU run of the
every-peer kernels (4 × H200, 2026-11-28), where the one-launch cached dispatch and combine moved
288–305 GB/s of remote rows into each GPU at 2 and 4 ranks alike.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Dict

import torch

from ..layout import tokens_to_ranks
from ..testing.routing import uniform_topk

# Measured on 4 x H200 at commit 7562a92 (docs/PERFORMANCE.md), gpu / synced µs on rank 0, T=4096,
# H=7168, top-8 of 256, Config(24, 8, 256); DeepEP V1 in the same run and (8 ranks) on 8 x H200.
MEASURED = {
    2: {"full dispatch": ("374 / 534", "416"), "cached dispatch": ("295 / 328", "376"), "combine": ("323 / 363", "398")},
    4: {"full dispatch": ("1119 / 1031", "863"), "cached dispatch": ("1017 / 846", "821"),
        "combine": ("945 / 970", "616")},
    8: {"full dispatch": ("-", "-"), "cached dispatch": ("-", "925"), "combine": ("-", "960")},
}
# The every-peer kernels in one launch (push on 2 x num_sms), the full dispatch's pull in turn on
# 3 x num_sms programs with the side rows loaded first and the lists pushed to their receivers
# (the defaults since 67cd161), gpu / synced µs on rank 0, DeepEP V1's gpu µs in the same run:
# 2 x H200 and 4 x H200, 2026-11-28i (notes/runs/2026-11-28i_x4_h200_call3_* at 2 ranks and _call1_* at 4,
# both on one x4 machine; 2026-11-28f's gpu figures were within 2 % of these).
MEASURED_NOW = {
    2: {"full dispatch": ("242 / 328", "420"), "cached dispatch": ("198 / 319", "376"),
        "combine": ("195 / 242", "399")},
    4: {"full dispatch": ("627 / 734", "857"), "cached dispatch": ("524 / 607", "819"),
        "combine": ("533 / 581", "614")},
}


@dataclass
class Rates:
    """GB/s: link (one GPU, one direction); per program: local rows, remote loads (pull), remote
    stores (push); local copy (stage) and reduce rates of the whole GPU; µs: fixed per call, and
    the full dispatch's count exchange and host wait."""

    link: float
    program_local: float
    program_remote_load: float
    program_remote_store: float
    local_copy: float
    local_reduce: float
    fixed_us: float
    notify_us: float
    # (These two default to the model before 2026-11-28, which the rank-order fit was made with; the
    # command's defaults are the kernels' now: 2, and the 300 GB/s fitted across 4 H200s.)
    push_programs_per_sm: float = 1.0  # the one-launch combine's push programs per P (choices.PUSH_PROGRAMS_PER_SM)
    duplex_link: float = 0.0  # GB/s each way while the links carry both ways (every peer); 0: ``link``
    pull_programs_per_sm: float = 1.0  # the full dispatch's pull in turn, programs per P (choices.PULL_PROGRAMS_PER_SM)
    # the full dispatch's notify and host wait beside its stage, in the "overlapped" column (fitted on
    # 4 x H200, 2026-11-28b: 269 / 658 µs measured at 2 / 4 ranks, the model 293 / 631)
    count_wait_us: float = 30.0
    # GB/s of the full dispatch's stage in turn, on choices.STAGE_PROGRAMS_PER_SM x num_sms copy
    # programs (read + written); 0: ``local_copy``, the stage of the one-launch cached dispatch
    stage_in_turn: float = 0.0


def rows_between(num_ranks: int, tokens: int, experts: int, topk: int, seed: int = 0) -> torch.Tensor:
    """``rows[s, d]``: rows source s sends rank d in a dispatch (DeepEP's routing, one draw per rank)."""
    g = torch.Generator().manual_seed(seed)
    return torch.stack([tokens_to_ranks(uniform_topk(tokens, experts, topk, generator=g), experts, num_ranks).sum(0)
                        for _ in range(num_ranks)]).double()


def _every_peer_us(rows: torch.Tensor, row_bytes: int, programs: int, rates: Rates, remote_rate: float) -> float:
    R = rows.shape[0]
    local = rows.diagonal() * row_bytes
    remote_in = (rows.sum(0) - rows.diagonal()) * row_bytes
    remote_out = (rows.sum(1) - rows.diagonal()) * row_bytes
    per_rank = torch.maximum(local / (programs * rates.program_local) + remote_in / (programs * remote_rate),
                             torch.maximum(remote_in, remote_out) / (rates.duplex_link or rates.link)) if R > 1 else \
        local / (programs * rates.program_local)
    return float(per_rank.max()) / 1e3  # bytes / (GB/s) = ns


def _rank_order_us(rows: torch.Tensor, row_bytes: int, programs: int, rates: Rates, remote_rate: float) -> float:
    """The rank-order walk as a fluid queue: every receiver takes its sources 0, 1, ... in turn; the
    remote receivers on one source share that GPU's links (each at most its programs' rate), so
    receivers that reach a source together slow each other down and drift apart."""
    R = rows.shape[0]
    remaining = [float(rows[0, d]) * row_bytes for d in range(R)]
    source = [0] * R
    t = 0.0
    while True:
        for d in range(R):  # past the sources it has no rows from
            while source[d] < R and remaining[d] <= 1e-3:  # (bytes: float rounding)
                source[d] += 1
                remaining[d] = float(rows[source[d], d]) * row_bytes if source[d] < R else 0.0
        active = [d for d in range(R) if source[d] < R]
        if not active:
            return t / 1e3
        readers = [sum(1 for d in active if source[d] == s and d != s) for s in range(R)]
        rate = {d: programs * rates.program_local if source[d] == d else
                min(programs * remote_rate, rates.link / readers[source[d]]) for d in active}
        step = min(remaining[d] / rate[d] for d in active)
        t += step
        for d in active:
            remaining[d] -= rate[d] * step


def estimate(num_ranks: int, tokens: int, hidden: int, topk: int, experts: int, programs: int,
             rates: Rates) -> Dict[str, Dict[str, float]]:
    """µs per call of the busiest rank, ``{schedule: {call: µs}}`` for "every peer", "rank order" and
    "overlapped" (every peer, with stage and pull, push and reduce overlapped: the one-launch cached
    dispatch and combine; the full dispatch stays in turn, as in "every peer")."""
    rows = rows_between(num_ranks, tokens, experts, topk)
    x_bytes = 2 * hidden  # BF16 rows
    stage_bytes = tokens * (x_bytes + 12 * topk) * 2  # read + write
    stage_us = stage_bytes / rates.local_copy / 1e3
    stage_in_turn_us = stage_bytes / (rates.stage_in_turn or rates.local_copy) / 1e3
    reduce_us = float((rows.sum(1).max() + tokens) * x_bytes) / rates.local_reduce / 1e3
    out = {}
    for schedule, kernel in (("every peer", _every_peer_us), ("rank order", _rank_order_us)):
        pull = kernel(rows, x_bytes, programs, rates, rates.program_remote_load)
        push = kernel(rows, x_bytes, programs, rates, rates.program_remote_store)
        cached = rates.fixed_us + stage_us + pull
        out[schedule] = {"cached dispatch": cached, "full dispatch": cached + rates.notify_us,
                         "combine": rates.fixed_us + push + reduce_us}
        if schedule == "every peer":  # the phases overlapped through per-block flags (one launch)
            wide_push = kernel(rows, x_bytes, round(programs * rates.push_programs_per_sm), rates,
                               rates.program_remote_store)
            wide_pull = kernel(rows, x_bytes, round(programs * rates.pull_programs_per_sm), rates,
                               rates.program_remote_load)
            out["overlapped"] = {"cached dispatch": rates.fixed_us + max(stage_us, pull),
                                 # (in turn: the stage runs in the host's count wait, then the pull)
                                 "full dispatch": rates.fixed_us + stage_in_turn_us + wide_pull + rates.count_wait_us,
                                 "combine": rates.fixed_us + max(wide_push, reduce_us)}
    remote_mb = float((rows.sum(0) - rows.diagonal()).max()) * x_bytes / 1e6
    out["bytes"] = {"remote MB in": remote_mb, "link floor us": remote_mb * 1e3 / (rates.duplex_link or rates.link)}
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from .args import add_routing_arguments, non_negative_float, positive_float, positive_int, token_list
    parser.add_argument("--ranks", type=token_list, default="2,4,8", help="ranks of the node to model")
    add_routing_arguments(parser)
    parser.add_argument("--sms", type=positive_int, default=24, help="programs of the pull and push (Config.num_sms)")
    parser.add_argument("--link-gbps", type=positive_float, default=478.0,
                        help="GB/s of one GPU's NVLinks, one way (H200: 18 links of 26.6): the rank-order queue")
    parser.add_argument("--duplex-link-gbps", type=positive_float, default=300.0,
                        help="GB/s of remote rows one GPU's NVLinks carry each way while they carry as much the "
                             "other way (every peer at once; fitted on 4 x H200, 2026-11-28: 288-305 at 2 and 4 ranks)")
    parser.add_argument("--program-local-gbps", type=positive_float, default=36.0,
                        help="GB/s of rows one program copies locally (the pull alone on one GPU: 4096 rows of "
                             "14 KB in 67 µs at 24 programs on H100, scripts/kernels_alone.py)")
    parser.add_argument("--program-load-gbps", type=positive_float, default=15.0,
                        help="GB/s of rows one program loads from a peer (fitted: cached dispatch at 2 ranks, "
                             "295 µs on 2 x H200, half its rows remote)")
    parser.add_argument("--program-store-gbps", type=positive_float, default=12.0,
                        help="GB/s of rows one program stores to a peer (fitted: combine at 2 ranks, 323 µs)")
    parser.add_argument("--copy-gbps", type=positive_float, default=2060.0,
                        help="GB/s of the stage's local copy, bytes read + written (4096 rows in 57 µs on H200)")
    parser.add_argument("--stage-in-turn-gbps", type=positive_float, default=2940.0,
                        help="GB/s of the full dispatch's stage in turn on 2 x --sms copy programs, bytes read + "
                             "written (choices.STAGE_PROGRAMS_PER_SM: 4096 rows in 40.2 µs on H200, 2026-11-28c)")
    parser.add_argument("--reduce-gbps", type=positive_float, default=2800.0,
                        help="GB/s of the reduce, rows read + written (one GPU: 42 µs on H200)")
    parser.add_argument("--push-programs-per-sm", type=positive_float, default=2.0,
                        help="the one-launch combine's push programs per --sms (choices.PUSH_PROGRAMS_PER_SM)")
    parser.add_argument("--pull-programs-per-sm", type=positive_float, default=3.0,
                        help="the full dispatch's pull in turn, programs per --sms (choices.PULL_PROGRAMS_PER_SM)")
    parser.add_argument("--count-wait-us", type=non_negative_float, default=30.0,
                        help="the full dispatch's notify and host wait beside its stage (the overlapped column; "
                             "fitted on 4 x H200, 2026-11-28b)")
    parser.add_argument("--fixed-us", type=non_negative_float, default=10.0, help="launch gaps per call")
    parser.add_argument("--notify-us", type=non_negative_float, default=80.0,
                        help="a full dispatch's count exchange and host wait over a cached one (measured 79 at 2 "
                             "ranks)")


def run(args) -> int:
    rates = Rates(args.link_gbps, args.program_local_gbps, args.program_load_gbps, args.program_store_gbps,
                  args.copy_gbps, args.reduce_gbps, args.fixed_us, args.notify_us, args.push_programs_per_sm,
                  args.duplex_link_gbps, args.pull_programs_per_sm, args.count_wait_us, args.stage_in_turn_gbps)
    print(f"model: one node, T={args.tokens} H={args.hidden} K={args.topk} E={args.experts}, {args.sms} programs, "
          f"link {args.link_gbps:g} GB/s one way, {args.duplex_link_gbps:g} each way both ways, per program {args.program_local_gbps:g} local / {args.program_load_gbps:g} "
          f"remote loads / {args.program_store_gbps:g} remote stores GB/s; busiest rank, BF16")
    print("| ranks | call | remote MB in | link floor µs | every peer µs | + phases overlapped µs | rank order µs | "
          "measured gpu / synced (7562a92, rank order) | DeepEP V1 | measured gpu / synced (2026-11-28i, every peer, "
          "one launch) | DeepEP V1, same run |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for R in args.ranks:
        if R < 1 or args.experts % R:
            print(f"skipped {R} ranks: {args.experts} experts do not split over them")
            continue
        est = estimate(R, args.tokens, args.hidden, args.topk, args.experts, args.sms, rates)
        for call in ("full dispatch", "cached dispatch", "combine"):
            shape = args.tokens == 4096 and args.hidden == 7168 and args.sms == 24
            measured, peer = MEASURED.get(R, {}).get(call, ("-", "-")) if shape else ("-", "-")
            now, peer_now = MEASURED_NOW.get(R, {}).get(call, ("-", "-")) if shape else ("-", "-")
            print(f"| {R} | {call} | {est['bytes']['remote MB in']:.0f} | {est['bytes']['link floor us']:.0f} | "
                  f"{est['every peer'][call]:.0f} | {est['overlapped'][call]:.0f} | {est['rank order'][call]:.0f} | "
                  f"{measured} | {peer} | {now} | {peer_now} |")
    return 0
