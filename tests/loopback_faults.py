"""Loopback cases of faults (loopback_suite.py runs them): a dead rank masked, counts that do not match the
routing, a rejected call and its recovery, ranks that disagree, a rank in another call."""
from __future__ import annotations

from typing import Optional

import torch

from epcomm.backends.gpu import launch
from epcomm.backends.base import DispatchArgs, LowLatencyCombineArgs, LowLatencyDispatchArgs
from epcomm.backends.nvshmem.backend import NvshmemBackend
from epcomm.backends.gpu.workspace import low_latency_bytes
from epcomm.backends.nvshmem import bytes_for_tokens
from epcomm.config import Config
from epcomm.layout import dispatch_layout
from epcomm.testing.reference import (reference_combine, reference_dispatch, reference_low_latency_combine,
                                      reference_low_latency_dispatch)
from epcomm.testing.sweeps import _equal_payload, expert_fn, make_routing, rank_fn
from loopback_cases import warm_low_latency
from loopback_common import run_ranks, to_cpu, wait_stream


def low_latency_dead_rank_case(num_ranks: int, ranks_per_node: int, hidden: int = 512, rounds: int = 3,
                               shrink: bool = True, device: Optional[torch.device] = None) -> None:
    """The last rank makes no call: every other rank times out once (1 s) and masks it. With
    ``shrink`` (enable_shrink) each gets the live ranks' results — dispatch counts without the dead
    rank's messages, combine without its experts — in every round; without it the combine rows of
    tokens routed to the dead rank are NaN (no plausible partial sums; the Buffer raises
    EPTimeoutError at the next call) and the other rows are right. Raises AssertionError naming
    what differs."""
    device = device or torch.device("cuda", torch.cuda.current_device())
    R, E, M, K = num_ranks, 4 * num_ranks, 16, 4
    num_local, dead = E // R, num_ranks - 1
    routings = [make_routing(60 + r, "uniform", R, E, K, M, hidden, fixed_tokens=M) for r in range(rounds)]

    def rank_body(rank: int, backend: NvshmemBackend):
        if rank == dead:
            return None
        mask = torch.zeros(R, dtype=torch.int32, device=device)
        outs = []
        for xs, topks, weights in routings:
            x, topk = xs[rank].to(device), topks[rank].to(device)
            args = LowLatencyDispatchArgs(x, topk, M, E, False, False, False, None, None, False, mask)
            backend.check_low_latency_dispatch(args)
            recv_x, recv_count, handle, _ = backend.low_latency_dispatch(args)
            scale = ((rank * num_local + torch.arange(num_local, device=device)).float() + 1) / 8
            expert_out = (recv_x.float() * scale[:, None, None]).to(torch.bfloat16)
            cargs = LowLatencyCombineArgs(expert_out, topk, weights[rank].to(device), handle, None, None, False, mask)
            backend.check_low_latency_combine(cargs)
            outs.append((recv_count.clone(), backend.low_latency_combine(cargs)[0]))
        wait_stream(device)
        return [(c.cpu(), o.cpu()) for c, o in outs], mask.cpu()

    def warm(backend: NvshmemBackend) -> None:  # (a rank compiling in its thread would be masked)
        warm_low_latency(backend, E, M, hidden, K)

    what = f"low-latency dead rank R={R} k={ranks_per_node} shrink={shrink}"
    got = run_ranks(R, ranks_per_node, rank_body, 1 << 20, timeout_s=1.0, device=device, warm=warm,
                    num_ll_bytes=low_latency_bytes(M, hidden, R, E), shrink=shrink)
    for rank in range(R - 1):
        results, mask = got[rank]
        assert mask.tolist() == [int(r == dead) for r in range(R)], f"{what} rank {rank}: mask {mask.tolist()}"
        for r, ((counts, out), (xs, topks, weights)) in enumerate(zip(results, routings)):
            live = [x for i, x in enumerate(xs) if i != dead] + [xs[dead][:0]]
            live_topks = [t for i, t in enumerate(topks) if i != dead] + [topks[dead][:0]]
            ref = reference_low_latency_dispatch(live, live_topks, E, False)[rank]
            assert counts.tolist() == [e["rows"].shape[0] for e in ref], f"{what} round {r} rank {rank} counts"
            on_dead = (topks[rank] // num_local) == dead
            live_topk = topks[rank].clone()
            live_topk[on_dead] = -1
            want = reference_low_latency_combine(xs[rank], live_topk, weights[rank], expert_fn, use_fp8=False)
            if not shrink:  # a token with an entry on the late rank: NaN, not the live ranks' partial sum
                lost = on_dead.any(dim=1)
                assert bool(out[lost].isnan().all()), f"{what} round {r} rank {rank}: lost tokens not NaN"
                out, want = out[~lost], want[~lost]
            torch.testing.assert_close(out, want, rtol=2e-2, atol=2e-2,
                                       msg=lambda m: f"{what} round {r} rank {rank} combine: {m}")


def bad_counts_case(num_ranks: int, ranks_per_node: int, argument: str = "num_tokens_per_expert",
                    device: Optional[torch.device] = None) -> None:
    """The last rank passes counts that do not summarise its routing (``argument``): every rank's
    full dispatch raises EPInputError naming it (the count rows carry the abort code; no hang)."""
    from epcomm.errors import EPInputError
    device = device or torch.device("cuda", torch.cuda.current_device())
    R, E, T, hidden = num_ranks, 4 * num_ranks, 24, 256
    xs, topks, weights = make_routing(80, "uniform", R, E, 4, T, hidden, fixed_tokens=T)
    config = Config(num_sms=4)

    def rank_body(rank: int, backend: NvshmemBackend):
        topk = topks[rank].to(device)
        per_rank, _, per_expert, in_rank = dispatch_layout(topk, E, R)
        if rank == R - 1:
            if argument == "num_tokens_per_rank":
                per_rank = per_rank + 1
            else:
                per_expert = torch.roll(per_expert, 1)
        args = DispatchArgs(x=xs[rank].to(device), handle=None, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                            num_tokens_per_expert=per_expert, topk_idx=topk, topk_weights=weights[rank].to(device),
                            expert_alignment=1, num_worst_tokens=0, config=config)
        backend.check_dispatch(args)
        try:
            backend.dispatch(args)
        except EPInputError as err:
            return err.argument
        return "no error"

    got = run_ranks(R, ranks_per_node, rank_body, bytes_for_tokens(T, R, ranks_per_node, E, hidden, 4), device=device)
    assert got == [argument] * R, f"bad {argument} on the last rank, R={R} k={ranks_per_node}: ranks raised {got}"


def _ll_round_trip(rank: int, backend: NvshmemBackend, args: LowLatencyDispatchArgs, weights: torch.Tensor,
                   hidden: int) -> torch.Tensor:
    """One low-latency dispatch + combine on a loopback rank, the experts being ``expert_fn`` (the
    empty slots zeroed, without a host sync); returns the combined rows."""
    R, M, E = backend.num_ranks, args.num_max_dispatch_tokens_per_rank, args.num_experts
    device = args.x.device
    recv_x, recv_count, handle, _ = backend.low_latency_dispatch(args)
    experts = rank * (E // R) + torch.arange(E // R, device=device)
    valid = torch.arange(R * M, device=device)[None, :] < recv_count[:, None]
    expert_out = torch.where(valid[..., None], expert_fn(experts.repeat_interleave(R * M),
                                                         recv_x.float().reshape(-1, hidden)).reshape(recv_x.shape),
                             0.0).to(torch.bfloat16)
    combine_args = LowLatencyCombineArgs(expert_out, args.topk_idx, weights, handle, None, None, False, args.rank_mask)
    backend.check_low_latency_combine(combine_args)
    return backend.low_latency_combine(combine_args)[0]


def recovery_case(num_ranks: int, ranks_per_node: int, hidden: int = 512,
                  device: Optional[torch.device] = None) -> None:
    """A rejected call costs nothing, in both modes: the last rank rejects its
    input and aborts; the others' call raises EPInputError naming the argument (a full dispatch at
    its count wait; a low-latency dispatch at the next look at the mailbox); every rank then
    resyncs (what Buffer does at the next call) and the next call pairs and matches the reference."""
    from epcomm.errors import EPInputError
    device = device or torch.device("cuda", torch.cuda.current_device())
    R, E, T, M, K = num_ranks, 4 * num_ranks, 24, 16, 4
    normal = make_routing(83, "uniform", R, E, K, T, hidden, fixed_tokens=T)
    ll = make_routing(84, "uniform", R, E, K, M, hidden, fixed_tokens=M)
    config = Config(num_sms=4)
    planted = EPInputError("x", "planted on the last rank")

    def warm(backend: NvshmemBackend) -> None:  # the abort kernels too (a rank compiling one stalls the others)
        backend.normal._dispatch_plan(2 * hidden, 0, K, E, 2, False)
        backend.normal._combine_plan(hidden, K, 0, 2)
        warm_low_latency(backend, E, M, hidden, K)
        backend.warm_abort()

    def raised(fn) -> str:
        try:
            fn()
        except EPInputError as err:
            return err.argument
        return "no error"

    def rank_body(rank: int, backend: NvshmemBackend):
        xs, topks, weights = normal
        topk = topks[rank].to(device)
        per_rank, _, per_expert, in_rank = dispatch_layout(topk, E, R)
        args = DispatchArgs(x=xs[rank].to(device), handle=None, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                            num_tokens_per_expert=per_expert, topk_idx=topk, topk_weights=weights[rank].to(device),
                            expert_alignment=1, num_worst_tokens=0, config=config)
        backend.check_dispatch(args)
        # the data region holds what earlier calls left (combine rows, low-latency data: the modes
        # share these bytes): an aborting rank's count row is not put, and its peers must not read
        # its stale bytes there as a count or an abort code
        torch.cuda.synchronize(device)
        backend.t.buffer[backend.pre.data:].fill_(0x5A)
        torch.cuda.synchronize(device)
        backend.t.barrier()
        seen = []
        if rank == R - 1:  # rejected: takes part as an abort (what Buffer does with the error)
            backend.agree("dispatch", None, planted)
            seen.append("x")
        else:
            seen.append(raised(lambda: backend.dispatch(args)))
        seen.append(backend.needs_resync)
        backend.resync()
        result = backend.dispatch(args)
        y = rank_fn(rank, result.recv_x)
        backend.check_combine(y, result.handle, None, ())
        combined, _ = backend.combine(y, result.handle, None, (), config)
        backend.clean_low_latency()
        # low-latency mode (after a round that passes, as in a decode loop): the others learn of the
        # abort at their next look at the mailbox
        xs, topks, weights = ll
        mask = torch.zeros(R, dtype=torch.int32, device=device)
        x, topk = xs[rank].to(device), topks[rank].to(device)
        ll_args = LowLatencyDispatchArgs(x, topk, M, E, False, False, False, None, None, False, mask)
        backend.check_low_latency_dispatch(ll_args)
        _ll_round_trip(rank, backend, ll_args, weights[rank].to(device), hidden)
        if rank == R - 1:
            backend.agree("low_latency_dispatch", None, planted)
            seen.append("x")
        else:
            backend.low_latency_dispatch(ll_args)
            wait_stream(device)
            seen.append(raised(backend.raise_pending))
        seen.append(backend.needs_resync)
        backend.resync()
        ll_combined = _ll_round_trip(rank, backend, ll_args, weights[rank].to(device), hidden)
        wait_stream(device)
        backend.raise_pending()
        return dict(seen=seen, recv_x=to_cpu(result.recv_x), combined=to_cpu(combined), ll_combined=to_cpu(ll_combined),
                    mask=mask.cpu())

    what = f"recovery case R={R} k={ranks_per_node}"
    num_bytes = bytes_for_tokens(T, R, ranks_per_node, E, hidden, K)
    got = run_ranks(R, ranks_per_node, rank_body, num_bytes, timeout_s=5.0, device=device, warm=warm,
                    num_ll_bytes=low_latency_bytes(M, hidden, R, E))
    expected = reference_dispatch(*normal, E)
    for rank in range(R):
        mine = got[rank]
        assert mine["seen"] == ["x", True, "x", True], f"{what} rank {rank}: raised / resync asked {mine['seen']}"
        assert not mine["mask"].any(), f"{what} rank {rank}: masked {mine['mask'].tolist()}"
        _equal_payload(mine["recv_x"], expected[rank]["recv_x"], f"{what} rank {rank} recv_x after the resync")
        want = reference_combine(normal[0][rank], normal[1][rank], E, R, rank_fn)
        torch.testing.assert_close(mine["combined"].float(), want.float(), rtol=2e-2, atol=2e-2,
                                   msg=lambda m: f"{what} rank {rank} combine after the resync: {m}")
        want = reference_low_latency_combine(ll[0][rank], ll[1][rank], ll[2][rank], expert_fn, False)
        torch.testing.assert_close(mine["ll_combined"], want, rtol=2e-2, atol=2e-2,
                                   msg=lambda m: f"{what} rank {rank} low-latency round trip after the resync: {m}")


def disagreement_case(num_ranks: int, ranks_per_node: int, hidden: int = 512,
                      device: Optional[torch.device] = None) -> None:
    """Ranks that disagree move nothing (a fault first seen on 2 x H200): a cached dispatch in which the
    last rank sends FP8 and the others BF16 (rows of another size), then a combine in which only
    the last rank passes top-k weights (combine rows of another size). Neither call waits on the
    host, so each returns; every later kernel of the call must return at once (the step barrier
    failed: gpu/normal/two_level/step.py), since reading the peers' rows with this rank's layout indexes
    anything. Every rank then raises EPInputError naming the argument at its next look at the
    mailbox, resyncs, and the next full dispatch and combine match the reference."""
    from epcomm.errors import EPInputError
    from epcomm.fp8 import per_token_cast_to_fp8
    device = device or torch.device("cuda", torch.cuda.current_device())
    R, E, T, K = num_ranks, 4 * num_ranks, 24, 4
    routing = make_routing(85, "uniform", R, E, K, T, hidden, fixed_tokens=T)
    config = Config(num_sms=4)

    def warm(backend: NvshmemBackend) -> None:
        backend.normal._dispatch_plan(2 * hidden, 0, K, E, 2, False)
        backend.normal._dispatch_plan(2 * hidden, 0, 0, E, 2, True)
        backend.normal._dispatch_plan(hidden, hidden // 128, 0, E, 2, True)
        for num_topk in (0, K):
            backend.normal._combine_plan(hidden, num_topk, 0, 2)

    def raised(backend) -> str:
        wait_stream(device)
        try:
            backend.raise_pending()
        except EPInputError as err:
            return err.argument
        return "no error"

    def rank_body(rank: int, backend: NvshmemBackend):
        xs, topks, weights = routing
        x, topk = xs[rank].to(device), topks[rank].to(device)
        per_rank, _, per_expert, in_rank = dispatch_layout(topk, E, R)

        def full_dispatch():
            args = DispatchArgs(x=x, handle=None, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                num_tokens_per_expert=per_expert, topk_idx=topk,
                                topk_weights=weights[rank].to(device), expert_alignment=1, num_worst_tokens=0,
                                config=config)
            backend.check_dispatch(args)
            return backend.dispatch(args)

        first = full_dispatch()
        seen = []
        payload = per_token_cast_to_fp8(x) if rank == R - 1 else x
        cached = DispatchArgs(x=payload, handle=first.handle, num_tokens_per_rank=None, is_token_in_rank=None,
                              num_tokens_per_expert=None, topk_idx=None, topk_weights=None, expert_alignment=1,
                              num_worst_tokens=0, config=config)
        backend.check_dispatch(cached)
        backend.dispatch(cached)
        seen.append(raised(backend))
        backend.resync()
        y = rank_fn(rank, first.recv_x)
        combine_weights = first.recv_topk_weights if rank == R - 1 else None
        backend.check_combine(y, first.handle, combine_weights, ())
        backend.combine(y, first.handle, combine_weights, (), config)
        seen.append(raised(backend))
        backend.resync()
        result = full_dispatch()
        y = rank_fn(rank, result.recv_x)
        backend.check_combine(y, result.handle, None, ())
        combined, _ = backend.combine(y, result.handle, None, (), config)
        seen.append(raised(backend))
        return dict(seen=seen, recv_x=to_cpu(result.recv_x), combined=to_cpu(combined))

    what = f"disagreement case R={R} k={ranks_per_node}"
    got = run_ranks(R, ranks_per_node, rank_body, bytes_for_tokens(T, R, ranks_per_node, E, hidden, K),
                    timeout_s=5.0, device=device, warm=warm)
    expected = reference_dispatch(*routing, E)
    for rank in range(R):
        mine = got[rank]
        assert mine["seen"] == ["x", "topk_weights", "no error"], f"{what} rank {rank}: raised {mine['seen']}"
        _equal_payload(mine["recv_x"], expected[rank]["recv_x"], f"{what} rank {rank} recv_x after the resyncs")
        want = reference_combine(routing[0][rank], routing[1][rank], E, R, rank_fn)
        torch.testing.assert_close(mine["combined"].float(), want.float(), rtol=2e-2, atol=2e-2,
                                   msg=lambda m: f"{what} rank {rank} combine after the resyncs: {m}")


def ll_other_call_case(num_ranks: int, ranks_per_node: int, hidden: int = 512,
                       device: Optional[torch.device] = None) -> None:
    """Ranks that disagree on a low-latency dispatch's expert count, near and far: the last rank's low-latency dispatch has
    twice the others' expert count, so its count words lie elsewhere. Every rank's receive must
    end its wait by the senders' fingerprint rows — well before the timeout, nobody masked — and
    raise EPInputError naming num_experts; after the resync a round trip matches the reference."""
    import time

    from epcomm.errors import EPInputError
    device = device or torch.device("cuda", torch.cuda.current_device())
    R, E, M, K, timeout_s = num_ranks, 4 * num_ranks, 16, 4, 5.0
    xs, topks, weights = make_routing(85, "uniform", R, E, K, M, hidden, fixed_tokens=M)

    def warm(backend: NvshmemBackend) -> None:
        for experts in (E, 2 * E):
            warm_low_latency(backend, experts, M, hidden, K)
        backend.warm_abort()

    def rank_body(rank: int, backend: NvshmemBackend):
        mask = torch.zeros(R, dtype=torch.int32, device=device)
        x, topk = xs[rank].to(device), topks[rank].to(device)
        experts = 2 * E if rank == R - 1 else E
        args = LowLatencyDispatchArgs(x, topk, M, experts, False, False, False, None, None, False, mask)
        backend.check_low_latency_dispatch(args)
        started = time.monotonic()
        backend.low_latency_dispatch(args)
        wait_stream(device)
        seconds = time.monotonic() - started
        try:
            backend.raise_pending()
            raised = "no error"
        except EPInputError as err:
            raised = err.argument
        masked = mask.cpu().tolist()
        backend.resync()
        args = LowLatencyDispatchArgs(x, topk, M, E, False, False, False, None, None, False, mask)
        backend.check_low_latency_dispatch(args)
        combined = _ll_round_trip(rank, backend, args, weights[rank].to(device), hidden)
        wait_stream(device)
        return dict(seconds=seconds, raised=raised, masked=masked, combined=to_cpu(combined))

    what = f"other-call case R={R} k={ranks_per_node}"
    got = run_ranks(R, ranks_per_node, rank_body, 1 << 20, timeout_s=timeout_s, device=device, warm=warm,
                    num_ll_bytes=low_latency_bytes(M, hidden, R, 2 * E))
    for rank in range(R):
        mine = got[rank]
        assert mine["raised"] == "num_experts", f"{what} rank {rank} raised {mine['raised']}"
        assert not any(mine["masked"]), f"{what} rank {rank} masked {mine['masked']} (a wait ran out)"
        assert mine["seconds"] < timeout_s / 2, f"{what} rank {rank}: the wait took {mine['seconds']:.1f} s"
        want = reference_low_latency_combine(xs[rank], topks[rank], weights[rank], expert_fn, False)
        torch.testing.assert_close(mine["combined"], want, rtol=2e-2, atol=2e-2,
                                   msg=lambda m: f"{what} rank {rank} round trip after the resync: {m}")


def skip_across_buffers_case(num_ranks: int, ranks_per_node: int, hidden: int = 512,
                             device: Optional[torch.device] = None) -> None:
    """A rank that skips a call and goes on to another Buffer of the group (the call board,
    gpu/call_board.py): two low-latency Buffers A and B per rank. Every rank dispatches on B; the
    last rank's expert code fails, so it skips B's combine and dispatches on A. The peers' combine
    on B and the last rank's dispatch on A each find the other side's call on the board: every rank
    raises EPInputError naming ``call`` well before the timeout, nobody is masked; after the
    resync (one for the whole group) a round trip on A and one on B match the reference."""
    import time

    from epcomm.errors import EPInputError
    device = device or torch.device("cuda", torch.cuda.current_device())
    R, E, M, K, timeout_s = num_ranks, 4 * num_ranks, 16, 4, 5.0
    xs, topks, weights = make_routing(86, "uniform", R, E, K, M, hidden, fixed_tokens=M)

    def warm(backend: NvshmemBackend) -> None:
        warm_low_latency(backend, E, M, hidden, K)
        backend.warm_abort()

    def rank_body(rank: int, backends):
        buffer_a, buffer_b = backends
        masks = [torch.zeros(R, dtype=torch.int32, device=device) for _ in backends]
        x, topk, w = xs[rank].to(device), topks[rank].to(device), weights[rank].to(device)

        def args(mask):
            return LowLatencyDispatchArgs(x, topk, M, E, False, False, False, None, None, False, mask)
        compiled_before = len(launch.compiled_specialisations)
        started = time.monotonic()
        if rank == R - 1:  # its expert code failed after B's dispatch: its next call is on A
            buffer_b.low_latency_dispatch(args(masks[1]))
            buffer_a.low_latency_dispatch(args(masks[0]))
        else:
            _ll_round_trip(rank, buffer_b, args(masks[1]), w, hidden)
        launched_s = time.monotonic() - started  # the host's part: launches (and any first-call work)
        wait_stream(device)
        seconds = time.monotonic() - started
        # a compile inside the timed window (any rank's: one process) lets the peers' waits run out
        compiled = launch.compiled_specialisations[compiled_before:]
        raised = []
        for backend in backends:  # what each Buffer reports (the board's record is on the one that waited)
            try:
                backend.raise_pending()
            except EPInputError as err:
                raised.append(err.argument)
        masked = [m.cpu().tolist() for m in masks]
        buffer_a.resync()  # the whole group: B resyncs with it
        combined = [to_cpu(_ll_round_trip(rank, backend, args(mask), w, hidden))
                    for backend, mask in zip(backends, masks)]
        wait_stream(device)
        return dict(seconds=seconds, raised=raised, masked=masked, combined=combined,
                    resynced=not buffer_b.needs_resync, compiled=compiled,
                    launched_s=launched_s)

    what = f"skip-across-Buffers case R={R} k={ranks_per_node}"
    got = run_ranks(R, ranks_per_node, rank_body, 1 << 20, timeout_s=timeout_s, device=device, warm=warm,
                    num_ll_bytes=low_latency_bytes(M, hidden, R, E), buffers=2)
    want = [reference_low_latency_combine(xs[rank], topks[rank], weights[rank], expert_fn, False) for rank in range(R)]
    for rank in range(R):
        mine = got[rank]
        assert "call" in mine["raised"], f"{what} rank {rank} raised {mine['raised']}"
        assert not any(any(m) for m in mine["masked"]), f"{what} rank {rank} masked {mine['masked']}"
        launches = [round(got[r]["launched_s"], 2) for r in range(R)]
        assert mine["seconds"] < timeout_s / 2, (f"{what} rank {rank}: the waits took {mine['seconds']:.1f} s; "
                                                 f"compiled meanwhile: {mine['compiled'] or 'nothing'}; "
                                                 f"the host's launches per rank took {launches} s")
        assert mine["resynced"], f"{what} rank {rank}: Buffer B still asks for a resync after A's"
        for name, combined in zip("AB", mine["combined"]):
            torch.testing.assert_close(combined, want[rank], rtol=2e-2, atol=2e-2,
                                       msg=lambda m: f"{what} rank {rank} round trip on {name} after the resync: {m}")
