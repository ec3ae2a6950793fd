"""What the loopback cases share: running ranks as threads of this process over one GPU (the
``LoopbackWorld`` itself is backends/gpu/reach/transport.py's), and reporting a failure (signal
words, row differences). The cases are in loopback_cases.py and loopback_faults.py; the runner in
loopback_suite.py."""
from __future__ import annotations

import threading
from typing import Callable, List, Optional

import torch

from epcomm.backends.nvshmem.backend import NvshmemBackend
from epcomm.backends.gpu.reach.transport import LoopbackWorld


def run_ranks(num_ranks: int, ranks_per_node: int, fn: Callable[[int, NvshmemBackend], object], num_bytes: int,
              timeout_s: float = 20.0, device: Optional[torch.device] = None,
              warm: Optional[Callable[[NvshmemBackend], None]] = None, num_ll_bytes: int = 0,
              ll_ranks_per_node: Optional[int] = None, send_parts: int = 1, p2p: bool = False,
              buffers: int = 1, shrink: bool = False) -> List[object]:
    """``fn(rank, backend)`` for every rank, each in its own thread and CUDA stream, over one
    :class:`LoopbackWorld`; returns the results by rank, or raises the first rank's exception.
    ``warm(backend)`` runs first, in this thread: compile the kernels ``fn`` will launch there,
    since a rank compiling inside ``fn`` holds up the others' waits (by seconds per kernel).
    ``num_ll_bytes``: the backends' low-latency workspace (0: none); ``send_parts``: programs per
    (channel, node) of a dispatch's send; ``p2p``: rows for another node stored straight into its
    workspace (NvshmemBackend; every loopback workspace is mapped, so False keeps the puts that
    ranks on other hosts take). ``buffers`` > 1: that many backends per rank, as Buffers of one
    group (their own workspaces, one call board per rank); ``fn`` then gets the list. ``shrink``: the
    Buffer's ``enable_shrink`` (a late rank masked in low-latency mode; without it, reported)."""
    device = device or torch.device("cuda", torch.cuda.current_device())
    worlds = [LoopbackWorld(num_ranks, device,
                            NvshmemBackend.allocation_bytes(num_bytes, num_ll_bytes, num_ranks, ranks_per_node))
              for _ in range(buffers)]
    for world in worlds[1:]:
        world.call_boards = worlds[0].call_boards  # one group: the ranks' boards are shared
    per_rank = [[NvshmemBackend(None, device, num_bytes, ranks_per_node, timeout_s, world.transport(rank),
                                num_ll_bytes=num_ll_bytes, ll_ranks_per_node=ll_ranks_per_node,
                                send_parts=send_parts, p2p=p2p, shrink=shrink) for world in worlds]
                for rank in range(num_ranks)]
    backends = [mine[0] if buffers == 1 else mine for mine in per_rank]
    if warm is not None:
        warm(per_rank[0][0])  # compiled kernels are shared by every backend of the process
    results: List[object] = [None] * num_ranks
    errors: List[Optional[BaseException]] = [None] * num_ranks

    def worker(rank: int) -> None:
        torch.cuda.set_device(device)
        with torch.cuda.stream(torch.cuda.Stream(device)):
            try:
                results[rank] = fn(rank, backends[rank])
                wait_stream(device)
            except BaseException as exc:  # reported to the caller below
                errors[rank] = exc

    threads = [threading.Thread(target=worker, args=(rank,), daemon=True) for rank in range(num_ranks)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    failed = [(rank, exc) for rank, exc in enumerate(errors) if exc is not None]
    if failed:  # every rank's error: a rank that died first makes the others time out
        first = next((item for item in failed if "exceeded" not in str(item[1])), failed[0])
        shown = "; ".join(f"rank {rank}: {type(exc).__name__}: {exc}" for rank, exc in failed)
        torch.cuda.synchronize(device)
        words = "\n".join(signal_words(backend) for mine in per_rank for backend in mine)
        raise RuntimeError(f"loopback ranks failed: {shown}\nsignal words after the failure:\n{words}") from first[1]
    return results


def wait_stream(device: torch.device) -> None:
    """Wait for this thread's current stream without holding the GIL: a rank that blocks in a
    synchronising call that keeps the GIL (``tolist()`` does) stops the other ranks' threads from
    launching the kernels its own spinning kernels wait for — the waits then time out."""
    import time
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(device))
    while not done.query():
        time.sleep(1e-4)


def signal_words(backend: NvshmemBackend) -> str:
    """One rank's epoch and the nonzero words of its fixed signal areas (what a timed-out wait read)."""
    pre, buffer = backend.pre, backend.t.buffer
    areas = [("step", pre.step_rows, pre.fingerprint), ("notify", pre.notify_signals, pre.dispatch_signals),
             ("dispatch", pre.dispatch_signals, pre.push_flags), ("push", pre.push_flags, pre.home_signals),
             ("home", pre.home_signals, pre.data)]
    parts = [f"rank {backend.rank} epoch {backend.normal.epoch}"]
    for name, lo, hi in areas:
        values = buffer[lo:hi].view(torch.int64).cpu()
        if name == "step":
            values = values.view(-1, 4)[:, 2]
        nonzero = values.nonzero().flatten().tolist()
        parts.append(f"{name} " + " ".join(f"[{i}]={int(values[i])}" for i in nonzero))
    return "; ".join(parts)


def low_latency_words(backend: NvshmemBackend, num_experts: int) -> str:
    """One rank's low-latency epochs, combine flags and count words (both halves; nonzero ones as
    source:local expert=epoch/messages): what a timed-out wait read."""
    from epcomm.backends.gpu import sync
    ws, R = backend.ll_ws, backend.num_ranks
    state = backend.state.cpu().tolist()
    words = ws.buffer.view(torch.int64)
    flags = words[sync.FLAGS_LL_COMBINE * R:(sync.FLAGS_LL_COMBINE + 1) * R].tolist()
    parts = [f"rank {backend.rank} epochs dispatch {state[sync.EPOCH_LL_DISPATCH]} combine "
             f"{state[sync.EPOCH_LL_COMBINE]} halves {state[sync.LL_DISPATCH_HALF_EPOCH:sync.LL_DISPATCH_HALF_EPOCH + 2]}"
             f" {state[sync.LL_COMBINE_HALF_EPOCH:sync.LL_COMBINE_HALF_EPOCH + 2]}; combine flags {flags}"]
    num_local = num_experts // R
    for half in (0, 1):
        start = ws.ll_half_offset(half) // 8
        counts = words[start:start + num_experts].tolist()
        shown = " ".join(f"{i // num_local}:{i % num_local}={c >> 32}/{c & 0xFFFFFFFF}" for i, c in enumerate(counts))
        parts.append(f"half {half} counts {shown}")
    return "; ".join(parts)


def to_cpu(value):
    if isinstance(value, tuple):
        return tuple(v.cpu() for v in value)
    return None if value is None else value.cpu()


class HandleView:
    """The two index tensors of a LowLatencyHandle that ``sweeps._ll_rows`` reads (CPU copies)."""

    def __init__(self, recv_src_info: torch.Tensor, recv_layout_range: torch.Tensor):
        self.recv_src_info, self.recv_layout_range = recv_src_info, recv_layout_range


def differing_rows(got, want) -> str:
    """Which rows differ (a hint for a failing comparison): their indices, and how many are zero."""
    got, want = (got[0], want[0]) if isinstance(want, tuple) else (got, want)
    got = got.contiguous().view(torch.uint8).reshape(len(want), -1)
    want = want.contiguous().view(torch.uint8).reshape(len(want), -1)
    rows = (got != want).any(1).nonzero().flatten()
    zero = int((got[rows] == 0).all(1).sum()) if len(rows) else 0
    return f"{len(rows)} of {len(want)} rows differ: {rows[:12].tolist()}, {zero} of them all zero"


def xs_home(x, use_fp8: bool) -> torch.Tensor:
    """The bf16 rows a rank's experts see for its own tokens (FP8 inputs dequantised, as the
    dispatch receivers do above)."""
    if not use_fp8:
        return x
    values, scales = x
    return (values.float() * scales.repeat_interleave(128, dim=1)).to(torch.bfloat16)


def bits16(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)
