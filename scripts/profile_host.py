"""Where the host time of each call goes (rank 0): primitive costs, then cProfile of each call.

Run on a GPU machine: ``python3 scripts/profile_host.py [tokens]``. Host cost is the risk of a
Python design (docs/PERFORMANCE.md); this shows which Python lines a call spends it on.
"""
import cProfile
import io
import os
import pstats
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))


def _per_call_us(fn, n=2000):
    fn()
    started = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - started) / n * 1e6


def profile_rank(tokens: int):
    import epcomm
    from epcomm import checks
    from epcomm.backends.nvlink import sync
    from epcomm.backends.nvlink.launch import current_stream
    from epcomm.fp8 import per_token_cast_to_fp8
    rank, R = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device())
    T, H, K, E, M = tokens, 7168, 8, 256, 128
    g = torch.Generator(device=dev).manual_seed(rank)
    x = torch.randn(T, H, device=dev, generator=g).to(torch.bfloat16)
    topk = (torch.randn(T, E, device=dev, generator=g).abs() + 1).topk(K, dim=-1).indices
    w = torch.rand(T, K, device=dev, generator=g)
    buf = epcomm.Buffer(dist.group.WORLD, num_nvl_bytes=1 << 30)
    cfg = epcomm.Config(24, 8, 256)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(topk, E)
    recv, _, _, _, handle, _ = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                            num_tokens_per_expert=per_expert, topk_idx=topk, topk_weights=w, config=cfg)
    x8 = per_token_cast_to_fp8(x)
    handle8 = buf.dispatch(x8, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                           num_tokens_per_expert=per_expert, topk_idx=topk, topk_weights=w, config=cfg)[4]
    ll = epcomm.Buffer(dist.group.WORLD, low_latency_mode=True,
                       num_rdma_bytes=epcomm.Buffer.get_low_latency_rdma_size_hint(M, H, R, E))
    xl, tl_, wl = x[:M].contiguous(), topk[:M].contiguous(), w[:M].contiguous()
    lrecv, _, lhandle, _, _ = ll.low_latency_dispatch(xl, tl_, M, E, use_fp8=True)
    y = torch.zeros(E // R, R * M, H, dtype=torch.bfloat16, device=dev)
    calls = {
        "get_dispatch_layout": lambda: buf.get_dispatch_layout(topk, E),
        "dispatch cached bf16": lambda: buf.dispatch(x, handle=handle, config=cfg),
        "dispatch cached fp8": lambda: buf.dispatch(x8, handle=handle8, config=cfg),
        "combine": lambda: buf.combine(recv, handle, config=cfg),
        "ll dispatch": lambda: ll.low_latency_dispatch(xl, tl_, M, E, use_fp8=True),
        "ll combine": lambda: ll.low_latency_combine(y, tl_, wl, lhandle),
    }
    report = []
    if rank == 0:
        probe = sync._probe_kernel.bind(num_warps=1)
        scratch = torch.zeros(1, dtype=torch.int64, device=dev)
        host_word = torch.zeros(1, dtype=torch.int64, pin_memory=True)
        from epcomm.backends.nvlink import normal
        layout_kernel = normal.LAYOUT.bind(num_warps=4, BLOCK_T=128, E_P2=256, K_P2=8, R_P2=2, SUM_ROWS=16)
        layout_tensors = [topk, torch.empty(R, dtype=torch.int32, device=dev), torch.empty(E, dtype=torch.int32, device=dev),
                          torch.empty(T, R, dtype=torch.bool, device=dev), torch.empty(64, 258, dtype=torch.int32, device=dev)]
        layout_state = buf._backend.state.data_ptr()
        block = torch.empty(1 << 20, dtype=torch.uint8, device=dev)
        report.append("primitive costs (µs/call):")
        for name, fn in (
                ("torch.empty 1 MB uint8", lambda: torch.empty(1 << 20, dtype=torch.uint8, device=dev)),
                ("slice+view(dtype)+view(shape)", lambda: block[256:512].view(torch.int32).view(8, 8)),
                ("bound launch (2 args)", lambda: probe.launch(1, 1, current_stream(dev.index), host_word.data_ptr(), scratch)),
                ("raw stream handle", lambda: current_stream(dev.index)),
                ("layout launch, 5 tensor pointers", lambda: layout_kernel.launch(
                    1, 1, current_stream(dev.index), *layout_tensors, buf._backend.state, host_word.data_ptr(), 0, 0, E, R, E // R)),
                ("layout launch, 5 int pointers", lambda: layout_kernel.launch(
                    1, 1, current_stream(dev.index), *[t.data_ptr() for t in layout_tensors], layout_state, host_word.data_ptr(), 0, 0, E, R,
                    E // R)),
                ("check_tensor", lambda: checks.check_tensor("x", x, dtype=torch.bfloat16, shape=(T, None), device=dev)),
                ("x.data_ptr()", lambda: x.data_ptr())):
            report.append(f"  {name:<34} {_per_call_us(fn):7.2f}")
        torch.cuda.synchronize()
    for name, fn in calls.items():
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        dist.barrier()
        profiler = cProfile.Profile() if rank == 0 else None
        started = time.perf_counter()
        if profiler:
            profiler.enable()
        for _ in range(200):
            fn()
        if profiler:
            profiler.disable()
        elapsed = (time.perf_counter() - started) / 200 * 1e6
        torch.cuda.synchronize()
        dist.barrier()
        plain = _per_call_us(fn, 200)
        torch.cuda.synchronize()
        dist.barrier()
        if profiler:
            out = io.StringIO()
            pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(14)
            lines = [ln for ln in out.getvalue().splitlines() if ln.strip() and not ln.startswith(("   Ordered", "   List"))]
            report.append(f"\n== {name}: {plain:.1f} µs/call plain, {elapsed:.1f} under cProfile")
            report += lines[-15:]
    buf.destroy()
    ll.destroy()
    return "\n".join(report)


if __name__ == "__main__":
    from epcomm.testing import run_distributed
    tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 512
    print(run_distributed(profile_rank, torch.cuda.device_count(), tokens, backend="nccl", timeout_s=600)[0])
