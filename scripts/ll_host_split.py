"""Where the host time of an eager low-latency chain goes, call by call: its parts (the front end, the
kernel launch, an output's allocation, the backend's other Python), and which calls run slow, per rank.

``scripts/ll_back_to_back.py`` shows the eager round trip following the slowest rank's host
(2026-11-28i: epcomm's hosts 57-113 us per round trip, DeepEP's 45-69).
This script issues ``--batches`` batches of ``--round-trips`` round trips back to back (after a
barrier, as the bench does) and stamps every call with perf_counter_ns: the whole call, the time in
the Buffer's front end (the call less the backend's ``LowLatencyMode`` method), and inside the
backend its kernel launches (``BoundKernel.launch`` and ``launch_resident``), its ``new_empty`` /
``new_empty_strided`` allocations and the rest of its Python. Per rank and call it prints the median,
90th percentile and largest of each, and for the slow calls (over 1.5 x the median) the mean excess
of each part, so a blocked launch, a slow allocation and a slow interpreter tell apart. With
``--peer deep_ep`` (DeepEP's wheel importable) its whole calls are stamped the same way, after
epcomm's, for their spread.

Run on a machine with 2+ GPUs (``--ranks 1``: one rank alone, its chain without peers' waits):
``python3 scripts/ll_host_split.py [--ranks 2] [--tokens 128]
[--round-trips 40] [--batches 5] [--peer deep_ep]``. (Pinning each rank's main thread to one core
made it worse: threads made later inherit the core, and calls then stall for a 4 ms time slice.)
"""
import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

PARTS = ("call", "front", "launch", "alloc", "rest")


class _Stamps:
    """Inclusive time spent in the patched functions during the current call, by part: "mode" (the
    backend's LowLatencyMode.dispatch / combine), "launch" and "alloc" (inside it)."""

    def __init__(self):
        self.spent = {"mode": 0, "launch": 0, "alloc": 0}
        self._inside = set()  # parts being timed now (a part inside itself counts once: the outer)

    def wrap(self, part, fn):
        def timed(*args, **kwargs):
            if part in self._inside:
                return fn(*args, **kwargs)
            self._inside.add(part)
            started = time.perf_counter_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spent[part] += time.perf_counter_ns() - started
                self._inside.discard(part)
        return timed


def _split(calls, stamps, round_trips: int, batches: int):
    """Per call name: a list of {part: µs} over every call of every batch; and the least GPU time
    per round trip of a batch (µs, between two events: what the bench's eager row reads)."""
    found = {name: [] for name in calls}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    gpu = float("inf")
    for _ in range(batches):
        torch.cuda.synchronize()
        dist.barrier()
        torch.cuda.synchronize()
        start.record()
        for _ in range(round_trips):
            carried = None
            for name, fn in calls.items():
                stamps.spent = {"mode": 0, "launch": 0, "alloc": 0}
                started = time.perf_counter_ns()
                carried = fn(carried)
                whole = time.perf_counter_ns() - started
                mode, launch, alloc = stamps.spent["mode"], stamps.spent["launch"], stamps.spent["alloc"]
                if not mode:  # (a library without the patched backend: its whole call is its front)
                    mode = launch + alloc
                found[name].append({"call": whole / 1e3, "front": (whole - mode) / 1e3, "launch": launch / 1e3,
                                    "alloc": alloc / 1e3, "rest": (mode - launch - alloc) / 1e3})
        end.record()
        torch.cuda.synchronize()
        gpu = min(gpu, start.elapsed_time(end) * 1e3 / round_trips)
    return found, gpu


def _summary(records):
    """{part: (median, p90, max)} and, for the calls over 1.5 x the median, their count and each
    part's mean excess over its own median."""
    columns = {part: sorted(r[part] for r in records) for part in PARTS}
    stats = {part: (statistics.median(v), v[int(0.9 * (len(v) - 1))], v[-1]) for part, v in columns.items()}
    slow = [r for r in records if r["call"] > 1.5 * stats["call"][0]]
    excess = {part: (statistics.fmean(r[part] for r in slow) - stats[part][0]) if slow else 0.0 for part in PARTS}
    return stats, len(slow), excess


def rank_main(tokens: int, round_trips: int, batches: int, peer_name: str):
    import epcomm
    from epcomm.backends.gpu.launch import BoundKernel
    from epcomm.fp8 import per_token_cast_back
    from epcomm.tools.measure import load_peer, random_batch
    R = dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device())
    H, K, E = 7168, 8, 256
    x, topk, weights = random_batch(tokens, H, K, E, 11 + dist.get_rank(), dev)
    libraries = {"epcomm": epcomm.Buffer(dist.group.WORLD, low_latency_mode=True,
                                         num_rdma_bytes=epcomm.Buffer.get_low_latency_rdma_size_hint(tokens, H, R, E))}
    peer = load_peer(peer_name)  # (None, with the reason printed, where it is not importable)
    if peer is not None:
        libraries[peer_name] = peer.Buffer(dist.group.WORLD, low_latency_mode=True, num_qps_per_rank=E // R,
                                           num_rdma_bytes=peer.Buffer.get_low_latency_rdma_size_hint(tokens, H, R, E))
    stamps = _Stamps()
    from epcomm.backends.gpu.low_latency.mode import LowLatencyMode
    patched = {(LowLatencyMode, "dispatch"): "mode", (LowLatencyMode, "combine"): "mode",
               (BoundKernel, "launch"): "launch", (BoundKernel, "launch_resident"): "launch",
               (torch.Tensor, "new_empty"): "alloc", (torch.Tensor, "new_empty_strided"): "alloc"}
    originals = {key: getattr(*key) for key in patched}
    rows = {}
    try:
        for key, part in patched.items():
            setattr(*key, stamps.wrap(part, originals[key]))
        for name, buffer in libraries.items():
            recv, _, _, _, _ = buffer.low_latency_dispatch(x, topk, tokens, E, use_fp8=True)
            expert_out = per_token_cast_back(recv[0], recv[1])
            calls = {
                "dispatch": lambda _, b=buffer: b.low_latency_dispatch(x, topk, tokens, E, use_fp8=True)[2],
                "combine": lambda handle, b=buffer, out=expert_out: b.low_latency_combine(out, topk, weights, handle),
            }
            _split(calls, stamps, 5, 1)  # (warm: every kind compiled and bound)
            found, gpu = _split(calls, stamps, round_trips, batches)
            rows[name] = {call: _summary(records) for call, records in found.items()}
            rows[name]["gpu"] = gpu
    finally:
        for key in patched:
            setattr(*key, originals[key])
    gathered = [None] * R
    dist.all_gather_object(gathered, rows)
    return gathered


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=0, help="ranks, one per GPU (default: every GPU)")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--round-trips", type=int, default=40)
    parser.add_argument("--batches", type=int, default=5)
    parser.add_argument("--peer", default="", help="deep_ep: its whole calls stamped too")
    args = parser.parse_args()
    world = args.ranks or torch.cuda.device_count()
    if world < 1 or torch.cuda.device_count() < world or args.round_trips < 2 or args.batches < 1:
        print(f"ll_host_split.py needs {max(world, 1)} CUDA GPUs, --round-trips >= 2 and --batches >= 1", file=sys.stderr)
        return 2
    from epcomm.testing import run_distributed
    per_rank = run_distributed(rank_main, world, args.tokens, args.round_trips, args.batches, args.peer,
                               backend="nccl", timeout_s=300)[0]
    print(f"# {world} ranks, T={args.tokens}, {args.batches} batches of {args.round_trips} round trips back to back; "
          "host µs per call: median / p90 / max; slow: calls over 1.5 x the median, each part's mean excess")
    print(f"{'library':8s} {'rank':>4s} {'call':9s} " + " ".join(f"{p:>17s}" for p in PARTS) + "   slow  excess "
          + " ".join(f"{p:>6s}" for p in PARTS))
    for rank, rows in enumerate(per_rank):
        for library, calls in rows.items():
            gpu = calls.pop("gpu")
            for call, (stats, num_slow, excess) in calls.items():
                cells = " ".join(f"{m:5.1f} /{p:5.1f} /{x:5.0f}" for m, p, x in (stats[part] for part in PARTS))
                print(f"{library:8s} {rank:4d} {call:9s} {cells} {num_slow:6d}        "
                      + " ".join(f"{excess[part]:6.1f}" for part in PARTS))
            print(f"{library:8s} {rank:4d} gpu per round trip (least of the batches): {gpu:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
