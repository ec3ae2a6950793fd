"""``epcomm bench normal | low-latency``: epcomm beside the NCCL baseline and, with ``--peer deep_ep``,
DeepEP V1 — same process, same random data, same run (machines are shared and noisy: only same-run
ratios are honest).

Every call is reported with three figures (as docs/PERFORMANCE.md defines them), in µs, rank 0:

- **host**: host time per call, calls issued back to back without waiting for the GPU;
- **gpu**: per-call time of ``reps`` calls queued back to back between two CUDA events (a call
  is host-bound when host >= gpu: then this is the host's pace, not the kernels'); host and gpu
  are each the least of ``BATCHES`` such batches (measure.py), since a shared host's interference
  only adds time (a host-bound call's ratio moved by 0.3 between runs of one lease with one batch);
- **synced**: median of single calls, each started on an idle, synchronised GPU (L2 flushed, ranks
  aligned): what a layer sees right after a host sync, and what decode sees.

Settings and routing follow DeepEP's tests: T tokens per rank, hidden H, top-K of E experts,
``topk(|randn| + 1)``. Correctness is checked in the same run on the same data: epcomm's received
rows equal the NCCL baseline's (and DeepEP's), and combine agrees within bf16 tolerance.
epcomm itself never imports ``deep_ep``; only this benchmark's ``--peer deep_ep`` path does.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from .bench_tables import low_latency_table, normal_table, plot_normal, with_every_rank
from .measure import (NO_PEER_LOW_LATENCY_ON_SHARED_GPU, NCCLBaseline, load_peer, measure, measure_decode_loop,
                      peer_buffer, random_batch, release_peer_buffers)


# ---------------------------------------------------------------------- normal mode
@dataclass
class NormalBenchSettings:
    tokens: int = 4096
    hidden: int = 7168
    num_topk: int = 8
    num_experts: int = 256
    sms: int = 24
    more_sms: List[int] = field(default_factory=list)  # further Config num_sms settings, each a point at T=tokens
    extra_tokens: List[int] = field(default_factory=lambda: [512])
    reps: int = 30
    num_nvl_bytes: int = 3 << 30
    peer: Optional[str] = None
    # the peer's chunk sizes: "same" (Config(sms, 8, 256), as epcomm's), or "recommended" (its own
    # Buffer.get_dispatch_config / get_combine_config for the group's size, on the same sms)
    peer_configs: str = "same"
    seed: int = 0
    ranks_per_node: int = 0  # > 0: virtual nodes of this many ranks on the nvshmem backend
    send_parts: List[int] = field(default_factory=list)  # nvshmem: further send_parts settings, a point each
    p2p: List[int] = field(default_factory=list)  # nvshmem: p2p settings (1 stores, 0 puts), crossed with send_parts
    # one node: a further point at T=tokens for each: "rank-order" (the pull and push walking peers in rank
    # order, schedule.py), "pipelined-pull" (the pull's experimental PIPELINE, dispatch.py), "serial-combine"
    # (the combine's push and reduce in turn, a barrier between them: combine.py), "serial-dispatch" (the
    # dispatch's stage and pull in turn: dispatch.py), "doorbell-dispatch" (a full dispatch in one launch
    # before the count wait: mode.py, NormalMode.doorbell_dispatch), "tile-reduce" (the combine's
    # reduce summing a token's [R, BLOCK_C] tile, as before RANK_LOOP became the default: combine.py),
    # "reduce-warps-apart" (the one-launch combine's reduce waiting per warp: combine.py, WARPS_APART),
    # "single-push" (the one-launch combine's push on num_sms programs and its reduce on 3 x num_sms, the
    # split before 2026-11-28: choices.py, PUSH_PROGRAMS_PER_SM), "side-loads-after" (the pull loading an
    # item's scales and top-k rows after its x rows, the default before 2026-11-28: dispatch.py,
    # SIDE_FIRST), "gathered-index" (a full dispatch's pull gathering its receive index before its items:
    # dispatch.py, GATHER_INDEX), "full-one-launch" (a full dispatch as one launch after the count wait:
    # mode.py), "pull-Nx" (the pull in turn on N x num_sms programs, N = 1..4: choices.py, PULL_PROGRAMS_PER_SM),
    # "stage-Nx" (the stage in turn's copy programs likewise, N = 1..4: choices.py, STAGE_PROGRAMS_PER_SM),
    # "pulled-lists" (each list left in its source's workspace and read from there remotely, the default
    # before 2026-11-28d: receive_index.py, list_of; choices.py, PUSHED_LISTS), "small-one-launch"
    # (a full dispatch in one launch after its count wait where every rank's batch is at most
    # SMALL_ONE_LAUNCH_TOKENS, larger ones staged during the wait as by default: choices.py),
    # "notify-apart" (the count exchange launched apart from the stage, and from a num_worst_tokens
    # dispatch's one launch: choices.py, notify_with_stage)
    variants: List[str] = field(default_factory=list)
    # the full dispatch with num_worst_tokens = R x T too (no host wait), eagerly and as one CUDA
    # graph's replay: how an engine that captures its step (prefill, training) makes the call
    worst_tokens: bool = True


# The num_worst_tokens rows (the call's name, short for the table's first column)
WORST_EAGER, WORST_GRAPH = "dispatch, num_worst", "dispatch, num_worst, graph"


def _inter_node_rows(buffer, handle, in_rank) -> Dict[str, int]:
    """Rows this rank put over the network in a dispatch (its count row's per-node counts, other
    nodes: what ml_dispatch_send sends) beside the minimum (one per token and other node needing it)."""
    from ..backends.gpu.normal.two_level.rows import MetaRow
    from ..backends.gpu.normal.two_level.hierarchy import Topology, min_network_rows
    rank, topology = dist.get_rank(), Topology(buffer.group_size, buffer.ranks_per_node)
    state = handle.backend_state
    meta = MetaRow(topology.num_ranks, state.num_experts, topology.num_nodes, state.num_channels)
    per_node = state.table[rank, meta.per_node:meta.per_node + topology.num_nodes].cpu()
    sent = int(per_node.sum()) - int(per_node[topology.node_of(rank)])
    return {"rows": sent, "min_rows": min_network_rows(in_rank.cpu(), rank, topology)}


def _peer_configs(peer, how: str, sms: int, num_ranks: int):
    """``(dispatch config, combine config)`` of the peer library on ``sms`` SMs: its chunk sizes as
    epcomm's (``how="same"``), or its own recommended ones for ``num_ranks`` (``"recommended"``)."""
    if how == "same":
        return peer.Config(sms, 8, 256), peer.Config(sms, 8, 256)
    peer.Buffer.set_num_sms(sms)  # (the recommended configs take the class's SM count)
    return peer.Buffer.get_dispatch_config(num_ranks), peer.Buffer.get_combine_config(num_ranks)


def _normal_calls(buffer, config, combine_config, x, x_fp8, topk_idx, topk_weights, num_experts,
                  extensions: bool = False):
    """The five calls of the table, as closures over one buffer (epcomm or DeepEP: same API):
    the dispatches on ``config``, the combine on ``combine_config``. Returns ``(calls, full,
    is_token_in_rank, handle, dispatch_args)``: the full BF16 dispatch's outputs (``full``: recv_x,
    recv_topk_idx, recv_topk_weights) and keywords."""
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, num_experts)
    dispatch_args = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                         topk_idx=topk_idx, topk_weights=topk_weights, config=config)
    full = buffer.dispatch(x, **dispatch_args)
    recv_x, handle = full[0], full[4]
    fp8_handle = buffer.dispatch(x_fp8, **dispatch_args)[4]
    expert_out = recv_x
    calls = {
        "get_dispatch_layout": lambda: buffer.get_dispatch_layout(topk_idx, num_experts),
        "dispatch, full, BF16": lambda: buffer.dispatch(x, **dispatch_args),
        "dispatch, cached, BF16": lambda: buffer.dispatch(x, handle=handle, config=config),
        "dispatch, cached, FP8": lambda: buffer.dispatch(x_fp8, handle=fp8_handle, config=config),
        "combine, BF16": lambda: buffer.combine(expert_out, handle, config=combine_config),
    }
    if extensions:  # epcomm's own: the expert-major layout's cost beside the plain one
        em_rows, _, _, _, em_handle, _ = buffer.dispatch(x, expert_major=True, **dispatch_args)
        calls["dispatch, full, BF16, expert-major"] = lambda: buffer.dispatch(x, expert_major=True, **dispatch_args)
        calls["dispatch, cached, BF16, expert-major"] = lambda: buffer.dispatch(x, handle=em_handle, config=config)
        calls["combine, BF16, expert-major"] = lambda: buffer.combine(em_rows, em_handle, config=config)
    return calls, full[:3], in_rank, handle, dispatch_args


def _num_worst_calls(buffer, x, dispatch_args: Dict, num_worst: int, graph: bool = True, capture=None):
    """The full dispatch with ``num_worst_tokens`` (collective, as every bench call): ``(calls, received,
    failure)``. ``calls``: WORST_EAGER, and WORST_GRAPH (one CUDA graph's replay) where ``graph`` and
    the capture worked; ``received``: each form's (recv_x, recv_topk_idx, recv_topk_weights), num_worst
    rows each (the first ones received); ``failure``: as text, the exception of the first call (a
    library without num_worst_tokens: no rows) or of the capture, else None. Where a capture fails
    on any rank, every rank leaves the graph out (``_capture`` agrees across ranks)."""
    def worst():
        return buffer.dispatch(x, num_worst_tokens=num_worst, **dispatch_args)
    try:
        received = {WORST_EAGER: worst()[:3]}
    except TypeError as exc:  # a library without num_worst_tokens (before any exchange: alike on every rank)
        return {}, {}, f"{type(exc).__name__}: {str(exc)[:120]}"
    calls = {WORST_EAGER: worst}
    if not graph:
        return calls, received, None
    try:
        replay, out = (capture or _capture)(worst)
    except Exception as exc:  # reported in the checks, not hidden
        return calls, received, f"{type(exc).__name__}: {str(exc)[:120]}"
    replay.replay()
    calls[WORST_GRAPH], received[WORST_GRAPH] = replay.replay, out[:3]
    return calls, received, None


def _measure_num_worst(name: str, buffer, x, dispatch_args: Dict, num_worst: int, full_rows: torch.Tensor,
                       own_full: tuple, results: Dict, checks: Dict, reps: int, flush: torch.Tensor,
                       no_graph: set) -> None:
    """The num_worst_tokens rows of library ``name`` (:func:`_num_worst_calls`) measured into
    ``results``; into ``checks``, each form's received rows against ``full_rows`` (epcomm's full
    dispatch) and its top-k ids and weights against ``own_full``'s (this library's full dispatch:
    recv_x, recv_topk_idx, recv_topk_weights). The graph and the outputs are dropped on return. (A
    two-level Buffer refuses a captured call by design: no graph row there.) ``no_graph``: the
    libraries whose capture failed at an earlier point of the run, not captured again (a failed
    capture may leave a library's state behind); a failure here adds ``name``."""
    graph = getattr(buffer, "backend_name", "") != "nvshmem" and name not in no_graph
    calls, received, failure = _num_worst_calls(buffer, x, dispatch_args, num_worst, graph=graph)
    n = full_rows.shape[0]
    for call, (rows, topk_idx, topk_weights) in received.items():
        checks[f"{name} {call.split(', ', 1)[1]} == full"] = bool(
            torch.equal(rows[:n], full_rows) and torch.equal(topk_idx[:n], own_full[1]) and
            torch.equal(topk_weights[:n], own_full[2]))
    if failure is not None:
        checks[f"{name} num_worst_tokens " + ("graph capture" if calls else "call") + f" ({failure})"] = False
        no_graph.add(name)
    for call, fn in calls.items():
        results.setdefault(call, {"call": call})[name] = measure(fn, reps, flush)


def _bench_normal_point(settings: NormalBenchSettings, tokens: int, buffers: Dict, flush: torch.Tensor,
                        sms: int, no_graph: Optional[set] = None) -> Dict:
    """One table: every call of every library at ``tokens`` per rank on ``sms``, checked;
    ``no_graph``: the run's libraries whose num_worst_tokens capture failed (_measure_num_worst)."""
    from ..fp8 import per_token_cast_to_fp8
    rank = dist.get_rank()
    dev = torch.device("cuda", torch.cuda.current_device())
    g = torch.Generator(device=dev).manual_seed(settings.seed * 7919 + rank * 31 + tokens)
    x = torch.randn(tokens, settings.hidden, device=dev, generator=g).to(torch.bfloat16)
    scores = torch.randn(tokens, settings.num_experts, device=dev, generator=g).abs() + 1
    topk_idx = scores.topk(settings.num_topk, dim=-1).indices.to(torch.int64)
    topk_weights = torch.rand(tokens, settings.num_topk, device=dev, generator=g)
    x_fp8 = per_token_cast_to_fp8(x)
    results: Dict[str, Dict] = {}
    checks: Dict[str, bool] = {}
    epcomm_recv = None
    inter_node = None
    for name, (buffer, configs) in buffers.items():
        config, combine_config = configs(sms)
        calls, full, in_rank, handle, dispatch_args = _normal_calls(
            buffer, config, combine_config, x, x_fp8, topk_idx, topk_weights, settings.num_experts,
            extensions=name == "epcomm")
        recv_x = full[0]
        if name == "epcomm":
            epcomm_recv = recv_x
            if buffer.num_nodes > 1 and buffer.backend_name == "nvshmem":
                inter_node = _inter_node_rows(buffer, handle, in_rank)
                checks["inter-node rows == minimum"] = inter_node["rows"] == inter_node["min_rows"]
            baseline = NCCLBaseline(x, in_rank)
            base_recv = baseline.dispatch()
            combined = buffer.combine(recv_x, handle, config=config)[0]
            checks["epcomm == nccl (dispatch)"] = bool(torch.equal(recv_x, base_recv))
            checks["epcomm ~ nccl (combine)"] = bool(torch.allclose(combined.float(), baseline.combine(base_recv).float(),
                                                                    rtol=1e-2, atol=1e-2))
        else:
            checks[f"epcomm == {name} (dispatch)"] = bool(torch.equal(recv_x, epcomm_recv))
        for call, fn in calls.items():
            results.setdefault(call, {"call": call})[name] = measure(fn, settings.reps, flush)
        del calls
        if settings.worst_tokens:  # after the rows above: its graph and outputs live only while measured
            _measure_num_worst(name, buffer, x, dispatch_args, dist.get_world_size() * tokens, epcomm_recv, full,
                               results, checks, settings.reps, flush, set() if no_graph is None else no_graph)
    baseline = NCCLBaseline(x, buffers["epcomm"][0].get_dispatch_layout(topk_idx, settings.num_experts)[3])
    base_recv = baseline.dispatch()
    results["dispatch, full, BF16"]["nccl"] = measure(baseline.dispatch, settings.reps, flush)
    results["combine, BF16"]["nccl"] = measure(lambda: baseline.combine(base_recv), settings.reps, flush)
    # epcomm's own checks decide (beside NCCL, beside the peer, its num_worst_tokens rows); the peer's do not
    ok = torch.tensor([int(all(v for k, v in checks.items() if k.startswith("epcomm")))], device=dev)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    point = {"tokens": tokens, "sms": sms, "recv_tokens": int(epcomm_recv.shape[0]), "rows": list(results.values()),
             "checks": checks, "ok": bool(ok.item())}
    if inter_node is not None:  # BF16 rows of the dispatch; combine returns one row per (token, node) too
        from ..backends.gpu.normal.two_level.rows import RowLayout
        row_bytes = RowLayout(2 * settings.hidden, 0, settings.num_topk).row_bytes
        point["inter_node"] = dict(inter_node, bytes=inter_node["rows"] * row_bytes,
                                   min_bytes=inter_node["min_rows"] * row_bytes)
    return point


def bench_normal_rank(settings: NormalBenchSettings) -> Dict:
    import epcomm
    dev = torch.device("cuda", torch.cuda.current_device())
    if settings.ranks_per_node:  # virtual nodes: the multi-node backend, sized for the largest batch
        from ..backends.nvshmem import bytes_for_tokens
        most = max([settings.tokens] + list(settings.extra_tokens))
        rdma = bytes_for_tokens(most, dist.get_world_size(), settings.ranks_per_node, settings.num_experts,
                                settings.hidden, settings.num_topk)
        fast = epcomm.Buffer(dist.group.WORLD, num_rdma_bytes=rdma, backend="nvshmem",
                             ranks_per_node=settings.ranks_per_node)
    else:
        fast = epcomm.Buffer(dist.group.WORLD, num_nvl_bytes=settings.num_nvl_bytes)
    buffers = {"epcomm": (fast, lambda sms: (epcomm.Config(sms, 8, 256),) * 2)}  # (dispatch, combine)
    # DeepEP's internode kernels need real RDMA NICs: no peer on virtual nodes
    peer = load_peer(settings.peer) if not settings.ranks_per_node else None
    if peer is not None:
        R = dist.get_world_size()
        configs = lambda sms: _peer_configs(peer, settings.peer_configs, sms, R)  # noqa: E731
        hint = max(config.get_nvl_buffer_size_hint(settings.hidden * 2, R)
                   for sms in [settings.sms] + settings.more_sms for config in configs(sms))
        buffers[settings.peer] = (peer_buffer(peer, dist.group.WORLD, num_nvl_bytes=max(hint, 1 << 30)), configs)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    points = []
    result = {"world": dist.get_world_size(), "backend": buffers["epcomm"][0].backend_name,
              "device": torch.cuda.get_device_name(dev), "peer": settings.peer if peer is not None else None,
              "settings": asdict(settings)}
    started = time.time()
    no_graph: set = set()  # libraries whose num_worst_tokens capture failed: not captured again this run
    normal = getattr(buffers["epcomm"][0]._backend, "normal", None)  # (the nvshmem backend's TwoLevelMode)
    default_transport = (getattr(normal, "send_parts", None), getattr(normal, "p2p", None))
    runs = [(tokens, settings.sms, default_transport, None) for tokens in [settings.tokens] + [
        t for t in settings.extra_tokens if t != settings.tokens]]
    runs += [(settings.tokens, sms, default_transport, None) for sms in settings.more_sms if sms != settings.sms]
    if settings.send_parts or settings.p2p:  # the nvshmem backend's transport settings, crossed
        runs += [(settings.tokens, settings.sms, (parts, bool(p2p)), None)
                 for parts in settings.send_parts or [default_transport[0]]
                 for p2p in settings.p2p or [default_transport[1]] if (parts, bool(p2p)) != default_transport]
    runs += [(settings.tokens, settings.sms, default_transport, variant) for variant in settings.variants]
    for tokens, sms, (parts, p2p), variant in runs:
        if parts is not None:  # the nvshmem backend reads both at every launch
            normal.send_parts, normal.p2p = parts, p2p
        if hasattr(normal, "every_peer"):  # one node's variants (the plans of a shape are made per variant)
            use_normal_variants(normal, [variant] if variant else [])
        if dist.get_rank() == 0:
            print(f"[normal] T={tokens} num_sms={sms}" + (f" send_parts={parts} p2p={p2p}" if parts else "") +
                  (f" {variant}" if variant else "") + f" ({time.time() - started:.0f} s)", file=sys.stderr,
                  flush=True)
        points.append(dict(_bench_normal_point(settings, tokens, buffers, flush, sms, no_graph), send_parts=parts,
                           p2p=p2p, variant=variant))
        if dist.get_rank() == 0:  # each table as it is measured: a later point that fails loses none of it
            print(normal_table(dict(result, points=points[-1:])), file=sys.stderr, flush=True)
    buffers["epcomm"][0].destroy()
    if peer is not None:
        release_peer_buffers(buffers[settings.peer][0])
    return dict(result, points=points)


# ---------------------------------------------------------------------- low-latency mode
@dataclass
class LowLatencyBenchSettings:
    tokens: int = 128
    hidden: int = 7168
    num_topk: int = 8
    num_experts: int = 256
    reps: int = 50
    peer: Optional[str] = None
    seed: int = 0
    ranks_per_node: int = 0  # > 0: epcomm on nvshmem over virtual nodes, beside nvlink on one node
    decode_pairs: int = 100  # iterations of the decode-loop row
    # one node: a further epcomm column, "epcomm two-launch", every call's phases in two launches
    # (Tuning(ll_one_launch=False)) where the default runs an eager call in one
    two_launch: bool = False


def _ll_expert_out(recv):
    """Stand-in expert: the dequantised input, as bf16 [E_local, R*M, H]."""
    from ..fp8 import per_token_cast_back
    return per_token_cast_back(recv[0], recv[1])


def _capture(fn):
    """A CUDA graph of ``fn`` (warmed up on a side stream first), and its output. Collective: the
    ranks agree whether every capture worked (an all-reduce after it, reached whatever happened),
    and where one failed every rank raises (its own error, or a RuntimeError naming none), so no
    rank replays a graph whose peers have none and the ranks' later calls still pair up."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    dist.barrier()
    graph, out, error = torch.cuda.CUDAGraph(), None, None
    try:
        with torch.cuda.graph(graph):
            out = fn()
    except Exception as exc:  # (this rank's own; raised below, after the ranks agreed)
        error = exc
    torch.cuda.synchronize()
    captured = _on_every_rank(error is None)
    if error is not None:
        raise error
    if not captured:
        raise RuntimeError("the capture failed on another rank")
    return graph, out


def _on_every_rank(flag: bool) -> bool:
    """Whether ``flag`` holds on every rank (collective: an all-reduce of one int on this GPU)."""
    value = torch.tensor([int(flag)], device=torch.device("cuda", torch.cuda.current_device()))
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return bool(value.item())


def _kernel_times(fn, repeats: int = 5):
    """Device µs per call of each kernel ``fn`` launches (torch.profiler; rank 0 reports)."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    dist.barrier()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            # ranks start each call together, so receive kernels time their work, not a peer's lag
            dist.barrier()
            torch.cuda.synchronize()
            fn()
            torch.cuda.synchronize()
    kernels = []
    for evt in prof.key_averages():
        device_us = getattr(evt, "device_time_total", 0) or getattr(evt, "cuda_time_total", 0)
        if device_us > 0 and "nccl" not in evt.key.lower() and "memset" not in evt.key.lower():
            kernels.append((round(device_us / repeats, 1), evt.key.split("(")[0][:48]))
    return sorted(kernels, reverse=True)[:8]


def profiled_last(columns: Dict[str, Callable[[], Callable]], kernel_times: Callable[[Callable], list],
                  then: Optional[Callable[[], None]] = None) -> Dict[str, list]:
    """Every column measured (``columns[name]()`` returns the call to profile), then ``then()``, and
    only then each column's ``kernel_times``: a torch.profiler session (CUPTI) can leave later
    launches slower on the host (until 2026-11-28h every column but the first was timed after one)."""
    measured = {name: column() for name, column in columns.items()}
    if then is not None:
        then()
    return {name: kernel_times(fn) for name, fn in measured.items()}


def bench_low_latency_rank(settings: LowLatencyBenchSettings) -> Dict:
    """LL dispatch (FP8) / combine (BF16) / round trip eager and in a CUDA graph, beside the NCCL
    baseline and the peer, checked against the torch_dist reference backend on the same data."""
    import epcomm
    R, rank = dist.get_world_size(), dist.get_rank()
    dev = torch.device("cuda", torch.cuda.current_device())
    T, H, K, E = settings.tokens, settings.hidden, settings.num_topk, settings.num_experts
    size = epcomm.Buffer.get_low_latency_rdma_size_hint(T, H, R, E)
    checks: Dict[str, bool] = {}
    if settings.ranks_per_node:  # multi-node on virtual nodes, and the one-node backend beside it
        # NVSHMEM sizes its heap once, at the first allocation: room for both buffers (the nvlink
        # one is allocated there too once NVSHMEM is PyTorch's symmetric-memory backend)
        from ..backends.gpu.workspace import Workspace
        from ..backends.nvshmem.backend import NvshmemBackend
        heap = NvshmemBackend.allocation_bytes(size, size, R, settings.ranks_per_node) + \
            Workspace.size_for(R, 0, size) + (512 << 20)
        os.environ.setdefault("NVSHMEM_SYMMETRIC_SIZE", str(heap))
        buffers = {"epcomm": epcomm.Buffer(dist.group.WORLD, low_latency_mode=True, num_rdma_bytes=size,
                                           backend="nvshmem", ranks_per_node=settings.ranks_per_node)}
        try:  # after NVSHMEM became the symmetric-memory backend: its memory serves NVLink stores too
            buffers["nvlink"] = epcomm.Buffer(dist.group.WORLD, low_latency_mode=True, num_rdma_bytes=size,
                                              backend="nvlink")
        except Exception as exc:  # reported, not hidden
            checks[f"nvlink beside nvshmem ({type(exc).__name__}: {str(exc)[:120]})"] = False
    else:
        buffers = {"epcomm": epcomm.Buffer(dist.group.WORLD, low_latency_mode=True, num_rdma_bytes=size)}
        if settings.two_launch:
            buffers["epcomm two-launch"] = epcomm.Buffer(dist.group.WORLD, low_latency_mode=True, num_rdma_bytes=size,
                                                         tuning=epcomm.Tuning(ll_one_launch=False))
    peer = load_peer(settings.peer) if not settings.ranks_per_node else None
    if peer is not None:
        buffers[settings.peer] = peer_buffer(peer, dist.group.WORLD, low_latency_mode=True, num_qps_per_rank=E // R,
                                             num_rdma_bytes=peer.Buffer.get_low_latency_rdma_size_hint(T, H, R, E))
    reference = epcomm.Buffer(dist.group.WORLD, low_latency_mode=True, backend="torch_dist")
    x, topk_idx, topk_weights = random_batch(T, H, K, E, settings.seed * 7919 + rank, dev)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev)

    def round_trip(buf, expert_out=None):
        recv, count, handle, _, _ = buf.low_latency_dispatch(x, topk_idx, T, E, use_fp8=True)
        y = expert_out if expert_out is not None else _ll_expert_out(recv)
        return buf.low_latency_combine(y, topk_idx, topk_weights, handle)[0]

    want = round_trip(reference)
    rows: Dict[str, Dict] = {}
    decode_loop: Dict[str, Dict[str, float]] = {}

    def measure_column(name, buffer):
        """The column's rows, decode loop and graph; returns its eager round trip (for its kernels)."""
        out = round_trip(buffer)
        error = float((out.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30))
        checks[f"{name} round trip vs reference (rel. error {error:.1e})"] = error < 1e-2
        recv, count, handle, _, _ = buffer.low_latency_dispatch(x, topk_idx, T, E, use_fp8=True)
        expert_out = _ll_expert_out(recv)
        calls = {
            "low_latency_dispatch": lambda: buffer.low_latency_dispatch(x, topk_idx, T, E, use_fp8=True),
            "low_latency_combine": lambda: buffer.low_latency_combine(expert_out, topk_idx, topk_weights, handle),
            "round trip, eager": lambda: round_trip(buffer, expert_out),
        }
        for call, fn in calls.items():
            rows.setdefault(call, {"call": call})[name] = measure(fn, settings.reps, flush)
        decode_loop[name] = measure_decode_loop(lambda: round_trip(buffer, expert_out), settings.decode_pairs)
        try:
            graph, graph_out = _capture(lambda: round_trip(buffer))
            graph.replay()
            torch.cuda.synchronize()
            checks[f"{name} graph replay == eager"] = bool(torch.allclose(graph_out.float(), out.float(), rtol=1e-2,
                                                                          atol=1e-2))
            timed, _ = _capture(lambda: round_trip(buffer, expert_out))
            rows.setdefault("round trip, one CUDA graph", {"call": "round trip, one CUDA graph"})[name] = \
                measure(timed.replay, settings.reps, flush)
        except Exception as exc:  # reported, not hidden
            checks[f"{name} graph capture ({type(exc).__name__}: {str(exc)[:120]})"] = False
        return lambda: round_trip(buffer, expert_out)

    def measure_nccl():  # (the baseline's rows, also before any profile)
        in_rank = torch.zeros(T, R, dtype=torch.bool, device=dev)
        in_rank.scatter_(1, topk_idx // (E // R), True)
        baseline = NCCLBaseline(x, in_rank)
        base_recv = baseline.dispatch()
        rows["low_latency_dispatch"]["nccl"] = measure(baseline.dispatch, settings.reps, flush)
        rows["low_latency_combine"]["nccl"] = measure(lambda: baseline.combine(base_recv), settings.reps, flush)

    columns = {name: functools.partial(measure_column, name, buffer) for name, buffer in buffers.items()}
    kernels = profiled_last(columns, _kernel_times, then=measure_nccl)
    ok = torch.tensor([int(all(v for k, v in checks.items() if k.startswith("epcomm")))], device=dev)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    if peer is not None:
        release_peer_buffers(buffers[settings.peer])
    second = settings.peer if peer is not None else "nvlink" if "nvlink" in buffers else None
    return {"world": R, "backend": buffers["epcomm"].backend_name, "device": torch.cuda.get_device_name(dev),
            "peer": second, "settings": asdict(settings), "rows": list(rows.values()), "checks": checks,
            "kernels_us_per_round_trip": kernels, "decode_loop": decode_loop, "ok": bool(ok.item())}


# ---------------------------------------------------------------------- CLI
MODE_DESCRIPTIONS = {
    "normal": "Normal mode on this machine's GPUs (2 or more CUDA GPUs): get_dispatch_layout, dispatch (full, "
              "cached, FP8) and combine, host / gpu / synced µs per call beside the NCCL baseline (and DeepEP "
              "with --peer), at --tokens and each of --extra-tokens, a table per --sms setting; with "
              "--ranks-per-node, on virtual nodes (the nvshmem backend), a table per --send-parts x --p2p setting.",
    "low-latency": "Low-latency mode on this machine's GPUs (2 or more CUDA GPUs): dispatch + combine round "
                   "trips at --tokens (default 128) per rank, eager and in a CUDA graph, beside the NCCL "
                   "baseline (and DeepEP with --peer); with --ranks-per-node, on virtual nodes beside nvlink.",
}


NORMAL_VARIANTS = ("rank-order", "pipelined-pull", "serial-combine", "serial-dispatch", "doorbell-dispatch",
                   "tile-reduce", "reduce-warps-apart", "single-push",
                   "side-loads-after", "gathered-index", "full-one-launch", "pull-1x", "pull-2x", "pull-3x",
                   "pull-4x", "stage-1x", "stage-2x", "stage-3x", "stage-4x",
                   "pulled-lists", "small-one-launch", "notify-apart")  # NormalBenchSettings.variants


def normal_variants(text: str) -> List[str]:
    """The entries of a comma list of NORMAL_VARIANTS, each one name or several joined by ``+``
    (``side-loads-after+pull-1x``: one point with both set); ValueError naming the choices
    for any other."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [part for name in names for part in name.split("+") if part not in NORMAL_VARIANTS]
    if unknown:
        raise ValueError(f"unknown normal-mode variant(s) {unknown}: choose from {', '.join(NORMAL_VARIANTS)}")
    return names


def use_normal_variants(normal, variants: Sequence[str]) -> None:
    """Sets a one-node NormalMode (backends/gpu/normal/one_node/mode.py) to ``variants``, names of
    NORMAL_VARIANTS (each away from a default; none: the defaults; an entry may join several by
    ``+``): the bench's points, one entry each, scripts/kernels_alone.py and the shared-GPU bed's
    ``EPCOMM_SHARED_GPU_VARIANT``. Every rank of a group must set the same."""
    from ..backends.gpu.normal.one_node import choices  # (loaded already: the NormalMode's defaults)
    variants = [part for name in normal_variants(",".join(variants)) for part in name.split("+")]  # (checked)
    normal.every_peer = "rank-order" not in variants
    normal.pipelined_pull = "pipelined-pull" in variants
    normal.overlapped_combine = "serial-combine" not in variants
    normal.overlapped_dispatch = "serial-dispatch" not in variants
    normal.doorbell_dispatch = "doorbell-dispatch" in variants
    normal.rank_loop_reduce = "tile-reduce" not in variants
    normal.reduce_warps_apart = "reduce-warps-apart" in variants
    normal.side_loads_first = "side-loads-after" not in variants
    normal.gathered_index = "gathered-index" in variants
    normal.full_one_launch = "full-one-launch" in variants or "small-one-launch" in variants
    normal.one_launch_tokens = choices.SMALL_ONE_LAUNCH_TOKENS if "small-one-launch" in variants else 0
    normal.pushed_lists = "pulled-lists" not in variants
    normal.notify_with_stage = "notify-apart" not in variants
    normal.stage_programs_per_sm = next((n for n in (1, 2, 3, 4) if f"stage-{n}x" in variants),
                                        choices.STAGE_PROGRAMS_PER_SM)
    normal.pull_programs_per_sm = next((n for n in (1, 2, 3, 4) if f"pull-{n}x" in variants),
                                       choices.PULL_PROGRAMS_PER_SM)
    normal.combine_split = (1, 3) if "single-push" in variants else (choices.PUSH_PROGRAMS_PER_SM,
                                                                     choices.REDUCE_PROGRAMS_PER_SM)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``epcomm bench`` (shared by the ``epcomm`` command and :func:`main`): one
    sub-command per mode, each with its own ``--help``."""
    modes = parser.add_subparsers(dest="mode", required=True, metavar="{normal,low-latency}")
    for mode, description in MODE_DESCRIPTIONS.items():
        _add_mode_arguments(modes.add_parser(mode, help=description.split(":")[0], description=description,
                                             formatter_class=argparse.ArgumentDefaultsHelpFormatter), mode)


def _add_mode_arguments(parser: argparse.ArgumentParser, mode: str) -> None:
    """Each mode's own options only (``epcomm bench low-latency --help`` lists no normal-mode one)."""
    from .args import non_negative_int, positive_int, switch_list, token_list

    def variant_list(text: str):
        try:
            return normal_variants(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    normal = mode == "normal"
    parser.add_argument("--tokens", type=non_negative_int, default=0,
                        help=f"tokens per rank (0: {4096 if normal else 128})")
    parser.add_argument("--hidden", type=positive_int, default=7168, help="hidden size H")
    if normal:
        parser.add_argument("--sms", type=token_list, default="24",
                            help="Config num_sms, comma-separated: the first for every token count, each further "
                                 "one a table of its own at --tokens")
        parser.add_argument("--extra-tokens", type=token_list, default="512",
                            help="more token counts to run, comma-separated ('' for none)")
    parser.add_argument("--reps", type=positive_int, default=30,
                        help="calls per batch of back-to-back calls (host and gpu: the least of 3 batches; "
                             "synced: half as many single calls, at least 10)" + ("" if normal else " (at least 20)"))
    parser.add_argument("--peer", choices=["deep_ep"], default=None,
                        help="also run this library on the same data (needs it importable)")
    if normal:
        parser.add_argument("--peer-configs", choices=["same", "recommended"], default="same",
                            help="the peer's chunk sizes: same (Config(sms, 8, 256), as epcomm's) or "
                                 "recommended (its own get_dispatch_config / get_combine_config for the group's "
                                 "size, on the same --sms)")
    parser.add_argument("--ranks", type=non_negative_int, default=0,
                        help="ranks to use (0: all GPUs; with --shared-gpu, 2)")
    parser.add_argument("--shared-gpu", action="store_true",
                        help="every rank on GPU 0 under CUDA MPS (scripts/shared_gpu.sh host): the host column "
                             "compares libraries, gpu and synced are shared SMs', not speed; EPCOMM_BACKEND=nvlink "
                             "for the one-node kernels (the automatic choice there is nvshmem)")
    if normal:
        parser.add_argument("--send-parts", type=token_list, default="",
                            help="nvshmem (--ranks-per-node): further send_parts settings, each a table of its own "
                                 "at --tokens (programs per channel and node of the puts between nodes)")
        parser.add_argument("--variants", type=variant_list, default="",
                            help="one node: a further table at --tokens for each, in the same run: rank-order (the "
                                 "pull and push walking peers in rank order, the schedule before every peer at "
                                 "once), pipelined-pull (the pull's experiment: next loads before these stores), "
                                 "serial-combine (the combine's push and reduce in turn instead of overlapped), "
                                 "serial-dispatch (the dispatch's stage and pull in turn), doorbell-dispatch (a "
                                 "full dispatch in one launch before its count wait), tile-reduce (the "
                                 "combine's reduce summing each token's [ranks, columns] tile, across warps at 8 "
                                 "ranks: the default before RANK_LOOP), reduce-warps-apart (the one-launch "
                                 "combine's reduce deciding its waits per warp, no barrier per chunk), single-push (the "
                                 "one-launch combine's push on num_sms programs and its reduce on 3 x num_sms, "
                                 "instead of 2 x num_sms each), side-loads-after (the pull loading an item's "
                                 "scales and top-k rows after its x rows, the default before 2026-11-28), "
                                 "gathered-index (a full dispatch's pull gathering its receive index before its "
                                 "items), full-one-launch (a full dispatch in one launch after its count wait), "
                                 "pull-1x ... pull-4x (the pull in turn on N x num_sms programs; default 3), stage-1x ... "
                                 "stage-4x (the stage in turn's copy programs, likewise; default 2), pulled-lists (each "
                                 "token list left at its source, read remotely: the default before 2026-11-28d), "
                                 "small-one-launch (full-one-launch where every rank's batch is at most 1024 tokens, "
                                 "larger ones staged during the count wait as by default), notify-apart (a full "
                                 "dispatch's count exchange launched apart from its stage, and from a num_worst_tokens "
                                 "dispatch's one launch: the default before 2026-11-29); join several with + for one "
                                 "table")
        parser.add_argument("--no-worst-tokens", action="store_true",
                            help="leave out the full dispatch with num_worst_tokens = ranks x tokens (no host wait), "
                                 "eager and as one CUDA graph's replay, for every library")
        parser.add_argument("--p2p", type=switch_list, default="",
                            help="nvshmem (--ranks-per-node): p2p settings crossed with --send-parts, each a table "
                                 "of its own at --tokens (1: rows stored straight into a peer mapped here, 0: staged "
                                 "and put, as between hosts)")
    if not normal:
        parser.add_argument("--two-launch", action="store_true",
                            help="one node: a further epcomm column in the same run, every call's send and receive "
                                 "phases in two launches (the default runs an eager call in one)")
    parser.add_argument("--ranks-per-node", type=non_negative_int, default=0,
                        help="virtual nodes of this many ranks, on the nvshmem backend" +
                             ("" if normal else ", with nvlink on one node beside it") + "; 0: one node")
    parser.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for JSON and PNG results")


def run(args: argparse.Namespace) -> int:
    """Run the benchmark described by parsed ``args``; prints the table, returns the exit code."""
    if not torch.cuda.is_available() or torch.cuda.device_count() < (1 if args.shared_gpu else 2):
        print("epcomm bench needs at least 2 CUDA GPUs (1 with --shared-gpu)", file=sys.stderr)
        return 2
    if args.shared_gpu and args.mode == "low-latency" and args.peer:
        print(NO_PEER_LOW_LATENCY_ON_SHARED_GPU, file=sys.stderr)
        return 2
    from ..testing import run_distributed
    from ..testing.launcher import SHARED_GPU
    world = args.ranks or (2 if args.shared_gpu else torch.cuda.device_count())
    backend = SHARED_GPU if args.shared_gpu else "nccl"
    os.makedirs(args.out, exist_ok=True)
    if args.mode == "low-latency":
        settings = LowLatencyBenchSettings(tokens=args.tokens or 128, hidden=args.hidden, reps=max(args.reps, 20),
                                           peer=args.peer, ranks_per_node=args.ranks_per_node,
                                           two_launch=args.two_launch)
        if args.two_launch and args.ranks_per_node:
            print("--two-launch is the one-node kernels' (the nvlink backend); leave out --ranks-per-node",
                  file=sys.stderr)
            return 2
        _say_shared(args.shared_gpu, world)
        result = run_distributed(bench_low_latency_rank, world, settings, backend=backend, timeout_s=900)[0]
        with open(os.path.join(args.out, "bench_low_latency.json"), "w") as f:
            json.dump(result, f, indent=1)
        print(low_latency_table(result))
        return 0 if result["ok"] else 1
    if not args.sms:
        print("--sms needs at least one value", file=sys.stderr)
        return 2
    settings = NormalBenchSettings(tokens=args.tokens or 4096, hidden=args.hidden, reps=args.reps, sms=args.sms[0],
                                   more_sms=list(args.sms[1:]),
                                   extra_tokens=list(args.extra_tokens), peer=args.peer, peer_configs=args.peer_configs,
                                   ranks_per_node=args.ranks_per_node, send_parts=list(args.send_parts),
                                   p2p=list(args.p2p), variants=list(args.variants),
                                   worst_tokens=not args.no_worst_tokens)
    if args.variants and args.ranks_per_node:
        print("--variants are the one-node kernels' (the nvlink backend); leave out --ranks-per-node", file=sys.stderr)
        return 2
    if (args.send_parts or args.p2p) and not args.ranks_per_node:
        print("--send-parts and --p2p need --ranks-per-node (the nvshmem backend)", file=sys.stderr)
        return 2
    _say_shared(args.shared_gpu, world)
    result = with_every_rank(run_distributed(bench_normal_rank, world, settings, backend=backend, timeout_s=1800))
    with open(os.path.join(args.out, "bench_normal.json"), "w") as f:
        json.dump(result, f, indent=1)
    plot_normal(result, os.path.join(args.out, "bench_normal.png"))
    print(normal_table(result))
    return 0 if all(p["ok"] for p in result["points"]) else 1


def _say_shared(shared_gpu: bool, world: int) -> None:
    if shared_gpu:
        print(f"# {world} ranks share GPU 0 (--shared-gpu): compare the host column; gpu and synced are not speed")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="epcomm bench", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))
