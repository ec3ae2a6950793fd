"""Where the eager low-latency round trip loses time against one CUDA graph, read from the kernels.

The bench's "round trip, eager" row times round trips issued back to back (the host runs ahead of
the GPU), its graph row the same round trip captured once and replayed back to back. Their gap is
neither host time (the host is ahead) nor the kernels' work (the graph runs the same kernels), so
it is in how the kernels meet: a launch's start after the previous kernel's end on the stream, or a
kernel that waits longer for its peers. This script records, on every rank, the kernels of
``--round-trips`` back-to-back round trips each way (torch.profiler, GPU activity) and prints per
library and mode, medians over the steady round trips (the first ``--skip`` dropped):

    period    the time from one round trip's first kernel start to the next one's
    kernels   how many kernels one round trip launches (epcomm: one per call eagerly and a send
              and a receive per call in a graph by default; LIBRARIES names the others)
    busy      the summed durations of one round trip's kernels (their work and waits for peers)
    idle      period - busy: the stream's time between kernels (launch gaps)
    skew      the spread of the round trips' first kernel starts over the ranks (host clock, shared)

Run on a machine with 2+ GPUs: ``python3 scripts/ll_back_to_back.py [--order epcomm,deep_ep,epcomm]
[--tokens 128]`` (DeepEP's wheel importable for ``deep_ep``). ``host`` and ``gpu`` are the
bench's columns for the same calls, unprofiled: every place in ``--order`` is timed before any
place's kernels are recorded (a profile can leave later launches slower on the host).
"""
import argparse
import functools
import gc
import os
import statistics
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))


def _kernels(fn, count: int):
    """[(start ns, duration ns, name)] of the GPU kernels of ``count`` calls of ``fn`` issued back
    to back after a barrier (NCCL's and copies' left out), in start order."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    dist.barrier()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(count):
            fn()
        torch.cuda.synchronize()
    base = prof.profiler.kineto_results.trace_start_ns()
    found = []
    for event in prof.events():
        name = event.name
        if event.device_type.name != "CUDA" or "nccl" in name.lower() or "emcpy" in name or "emset" in name:
            continue
        found.append((base + event.time_range.start * 1000, event.time_range.elapsed_us() * 1000, name))
    return sorted(found)


def _round_trips(kernels, dispatch_key: str):
    """The kernels grouped by round trip: a new one starts at each dispatch kernel that follows a
    kernel of another name (the previous round trip's combine)."""
    trips, previous_was_dispatch = [], False
    for begin, length, name in kernels:
        is_dispatch = dispatch_key in name
        if is_dispatch and not previous_was_dispatch:
            trips.append([])
        if trips:
            trips[-1].append((begin, length))
        previous_was_dispatch = is_dispatch
    return trips


def _steady(trips, skip: int):
    """Medians in µs over the round trips after the first ``skip`` (the last one has no period)."""
    trips = trips[skip:]
    med = lambda values: statistics.median(values) / 1e3 if values else float("nan")  # noqa: E731
    periods = [b[0][0] - a[0][0] for a, b in zip(trips, trips[1:])]
    busy = [sum(length for _, length in trip) for trip in trips[:-1]]
    return {"period": med(periods), "kernels": statistics.median(len(t) for t in trips) if trips else 0,
            "busy": med(busy), "idle": med([p - b for p, b in zip(periods, busy)])}


def _timed(fn, count: int):
    """Unprofiled, µs per call of ``count`` calls issued back to back: host and gpu as the bench's
    columns (measure.back_to_back), and the median and 90th percentile of the single calls' host
    times over its batches (a slow call now and then, a collector's pass or a blocked launch, shows
    as a p90 far above the median)."""
    from epcomm.tools.measure import back_to_back
    singles = []
    host, gpu = back_to_back(fn, count, each=singles)
    singles.sort()
    return {"host": host * 1e6, "gpu": gpu * 1e6, "host p50": statistics.median(singles) * 1e6,
            "host p90": singles[int(0.9 * len(singles))] * 1e6}


def _buffer(name: str, peer, tokens: int, H: int, R: int, E: int):
    """The Buffer an entry of ``--order`` names (see LIBRARIES)."""
    import epcomm
    if name == "deep_ep":
        return peer.Buffer(dist.group.WORLD, low_latency_mode=True, num_qps_per_rank=E // R,
                           num_rdma_bytes=peer.Buffer.get_low_latency_rdma_size_hint(tokens, H, R, E))
    size = epcomm.Buffer.get_low_latency_rdma_size_hint(tokens, H, R, E)
    tuning = epcomm.Tuning(ll_one_launch={"one-launch": True, "two-launch": False}.get(name))
    return epcomm.Buffer(dist.group.WORLD, low_latency_mode=True, num_rdma_bytes=size, tuning=tuning)


# --order's names: epcomm's default (Tuning(ll_one_launch=None): one launch per call eagerly, two
# in a graph), its calls always in one launch or always in two (ll_one_launch=True / False), and
# DeepEP V1
LIBRARIES = ("epcomm", "one-launch", "two-launch", "deep_ep")
# A name with "+nogc" is timed with Python's cyclic collector off (gc.disable): its host and gpu columns.


def rank_main(order, tokens, round_trips, skip):
    from epcomm.fp8 import per_token_cast_back
    from epcomm.tools.bench import _capture, profiled_last
    from epcomm.tools.measure import load_peer, random_batch
    R, rank = dist.get_world_size(), dist.get_rank()
    dev = torch.device("cuda", torch.cuda.current_device())
    H, K, E = 7168, 8, 256
    x, topk, weights = random_batch(tokens, H, K, E, 5 + rank, dev)
    peer = load_peer("deep_ep") if "deep_ep" in order else None
    made = {}  # name: (round trip, its graph): one Buffer per name, so a repeat differs only by its place
    timed = {}  # (position, mode): the unprofiled figures

    def time_one(position, name, mode, nogc):
        """The unprofiled figures of ``name`` at ``position`` in ``mode``; returns the call to profile."""
        if name not in made:
            buffer = _buffer(name, peer, tokens, H, R, E)
            recv, _, _, _, _ = buffer.low_latency_dispatch(x, topk, tokens, E, use_fp8=True)
            expert_out = per_token_cast_back(recv[0], recv[1])

            def round_trip(_buffer=buffer, _out=expert_out):
                _, _, handle, _, _ = _buffer.low_latency_dispatch(x, topk, tokens, E, use_fp8=True)
                return _buffer.low_latency_combine(_out, topk, weights, handle)[0]
            for _ in range(5):
                round_trip()
            made[name] = (round_trip, _capture(round_trip)[0])
        fn = made[name][0] if mode == "eager" else made[name][1].replay
        if nogc:
            gc.disable()
        timed[position, mode] = _timed(fn, round_trips)
        gc.enable()
        torch.cuda.synchronize()
        dist.barrier()
        return fn

    places = {}  # (position, mode): the row's label and its dispatch kernel's name
    columns = {}
    for position, entry in enumerate(order):
        name, _, suffix = entry.partition("+")
        if name == "deep_ep" and peer is None:
            continue
        for mode in ("eager", "graph"):
            places[position, mode] = (f"{position}:{entry}", "dispatch<" if name == "deep_ep" else "ep_ll_dispatch")
            columns[position, mode] = functools.partial(time_one, position, name, mode, suffix == "nogc")
    # every place timed first, then every place's kernels recorded (bench.profiled_last: a profile
    # can leave later launches slower on the host)
    kernels = profiled_last(columns, lambda fn: _kernels(fn, round_trips))
    rows = []
    for (position, mode), recorded in kernels.items():
        label, dispatch_key = places[position, mode]
        trips = _round_trips(recorded, dispatch_key)
        gathered = [None] * R
        dist.all_gather_object(gathered, (dict(_steady(trips, skip), **timed[position, mode]),
                                          [t[0][0] for t in trips]))
        if rank == 0:
            spread = [(max(s[i] for _, s in gathered) - min(s[i] for _, s in gathered)) / 1e3
                      for i in range(skip, min(len(s) for _, s in gathered))]
            rows.append((label, mode, [g[0] for g in gathered], statistics.median(spread) if spread else float("nan")))
    return rows


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--order", default="epcomm,two-launch,deep_ep,epcomm",
                        help=f"comma list of {', '.join(LIBRARIES)}, measured in this order (a name may repeat: "
                             "the same Buffer again, to tell its place in the run from its code; NAME+nogc: with Python's "
                             "cyclic collector off)")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--round-trips", type=int, default=40)
    parser.add_argument("--skip", type=int, default=5)
    args = parser.parse_args()
    order = args.order.split(",")
    unknown = sorted({name.partition("+")[0] for name in order} - set(LIBRARIES)
                     | {name.partition("+")[2] for name in order} - {"", "nogc"})
    if unknown:
        parser.error(f"unknown --order names {unknown} (known: {', '.join(LIBRARIES)})")
    from epcomm.testing import run_distributed
    world = torch.cuda.device_count()
    rows = run_distributed(rank_main, world, order, args.tokens, args.round_trips, args.skip,
                           backend="nccl", timeout_s=600)[0]
    print(f"# {world} ranks, T={args.tokens}, {args.round_trips} round trips back to back; host, gpu: unprofiled, "
          f"the least of 3 batches; the rest profiled, medians (first {args.skip} dropped); µs per rank r0 r1 ...")
    columns = ("host", "host p50", "host p90", "gpu", "period", "busy", "idle")
    width = 6 * world
    print(f"{'library':16s} {'mode':6s} kernels " + " ".join(f"{c:>{width}s}" for c in columns) + f" {'skew':>7s}")
    for name, mode, per_rank, skew in rows:
        cells = [" ".join(f"{r[c]:5.1f}" for r in per_rank) for c in columns]
        print(f"{name:16s} {mode:6s} {per_rank[0]['kernels']:7.0f} " + " ".join(f"{c:>{width}s}" for c in cells)
              + f" {skew:7.1f}")


if __name__ == "__main__":
    main()
