"""``epcomm bench normal | low-latency``: epcomm against the NCCL baseline, side by side, on the same data.

Settings and byte counting follow DESIGN section 4 (DeepEP's tests): T tokens per rank, hidden H,
top-K of E experts, routing ``topk(|randn| + 1)``; bandwidth = ``recv_x`` bytes (BF16; FP8 counts
``(1 + 4/128)`` bytes per element) ÷ time, local rows included. Every timing is the median of
``--reps`` CUDA-event timings after warm-up, with the L2 cache flushed and all ranks aligned
before each repetition. Correctness (epcomm == baseline on the received rows, combine within
tolerance) is checked in the same run on the same random data.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Dict, List

import torch
import torch.distributed as dist


@dataclass
class NormalBenchSettings:
    tokens: int = 4096
    hidden: int = 7168
    num_topk: int = 8
    num_experts: int = 256
    sms: List[int] = field(default_factory=lambda: [16, 24, 32, 64])
    token_sweep: List[int] = field(default_factory=lambda: [512, 1024, 2048, 4096, 8192, 16384])
    sweep_sms: int = 24
    reps: int = 30
    warmup: int = 5
    num_nvl_bytes: int = 3 << 30
    seed: int = 0


def _timed(fn, reps: int, warmup: int, flush: torch.Tensor) -> float:
    """Median seconds of ``fn`` over ``reps`` CUDA-event timings (L2 flushed, ranks aligned)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        flush.zero_()
        dist.barrier()
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


class NCCLBaseline:
    """Count exchange with all_to_all_single + permute + all_to_all_single; combine mirrors it with
    a weighted-free ``index_add_`` (DESIGN section 4)."""

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


def _bench_point(buffer, settings, tokens, num_sms, use_fp8, flush, reps, warmup):
    import epcomm
    from .fp8 import per_token_cast_to_fp8
    R, rank = dist.get_world_size(), dist.get_rank()
    dev = torch.device("cuda", torch.cuda.current_device())
    g = torch.Generator(device=dev).manual_seed(settings.seed * 7919 + rank * 31 + tokens)
    x = torch.randn(tokens, settings.hidden, device=dev, generator=g).to(torch.bfloat16)
    scores = torch.randn(tokens, settings.num_experts, device=dev, generator=g).abs() + 1
    topk_idx = scores.topk(settings.num_topk, dim=-1).indices.to(torch.int64)
    topk_weights = torch.rand(tokens, settings.num_topk, device=dev, generator=g)
    x_in = per_token_cast_to_fp8(x) if use_fp8 else x
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, settings.num_experts)
    config = epcomm.Config(num_sms, 8, 256)
    full = lambda: buffer.dispatch(x_in, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,  # noqa: E731
                                   num_tokens_per_expert=per_expert, topk_idx=topk_idx, topk_weights=topk_weights,
                                   config=config)
    recv_x, _, _, _, handle, _ = full()
    recv_values = recv_x[0] if use_fp8 else recv_x
    baseline = NCCLBaseline(x, in_rank)
    base_recv = baseline.dispatch()
    # correctness on this data: identical rows (bf16 path), combine within tolerance
    ok = True
    if not use_fp8:
        ok &= torch.equal(recv_values, base_recv)
    expert_out = base_recv if not use_fp8 else base_recv
    combined = buffer.combine(expert_out, handle, config=config)[0]
    base_combined = baseline.combine(expert_out)
    ok &= bool(torch.allclose(combined.float(), base_combined.float(), rtol=1e-2, atol=1e-2))
    ok_t = torch.tensor([1 if ok else 0], device=dev)
    dist.all_reduce(ok_t, op=dist.ReduceOp.MIN)

    element_bytes = (1 + 4 / 128) if use_fp8 else 2
    recv_bytes = recv_values.numel() * element_bytes
    combine_bytes = recv_values.numel() * 2
    row = {"tokens": tokens, "sms": num_sms, "fp8": use_fp8, "recv_tokens": recv_values.shape[0], "ok": bool(ok_t.item())}
    row["cached_dispatch_s"] = _timed(lambda: buffer.dispatch(x_in, handle=handle, config=config), reps, warmup, flush)
    row["full_dispatch_s"] = _timed(full, reps, warmup, flush)
    row["combine_s"] = _timed(lambda: buffer.combine(expert_out, handle, config=config), reps, warmup, flush)
    if not use_fp8:
        row["nccl_dispatch_s"] = _timed(baseline.dispatch, reps, warmup, flush)
        row["nccl_combine_s"] = _timed(lambda: baseline.combine(expert_out), reps, warmup, flush)
    row["recv_bytes"], row["combine_bytes"] = recv_bytes, combine_bytes
    # average over ranks (each rank receives a different number of rows)
    keys = [k for k in row if k.endswith("_s") or k.endswith("_bytes") or k == "recv_tokens"]
    values = torch.tensor([float(row[k]) for k in keys], dtype=torch.float64, device=dev)
    dist.all_reduce(values)
    for k, v in zip(keys, (values / R).tolist()):
        row[k] = v
    return row


def bench_normal_rank(settings: NormalBenchSettings):
    import epcomm
    R, rank = dist.get_world_size(), dist.get_rank()
    dev = torch.device("cuda", torch.cuda.current_device())
    buffer = epcomm.Buffer(dist.group.WORLD, num_nvl_bytes=settings.num_nvl_bytes)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    points = [(settings.tokens, s, False) for s in settings.sms]
    points += [(settings.tokens, settings.sweep_sms, True)]
    points += [(t, settings.sweep_sms, False) for t in settings.token_sweep if t != settings.tokens]
    rows = []
    started = time.time()
    for index, (tokens, sms, use_fp8) in enumerate(points):
        if rank == 0:
            print(f"[{index + 1}/{len(points)}] T={tokens} sms={sms} {'fp8' if use_fp8 else 'bf16'} "
                  f"({time.time() - started:.0f} s)", file=sys.stderr, flush=True)
        rows.append(_bench_point(buffer, settings, tokens, sms, use_fp8, flush, settings.reps, settings.warmup))
    buffer.destroy()
    return {"world": R, "backend": buffer.backend_name, "device": torch.cuda.get_device_name(dev),
            "settings": asdict(settings), "rows": rows}


def _table(result: Dict) -> str:
    lines = [f"# epcomm bench normal: {result['world']} x {result['device']}, backend {result['backend']}, "
             f"H={result['settings']['hidden']} K={result['settings']['num_topk']} E={result['settings']['num_experts']}",
             "# times in us (median); GB/s = recv_x bytes / time (DeepEP counting, local rows included)",
             f"{'T':>6} {'sms':>4} {'dtype':>5} {'cached':>8} {'GB/s':>6} {'full':>8} {'GB/s':>6} {'combine':>8} {'GB/s':>6}"
             f" {'nccl-disp':>9} {'GB/s':>6} {'nccl-comb':>9} {'GB/s':>6} {'full-x':>6} {'ok':>3}"]
    for r in result["rows"]:
        def gbps(bytes_key, time_key):
            return r[bytes_key] / r[time_key] / 1e9 if time_key in r else float("nan")
        nccl_d = r.get("nccl_dispatch_s", float("nan"))
        nccl_c = r.get("nccl_combine_s", float("nan"))
        lines.append(
            f"{r['tokens']:>6} {r['sms']:>4} {'fp8' if r['fp8'] else 'bf16':>5} "
            f"{r['cached_dispatch_s'] * 1e6:>8.0f} {gbps('recv_bytes', 'cached_dispatch_s'):>6.0f} "
            f"{r['full_dispatch_s'] * 1e6:>8.0f} {gbps('recv_bytes', 'full_dispatch_s'):>6.0f} "
            f"{r['combine_s'] * 1e6:>8.0f} {gbps('combine_bytes', 'combine_s'):>6.0f} "
            f"{nccl_d * 1e6:>9.0f} {gbps('recv_bytes', 'nccl_dispatch_s'):>6.0f} "
            f"{nccl_c * 1e6:>9.0f} {gbps('combine_bytes', 'nccl_combine_s'):>6.0f} "
            f"{nccl_d / r['full_dispatch_s']:>6.2f} {'OK' if r['ok'] else 'BAD':>3}")
    return "\n".join(lines)


def _plot(result: Dict, path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    rows = [r for r in result["rows"] if not r["fp8"] and r["sms"] == result["settings"]["sweep_sms"]]
    rows.sort(key=lambda r: r["tokens"])
    fig, ax = plt.subplots(figsize=(7, 4))
    for key, bytes_key, label in (("cached_dispatch_s", "recv_bytes", "epcomm dispatch (cached)"),
                                  ("full_dispatch_s", "recv_bytes", "epcomm dispatch (full)"),
                                  ("combine_s", "combine_bytes", "epcomm combine"),
                                  ("nccl_dispatch_s", "recv_bytes", "NCCL dispatch"),
                                  ("nccl_combine_s", "combine_bytes", "NCCL combine")):
        ax.plot([r["tokens"] for r in rows], [r[bytes_key] / r[key] / 1e9 for r in rows], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens per rank")
    ax.set_ylabel("GB/s per rank (DeepEP counting)")
    ax.set_title(f"{result['world']} x {result['device']}")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


@dataclass
class LowLatencyBenchSettings:
    tokens: int = 128
    hidden: int = 7168
    num_topk: int = 8
    num_experts: int = 256
    reps: int = 50
    warmup: int = 10
    seed: int = 0


def bench_low_latency_rank(settings: LowLatencyBenchSettings):
    """LL dispatch (FP8) / combine (BF16) / round trip, eager and CUDA-graph replayed, beside the
    NCCL baseline and checked against the torch_dist reference backend on the same data."""
    import epcomm
    R, rank = dist.get_world_size(), dist.get_rank()
    dev = torch.device("cuda", torch.cuda.current_device())
    T, H, K, E = settings.tokens, settings.hidden, settings.num_topk, settings.num_experts
    size = epcomm.Buffer.get_low_latency_rdma_size_hint(T, H, R, E)
    buffer = epcomm.Buffer(dist.group.WORLD, num_rdma_bytes=size, low_latency_mode=True)
    os.environ["EPCOMM_BACKEND"] = "torch_dist"
    try:
        reference = epcomm.Buffer(dist.group.WORLD, low_latency_mode=True)
    finally:
        os.environ.pop("EPCOMM_BACKEND")
    g = torch.Generator(device=dev).manual_seed(settings.seed * 7919 + rank)
    x = torch.randn(T, H, device=dev, generator=g).to(torch.bfloat16)
    topk_idx = (torch.randn(T, E, device=dev, generator=g).abs() + 1).topk(K, dim=-1).indices.to(torch.int64)
    topk_weights = torch.rand(T, K, device=dev, generator=g)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev)

    def round_trip(buf, expert_out=None):
        recv, count, handle, _, _ = buf.low_latency_dispatch(x, topk_idx, T, E, use_fp8=True)
        y = expert_out if expert_out is not None else _ll_expert_out(recv, count)
        return buf.low_latency_combine(y, topk_idx, topk_weights, handle)[0]

    out = round_trip(buffer)
    want = round_trip(reference)
    error = float((out.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30))
    ok_t = torch.tensor([1 if error < 1e-2 else 0], device=dev)
    dist.all_reduce(ok_t, op=dist.ReduceOp.MIN)

    recv, count, handle, _, _ = buffer.low_latency_dispatch(x, topk_idx, T, E, use_fp8=True)
    expert_out = _ll_expert_out(recv, count)
    row = {"ok": bool(ok_t.item()), "rel_error": error}
    row["dispatch_s"] = _timed(lambda: buffer.low_latency_dispatch(x, topk_idx, T, E, use_fp8=True),
                               settings.reps, settings.warmup, flush)
    row["combine_s"] = _timed(lambda: buffer.low_latency_combine(expert_out, topk_idx, topk_weights, handle),
                              settings.reps, settings.warmup, flush)
    row["round_trip_s"] = _timed(lambda: round_trip(buffer, expert_out), settings.reps, settings.warmup, flush)
    # CUDA graphs: one of dispatch + stand-in expert + combine, checked against the eager result;
    # one of dispatch + combine on fixed expert outputs, whose replays time the device work alone.
    try:
        graphs = {}
        for name, fn in (("checked", lambda: round_trip(buffer)), ("timed", lambda: round_trip(buffer, expert_out))):
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):
                    fn()
            torch.cuda.current_stream().wait_stream(stream)
            dist.barrier()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                graph_out = fn()
            dist.barrier()
            graphs[name] = (graph, graph_out)
        graph, graph_out = graphs["checked"]
        graph.replay()
        torch.cuda.synchronize()
        row["graph_ok"] = bool(torch.allclose(graph_out.float(), out.float(), rtol=1e-2, atol=1e-2))
        row["graph_round_trip_s"] = _timed(graphs["timed"][0].replay, settings.reps, settings.warmup, flush)
    except Exception as exc:  # reported, not hidden
        row["graph_error"] = f"{type(exc).__name__}: {exc}"[:300]
    # where the device time goes (rank 0 reports its kernels)
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    dist.barrier()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            round_trip(buffer, expert_out)
        torch.cuda.synchronize()
    kernels = []
    for evt in prof.key_averages():
        device_us = getattr(evt, "device_time_total", 0) or getattr(evt, "cuda_time_total", 0)
        if device_us > 0:
            kernels.append((device_us / 5, evt.key[:60]))
    kernels.sort(reverse=True)
    in_rank = torch.zeros(T, R, dtype=torch.bool, device=dev)
    in_rank.scatter_(1, topk_idx // (E // R), True)
    baseline = NCCLBaseline(x, in_rank)
    base_recv = baseline.dispatch()
    row["nccl_dispatch_s"] = _timed(baseline.dispatch, settings.reps, settings.warmup, flush)
    row["nccl_combine_s"] = _timed(lambda: baseline.combine(base_recv), settings.reps, settings.warmup, flush)
    selections = float((topk_idx >= 0).sum())
    row["dispatch_bytes"] = selections * (H + H / 128 * 4 + 16)
    row["combine_bytes"] = selections * H * 2
    keys = [k for k in row if k.endswith("_s") or k.endswith("_bytes")]
    values = torch.tensor([float(row[k]) for k in keys], dtype=torch.float64, device=dev)
    dist.all_reduce(values)
    for k, v in zip(keys, (values / R).tolist()):
        row[k] = v
    return {"world": R, "backend": buffer.backend_name, "device": torch.cuda.get_device_name(dev),
            "settings": asdict(settings), "row": row, "kernels_us_per_round_trip": kernels[:10]}


def _ll_expert_out(recv, count):
    """Stand-in expert: the dequantised input, as bf16 [E_local, R*M, H]."""
    from .fp8 import per_token_cast_back
    values, scales = recv
    return per_token_cast_back(values, scales)


def _ll_table(result: Dict) -> str:
    r = result["row"]
    s = result["settings"]
    lines = [f"# epcomm bench low-latency: {result['world']} x {result['device']}, backend {result['backend']}, "
             f"T={s['tokens']} H={s['hidden']} K={s['num_topk']} E={s['num_experts']} (FP8 dispatch, BF16 combine)",
             f"{'what':<34} {'time us':>9} {'GB/s':>7}"]
    for key, label, bytes_key in (("dispatch_s", "epcomm dispatch", "dispatch_bytes"),
                                  ("combine_s", "epcomm combine", "combine_bytes"),
                                  ("round_trip_s", "epcomm round trip (eager)", None),
                                  ("graph_round_trip_s", "epcomm round trip (CUDA graph)", None),
                                  ("nccl_dispatch_s", "NCCL baseline dispatch (bf16)", None),
                                  ("nccl_combine_s", "NCCL baseline combine", None)):
        if key in r:
            gbps = f"{r[bytes_key] / r[key] / 1e9:7.0f}" if bytes_key else f"{'':>7}"
            lines.append(f"{label:<34} {r[key] * 1e6:>9.1f} {gbps}")
    lines.append(f"correct vs torch_dist reference: {'OK' if r['ok'] else 'BAD'} (rel. error {r['rel_error']:.1e})"
                 + (f"; graph replay {'OK' if r.get('graph_ok') else 'BAD'}" if "graph_ok" in r else "")
                 + (f"; graph capture failed: {r['graph_error']}" if "graph_error" in r else ""))
    lines.append("device time per eager round trip, by kernel (rank 0): " + ", ".join(
        f"{name.split('(')[0]} {us:.1f}" for us, name in result.get("kernels_us_per_round_trip", [])[:6]))
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="epcomm bench")
    parser.add_argument("mode", choices=["normal", "low-latency"])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--sms", default="16,24,32,64")
    parser.add_argument("--token-sweep", default="512,1024,2048,4096,8192,16384")
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--ranks", type=int, default=0, help="default: all GPUs")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        print("epcomm bench needs at least 2 CUDA GPUs", file=sys.stderr)
        return 2
    from .testing import run_distributed
    world = args.ranks or torch.cuda.device_count()
    os.makedirs(args.out, exist_ok=True)
    if args.mode == "low-latency":
        settings = LowLatencyBenchSettings(tokens=args.tokens if args.tokens != 4096 else 128, hidden=args.hidden,
                                           reps=max(args.reps, 20))
        result = run_distributed(bench_low_latency_rank, world, settings, backend="nccl", timeout_s=900)[0]
        with open(os.path.join(args.out, "bench_low_latency.json"), "w") as f:
            json.dump(result, f, indent=1)
        print(_ll_table(result))
        return 0 if result["row"]["ok"] and result["row"].get("graph_ok", False) else 1
    settings = NormalBenchSettings(tokens=args.tokens, hidden=args.hidden, reps=args.reps,
                                   sms=[int(s) for s in args.sms.split(",")],
                                   token_sweep=[int(t) for t in args.token_sweep.split(",") if t])
    result = run_distributed(bench_normal_rank, world, settings, backend="nccl", timeout_s=1800)[0]
    with open(os.path.join(args.out, "bench_normal.json"), "w") as f:
        json.dump(result, f, indent=1)
    _plot(result, os.path.join(args.out, "bench_normal.png"))
    print(_table(result))
    return 0 if all(r["ok"] for r in result["rows"]) else 1
