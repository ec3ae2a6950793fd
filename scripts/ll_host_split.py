"""Where the host time of an eager low-latency chain goes, call by call: its parts (the front end, the
kernel launch, an output's allocation, the backend's other Python), and which calls run slow, per rank.

``scripts/ll_back_to_back.py`` shows the eager round trip following the slowest rank's host
(2026-11-28i: epcomm's hosts 57-113 us per round trip, DeepEP's 45-69).
This script first times whole calls, unstamped: ``--batches`` batches of ``--round-trips`` round
trips back to back (after a barrier, as the bench does), every library twice in turn (epcomm and,
with ``--peer deep_ep``, DeepEP: neither always first), with the GPU time per round trip. Then
epcomm's calls again with every call stamped by part (perf_counter_ns, rows marked ``*``): the
Buffer's front end (the call less the backend's ``LowLatencyMode`` method), and inside the backend
its kernel launches (``BoundKernel.launch`` and ``launch_resident``), its ``new_empty`` /
``new_empty_strided`` allocations and the rest of its Python. The stamps cost each stamped call
about a microsecond per stamped function, so compare libraries on the unstamped rows. Per rank and
call it prints the median, 90th percentile and largest of each part, and for the slow calls (over
1.5 x the median) the mean excess of each, so a blocked launch, a slow allocation and a slow
interpreter tell apart.

Run on a machine with 2+ GPUs (``--ranks 1``: one rank alone, its chain without peers' waits):
``python3 scripts/ll_host_split.py [--ranks 2] [--tokens 128]
[--round-trips 40] [--batches 5] [--peer deep_ep]``. On one GPU, ``--shared-gpu`` puts every rank
on it, epcomm on the nvlink backend (under CUDA MPS: ``SCRIPT="python3 scripts/ll_host_split.py
--shared-gpu" scripts/shared_gpu.sh script``). The host columns stand, since each rank's host is
its own process on its own core; the GPU column is the ranks' shared SMs, not speed. DeepEP's
low-latency kernels need a NIC's queue pairs, so ``--peer`` is refused there. (Pinning each
rank's main thread to one core made it worse: threads made later inherit the core, and calls then
stall for a 4 ms time slice.)
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
    per round trip of a batch (µs, between two events). ``stamps`` None: the whole calls alone,
    their times kept as raw clock readings until the batch ends (nothing else in the timed window:
    what the bench's eager row reads); else every part, whose bookkeeping runs between the calls."""
    found = {name: [] for name in calls}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    gpu = float("inf")
    clock = time.perf_counter_ns
    for _ in range(batches):
        torch.cuda.synchronize()
        dist.barrier()
        torch.cuda.synchronize()
        readings = []  # (name, ns, spent or None)
        start.record()
        for _ in range(round_trips):
            carried = None
            for name, fn in calls.items():
                if stamps is not None:
                    stamps.spent = {"mode": 0, "launch": 0, "alloc": 0}
                started = clock()
                carried = fn(carried)
                readings.append((name, clock() - started, None if stamps is None else stamps.spent))
        end.record()
        torch.cuda.synchronize()
        gpu = min(gpu, start.elapsed_time(end) * 1e3 / round_trips)
        for name, whole, spent in readings:
            spent = spent or {"mode": 0, "launch": 0, "alloc": 0}
            # (mode 0: no patched backend (DeepEP, or the unstamped pass): the whole call is its front)
            mode = spent["mode"] or spent["launch"] + spent["alloc"]
            found[name].append({"call": whole / 1e3, "front": (whole - mode) / 1e3, "launch": spent["launch"] / 1e3,
                                "alloc": spent["alloc"] / 1e3, "rest": (mode - spent["launch"] - spent["alloc"]) / 1e3})
    return found, gpu


def _summary(records):
    """{part: (median, p90, max)} and, for the calls over 1.5 x the median, their count and each
    part's mean excess over its own median."""
    columns = {part: sorted(r[part] for r in records) for part in PARTS}
    stats = {part: (statistics.median(v), v[int(0.9 * (len(v) - 1))], v[-1]) for part, v in columns.items()}
    slow = [r for r in records if r["call"] > 1.5 * stats["call"][0]]
    excess = {part: (statistics.fmean(r[part] for r in slow) - stats[part][0]) if slow else 0.0 for part in PARTS}
    return stats, len(slow), excess


def _measure(calls_of, stamps, patched, round_trips: int, batches: int):
    """``{library: {"unstamped": {call: summary}, "gpu": µs, and for epcomm "stamped": {call:
    summary}}}`` of ``calls_of`` ({library: {call: fn}}, warmed up): whole calls unstamped, the
    libraries in turn twice (A B A B: neither always first), then epcomm's parts stamped (each stamp
    costs its call about a microsecond, which DeepEP's calls, whose launches and allocations are
    its C++'s, would not carry). ``patched``: {(owner, name): part}, wrapped for the stamped pass
    only and restored after it, also on an error."""
    whole = {name: ({call: [] for call in calls}, []) for name, calls in calls_of.items()}
    for _ in range(2):
        for name, calls in calls_of.items():
            found, gpu = _split(calls, None, round_trips, batches)
            for call, records in found.items():
                whole[name][0][call] += records
            whole[name][1].append(gpu)
    rows = {name: {"unstamped": {call: _summary(records) for call, records in found.items()}, "gpu": min(gpus)}
            for name, (found, gpus) in whole.items()}
    originals = {key: getattr(*key) for key in patched}
    try:
        for key, part in patched.items():
            setattr(*key, stamps.wrap(part, originals[key]))
        found, _ = _split(calls_of["epcomm"], stamps, round_trips, batches)
        rows["epcomm"]["stamped"] = {call: _summary(records) for call, records in found.items()}
    finally:
        for key in patched:
            setattr(*key, originals[key])
    return rows


def rank_main(tokens: int, round_trips: int, batches: int, peer_name: str, backend=None):
    """Every rank's rows (rank order). ``backend``: epcomm's Buffer's (None: its automatic choice)."""
    import epcomm
    from epcomm.backends.gpu.launch import BoundKernel
    from epcomm.fp8 import per_token_cast_back
    from epcomm.tools.measure import load_peer, peer_buffer, random_batch, release_peer_buffers
    R = dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device())
    H, K, E = 7168, 8, 256
    x, topk, weights = random_batch(tokens, H, K, E, 11 + dist.get_rank(), dev)
    libraries = {"epcomm": epcomm.Buffer(dist.group.WORLD, low_latency_mode=True, backend=backend,
                                         num_rdma_bytes=epcomm.Buffer.get_low_latency_rdma_size_hint(tokens, H, R, E))}
    peer = load_peer(peer_name)  # (None, with the reason printed, where it is not importable)
    if peer is not None:
        libraries[peer_name] = peer_buffer(peer, dist.group.WORLD, low_latency_mode=True, num_qps_per_rank=E // R,
                                           num_rdma_bytes=peer.Buffer.get_low_latency_rdma_size_hint(tokens, H, R, E))
    stamps = _Stamps()
    from epcomm.backends.gpu.low_latency.mode import LowLatencyMode
    patched = {(LowLatencyMode, "dispatch"): "mode", (LowLatencyMode, "combine"): "mode",
               (BoundKernel, "launch"): "launch", (BoundKernel, "launch_resident"): "launch",
               (torch.Tensor, "new_empty"): "alloc", (torch.Tensor, "new_empty_strided"): "alloc"}
    calls_of = {}
    for name, buffer in libraries.items():
        recv, _, _, _, _ = buffer.low_latency_dispatch(x, topk, tokens, E, use_fp8=True)
        expert_out = per_token_cast_back(recv[0], recv[1])
        calls_of[name] = {
            "dispatch": lambda _, b=buffer: b.low_latency_dispatch(x, topk, tokens, E, use_fp8=True)[2],
            "combine": lambda handle, b=buffer, out=expert_out: b.low_latency_combine(out, topk, weights, handle),
        }
        _split(calls_of[name], None, 5, 1)  # (warm: every kind compiled and bound)
    rows = _measure(calls_of, stamps, patched, round_trips, batches)
    rows["epcomm"]["backend"] = libraries["epcomm"].backend_name
    if peer is not None:
        release_peer_buffers(libraries[peer_name])
    gathered = [None] * R
    dist.all_gather_object(gathered, rows)
    return gathered


def _report(per_rank, tokens: int, round_trips: int, batches: int) -> None:
    """Print every rank's rows (rank_main's results, rank order)."""
    print(f"# {len(per_rank)} ranks, epcomm on {per_rank[0]['epcomm']['backend']}, T={tokens}, "
          f"{batches} batches of {round_trips} round trips back to back; "
          "host µs per call: median / p90 / max; slow: calls over 1.5 x the median, each part's mean excess; "
          "a call without * timed whole (every library twice, in turn), with * epcomm's parts stamped after")
    print(f"{'library':8s} {'rank':>4s} {'call':11s} " + " ".join(f"{p:>17s}" for p in PARTS) + "   slow  excess "
          + " ".join(f"{p:>6s}" for p in PARTS))
    for rank, rows in enumerate(per_rank):
        for library, kinds in rows.items():
            for kind in ("unstamped", "stamped"):
                for call, (stats, num_slow, excess) in kinds.get(kind, {}).items():
                    cells = " ".join(f"{m:5.1f} /{p:5.1f} /{x:5.0f}" for m, p, x in (stats[part] for part in PARTS))
                    print(f"{library:8s} {rank:4d} {call + (' *' if kind == 'stamped' else ''):11s} {cells} "
                          f"{num_slow:6d}        " + " ".join(f"{excess[part]:6.1f}" for part in PARTS))
            print(f"{library:8s} {rank:4d} gpu per round trip, unstamped (least of the batches): {kinds['gpu']:.1f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=0,
                        help="ranks, one per GPU (default: every GPU; with --shared-gpu, 2)")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--round-trips", type=int, default=40)
    parser.add_argument("--batches", type=int, default=5)
    parser.add_argument("--peer", default="", help="deep_ep: its whole calls stamped too")
    parser.add_argument("--shared-gpu", action="store_true",
                        help="every rank on GPU 0 (CUDA MPS running: scripts/shared_gpu.sh script)")
    args = parser.parse_args()
    world = args.ranks or (2 if args.shared_gpu else torch.cuda.device_count())
    gpus_needed = 1 if args.shared_gpu else world
    if args.shared_gpu and args.peer:
        from epcomm.tools.measure import NO_PEER_LOW_LATENCY_ON_SHARED_GPU
        print(NO_PEER_LOW_LATENCY_ON_SHARED_GPU, file=sys.stderr)
        return 2
    if world < 1 or torch.cuda.device_count() < gpus_needed or args.round_trips < 2 or args.batches < 1:
        print(f"ll_host_split.py needs {max(gpus_needed, 1)} CUDA GPUs, --round-trips >= 2 and --batches >= 1",
              file=sys.stderr)
        return 2
    from epcomm.testing import run_distributed
    from epcomm.testing.launcher import SHARED_GPU
    per_rank = run_distributed(rank_main, world, args.tokens, args.round_trips, args.batches, args.peer,
                               "nvlink" if args.shared_gpu else None,
                               backend=SHARED_GPU if args.shared_gpu else "nccl", timeout_s=300)[0]
    _report(per_rank, args.tokens, args.round_trips, args.batches)
    return 0


if __name__ == "__main__":
    sys.exit(main())
