"""``epcomm demo``: an EP MoE layer forward in normal and low-latency mode, checked against one process."""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

# bf16 rounding of partial sums (normal) and FP8 activations (low latency) bound the error.
TOLERANCE = {"normal": 2e-2, "low-latency": 6e-2}


@dataclass
class DemoSettings:
    tokens: int = 64
    hidden: int = 512
    ffn: int = 256
    experts_per_rank: int = 4
    topk: int = 4
    iters: int = 5
    seed: int = 0


def demo_rank(settings: DemoSettings):
    """Runs on every rank; returns per-mode ``(tokens/s over all ranks, relative error)`` on rank 0."""
    import epcomm
    from .moe import MoEWeights, ep_forward_low_latency, ep_forward_normal, relative_error

    R, rank = dist.get_world_size(), dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    num_experts = settings.experts_per_rank * R
    weights = MoEWeights.create(settings.hidden, num_experts, settings.ffn, min(settings.topk, num_experts),
                                settings.seed, device)
    g = torch.Generator().manual_seed(settings.seed * 7919 + rank)
    x = torch.randn(settings.tokens, settings.hidden, generator=g).to(torch.bfloat16).to(device)
    want = weights.dense_forward(x)
    results = {}
    runs = {
        "normal": (epcomm.Buffer(dist.group.WORLD, num_nvl_bytes=1 << 28), lambda b: ep_forward_normal(b, weights, x)),
        "low-latency": (epcomm.Buffer(dist.group.WORLD, num_rdma_bytes=1 << 28, low_latency_mode=True),
                        lambda b: ep_forward_low_latency(b, weights, x, settings.tokens)),
    }
    for mode, (buffer, forward) in runs.items():
        got = forward(buffer)  # warm-up and correctness
        error = torch.tensor([relative_error(got, want)], dtype=torch.float64, device=device)
        dist.all_reduce(error, op=dist.ReduceOp.MAX)
        if device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier()
        start = time.perf_counter()
        for _ in range(settings.iters):
            forward(buffer)
        if device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        results[mode] = (settings.tokens * R * settings.iters / float(elapsed), float(error), buffer.backend_name)
        buffer.destroy()
    return results


def run_demo(ranks: int = 0, settings: DemoSettings = DemoSettings(), timeout_s: float = 600) -> int:
    """Run the demo on all GPUs (or ``ranks`` CPU ranks), print a table, return the exit code."""
    from ..testing import default_world, run_distributed
    from .args import counted

    world, backend = default_world(ranks)
    num_experts = settings.experts_per_rank * world
    if settings.topk > num_experts:
        print(f"epcomm demo: error: --topk {settings.topk} exceeds the {counted(num_experts, 'expert')} of "
              f"{counted(world, 'rank')}", file=sys.stderr)
        return 2
    print(f"epcomm demo: MoE layer forward on {counted(world, 'GPU rank' if backend == 'nccl' else 'CPU rank')} "
          f"(T={settings.tokens}/rank, H={settings.hidden}, E={settings.experts_per_rank * world}, K={settings.topk})",
          flush=True)
    results = run_distributed(demo_rank, world, settings, backend=backend, timeout_s=timeout_s)[0]
    failed = False
    print(f"{'mode':<12} {'backend':<11} {'ranks':>5} {'tokens/s':>12} {'rel. error':>11} {'limit':>7}  result")
    for mode, (tokens_per_s, error, backend_name) in results.items():
        ok = error <= TOLERANCE[mode]
        failed |= not ok
        print(f"{mode:<12} {backend_name:<11} {world:>5} {tokens_per_s:>12.0f} {error:>11.2e} {TOLERANCE[mode]:>7.0e}  "
              f"{'OK' if ok else 'MISMATCH'}")
    return 1 if failed else 0
