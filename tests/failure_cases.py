"""Rank bodies for the failure-contract tests (tests/test_failure_contract.py): each returns what
its rank saw, so the test asserts that every rank raised, and what they named."""
from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist

import epcomm
from epcomm.testing.sweeps import make_routing, world


def _layout_args(buffer, topk, num_experts):
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk, num_experts)
    return dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)


def _reference_buffer(device: str, **kwargs):
    """The reference backend on ``device``: gloo ranks on CPU, NCCL ranks on GPU (torch_dist)."""
    if device == "cuda":
        return epcomm.Buffer(dist.group.WORLD, backend="torch_dist", **kwargs)
    return epcomm.Buffer(dist.group.WORLD, **kwargs)


def _on(device: str, *tensors):
    dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    return tuple(t.to(dev) for t in tensors)


def _outcome(fn):
    """``("ok", value)`` or ``(error class name, argument or peers, message)``."""
    try:
        return "ok", fn()
    except epcomm.EPInputError as err:
        return "EPInputError", err.argument, str(err)
    except epcomm.EPTimeoutError as err:
        return "EPTimeoutError", err.peers, str(err)


def disagreement(case: str, device: str = "cpu"):
    """Ranks call with different arguments; every rank must raise EPInputError naming it."""
    R, rank = world()
    buffer = _reference_buffer(device, low_latency_mode=True, timeout=20)
    num_experts = 4 * R
    hidden = 256 if case != "hidden" or rank == 0 else 384
    xs, topks, weights = make_routing(3, "uniform", R, num_experts, 2, 8, hidden, fixed_tokens=8)
    x, topk, w = _on(device, xs[rank], topks[rank], weights[rank])

    def call():
        if case in ("hidden", "topk_idx"):
            args = _layout_args(buffer, topk, num_experts)
            if case == "topk_idx" and rank == 1:
                return buffer.dispatch(x, **args)  # no top-k on this rank only
            return buffer.dispatch(x, topk_idx=topk, topk_weights=w, **args)
        if case == "x":
            args = _layout_args(buffer, topk, num_experts)
            payload = epcomm.per_token_cast_to_fp8(x) if rank == 0 else x
            return buffer.dispatch(payload, **args)
        if case == "num_experts":
            experts = num_experts if rank == 0 else 2 * num_experts
            return buffer.low_latency_dispatch(x, topk, 8, experts, use_fp8=False)
        if case == "num_topk":
            k_topk = topk if rank == 0 else topk[:, :1].contiguous()
            return buffer.low_latency_dispatch(x, k_topk, 8, num_experts, use_fp8=False)
        raise ValueError(case)

    result = _outcome(call)
    # the buffer stays usable: a valid call afterwards works on every rank
    args = _layout_args(buffer, topk, num_experts)
    xs2, _, _ = make_routing(3, "uniform", R, num_experts, 2, 8, 256, fixed_tokens=8)
    assert buffer.dispatch(*_on(device, xs2[rank]), **args)[0].shape[1] == 256
    return result[:2] + (result[2][:300],) if len(result) == 3 else result


def one_rank_bad_argument(device: str = "cpu"):
    """Only rank 1's input is invalid: it raises before communicating, and so do all the others
    (abort fingerprint), instead of pairing with its next call."""
    R, rank = world()
    buffer = _reference_buffer(device, timeout=20)
    num_experts = 4 * R
    xs, topks, weights = make_routing(4, "uniform", R, num_experts, 2, 8, 128, fixed_tokens=8)
    x_ok, topk = _on(device, xs[rank], topks[rank])
    args = _layout_args(buffer, topk, num_experts)
    x = x_ok.float() if rank == 1 else x_ok  # float32 is invalid
    result = _outcome(lambda: buffer.dispatch(x, **args))
    ok = buffer.dispatch(x_ok, **args)[0]  # usable afterwards, calls still paired
    assert ok.dtype == torch.bfloat16
    return result[:2]


def absent_rank(call: str, timeout: float = 2.0, device: str = "cpu", with_message: bool = False):
    """The last rank builds the buffer but never makes the call (stalled, crashed in expert code,
    or skipped it): every other rank raises EPTimeoutError naming it, within timeout + 5 s.
    ``with_message``: the error's message too, before the seconds."""
    R, rank = world()
    buffer = _reference_buffer(device, low_latency_mode=True, timeout=timeout)
    num_experts = 4 * R
    xs, topks, weights = make_routing(5, "uniform", R, num_experts, 2, 8, 128, fixed_tokens=8)
    x, topk = _on(device, xs[rank], topks[rank])
    args = _layout_args(buffer, topk, num_experts)
    handle = buffer.dispatch(x, **args)[4] if call == "combine" else None
    if rank == R - 1:
        return ("absent",)
    started = time.monotonic()
    if call == "dispatch":
        result = _outcome(lambda: buffer.dispatch(x, **args))
    else:
        y = torch.zeros(handle.num_recv_rows, 128, dtype=torch.bfloat16, device=x.device)
        result = _outcome(lambda: buffer.combine(y, handle))
    return result[:3 if with_message else 2] + (time.monotonic() - started,)


def late_rank_last_seen(timeout: float = 2.0):
    """The last rank waits long in a dispatch (its peers come 0.5 s after it), then never makes the
    next one: its peers' EPTimeoutError says where it last waited — that dispatch, a call they made.
    Returns ``("absent",)`` on that rank, else ``(error class, peers, message)``."""
    R, rank = world()
    buffer = _reference_buffer("cpu", timeout=timeout)
    num_experts = 4 * R
    xs, topks, _ = make_routing(5, "uniform", R, num_experts, 2, 8, 128, fixed_tokens=8)
    x, topk = xs[rank], topks[rank]
    args = _layout_args(buffer, topk, num_experts)
    if rank != R - 1:
        time.sleep(0.5)
    buffer.dispatch(x, **args)
    if rank == R - 1:
        return ("absent",)
    return _outcome(lambda: buffer.dispatch(x, **args))


def inconsistent_counts(case: str, device: str = "cpu"):
    """Counts that do not summarise the routing they come with raise EPInputError naming them;
    ``topk_idx``: an expert id >= num_experts (no device assert on GPU)."""
    R, rank = world()
    buffer = _reference_buffer(device, timeout=20)
    num_experts = 4 * R
    xs, topks, weights = make_routing(6, "uniform", R, num_experts, 2, 12, 128, fixed_tokens=12)
    x, topk, w = _on(device, xs[rank], topks[rank], weights[rank])
    args = _layout_args(buffer, topk, num_experts)
    if case == "num_tokens_per_rank":
        args["num_tokens_per_rank"] = args["num_tokens_per_rank"] + 1
    elif case == "topk_idx":
        topk = topk.clone()
        topk[0, 0] = num_experts + 5
    elif case == "is_token_in_rank":  # taken from another routing
        other, = _on(device, make_routing(60, "skewed", R, num_experts, 2, 12, 128, fixed_tokens=12)[1][rank])
        other_args = _layout_args(buffer, other, num_experts)
        args["is_token_in_rank"], args["num_tokens_per_rank"] = other_args["is_token_in_rank"], \
            other_args["num_tokens_per_rank"]
    elif case == "num_tokens_per_expert":
        args["num_tokens_per_expert"] = torch.zeros_like(args["num_tokens_per_expert"])
    result = _outcome(lambda: buffer.dispatch(x, topk_idx=topk, topk_weights=w, **args))
    return result[:2]


def low_latency_dead_rank(timeout: float = 2.0):
    """The last rank stops taking part in low-latency mode (CPU backend): the others mask it on
    their first wait and every call, that one included, completes for the live ranks."""
    from epcomm.testing import reference_low_latency_combine
    from epcomm.testing.sweeps import expert_fn
    R, rank = world()
    buffer = epcomm.Buffer(dist.group.WORLD, low_latency_mode=True, enable_shrink=True, timeout=timeout)
    num_experts, M, hidden = 2 * R, 8, 128
    dead = R - 1
    if rank == dead:
        return "dead"
    num_local = num_experts // R
    elapsed = []
    for call in range(3):
        xs, topks, ws = make_routing(50 + call, "uniform", R, num_experts, 2, M, hidden, fixed_tokens=M)
        started = time.monotonic()
        recv, count, handle, _, _ = buffer.low_latency_dispatch(xs[rank], topks[rank], M, num_experts, use_fp8=False)
        scale = ((rank * num_local + torch.arange(num_local)).float() + 1) / 8
        expert_out = (recv.float() * scale[:, None, None]).to(torch.bfloat16)
        out = buffer.low_latency_combine(expert_out, topks[rank], ws[rank], handle)[0]
        elapsed.append(time.monotonic() - started)
        live_topk = topks[rank].clone()
        live_topk[(live_topk // num_local) == dead] = -1
        want = reference_low_latency_combine(xs[rank], live_topk, ws[rank], expert_fn, use_fp8=False)
        torch.testing.assert_close(out, want, rtol=2e-2, atol=2e-2)
    status = torch.zeros(R, dtype=torch.int32)
    buffer.low_latency_query_mask_buffer(status)
    assert status.tolist() == [1 if r == dead else 0 for r in range(R)], status.tolist()
    assert elapsed[0] < timeout + 5 and elapsed[-1] < 1.0, elapsed  # masked once, then not waited for
    return "masked"


# ---------------------------------------------------------------------- the nvlink backend (2+ GPUs)
GPU_CASES = {  # case -> the argument every rank's EPInputError must name
    "hidden": "hidden", "x": "x", "num_topk": "num_topk", "handle": "handle",
    "num_tokens_per_rank": "num_tokens_per_rank", "num_tokens_per_expert": "num_tokens_per_expert",
    "rejected_dispatch": "x", "rejected_combine": "x",
    "ll_num_experts": "num_experts", "ll_rejected": "x",
    # limits of the nvlink backend itself (Backend.check_*), met on one rank only
    "backend_rows": "x", "ll_backend_hidden": "x",
}


def gpu_contract(case: str, timeout: float = 3.0):
    """One failure case on the nvlink backend: every rank raises EPInputError naming the argument —
    in the call itself, or at the next call once the GPU ran the failing one (the kernels record,
    the host raises; no extra synchronisation on the hot path) — and afterwards a new Buffer works
    (the CUDA context survived). Returns ``(error class, argument)`` of this rank's first error."""
    R, rank = world()
    dev = torch.device("cuda", torch.cuda.current_device())
    num_experts, K, T, hidden = 4 * R, 2, 64, 256
    xs, topks, weights = make_routing(70, "uniform", R, num_experts, K, T, 512, fixed_tokens=T)
    x, topk, w = xs[rank][:, :hidden].contiguous().to(dev), topks[rank].to(dev), weights[rank].to(dev)
    ll = case.startswith("ll_")
    ll_bytes = epcomm.Buffer.get_low_latency_rdma_size_hint(T, 512, R, 2 * num_experts) if ll else 0
    buffer = epcomm.Buffer(dist.group.WORLD, num_nvl_bytes=64 << 20, num_rdma_bytes=ll_bytes, low_latency_mode=ll,
                           timeout=timeout)
    args = _layout_args(buffer, topk, num_experts)
    odd = rank == R - 1  # the rank that differs

    def dispatch(payload=x, **changes):
        return buffer.dispatch(payload, **dict(args, topk_idx=topk, topk_weights=w, **changes))

    def first_call():
        if case == "hidden":
            return dispatch(xs[rank][:, :384 if odd else hidden].contiguous().to(dev))
        if case == "x":
            return dispatch(epcomm.per_token_cast_to_fp8(x) if odd else x)
        if case == "num_topk":
            return buffer.dispatch(x, **args) if odd else dispatch()
        if case == "handle":
            first, second = dispatch()[4], dispatch()[4]
            handle = second if odd else first
            return buffer.combine(torch.ones(handle.num_recv_rows, hidden, dtype=torch.bfloat16, device=dev), handle)
        if case == "num_tokens_per_rank":
            return dispatch(num_tokens_per_rank=args["num_tokens_per_rank"] + (1 if odd else 0))
        if case == "num_tokens_per_expert":
            return dispatch(num_tokens_per_expert=torch.zeros_like(args["num_tokens_per_expert"]) if odd else
                            args["num_tokens_per_expert"])
        if case == "rejected_dispatch":
            return dispatch(x.float() if odd else x)
        if case == "rejected_combine":
            handle = dispatch()[4]
            y = torch.ones(handle.num_recv_rows + (1 if odd else 0), hidden, dtype=torch.bfloat16, device=dev)
            return buffer.combine(y, handle)
        if case == "ll_num_experts":
            return buffer.low_latency_dispatch(x, topk, T, 2 * num_experts if odd else num_experts, use_fp8=False)
        if case == "backend_rows":  # 258 bf16 = 516-byte rows: not whole 8-byte words
            return dispatch(xs[rank][:, :258 if odd else hidden].contiguous().to(dev))
        if case == "ll_backend_hidden":  # BF16 rows of 192: fine for Buffer, not for the nvlink kernels
            return buffer.low_latency_dispatch(xs[rank][:, :192 if odd else hidden].contiguous().to(dev), topk, T,
                                               num_experts, use_fp8=False)
        if case == "ll_rejected":
            return buffer.low_latency_dispatch(torch.cat([x, x]) if odd else x, topk, T, num_experts, use_fp8=False)
        raise ValueError(case)

    def next_call():
        if ll:
            return buffer.low_latency_dispatch(x, topk, T, num_experts, use_fp8=False)
        return dispatch()

    started = time.monotonic()
    outcome = _outcome(first_call)
    if outcome[0] == "ok":
        torch.cuda.synchronize()  # the failing call's kernels have run: the next call raises
        outcome = _outcome(next_call)
    torch.cuda.synchronize()
    elapsed = time.monotonic() - started
    assert elapsed <= timeout + 5, f"rank {rank}: the error took {elapsed:.1f} s (timeout {timeout} s)"
    del buffer
    fresh = epcomm.Buffer(dist.group.WORLD, num_nvl_bytes=64 << 20, timeout=timeout)
    recv_x, _, _, _, handle, _ = fresh.dispatch(x, **_layout_args(fresh, topk, num_experts), topk_idx=topk,
                                                topk_weights=w)
    fresh.combine(recv_x, handle)
    torch.cuda.synchronize()
    return outcome[:2]


def gpu_out_of_range_expert():
    """An expert id >= num_experts in topk_idx: no device assert; the layout kernel drops it and
    the next call raises EPInputError naming topk_idx on that rank; the buffer stays usable."""
    R, rank = world()
    dev = torch.device("cuda", torch.cuda.current_device())
    num_experts = 4 * R
    xs, topks, weights = make_routing(71, "uniform", R, num_experts, 2, 32, 256, fixed_tokens=32)
    buffer = epcomm.Buffer(dist.group.WORLD, num_nvl_bytes=64 << 20, timeout=3.0)
    bad = topks[rank].to(dev).clone()
    bad[0, 0] = num_experts + 5
    buffer.get_dispatch_layout(bad, num_experts)
    torch.cuda.synchronize()
    outcome = _outcome(lambda: buffer.get_dispatch_layout(topks[rank].to(dev), num_experts))
    x, topk, w = xs[rank].to(dev), topks[rank].to(dev), weights[rank].to(dev)
    recv_x, _, _, _, handle, _ = buffer.dispatch(x, **_layout_args(buffer, topk, num_experts), topk_idx=topk,
                                                 topk_weights=w)
    buffer.combine(recv_x, handle)
    torch.cuda.synchronize()
    return outcome[:2]


@contextlib.contextmanager
def ranks_in_processes(target, world_size: int, args: tuple, join_s: float = 10.0):
    """``target(rank, world_size, port, *args, results, done)`` in a process of its own per rank (not a
    WorkerPool: these tests make ranks stall or exit); yields the queue the ranks put results in,
    then sets ``done`` and stops them all (each given ``join_s`` to end, then killed)."""
    import torch.multiprocessing as mp
    from epcomm.testing.launcher import _free_port
    ctx = mp.get_context("spawn")
    results, done = ctx.Queue(), ctx.Event()
    port = _free_port()
    procs = [ctx.Process(target=target, args=(r, world_size, port, *args, results, done), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    try:
        yield results
    finally:
        done.set()
        for p in procs:
            p.join(timeout=join_s)
            if p.is_alive():
                p.kill()


def _init_gloo(rank: int, world_size: int, port: int) -> None:
    """The default process group of a process the test started itself (not a WorkerPool rank)."""
    import datetime
    import os
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=60))


def exited_rank_main(rank: int, world_size: int, port: int, call: str, results, done) -> None:
    """A process of its own (not a WorkerPool rank, whose pool stops when a rank exits): the last
    rank exits after building its buffer; the others' next call must raise EPTimeoutError naming
    it within timeout + 5 s, not a raw gloo error. Puts ``(rank, error class, peers, seconds)``;
    the live ranks stay until ``done`` is set (rank 0 hosts the store the others still use)."""
    import os
    _init_gloo(rank, world_size, port)
    try:
        buffer = epcomm.Buffer(dist.group.WORLD, timeout=2.0)
        num_experts = 4 * world_size
        xs, topks, _ = make_routing(8, "uniform", world_size, num_experts, 2, 8, 128, fixed_tokens=8)
        args = _layout_args(buffer, topks[rank], num_experts)
        handle = buffer.dispatch(xs[rank], **args)[4]
        dist.barrier()
        if rank == world_size - 1:
            os._exit(0)  # gone: its sockets close
        time.sleep(1.0)
        started = time.monotonic()
        try:
            if call == "dispatch":
                buffer.dispatch(xs[rank], **args)
            else:
                buffer.combine(torch.zeros(handle.num_recv_rows, 128, dtype=torch.bfloat16), handle)
            results.put((rank, "ok", None, time.monotonic() - started))
        except epcomm.EPTimeoutError as err:
            results.put((rank, "EPTimeoutError", err.peers, time.monotonic() - started))
        except Exception as err:  # noqa: BLE001 - reported, the test names what it was
            results.put((rank, type(err).__name__, str(err)[:200], time.monotonic() - started))
    finally:
        results.close()
        results.join_thread()  # the result is flushed before the process goes
        done.wait(60)
        os._exit(0)  # no teardown: the group has a dead member


def store_host_exit_main(rank: int, world_size: int, port: int, results, done) -> None:
    """A process of its own: the last rank stalls (never makes the call); rank 0, which hosts the
    process group's store, reaches its timeout first and exits; rank 1, still waiting, must raise
    EPTimeoutError naming the stalled rank (not only "the store is unreachable"). Puts ``(rank,
    error class, peers, message)``."""
    import os
    _init_gloo(rank, world_size, port)
    try:
        buffer = epcomm.Buffer(dist.group.WORLD, timeout=3.0)
        num_experts = 4 * world_size
        xs, topks, _ = make_routing(9, "uniform", world_size, num_experts, 2, 8, 128, fixed_tokens=8)
        args = _layout_args(buffer, topks[rank], num_experts)
        dist.barrier()
        if rank == world_size - 1:
            done.wait(60)  # stalled
            os._exit(0)
        time.sleep(1.5 * rank)  # rank 0 waits first, so its timeout comes first
        try:
            buffer.dispatch(xs[rank], **args)
            results.put((rank, "ok", None, ""))
        except epcomm.EPError as err:
            results.put((rank, type(err).__name__, getattr(err, "peers", None), str(err)[:300]))
    finally:
        results.close()
        results.join_thread()
        if rank != 0:
            done.wait(60)
        os._exit(0)  # rank 0 exits at once: its store goes with it


def rejected_layout_stands_in(num_steps: int = 3):
    """Rank 1's get_dispatch_layout rejects an expert id (a local call) and it skips that dispatch.
    Its peers, in that dispatch, raise EPInputError naming rank 1 and topk_idx; rank 1's next
    dispatch stands in for the skipped one and then pairs with the peers' next: every later step
    matches the reference (calls pair by identity, not by count)."""
    from epcomm.testing import reference_dispatch
    R, rank = world()
    buffer = epcomm.Buffer(dist.group.WORLD, timeout=20)
    num_experts = 4 * R
    seen = []
    for step in range(num_steps):
        xs, topks, ws = make_routing(20 + step, "uniform", R, num_experts, 2, 8, 128, fixed_tokens=8)
        topk = topks[rank].clone()
        if step == 0 and rank == 1:
            topk[0, 0] = num_experts + 3
        try:
            args = _layout_args(buffer, topk, num_experts)
            recv_x = buffer.dispatch(xs[rank], topk_idx=topk, topk_weights=ws[rank], **args)[0]
        except epcomm.EPInputError as err:
            seen.append(("EPInputError", err.argument, "rank 1" in str(err)))
            continue
        want = reference_dispatch(xs, topks, ws, num_experts)[rank]["recv_x"]
        seen.append(("ok", torch.equal(recv_x, want)))
    return seen


def low_latency_combine_topk_idx(case: str):
    """low_latency_combine given a topk_idx other than its dispatch's, on one rank: every rank
    raises EPInputError naming topk_idx before anything is exchanged; the next round trip works."""
    from epcomm.testing import reference_low_latency_combine
    from epcomm.testing.sweeps import expert_fn
    R, rank = world()
    buffer = epcomm.Buffer(dist.group.WORLD, low_latency_mode=True, timeout=20)
    num_experts, M, hidden = 2 * R, 8, 128
    xs, topks, ws = make_routing(31, "uniform", R, num_experts, 2, M, hidden, fixed_tokens=M)
    num_local = num_experts // R

    def round_trip(combine_topk):
        recv, _, handle, _, _ = buffer.low_latency_dispatch(xs[rank], topks[rank], M, num_experts, use_fp8=False)
        experts = rank * num_local + torch.arange(num_local)
        out = torch.stack([expert_fn(torch.full((recv.shape[1],), int(e)), recv[i].float())
                           for i, e in enumerate(experts)]).to(torch.bfloat16)
        return buffer.low_latency_combine(out, combine_topk, ws[rank] if combine_topk.shape == topks[rank].shape
                                          else ws[rank][:combine_topk.shape[0]], handle)[0]

    wrong = topks[rank]
    if rank == 1:
        wrong = topks[rank][1:].contiguous() if case == "shape" else topks[rank].flip(0).contiguous()
    result = _outcome(lambda: round_trip(wrong))
    want = reference_low_latency_combine(xs[rank], topks[rank], ws[rank], expert_fn, use_fp8=False)
    torch.testing.assert_close(round_trip(topks[rank]), want, rtol=2e-2, atol=2e-2)
    return result[:2]


def masked_rank_learns_it():
    """Rank 0 masks rank 1 (enable_shrink) while rank 1 is alive: rank 1's next low-latency call
    raises EPError saying rank 0 masked it, instead of exchanging with nobody; every other rank
    masks it too for that call (the masks stay one) and completes without it. Returns ``("ok",
    rows from rank 1 absent)`` or ``(error class, names rank 0)``."""
    R, rank = world()
    buffer = epcomm.Buffer(dist.group.WORLD, low_latency_mode=True, enable_shrink=True, timeout=20)
    num_experts, M, hidden = 2 * R, 8, 128
    xs, topks, ws = make_routing(32, "uniform", R, num_experts, 2, M, hidden, fixed_tokens=M)
    if rank == 0:
        buffer.low_latency_update_mask_buffer(1, True)
    try:
        _, count, handle, _, _ = buffer.low_latency_dispatch(xs[rank], topks[rank], M, num_experts, use_fp8=False)
    except epcomm.EPError as err:
        return (type(err).__name__, "ranks [0] masked this rank" in str(err))
    from_rank_1 = (handle.recv_layout_range[:, 1] & 0xFFFFFFFF).sum()
    mask = torch.zeros(R, dtype=torch.int32)
    buffer.low_latency_query_mask_buffer(mask)
    return ("ok", int(from_rank_1) == 0 and mask.tolist() == [1 if r == 1 else 0 for r in range(R)])


def rejected_layout_then_clean():
    """A rank whose layout rejected its input goes on to clean_low_latency_buffer (a collective
    barrier) while its peers make the dispatch it skipped: the clean stands in for that dispatch
    first (the peers raise naming it), then every rank cleans and a round trip works."""
    from epcomm.testing import reference_low_latency_combine
    from epcomm.testing.sweeps import expert_fn
    R, rank = world()
    buffer = epcomm.Buffer(dist.group.WORLD, low_latency_mode=True, timeout=20)
    E, M, H = 2 * R, 8, 128
    xs, topks, ws = make_routing(33, "uniform", R, E, 2, M, H, fixed_tokens=M)
    topk = topks[rank].clone()
    if rank == 1:
        topk[0, 0] = E + 1
    first = _outcome(lambda: buffer.dispatch(xs[rank], topk_idx=topk, topk_weights=ws[rank],
                                             **_layout_args(buffer, topk, E)))
    buffer.clean_low_latency_buffer(M, H, E)
    recv, _, handle, _, _ = buffer.low_latency_dispatch(xs[rank], topks[rank], M, E, use_fp8=False)
    local = rank * (E // R) + torch.arange(E // R)
    out = torch.stack([expert_fn(torch.full((recv.shape[1],), int(e)), recv[i].float()) for i, e in enumerate(local)])
    got = buffer.low_latency_combine(out.to(torch.bfloat16), topks[rank], ws[rank], handle)[0]
    want = reference_low_latency_combine(xs[rank], topks[rank], ws[rank], expert_fn, use_fp8=False)
    return first[:2], bool(torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2))


class _RecordingBackend:
    """Wraps a backend: records agree/resync calls; ``pending`` is raised once by raise_pending,
    ``resync_asked`` is what needs_resync says (the GPU backends' behaviour, on any machine)."""

    def __init__(self, inner):
        self._inner = inner
        self.calls, self.pending, self.resync_asked = [], None, False
        self.resync_generation = 0  # the group's resyncs (another Buffer of the group may make one)

    def __getattr__(self, name):
        return getattr(self._inner, name)

    @property
    def needs_resync(self):
        return self.resync_asked

    def resync(self):
        self.calls.append("resync")
        self.resync_asked = False
        self.resync_generation += 1

    def raise_pending(self):
        error, self.pending = self.pending, None
        if error is not None:
            raise error

    def agree(self, kind, fingerprint, error=None, rank_mask=None):
        self.calls.append((kind, "abort" if error is not None else "agree",
                           None if error is None else error.argument))
        if error is not None:
            self.resync_asked = True  # as the GPU backends do after an abort
        return self._inner.agree(kind, fingerprint, error, rank_mask)

    def stand_in(self, kind, error, rank_mask=None):  # (the GPU backends' default: an abort through agree)
        self.agree(kind, None, error, rank_mask)


def buffer_resync_rules():
    """Buffer's side of the GPU recovery, on one CPU rank with a recording backend: a resync the
    backend asks for runs at the start of the next call (and restarts the low-latency halves); an
    error reported for an earlier call makes a collective call take part as an abort; a rejected
    layout's stand-in precedes the next call and a resync follows it."""
    from epcomm.errors import EPInputError
    buffer = epcomm.Buffer(dist.group.WORLD, low_latency_mode=True, timeout=20)
    backend = buffer._backend = _RecordingBackend(buffer._backend)
    num_experts, M, H = 4, 8, 128
    xs, topks, ws = make_routing(34, "uniform", 1, num_experts, 2, M, H, fixed_tokens=M)
    x, topk, w = xs[0], topks[0], ws[0]
    seen = {}
    buffer.low_latency_dispatch(x, topk, M, num_experts, use_fp8=False)
    backend.resync_asked, backend.calls = True, []
    buffer.low_latency_dispatch(x, topk, M, num_experts, use_fp8=False)
    seen["resync first, phase restarted"] = backend.calls[0] == "resync" and buffer._ll_phase == 1
    args = _layout_args(buffer, topk, num_experts)
    backend.calls, backend.pending = [], EPInputError("x", "reported for an earlier call")
    try:
        buffer.dispatch(x, topk_idx=topk, topk_weights=w, **args)
        seen["deferred error raised"] = False
    except EPInputError as err:
        seen["deferred error raised"] = err.argument == "x"
    seen["deferred error takes part as an abort"] = backend.calls == [("dispatch", "abort", "x")]
    backend.resync_asked = False
    bad = topk.clone()
    bad[0, 0] = num_experts + 2
    try:
        buffer.get_dispatch_layout(bad, num_experts)
    except EPInputError:
        pass
    backend.calls = []
    buffer.dispatch(x, topk_idx=topk, topk_weights=w, **args)
    seen["stand-in, resync, then the call"] = backend.calls == [("dispatch", "abort", "topk_idx"), "resync",
                                                                ("dispatch", "agree", None)]
    # Another Buffer of the group resynced it (GPU backends, call_board.py): this Buffer's next call
    # restarts its low-latency halves, and a call a rejected layout skipped is over (no stand-in).
    buffer.low_latency_dispatch(x, topk, M, num_experts, use_fp8=False)
    try:
        buffer.get_dispatch_layout(bad, num_experts)
    except EPInputError:
        pass
    backend.calls, backend.resync_generation = [], backend.resync_generation + 1
    buffer.low_latency_dispatch(x, topk, M, num_experts, use_fp8=False)
    seen["a group resync elsewhere restarts the halves, voids the stand-in"] = \
        sum(d is not None for d in buffer._ll_dispatched) == 1 and \
        backend.calls == [("low_latency_dispatch", "agree", None)]
    return seen


DEBUG_MESSAGES = False


def _reported(buffer) -> bool:
    """The GPU has finished this rank's work so far and its kernels reported an error that the next
    call raises (a peer in another call): the results of the calls made since are not valid."""
    torch.cuda.synchronize()
    return any(member.mailbox.view[0] != 0 for member in buffer._backend.seat.board.members())


def judge_skipped_call_steps(results, timeout: float):
    """Checks every rank's steps from ``skipped_call_then_next_calls``: each step is right, the
    expert code's own error, a report of an earlier call, or ``EPInputError('call')`` raised in well
    under the timeout (a third of it); the last four steps are right on every rank."""
    for rank, steps in enumerate(results):
        judged = steps[:-2]
        for name, outcome, seconds in judged:
            assert outcome[0] in ("ok", "reported", "expert code", "EPInputError"), (rank, steps)
            if outcome[0] in ("EPInputError", "reported"):
                assert outcome[0] == "reported" or outcome[1] == "call", (rank, steps)
                assert seconds < timeout / 3, (rank, steps)
        assert [o[0] for _, o, _ in judged[-2:] + steps[-2:]] == ["ok"] * 4, (rank, steps)


def skipped_call_then_next_calls(skipped: str = "combine", timeout: float = 20.0, device: str = "cpu"):
    """A rank whose expert code raised skips a call its peers make (``skipped``: ``"combine"``,
    ``"ll_combine"``, ``"dispatch"``), then every rank goes on as a serving loop does: each step
    runs in ``try`` and a failed step is dropped. Steps: a normal round trip on Buffer A, a
    low-latency round trip on Buffer B of the same group, then both again. Returns per step
    ``(outcome, seconds)``, outcome ``"ok"`` (checked against the reference) or the error's class
    and argument — never wrong data. ``device="cuda"``: the group's GPU backend (the call board
    finds the skip, gpu/call_board.py). Its calls that do not wait on the host report at the next
    call (docs/ERRORS.md, the recovery rule): a round whose results the GPU has reported as not valid (its
    kernels finished, the report is pending) is ``"reported"``, not checked."""
    from epcomm.testing.reference import reference_combine, reference_low_latency_combine
    R, rank = world()
    skipper = 1 % R
    num_experts = 4 * R
    gpu = device == "cuda"
    dev = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")
    hidden = 128
    sizes = dict(num_nvl_bytes=64 << 20) if gpu else {}
    normal = epcomm.Buffer(dist.group.WORLD, timeout=timeout, **sizes)
    ll_sizes = dict(num_rdma_bytes=epcomm.Buffer.get_low_latency_rdma_size_hint(8, hidden, R, num_experts)) if gpu \
        else {}
    ll = epcomm.Buffer(dist.group.WORLD, low_latency_mode=True, timeout=timeout, **ll_sizes)
    xs, topks, weights = make_routing(35, "uniform", R, num_experts, 2, 8, hidden, fixed_tokens=8)
    x, topk, w = xs[rank].to(dev), topks[rank].to(dev), weights[rank].to(dev)

    def normal_round():
        recv_x, _, recv_w, _, handle, _ = normal.dispatch(x, **_layout_args(normal, topk, num_experts),
                                                          topk_idx=topk, topk_weights=w)
        if skipped == "combine" and rank == skipper and not state["skipped"]:
            state["skipped"] = True
            raise RuntimeError("expert code failed")
        out = (recv_x.float() * (rank + 1)).to(torch.bfloat16)
        combined, _, _ = normal.combine(out, handle, topk_weights=recv_w)
        want = reference_combine(xs[rank], topks[rank], num_experts, R,
                                 lambda j, rows: (rows.float() * (j + 1)).to(torch.bfloat16))
        if gpu and _reported(normal):
            return "reported"
        assert torch.allclose(combined.float().cpu(), want.float(), rtol=1e-2, atol=1e-2), "normal round: wrong data"

    def ll_round():
        if skipped == "dispatch" and rank == skipper and not state["skipped"]:
            state["skipped"] = True
            raise RuntimeError("expert code failed before the dispatch")
        recv_x, count, handle, _, _ = ll.low_latency_dispatch(x, topk, 8, num_experts, use_fp8=False)
        if skipped == "ll_combine" and rank == skipper and not state["skipped"]:
            state["skipped"] = True
            raise RuntimeError("expert code failed")
        combined, _, _ = ll.low_latency_combine(recv_x, topk, w, handle)
        want = reference_low_latency_combine(xs[rank], topks[rank], weights[rank], lambda e, rows: rows, False, False)
        if gpu and _reported(ll):
            return "reported"
        assert torch.allclose(combined.float().cpu(), want.float(), rtol=2e-2, atol=2e-2), \
            "low-latency round: wrong data"

    state = {"skipped": gpu}
    if gpu:  # every kernel of these shapes compiled first, so the steps below time the calls
        normal_round()
        ll_round()
        state["skipped"] = False
    steps = [("ll" if skipped == "dispatch" else "normal" if skipped == "combine" else "ll", None)]
    steps += [("normal", None), ("ll", None), ("normal", None), ("ll", None), ("normal", None), ("ll", None)]
    results = []
    for name, _ in steps:
        started = time.monotonic()
        try:
            outcome = ((normal_round if name == "normal" else ll_round)() or "ok",)
        except epcomm.EPInputError as err:
            outcome = ("EPInputError", err.argument) if not DEBUG_MESSAGES else ("EPInputError", err.argument, str(err)[:400])
        except epcomm.EPTimeoutError as err:
            outcome = ("EPTimeoutError", tuple(err.peers))
        except epcomm.EPError as err:
            outcome = ("EPError", str(err)[:200])
        except RuntimeError as err:
            outcome = ("expert code", str(err)) if "expert code" in str(err) else ("RuntimeError", str(err)[:200])
        except AssertionError as err:
            outcome = ("WRONG DATA", str(err))
        results.append((name, outcome, round(time.monotonic() - started, 2)))
    normal.destroy()
    ll.destroy()
    return results
