"""Where the time of one synced call goes, epcomm beside a peer library on one timeline.

Each iteration does what a decode loop does: ``dist.barrier()``, ``torch.cuda.synchronize()``,
then the call (or a dispatch + combine pair) and ``torch.cuda.synchronize()``. torch.profiler
records the host's CUDA runtime/driver calls and the GPU's kernels of every iteration on every
rank. All times are µs from rank 0's start of the iteration (the ranks share one host clock), the
median over iterations of each event (events matched by their order of occurrence), so a line
reads: when the host issued it, or when the GPU ran it, on which rank.

Run on a machine with 2+ GPUs: ``python3 scripts/profile_timeline.py [--peer deep_ep] [--out DIR]
[--variants full-one-launch,...]``. Prints a summary table (wall, host until the last launch, first
kernel start, kernel busy, gaps) and the timelines of rank 0 and rank 1; writes one Chrome trace per
library to ``--out``. ``--variants`` (one-node bench variants, each on an epcomm Buffer of its own)
adds each one's full dispatch at ``--tokens`` under the name ``epcomm+VARIANT``: its kernels' start
and end show which of them run when.
"""
import argparse
import os
import statistics
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

# host calls worth a line; everything else the host does shows as the gaps between them
HOST_CALLS = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchCooperativeKernel", "cuLaunchKernelEx",
              "cudaMemsetAsync", "cudaMemcpyAsync", "cudaStreamSynchronize", "cudaDeviceSynchronize",
              "cudaEventRecord", "cudaStreamWaitEvent", "cudaEventSynchronize", "cudaEventQuery",
              "cudaHostAlloc", "cudaMalloc", "cudaFree")


def _iteration_events(prof, marker: str):
    """Per iteration: [(absolute start ns, duration ns, where, name)] for host calls and kernels."""
    start_ns = prof.profiler.kineto_results.trace_start_ns()
    events = prof.events()
    # the host's ranges only (the profiler also records each range's GPU span under the same name)
    marks = sorted((e for e in events if e.name == marker and e.device_type.name == "CPU"),
                   key=lambda e: e.time_range.start)
    bounds = [m.time_range.start for m in marks] + [float("inf")]
    per_iteration = [[] for _ in marks]
    for event in events:
        gpu = event.device_type.name == "CUDA"
        if event.name == marker or (not gpu and not event.name.startswith(HOST_CALLS)):
            continue
        begin = event.time_range.start
        for i in range(len(marks)):
            if bounds[i] <= begin < bounds[i + 1]:
                name = event.name.split("(")[0][:44]
                per_iteration[i].append((start_ns + begin * 1000, event.time_range.elapsed_us() * 1000,
                                         "gpu" if gpu else "host", name))
                break
    origins = [start_ns + m.time_range.start * 1000 for m in marks]
    ends = [start_ns + m.time_range.end * 1000 for m in marks]
    return per_iteration, origins, ends


def _profile(fn, iterations: int, marker: str):
    from torch.profiler import ProfilerActivity, profile, record_function
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(iterations):
            dist.barrier()
            torch.cuda.synchronize()
            with record_function(marker):
                fn()
                torch.cuda.synchronize()
    return prof


def _host_regimes(fn, iterations: int):
    """Median host µs of one call of ``fn`` issued back to back, right after a
    ``torch.cuda.synchronize()``, and after a barrier and a sync (what a decode loop does)."""
    import time
    found = {}
    for regime in ("back to back", "after a sync", "after barrier + sync"):
        times = []
        torch.cuda.synchronize()
        dist.barrier()
        for _ in range(iterations):
            if regime != "back to back":
                if regime == "after barrier + sync":
                    dist.barrier()
                torch.cuda.synchronize()
            started = time.perf_counter()
            fn()
            times.append((time.perf_counter() - started) * 1e6)
        torch.cuda.synchronize()
        found[regime] = statistics.median(times)
    return found


def _median_timeline(per_iteration, origins):
    """Events keyed by (where, name, k-th occurrence): median start offset and duration, µs."""
    keyed = {}
    for events, origin in zip(per_iteration, origins):
        seen = {}
        for begin, length, where, name in sorted(events):
            k = seen[(where, name)] = seen.get((where, name), -1) + 1
            keyed.setdefault((where, name, k), []).append(((begin - origin) / 1e3, length / 1e3))
    lines = []
    for (where, name, _), samples in keyed.items():
        if len(samples) < len(origins) // 2:  # not in most iterations: noise (e.g. an allocator's call)
            continue
        lines.append((statistics.median(s[0] for s in samples), statistics.median(s[1] for s in samples),
                      where, name))
    return sorted(lines)


def _summary(lines, wall):
    kernels = [(s, d) for s, d, where, _ in lines if where == "gpu"]
    launches = [s + d for s, d, where, name in lines if where == "host" and "aunch" in name]
    busy = sum(d for _, d in kernels)
    first = min((s for s, _ in kernels), default=0.0)
    last = max((s + d for s, d in kernels), default=0.0)
    return {"wall": wall, "last launch": max(launches, default=0.0), "first kernel": first,
            "kernels": busy, "gaps": last - first - busy, "last kernel end": last}


def _gathered_timeline(fn, iterations):
    """``fn``'s median timeline on ranks 0 and 1 and its median wall time (``{rank: lines, "wall":
    µs}``) on rank 0, None elsewhere (collective: every rank profiles, rank 0 gathers)."""
    R, rank = dist.get_world_size(), dist.get_rank()
    prof = _profile(fn, iterations, "iteration")
    per_iteration, origins, ends = _iteration_events(prof, "iteration")
    gathered = [None] * R
    dist.all_gather_object(gathered, (per_iteration, origins, ends))
    if rank != 0:
        return None, prof
    origin0 = gathered[0][1]
    timeline = {r: _median_timeline(gathered[r][0], origin0) for r in range(min(R, 2))}
    timeline["wall"] = statistics.median([(e - o) / 1e3 for o, e in zip(origin0, gathered[0][2])])
    return timeline, prof


def _variant_timelines(variants, x, topk, weights, iterations, results):
    """Each variant's full dispatch (one-node bench variants, one Buffer each) into ``results`` under
    ``("epcomm+VARIANT", "T=... full dispatch")``, as rank_main records the libraries' calls."""
    import epcomm
    from epcomm.tools.bench import use_normal_variants
    for variant in variants:
        buffer = epcomm.Buffer(dist.group.WORLD, num_nvl_bytes=1 << 30)
        use_normal_variants(buffer._backend.normal, [variant])
        per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk, 256)
        args = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                    topk_idx=topk, topk_weights=weights, config=epcomm.Config(24, 8, 256))
        buffer.dispatch(x, **args)  # (compiles)
        timeline, _ = _gathered_timeline(lambda: buffer.dispatch(x, **args), iterations)
        if timeline is not None:
            results[(f"epcomm+{variant}", f"T={x.shape[0]} full dispatch")] = timeline
        buffer.destroy()
        torch.cuda.synchronize()
        dist.barrier()


def rank_main(peer_name, iterations, ll_tokens, tokens, out, variants=()):
    import epcomm
    from epcomm.fp8 import per_token_cast_back
    from epcomm.tools.measure import load_peer, random_batch
    R, rank = dist.get_world_size(), dist.get_rank()
    dev = torch.device("cuda", torch.cuda.current_device())
    H, K, E = 7168, 8, 256
    x, topk, weights = random_batch(tokens, H, K, E, 11 + rank, dev)
    lx, ltopk, lw = x[:ll_tokens].contiguous(), topk[:ll_tokens].contiguous(), weights[:ll_tokens].contiguous()
    peer = load_peer(peer_name)
    libraries = {"epcomm": epcomm}
    if peer is not None:
        libraries[peer_name] = peer
    results = {}
    for lib_name, lib in libraries.items():
        size = lib.Buffer.get_low_latency_rdma_size_hint(ll_tokens, H, R, E)
        extra = {"num_qps_per_rank": E // R} if lib is not epcomm else {}
        ll = lib.Buffer(dist.group.WORLD, low_latency_mode=True, num_rdma_bytes=size, **extra)
        normal = lib.Buffer(dist.group.WORLD, num_nvl_bytes=1 << 30)
        recv, _, handle, _, _ = ll.low_latency_dispatch(lx, ltopk, ll_tokens, E, use_fp8=True)
        expert_out = per_token_cast_back(recv[0], recv[1])
        per_rank, _, per_expert, in_rank, _ = normal.get_dispatch_layout(topk, E)
        config = lib.Config(24, 8, 256)
        args = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                    topk_idx=topk, topk_weights=weights, config=config)
        recv_x, _, _, _, normal_handle, _ = normal.dispatch(x, **args)

        def round_trip():
            _, _, h, _, _ = ll.low_latency_dispatch(lx, ltopk, ll_tokens, E, use_fp8=True)
            ll.low_latency_combine(expert_out, ltopk, lw, h)
        calls = {
            "LL round trip": round_trip,
            "LL dispatch": lambda: ll.low_latency_dispatch(lx, ltopk, ll_tokens, E, use_fp8=True),
            "LL combine": lambda: ll.low_latency_combine(expert_out, ltopk, lw, handle),
            f"T={tokens} layout": lambda: normal.get_dispatch_layout(topk, E),
            f"T={tokens} full dispatch": lambda: normal.dispatch(x, **args),
            f"T={tokens} cached dispatch": lambda: normal.dispatch(x, handle=normal_handle, config=config),
            f"T={tokens} combine": lambda: normal.combine(recv_x, normal_handle, config=config),
        }
        for call in ("LL dispatch", "LL combine", "LL round trip"):
            results[(lib_name, call, "host")] = _host_regimes(calls[call], iterations)
        if lib is epcomm and out:  # the Python functions of one synced round trip (Python tracer: slow, relative)
            from torch.profiler import ProfilerActivity, profile, record_function
            with profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:
                for _ in range(5):
                    dist.barrier()
                    torch.cuda.synchronize()
                    with record_function("iteration"):
                        round_trip()
                        torch.cuda.synchronize()
            if rank == 0:
                prof.export_chrome_trace(os.path.join(out, "trace_python_round_trip_epcomm.json"))
        for call, fn in calls.items():
            timeline, prof = _gathered_timeline(fn, iterations)
            if timeline is not None:
                results[(lib_name, call)] = timeline
                if call == "LL round trip" and out:
                    prof.export_chrome_trace(os.path.join(out, f"trace_ll_round_trip_{lib_name}.json"))
        del ll, normal
        torch.cuda.synchronize()
        dist.barrier()
    _variant_timelines(variants, x, topk, weights, iterations, results)
    return results


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--peer", default=None)
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--ll-tokens", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--out", default=os.environ.get("OUT", ""))
    parser.add_argument("--variants", default="",
                        help="one-node bench variants (a comma list; + joins several into one), each one's full "
                             "dispatch on a Buffer of its own beside the libraries'")
    args = parser.parse_args()
    from epcomm.tools.bench import normal_variants
    try:
        variants = normal_variants(args.variants) if args.variants else []
    except ValueError as err:
        parser.error(str(err))
    from epcomm.testing import run_distributed
    world = torch.cuda.device_count()
    results = run_distributed(rank_main, world, args.peer, args.iterations, args.ll_tokens, args.tokens, args.out,
                              variants, backend="nccl", timeout_s=900)[0]
    hosts = {key[:2]: value for key, value in results.items() if len(key) == 3}
    results = {key: value for key, value in results.items() if len(key) == 2}
    for (lib, call), timeline in results.items():
        print(f"\n## {lib}: {call} (µs from rank 0's iteration start; median of {args.iterations})")
        for r in (0, 1):
            for start, length, where, name in timeline.get(r, []):
                print(f"  rank {r} {where:4s} {start:8.1f} +{length:7.1f}  {name}")
    print("\n# summary, rank 0, µs: wall (barrier return .. sync return) | host's last launch returns | "
          "first kernel starts | kernel busy | gaps between first start and last end")
    for (lib, call), timeline in results.items():
        s = _summary(timeline[0], timeline["wall"])
        print(f"{lib:8s} {call:26s} wall {s['wall']:7.1f} | launch {s['last launch']:7.1f} | first "
              f"{s['first kernel']:7.1f} | kernels {s['kernels']:7.1f} | gaps {s['gaps']:7.1f}")
    print("\n# host µs per call, rank 0, median: back to back | right after a sync | after barrier + sync")
    for (lib, call), regimes in hosts.items():
        print(f"{lib:8s} {call:26s} " + " | ".join(f"{v:7.1f}" for v in regimes.values()))


if __name__ == "__main__":
    main()
