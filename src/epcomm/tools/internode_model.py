"""``epcomm model``: multi-node time from byte counts and per-leg rates (normal and low-latency mode).

The byte counts are exact for the routing given: DeepEP's test routing (``uniform_topk``) put
through the two-level plan of :mod:`epcomm.backends.gpu.normal.two_level.hierarchy` for every rank. The rates are inputs — what a
NIC and NVLink deliver per GPU — so the model answers "what would this plan take on that machine":

    dispatch ≈ latency + max(network bytes out / nic, network bytes in / nic, NVLink bytes in / nvlink)

because the legs are pipelined (channels stream rows through hop 1 while hop 2 drains them), so
the slowest leg sets the time. Combine moves the same rows back (BF16 rows, one partial per
token and node over the network). Figures are per rank, the busiest rank of the routing.

Low-latency mode sends one message per (token, expert) straight to the expert's rank (no
forwarding, no dedup): the network carries the messages for ranks of other nodes, NVLink those
for the node's other ranks; the combine sends one BF16 row per message back.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import List

import torch

from ..backends.gpu.normal.two_level import hierarchy as hy
from ..layout import tokens_to_ranks
from ..testing.routing import uniform_topk

SCALE_GROUP = 128  # FP8 channels per float32 scale


@dataclass
class Legs:
    """Rows one rank moves per leg in one dispatch (combine moves the same rows back).

    Fields: network_out (hop-1 rows it puts to other nodes), network_in (rows it receives as a
    forwarder from other nodes), nvlink_in (hop-2 rows it reads from its node peers), local (hop-2
    rows it takes from its own forwarder area), min_network_out (one per (token, other node)),
    one_level_network_out (a one-level dispatch: one per (token, rank on another node)).
    """

    network_out: int
    network_in: int
    nvlink_in: int
    local: int
    min_network_out: int
    one_level_network_out: int


def rank_legs(topks: List[torch.Tensor], num_experts: int, ranks_per_node: int) -> List[Legs]:
    """The legs of every rank for one routing (``topks[s]``: rank s's ``[T, K]`` expert ids)."""
    R = len(topks)
    topology = hy.Topology(R, ranks_per_node)
    in_rank = [tokens_to_ranks(t, num_experts, R) for t in topks]
    per_node = torch.stack([hy.node_membership(m, topology).sum(0) for m in in_rank])  # [source, node]
    per_rank = torch.stack([m.sum(0) for m in in_rank])  # [source, destination]
    legs = []
    for r in range(R):
        node, local = topology.node_of(r), topology.local_of(r)
        others = [d for d in range(R) if topology.node_of(d) != node]
        rail_in = sum(int(per_node[s, node]) for s in topology.rail(r) if topology.node_of(s) != node)
        same_local = torch.tensor([topology.local_of(s) == local for s in range(R)])
        legs.append(Legs(network_out=hy.network_rows(per_node[r], r, topology), network_in=rail_in,
                         nvlink_in=int(per_rank[~same_local, r].sum()), local=int(per_rank[same_local, r].sum()),
                         min_network_out=hy.min_network_rows(in_rank[r], r, topology),
                         one_level_network_out=int(in_rank[r][:, others].sum())))
    return legs


def row_bytes(hidden: int, topk: int, fp8: bool) -> int:
    """Bytes of one dispatched row: values, FP8 scales, top-k ids (int64) and weights (float32),
    source index and in-node mask (int32 each)."""
    values = hidden + hidden // SCALE_GROUP * 4 if fp8 else 2 * hidden
    return values + topk * 12 + 8


@dataclass
class Estimate:
    nodes: int
    ranks_per_node: int
    call: str
    network_mb_out: float
    nvlink_mb_in: float
    min_network_mb: float
    one_level_network_mb: float
    us: float
    bound: str


def estimate(nodes: int, ranks_per_node: int, tokens: int, hidden: int, topk: int, experts: int, nic_gbps: float,
             nvlink_gbps: float, latency_us: float, seed: int = 0) -> List[Estimate]:
    g = torch.Generator().manual_seed(seed)
    R = nodes * ranks_per_node
    legs = rank_legs([uniform_topk(tokens, experts, topk, generator=g) for _ in range(R)], experts, ranks_per_node)
    out = []
    for call, per_row in (("dispatch FP8", row_bytes(hidden, topk, True)), ("dispatch BF16", row_bytes(hidden, topk, False)),
                          ("combine BF16", 2 * hidden)):
        worst = None
        for leg in legs:
            times = {"network out": leg.network_out * per_row / nic_gbps / 1e3,
                     "network in": leg.network_in * per_row / nic_gbps / 1e3,
                     "NVLink in": leg.nvlink_in * per_row / nvlink_gbps / 1e3}
            bound = max(times, key=times.get)
            e = Estimate(nodes, ranks_per_node, call, leg.network_out * per_row / 1e6, leg.nvlink_in * per_row / 1e6,
                         leg.min_network_out * per_row / 1e6, leg.one_level_network_out * per_row / 1e6,
                         latency_us + times[bound], bound)
            if worst is None or e.us > worst.us:
                worst = e
        out.append(worst)
    return out


def low_latency_message_bytes(hidden: int, fp8: bool) -> int:
    """Bytes of one low-latency message: a 16-byte header, the values, FP8 scales (16-byte rounded)."""
    values = hidden + hidden // SCALE_GROUP * 4 if fp8 else 2 * hidden
    return (16 + values + 15) // 16 * 16


def estimate_low_latency(nodes: int, ranks_per_node: int, tokens: int, hidden: int, topk: int, experts: int,
                         nic_gbps: float, nvlink_gbps: float, latency_us: float, seed: int = 0) -> List[Estimate]:
    """Low-latency dispatch (FP8) and combine (BF16) of the busiest rank: messages out to / in from
    other nodes over the NIC, in from the node's other ranks over NVLink. ``min`` is one message
    per (token, other node) — what forwarding would send; ``one-level`` the messages themselves."""
    g = torch.Generator().manual_seed(seed)
    R = nodes * ranks_per_node
    topology = hy.Topology(R, ranks_per_node)
    topks = [uniform_topk(tokens, experts, topk, generator=g) for _ in range(R)]
    dest = [t // (experts // R) for t in topks]  # [T, K] destination rank of each message
    node_of = torch.arange(R) // ranks_per_node
    # messages[s, d]: from source s to rank d
    messages = torch.stack([torch.bincount(d.flatten(), minlength=R) for d in dest])
    out = []
    for call, per_msg in (("LL dispatch FP8", low_latency_message_bytes(hidden, True)),
                          ("LL combine BF16", 2 * hidden)):
        worst = None
        for r in range(R):
            far = node_of != node_of[r]
            near_peers = (~far) & (torch.arange(R) != r)
            sent_far = int(messages[r, far].sum())
            recv_far = int(messages[far, r].sum())
            recv_near = int(messages[near_peers, r].sum())
            min_far = int(sum((node_of[dest[r]] == n).any(1).sum() for n in range(nodes) if n != topology.node_of(r)))
            times = {"network out": sent_far * per_msg / nic_gbps / 1e3, "network in": recv_far * per_msg / nic_gbps / 1e3,
                     "NVLink in": recv_near * per_msg / nvlink_gbps / 1e3}
            bound = max(times, key=times.get)
            e = Estimate(nodes, ranks_per_node, call, sent_far * per_msg / 1e6, recv_near * per_msg / 1e6,
                         min_far * per_msg / 1e6, sent_far * per_msg / 1e6, latency_us + times[bound], bound)
            if worst is None or e.us > worst.us:
                worst = e
        out.append(worst)
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from .args import (add_routing_arguments, non_negative_float, non_negative_int, positive_float, positive_int,
                       token_list)
    parser.add_argument("--nodes", type=token_list, default="2,4", help="node counts to model, comma-separated")
    parser.add_argument("--ranks-per-node", type=positive_int, default=8, help="GPUs per node")
    add_routing_arguments(parser)
    parser.add_argument("--nic-gbps", type=positive_float, default=45.0,
                        help="GB/s one GPU's NIC delivers each way (400 Gb/s line = 50; DeepEP V1 reports 43-58)")
    parser.add_argument("--nvlink-gbps", type=positive_float, default=336.0,
                        help="GB/s one GPU receives over NVLink (DeepEP V1's cached dispatch on 8xH200: 336)")
    parser.add_argument("--latency-us", type=non_negative_float, default=25.0,
                        help="fixed cost per call (count exchange, launches)")
    parser.add_argument("--ll-tokens", type=non_negative_int, default=128,
                        help="tokens per rank of the low-latency rows (decode batch; 0: no low-latency rows)")
    parser.add_argument("--ll-latency-us", type=non_negative_float, default=15.0,
                        help="fixed cost per low-latency call (launches, one signal round)")


def run(args) -> int:
    import sys
    usable = [n for n in args.nodes if n >= 2 and args.experts % (n * args.ranks_per_node) == 0]
    if not usable:
        print(f"epcomm model: error: no node count in --nodes {','.join(map(str, args.nodes))} (2 or more nodes of "
              f"--ranks-per-node {args.ranks_per_node}) splits --experts {args.experts} evenly over its ranks",
              file=sys.stderr)
        return 2
    print(f"model: T={args.tokens} (low-latency {args.ll_tokens}) H={args.hidden} K={args.topk} E={args.experts}, "
          f"NIC {args.nic_gbps:g} GB/s, NVLink {args.nvlink_gbps:g} GB/s, +{args.latency_us:g} µs per call "
          f"(low-latency +{args.ll_latency_us:g}); busiest rank")
    print("| nodes x GPUs | call | network MB out (min; one-level) | NVLink MB in | µs | bound by |")
    print("|---|---|---|---|---|---|")
    for nodes in args.nodes:
        if nodes < 2:
            continue
        if args.experts % (nodes * args.ranks_per_node):
            print(f"skipped {nodes} nodes: {args.experts} experts do not split over {nodes * args.ranks_per_node} ranks")
            continue
        rows = estimate(nodes, args.ranks_per_node, args.tokens, args.hidden, args.topk, args.experts,
                        args.nic_gbps, args.nvlink_gbps, args.latency_us)
        if args.ll_tokens > 0:
            rows += estimate_low_latency(nodes, args.ranks_per_node, args.ll_tokens, args.hidden, args.topk,
                                         args.experts, args.nic_gbps, args.nvlink_gbps, args.ll_latency_us)
        for e in rows:
            print(f"| {e.nodes} x {e.ranks_per_node} | {e.call} | {e.network_mb_out:.1f} ({e.min_network_mb:.1f}; "
                  f"{e.one_level_network_mb:.1f}) | {e.nvlink_mb_in:.1f} | {e.us:.0f} | {e.bound} |")
    return 0
