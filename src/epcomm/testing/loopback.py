"""The multi-node backend's kernels on one GPU: every rank a thread of this process (loopback
transport, backends/nvshmem/transport.py), checked against the references.

Run it as ``python -m epcomm.testing.loopback [--topology R,k ...]``: it runs in a process with
``CUDA_MODULE_LOADING=EAGER`` (it starts one if needed). Under CUDA's default lazy loading, the
first launch of any kernel loads its module, and that waits for the GPU's running kernels —
here, another rank's kernels spinning until this rank's next launch: they time out, or hand on
stale rows. (Separate processes, as with NVSHMEM, have separate contexts and do not meet this.)

NVSHMEM itself needs one GPU per process, so this is how the kernels' logic — layouts, offsets,
masks, the order of rows and sums, the signals between hops — is tested where only one GPU is
lent; the NVSHMEM puts themselves are exercised by the GPU suite on two GPUs. Each case compares
every rank's dispatch bitwise with the one-level reference (rows, top-k, weights, source indices,
rank_prefix_matrix, receive counts), a cached dispatch with the full one, and the combine with the
two-level model (bitwise: the same float32 sums in the same order) and with the one-level
reference (within bf16 rounding).
"""
from __future__ import annotations

import threading
from typing import Callable, List, Optional

import torch

from ..backends.base import DispatchArgs
from ..backends.nvshmem.backend import NvshmemBackend
from ..backends.nvshmem.transport import LoopbackWorld
from ..backends.nvshmem.workspace import bytes_for_tokens
from ..config import Config
from ..layout import dispatch_layout
from .reference import reference_combine, reference_dispatch
from .sweeps import _equal_payload, make_routing, rank_fn, to_fp8_input
from .two_level import two_level_combine, two_level_dispatch


def run_ranks(num_ranks: int, ranks_per_node: int, fn: Callable[[int, NvshmemBackend], object], num_bytes: int,
              timeout_s: float = 20.0, device: Optional[torch.device] = None,
              warm: Optional[Callable[[NvshmemBackend], None]] = None) -> List[object]:
    """``fn(rank, backend)`` for every rank, each in its own thread and CUDA stream, over one
    :class:`LoopbackWorld`; returns the results by rank, or raises the first rank's exception.
    ``warm(backend)`` runs first, in this thread: compile the kernels ``fn`` will launch there,
    since a rank compiling inside ``fn`` holds up the others' waits (by seconds per kernel)."""
    device = device or torch.device("cuda", torch.cuda.current_device())
    world = LoopbackWorld(num_ranks, device, num_bytes)
    backends = [NvshmemBackend(None, device, num_bytes, ranks_per_node, timeout_s, world.transport(rank))
                for rank in range(num_ranks)]
    if warm is not None:
        warm(backends[0])  # compiled kernels are shared by every backend of the process
    results: List[object] = [None] * num_ranks
    errors: List[Optional[BaseException]] = [None] * num_ranks

    def worker(rank: int) -> None:
        torch.cuda.set_device(device)
        with torch.cuda.stream(torch.cuda.Stream(device)):
            try:
                results[rank] = fn(rank, backends[rank])
                torch.cuda.current_stream(device).synchronize()
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
        words = "\n".join(signal_words(backend) for backend in backends)
        raise RuntimeError(f"loopback ranks failed: {shown}\nsignal words after the failure:\n{words}") from first[1]
    return results


def signal_words(backend: NvshmemBackend) -> str:
    """One rank's epoch and the nonzero words of its fixed signal areas (what a timed-out wait read)."""
    pre, buffer = backend.pre, backend.t.buffer
    areas = [("step", pre.step_rows, pre.fingerprint), ("notify", pre.notify_signals, pre.dispatch_signals),
             ("dispatch", pre.dispatch_signals, pre.push_flags), ("push", pre.push_flags, pre.home_signals),
             ("home", pre.home_signals, pre.data)]
    parts = [f"rank {backend.rank} epoch {backend.epoch}"]
    for name, lo, hi in areas:
        values = buffer[lo:hi].view(torch.int64).cpu()
        if name == "step":
            values = values.view(-1, 4)[:, 2]
        nonzero = values.nonzero().flatten().tolist()
        parts.append(f"{name} " + " ".join(f"[{i}]={int(values[i])}" for i in nonzero))
    return "; ".join(parts)


def _cpu(value):
    if isinstance(value, tuple):
        return tuple(v.cpu() for v in value)
    return None if value is None else value.cpu()


def normal_case(seed: int, num_ranks: int, ranks_per_node: int, scenario: str = "uniform", hidden: int = 256,
                num_experts: int = 16, num_topk: int = 4, max_tokens: int = 40, use_fp8: bool = False,
                with_weights: bool = True, num_bias: int = 0, num_worst_tokens: int = 0, num_channels: int = 2,
                expert_alignment: int = 1, device: Optional[torch.device] = None) -> None:
    """One multi-node dispatch + cached dispatch + combine on loopback ranks; raises AssertionError
    naming what differs from the references."""
    device = device or torch.device("cuda", torch.cuda.current_device())
    xs, topks, weights = make_routing(seed, scenario, num_ranks, num_experts, num_topk, max_tokens, hidden)
    inputs = [to_fp8_input(x, column_major=seed % 2 == 1) for x in xs] if use_fp8 else xs
    expected = reference_dispatch(inputs, topks, weights if with_weights else [None] * num_ranks, num_experts,
                                  expert_alignment)
    model = two_level_dispatch(inputs, topks, weights, num_experts, ranks_per_node, num_channels)
    biases = [[(torch.randn(len(x), hidden) * (b + 1)).to(torch.bfloat16) for b in range(num_bias)] for x in xs]
    config = Config(num_sms=2 * num_channels)
    num_bytes = bytes_for_tokens(max(max_tokens, 1), num_ranks, ranks_per_node, num_experts, hidden, num_topk)

    x_bytes = hidden if use_fp8 else 2 * hidden
    num_scales = hidden // 128 if use_fp8 else 0
    num_topk_sent = num_topk if with_weights else 0

    def warm(backend: NvshmemBackend) -> None:
        backend._dispatch_plan(x_bytes, num_scales, num_topk_sent, num_experts, num_channels, False)
        backend._dispatch_plan(x_bytes, num_scales, 0, num_experts, num_channels, True)
        backend._combine_plan(hidden, num_topk_sent, num_bias, num_channels)

    def rank_body(rank: int, backend: NvshmemBackend):
        x = tuple(t.to(device) for t in inputs[rank]) if use_fp8 else inputs[rank].to(device)
        topk = topks[rank].to(device)
        per_rank, _, per_expert, in_rank = dispatch_layout(topk, num_experts, num_ranks)
        w = weights[rank].to(device) if with_weights else None
        args = DispatchArgs(x=x, handle=None, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                            num_tokens_per_expert=per_expert, topk_idx=topk if with_weights else None,
                            topk_weights=w, expert_alignment=expert_alignment, num_worst_tokens=num_worst_tokens,
                            config=config)
        backend.check_dispatch(args)
        result = backend.dispatch(args)
        handle = result.handle
        cached_args = DispatchArgs(x=x, handle=handle, num_tokens_per_rank=None, is_token_in_rank=None,
                                   num_tokens_per_expert=None, topk_idx=None, topk_weights=None, expert_alignment=1,
                                   num_worst_tokens=0, config=config)
        backend.check_dispatch(cached_args)
        cached = backend.dispatch(cached_args)
        recv = result.recv_x[0] if use_fp8 else result.recv_x
        values = recv.float() if not use_fp8 else recv.float() * result.recv_x[1].repeat_interleave(128, dim=1)
        y = rank_fn(rank, values.to(torch.bfloat16))
        bias = tuple(b.to(device) for b in biases[rank])
        backend.check_combine(y, handle, result.recv_topk_weights, bias)
        combined, combined_w = backend.combine(y, handle, result.recv_topk_weights, bias, config)
        torch.cuda.current_stream(device).synchronize()  # the kernels' reports land in the mailbox
        backend.raise_pending()
        return dict(recv_x=_cpu(result.recv_x), recv_topk_idx=_cpu(result.recv_topk_idx),
                    recv_topk_weights=_cpu(result.recv_topk_weights), recv_src_idx=_cpu(handle.recv_src_idx),
                    rank_prefix_matrix=_cpu(handle.rank_prefix_matrix), counts=result.num_recv_tokens_per_expert_list,
                    cached_x=_cpu(cached.recv_x), y=_cpu(y), combined=_cpu(combined), combined_w=_cpu(combined_w),
                    num_rows=handle.num_recv_rows)

    what = f"case seed={seed} {scenario} R={num_ranks} k={ranks_per_node} fp8={use_fp8} worst={num_worst_tokens}"
    try:
        got = run_ranks(num_ranks, ranks_per_node, rank_body, num_bytes, device=device, warm=warm)
    except RuntimeError as err:
        raise RuntimeError(f"{what} (tokens per rank {[len(x) for x in xs]}): {err}") from err
    for rank in range(num_ranks):
        mine, want = got[rank], expected[rank]
        n = len(want["recv_src_idx"])
        rows = slice(0, n)
        part = (lambda v: (v[0][rows], v[1][rows])) if use_fp8 else (lambda v: v[rows])
        _equal_payload(part(mine["recv_x"]), want["recv_x"], f"{what} rank {rank} recv_x")
        try:
            _equal_payload(part(mine["cached_x"]), want["recv_x"], f"{what} rank {rank} cached recv_x")
        except AssertionError as err:
            raise AssertionError(f"{err} ({_differing_rows(part(mine['cached_x']), want['recv_x'])})") from None
        assert torch.equal(mine["recv_src_idx"][rows], want["recv_src_idx"]), f"{what} rank {rank} recv_src_idx"
        assert torch.equal(mine["rank_prefix_matrix"], want["rank_prefix_matrix"]), f"{what} rank {rank} prefix"
        if num_worst_tokens:
            assert mine["num_rows"] == num_worst_tokens
            assert (mine["recv_src_idx"][n:] == -1).all(), f"{what} rank {rank} padding"
        else:
            assert mine["counts"] == want["num_recv_tokens_per_expert_list"], f"{what} rank {rank} counts"
        if with_weights:
            assert torch.equal(mine["recv_topk_idx"][rows], want["recv_topk_idx"]), f"{what} rank {rank} topk"
            assert torch.equal(mine["recv_topk_weights"][rows], want["recv_topk_weights"]), f"{what} rank {rank} w"
    # combine: each rank returned y for its rows (padding rows of num_worst_tokens are not sent back)
    ys = [got[r]["y"][:len(expected[r]["recv_src_idx"])] for r in range(num_ranks)]
    two_level = two_level_combine(model, ys, [len(x) for x in xs])
    for rank in range(num_ranks):
        combined = got[rank]["combined"]
        ref = reference_combine(xs_home(inputs[rank], use_fp8), topks[rank], num_experts, num_ranks, rank_fn,
                                biases[rank])
        if not num_bias:
            assert torch.equal(_bits16(combined), _bits16(two_level[rank])), f"{what} rank {rank} combine (two-level)"
        torch.testing.assert_close(combined.float(), ref.float(), rtol=2e-2, atol=2e-2,
                                   msg=lambda m: f"{what} rank {rank} combine: {m}")
        if with_weights:
            want_w = torch.where(topks[rank] >= 0, weights[rank], 0.0)
            torch.testing.assert_close(got[rank]["combined_w"], want_w, msg=lambda m: f"{what} rank {rank} weights: {m}")


def _differing_rows(got, want) -> str:
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


def _bits16(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


TOPOLOGIES = ((2, 1), (4, 2), (4, 1), (2, 2), (6, 2))  # (ranks, ranks per node)


def cases(num_ranks: int, ranks_per_node: int):
    """The suite for one topology: ``(seed, scenario, keyword arguments)`` of :func:`normal_case`."""
    R = num_ranks
    plain = [(seed, scenario, dict(num_experts=4 * R))
             for seed, scenario in enumerate(("uniform", "skewed", "holes", "empty_rank"))]
    return plain + [
        (10, "uniform", dict(use_fp8=True, num_experts=4 * R, hidden=512)),
        (11, "skewed", dict(num_bias=2, num_experts=4 * R, num_channels=3)),
        (12, "holes", dict(num_worst_tokens=40 * R, num_experts=4 * R)),
        (13, "uniform", dict(with_weights=False, expert_alignment=8, num_experts=4 * R)),
        (14, "one_rank", dict(max_tokens=300, hidden=2048, num_experts=8 * R, num_topk=8)),
    ]


def main(argv=None) -> int:
    import argparse
    import os
    import subprocess
    import sys
    import time
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--topology", action="append", default=[], help="R,k (ranks, ranks per node); repeatable")
    args = parser.parse_args(argv)
    if os.environ.get("CUDA_MODULE_LOADING") != "EAGER":  # see the module's docstring
        env = dict(os.environ, CUDA_MODULE_LOADING="EAGER")
        return subprocess.call([sys.executable, "-m", "epcomm.testing.loopback"] + list(argv or sys.argv[1:]),
                               env=env)
    topologies = [tuple(int(v) for v in t.split(",")) for t in args.topology] or TOPOLOGIES
    failed = 0
    for num_ranks, ranks_per_node in topologies:
        for seed, scenario, kwargs in cases(num_ranks, ranks_per_node):
            started = time.monotonic()
            try:
                normal_case(seed, num_ranks, ranks_per_node, scenario, **kwargs)
                status = "ok"
            except (AssertionError, RuntimeError) as err:
                failed += 1
                status = f"FAILED: {str(err)[:2000]}"
            print(f"R={num_ranks} k={ranks_per_node} seed={seed} {scenario} {kwargs}: {status} "
                  f"({time.monotonic() - started:.1f} s)", flush=True)
    print(f"{failed} failed" if failed else "all passed", flush=True)
    return 1 if failed else 0


__all__ = ["run_ranks", "normal_case", "cases", "main"]


if __name__ == "__main__":
    raise SystemExit(main())
