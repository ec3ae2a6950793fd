"""How ``epcomm bench`` and the speed scripts measure (docs/PERFORMANCE.md, "How to measure"): host
and gpu time of calls issued back to back (the least of ``BATCHES`` batches), synced single calls,
a decode loop's wall time, the benchmark's random batch, the peer library, and the NCCL baseline.
Every function here is collective: all ranks make the same calls (the barriers pair up)."""
from __future__ import annotations

import statistics
import sys
import time
from typing import Callable, Dict, Optional

import torch
import torch.distributed as dist

BATCHES = 3  # batches of back-to-back calls per point; host and gpu are each the least of them


def back_to_back(fn: Callable, reps: int, batches: int = BATCHES, each: Optional[list] = None):
    """``(host, gpu)`` seconds per call of ``fn`` (collective: every rank runs the same calls), each
    the least over ``batches`` batches of ``reps`` calls issued back to back after a barrier.
    ``each``: a list that also receives every call's own host seconds."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    host = gpu = float("inf")
    for _ in range(batches):
        torch.cuda.synchronize()
        dist.barrier()
        torch.cuda.synchronize()
        started = time.perf_counter()
        start.record()
        if each is None:
            for _ in range(reps):
                fn()
        else:
            previous = started
            for _ in range(reps):
                fn()
                now = time.perf_counter()
                each.append(now - previous)
                previous = now
        host = min(host, (time.perf_counter() - started) / reps)
        end.record()
        torch.cuda.synchronize()
        gpu = min(gpu, start.elapsed_time(end) / 1e3 / reps)
    return host, gpu


def random_batch(tokens: int, hidden: int, num_topk: int, num_experts: int, seed: int, device):
    """A benchmark's batch on ``device``: ``(x, topk_idx, topk_weights)``, bf16 ``[T, H]``, int64
    ``[T, K]`` distinct experts of ``num_experts``, float32 ``[T, K]``, drawn from ``seed``."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(tokens, hidden, device=device, generator=g).to(torch.bfloat16)
    scores = torch.randn(tokens, num_experts, device=device, generator=g).abs() + 1
    topk_idx = scores.topk(num_topk, dim=-1).indices.to(torch.int64)
    return x, topk_idx, torch.rand(tokens, num_topk, device=device, generator=g)


def measure(fn: Callable, reps: int, flush: torch.Tensor, warmup: int = 3, batches: int = BATCHES) -> Dict[str, float]:
    """host / gpu / synced seconds of ``fn`` (collective: every rank runs the same calls): host and
    gpu the least over ``batches`` batches of ``reps`` calls back to back, synced the median of
    single calls."""
    for _ in range(warmup):
        fn()
    host, gpu = back_to_back(fn, reps, batches)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    synced = []
    for _ in range(max(reps // 2, 10)):
        flush.zero_()
        torch.cuda.synchronize()
        dist.barrier()
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        synced.append(start.elapsed_time(end) / 1e3)
    return {"host": host, "gpu": gpu, "synced": statistics.median(synced)}


def measure_decode_loop(fn: Callable, pairs: int = 100, warmup: int = 5) -> Dict[str, float]:
    """What a decode loop sees, in seconds: each iteration aligns the ranks (``dist.barrier``),
    makes one call of ``fn`` (a dispatch + combine pair) and waits for the GPU; the wall time from
    the barrier's return to the end of the sync, median and p99 over ``pairs`` iterations."""
    times = []
    for i in range(warmup + pairs):
        dist.barrier()
        started = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - started)
    times.sort()
    return {"median": statistics.median(times), "p99": times[min(len(times) - 1, int(0.99 * len(times)))]}


def load_peer(name: Optional[str]):
    """The peer library's module, or None (with the reason printed) when absent."""
    if not name:
        return None
    if name != "deep_ep":
        raise SystemExit(f"unknown peer {name!r} (supported: deep_ep)")
    try:
        import deep_ep
        return deep_ep
    except ImportError as exc:
        if dist.get_rank() == 0:
            print(f"peer deep_ep is not importable ({exc}); running epcomm alone", file=sys.stderr, flush=True)
        return None


# Why ranks sharing one GPU cannot run DeepEP's low-latency kernels (bench, scripts/ll_host_split.py):
# 2026-11-29e, they assert on their queue pairs without a NIC, and the process dies.
NO_PEER_LOW_LATENCY_ON_SHARED_GPU = "--shared-gpu: DeepEP's low-latency kernels need IBGDA's queue pairs, a NIC per GPU"


def peer_buffer(peer, group, **kwargs):
    """The peer library's Buffer on ``group``, made to be released by :func:`release_peer_buffers`
    (``explicitly_destroy``): DeepEP warns that releasing it in its destructor may hang Python's
    exception handling."""
    return peer.Buffer(group, explicitly_destroy=True, **kwargs)


def release_peer_buffers(*buffers) -> None:
    """Collective: after a barrier (every rank done with the peer's kernels), destroy each buffer
    :func:`peer_buffer` made. Call it on the success path only: DeepEP's release waits for every
    rank, and after an error on one rank the others would wait for it. There the buffers stay until
    the worker process exits (DeepEP then warns of the leak: a warning, not a hang)."""
    dist.barrier()
    for buffer in buffers:
        buffer.destroy()


class NCCLBaseline:
    """Count exchange with all_to_all_single + permute + all_to_all_single; combine mirrors it and
    sums with ``index_add_`` (the baseline DeepEP's comparisons use)."""

    def __init__(self, x, is_token_in_rank):
        self.x, self.in_rank = x, is_token_in_rank

    def dispatch(self):
        counts = self.in_rank.sum(0).to(torch.int64)
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts)
        dst, token = self.in_rank.t().nonzero(as_tuple=True)
        send = self.x.index_select(0, token)
        send_sizes, recv_sizes = counts.tolist(), recv_counts.tolist()
        recv = torch.empty(sum(recv_sizes), self.x.shape[1], dtype=self.x.dtype, device=self.x.device)
        dist.all_to_all_single(recv, send, recv_sizes, send_sizes)
        self.token, self.send_sizes, self.recv_sizes = token, send_sizes, recv_sizes
        return recv

    def combine(self, y):
        back = torch.empty(sum(self.send_sizes), y.shape[1], dtype=y.dtype, device=y.device)
        dist.all_to_all_single(back, y, self.send_sizes, self.recv_sizes)
        out = torch.zeros(self.x.shape, dtype=torch.float32, device=y.device)
        out.index_add_(0, self.token, back.float())
        return out.to(torch.bfloat16)
