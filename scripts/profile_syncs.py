"""Which CUDA runtime calls that wait for the GPU (stream/device/event synchronisation, blocking
copies) each epcomm call makes, rank 0 — the host waits that keep work from queueing ahead.
Every GPU is a rank (one GPU: the nvlink backend on one rank).

Run on a GPU machine: ``python3 scripts/profile_syncs.py [tokens] [low-latency tokens]``.
Prints one row per call: the count per call of each such runtime call, and the kernels launched.
"""
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy ", "cudaMemcpy(",
         "cudaMemcpyAsync", "cudaStreamWaitEvent", "cuStreamSynchronize", "cuMemcpy")


def _profile(fn, repeats: int = 5):
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            fn()
        torch.cuda.synchronize()
    counts, kernels = {}, {}
    for event in prof.events():
        name = event.name
        if event.device_type.name == "CUDA":
            kernels[name.split("(")[0][:40]] = kernels.get(name.split("(")[0][:40], 0) + 1
        elif any(name.startswith(w.strip()) for w in WAITS):
            counts[name] = counts.get(name, 0) + 1
    return ({k: v / repeats for k, v in counts.items()}, {k: v / repeats for k, v in kernels.items()})


def rank_main(tokens: int, ll_tokens: int):
    import epcomm
    from epcomm.testing.sweeps import make_routing
    R, rank = dist.get_world_size(), dist.get_rank()
    dev = torch.device("cuda", torch.cuda.current_device())
    hidden, num_experts, K = 7168, 8 * R, min(8, 8 * R)
    xs, topks, ws = make_routing(3, "uniform", R, num_experts, K, tokens, hidden, fixed_tokens=tokens)
    x, topk, w = xs[rank].to(dev), topks[rank].to(dev), ws[rank].to(dev)
    buffer = epcomm.Buffer(dist.group.WORLD, num_nvl_bytes=1 << 30)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk, num_experts)
    args = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                topk_idx=topk, topk_weights=w)
    recv_x, _, _, _, handle, _ = buffer.dispatch(x, **args)
    calls = {
        "get_dispatch_layout": lambda: buffer.get_dispatch_layout(topk, num_experts),
        "dispatch, full": lambda: buffer.dispatch(x, **args),
        "dispatch, cached": lambda: buffer.dispatch(x, handle=handle),
        "combine": lambda: buffer.combine(recv_x, handle),
    }
    M = ll_tokens
    ll = epcomm.Buffer(dist.group.WORLD, low_latency_mode=True,
                       num_rdma_bytes=epcomm.Buffer.get_low_latency_rdma_size_hint(M, hidden, R, num_experts))
    lx, ltopk, lw = x[:M].contiguous(), topk[:M].contiguous(), w[:M].contiguous()
    recv, _, ll_handle, _, _ = ll.low_latency_dispatch(lx, ltopk, M, num_experts, use_fp8=True)
    from epcomm.fp8 import per_token_cast_back
    expert_out = per_token_cast_back(recv[0], recv[1])

    def round_trip():
        _, _, h, _, _ = ll.low_latency_dispatch(lx, ltopk, M, num_experts, use_fp8=True)
        ll.low_latency_combine(expert_out, ltopk, lw, h)
    calls.update({
        "low_latency_dispatch": lambda: ll.low_latency_dispatch(lx, ltopk, M, num_experts, use_fp8=True),
        "low_latency_combine": lambda: ll.low_latency_combine(expert_out, ltopk, lw, ll_handle),
        "low-latency round trip": round_trip,
    })
    rows = {}
    for name, fn in calls.items():
        dist.barrier()
        rows[name] = _profile(fn)
    return rows


def main():
    from epcomm.testing import run_distributed
    tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 512
    ll_tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 128
    world = max(1, torch.cuda.device_count())
    rows = run_distributed(rank_main, world, tokens, ll_tokens, backend="nccl", timeout_s=600)[0]
    print(f"# host waits per call, rank 0 of {world} (T={tokens}, low-latency T={ll_tokens})")
    for name, (waits, kernels) in rows.items():
        shown = ", ".join(f"{k} {v:g}" for k, v in sorted(waits.items())) or "none"
        launched = ", ".join(f"{k} {v:g}" for k, v in sorted(kernels.items()))
        print(f"{name:24s} waits: {shown}\n{'':24s} kernels: {launched}")


if __name__ == "__main__":
    main()
