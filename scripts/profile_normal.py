"""Per-kernel GPU time of one normal-mode dispatch (full and cached) and combine, via torch.profiler.

Run on a GPU machine: ``python3 scripts/profile_normal.py [tokens] [hidden]``; prints, per phase,
the kernels with their summed device time on rank 0, and the wall time of each call.
"""
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))


def profile_rank(tokens: int, hidden: int):
    import epcomm
    from torch.profiler import ProfilerActivity, profile
    rank = dist.get_rank()
    dev = torch.device("cuda", torch.cuda.current_device())
    buffer = epcomm.Buffer(dist.group.WORLD, num_nvl_bytes=2 << 30)
    g = torch.Generator(device=dev).manual_seed(rank)
    x = torch.randn(tokens, hidden, device=dev, generator=g).to(torch.bfloat16)
    topk = (torch.randn(tokens, 256, device=dev, generator=g).abs() + 1).topk(8, dim=-1).indices
    w = torch.rand(tokens, 8, device=dev, generator=g)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk, 256)
    cfg = epcomm.Config(24, 8, 256)
    full = lambda: buffer.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,  # noqa: E731
                                   num_tokens_per_expert=per_expert, topk_idx=topk, topk_weights=w, config=cfg)
    recv = full()
    phases = {"full": full, "cached": lambda: buffer.dispatch(x, handle=recv[4], config=cfg),
              "combine": lambda: buffer.combine(recv[0], recv[4], config=cfg)}
    report = []
    for name, fn in phases.items():
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        dist.barrier()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            wall = time.perf_counter() - t0
        rows = []
        for evt in prof.key_averages():
            device_us = getattr(evt, "device_time_total", getattr(evt, "cuda_time_total", 0))
            if device_us > 0 and evt.key and not evt.key.startswith("aten::") and not evt.key.startswith("cuda"):
                rows.append((device_us, evt.count, evt.key[:70]))
        rows.sort(reverse=True)
        report.append((name, wall, rows[:14]))
    buffer.destroy()
    return report


if __name__ == "__main__" and os.environ.get("EPCOMM_HOST_PROFILE") != "1":
    from epcomm.testing import run_distributed
    tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
    hidden = int(sys.argv[2]) if len(sys.argv) > 2 else 7168
    report = run_distributed(profile_rank, torch.cuda.device_count(), tokens, hidden, backend="nccl")[0]
    for name, wall, rows in report:
        print(f"== {name}: wall {wall * 1e6:.0f} us (rank 0)")
        for device_us, count, key in rows:
            print(f"   {device_us:9.1f} us  x{count:<3} {key}")


def host_rank(tokens: int, hidden: int):
    """Host-side cost: launch time of a cached dispatch / combine (no sync inside), and the
    Python functions that take it (cProfile)."""
    import cProfile
    import io
    import pstats
    import epcomm
    dev = torch.device("cuda", torch.cuda.current_device())
    buffer = epcomm.Buffer(dist.group.WORLD, num_nvl_bytes=2 << 30)
    x = torch.randn(tokens, hidden, device=dev).to(torch.bfloat16)
    topk = (torch.randn(tokens, 256, device=dev).abs() + 1).topk(8, dim=-1).indices
    w = torch.rand(tokens, 8, device=dev)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk, 256)
    cfg = epcomm.Config(24, 8, 256)
    full = lambda: buffer.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,  # noqa: E731
                                   num_tokens_per_expert=per_expert, topk_idx=topk, topk_weights=w, config=cfg)
    recv = full()
    out = {}
    for name, fn in (("full", full), ("cached", lambda: buffer.dispatch(x, handle=recv[4], config=cfg)),
                     ("combine", lambda: buffer.combine(recv[0], recv[4], config=cfg))):
        for _ in range(3):
            fn()
        launch, total = [], []
        for _ in range(10):
            torch.cuda.synchronize()
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            launch.append(t1 - t0)
            total.append(time.perf_counter() - t0)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(5):
            fn()
        prof.disable()
        torch.cuda.synchronize()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(12)
        out[name] = (sorted(launch)[5], sorted(total)[5], s.getvalue())
    return out


if __name__ == "__main__" and os.environ.get("EPCOMM_HOST_PROFILE") == "1":
    from epcomm.testing import run_distributed
    result = run_distributed(host_rank, torch.cuda.device_count(), 4096, 7168, backend="nccl")[0]
    for name, (launch, total, stats) in result.items():
        print(f"== {name}: host {launch * 1e6:.0f} us, host+device {total * 1e6:.0f} us")
        print("\n".join(line[:150] for line in stats.splitlines()[4:24]))
