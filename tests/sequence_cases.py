"""Randomized call sequences with faults: the failure contract checked step by step.

Every rank plays the same plan (one seed): a step is one unit of work — a normal-mode layout,
dispatch and combine; a cached dispatch and combine; or a low-latency dispatch and combine — and
carries at most one fault:

- ``bad``: some ranks (a random non-empty subset) pass an invalid argument to one call;
- ``disagree``: some ranks pass valid arguments that differ from the others' (hidden, FP8, top-k);
- ``layout``: one rank's ``get_dispatch_layout`` rejects its ``topk_idx``; that rank skips the step
  (its peers raise naming ``topk_idx`` — or ``call`` where its next call is on the other Buffer);
- ``skip``: one rank skips the step's combine (its expert code failed). Its peers raise naming
  ``call`` in that combine, and the rank's next call pairs with their next one: on the same
  Buffer the two calls meet at one call number and the skipped combine gives way (store_agreement
  .py), on the other Buffer (``two_buffers``) the peers find it waiting there. (On a GPU backend
  the call board makes the rank's next call raise naming ``call`` too; it makes it again.)
- ``drop`` (``two_buffers``): one rank drops the whole step (it fails before the dispatch) and
  the next step is on the other Buffer; its peers raise naming ``call`` in the dispatch.
- ``late`` (``late``, CPU): one rank comes past the timeout to a round trip on a Buffer of its own
  with a short timeout. Without ``enable_shrink`` (a low-latency or a normal round) every rank
  raises EPTimeoutError naming it, the late rank too when it comes; with it (low-latency) the
  others mask it and get the live ranks' sum, the late rank raises EPError (masked), and every
  rank unmasks and cleans the buffer. Either way the next round on that Buffer is right.

With ``two_buffers`` normal-mode steps run on one Buffer and low-latency steps on a second one of
the same group, as a server's prefill and decode paths do. (A rank that drops a whole step and
then makes the same kind of call on the same Buffer pairs with its peers' dropped call: calls pair
by order, and nothing in DeepEP's API says which step a call belongs to — so the plan never does.)

After every step each rank asserts that it either raised an :class:`epcomm.EPError` naming the
argument (and, where a peer caused it, that peer) or returned the reference's result; a step
after a fault has none, so the next valid call must succeed.
"""
from __future__ import annotations

import random
from collections import Counter
from typing import Callable, Dict, Optional

import torch
import torch.distributed as dist

import epcomm
from epcomm.testing.reference import reference_combine, reference_dispatch, reference_low_latency_combine
from epcomm.testing.sweeps import _bits, expert_fn, make_routing, rank_fn, world

OPS = ("normal", "cached", "low_latency")
FAULTS = ("none", "bad", "disagree", "layout", "skip", "drop", "late")
FAULT_WEIGHTS = (5, 2, 2, 2, 2, 0, 0)
TWO_BUFFER_WEIGHTS = (5, 2, 2, 2, 3, 2, 0)
LATE_WEIGHTS = (5, 1, 1, 1, 1, 0, 3)  # (a late step sleeps past LATE_TIMEOUT_S)
LATE_TIMEOUT_S = 1.5  # the late steps' Buffers' timeout; the late rank comes 0.4 s after it


class _Expected(Exception):
    """An EPError the plan expected (the step stops there on this rank)."""


def _plan(seed: int, step: int, num_ranks: int, previous: Dict, have_handle: bool, last: bool, gpu: bool,
          two_buffers: bool = False, late: bool = False) -> Dict:
    rng = random.Random(seed * 100003 + step)
    ops = OPS if have_handle else ("normal", "low_latency")
    op = previous.get("next_op") or rng.choice(ops)
    # a fault is followed by a valid step (the last step too: a rank that skipped needs a next call)
    weights = TWO_BUFFER_WEIGHTS if two_buffers else LATE_WEIGHTS if late else FAULT_WEIGHTS
    fault = "none" if previous["fault"] != "none" or last else rng.choices(FAULTS, weights)[0]
    next_op = None
    if fault in ("skip", "drop") or (fault == "layout" and two_buffers):  # the next step's op is part of it
        other = ["low_latency"] if op != "low_latency" else [o for o in ops if o != "low_latency"]
        next_op = rng.choice(other if fault == "drop" else list(ops))
    if fault == "layout" and op != "normal":
        fault = "bad"
    if gpu and not two_buffers and previous["fault"] == "skip" and \
            (previous["op"] == "low_latency") != (op == "low_latency"):
        # one GPU Buffer: the step after a skip stays in the skipped call's mode (on nvshmem the
        # modes share their bytes: a mode switch starts with clean_low_latency_buffer, a host
        # barrier, which the rank that skipped would reach while its peers resync)
        op = previous["op"] if previous["op"] != "cached" or have_handle else "normal"
    ranks = list(range(num_ranks))
    subset = sorted(rng.sample(ranks, rng.randint(1, num_ranks)))
    proper = sorted(rng.sample(ranks, rng.randint(1, num_ranks - 1)))
    return dict(op=op, fault=fault, at=rng.choice(("dispatch", "combine")), bad_ranks=subset, odd_ranks=proper,
                one=rng.randrange(num_ranks), variant=rng.randrange(2), routing_seed=seed * 7919 + step,
                next_op=next_op)


def error_sequence(num_steps: int, seed: int = 0, device: str = "cpu", hidden: int = 256, num_topk: int = 2,
                   tokens: int = 8, backend: Optional[str] = None, progress: Optional[Callable[[str], None]] = None,
                   two_buffers: bool = False, late: bool = False):
    """Run ``num_steps`` planned steps on this rank (all ranks call it with the same arguments);
    returns ``{outcome: count}``. Raises AssertionError naming the step on any broken promise.
    A step that completes updates the handle later cached steps use; one that raised anywhere
    leaves it (every rank keeps the same one).

    On a GPU backend (``device="cuda"``) a call that does not wait on the host learns of a peer's
    rejection or of a disagreement only at the next call (docs/ERRORS.md, the recovery rule): where a call
    must raise and returns instead, the step synchronises and makes it again, and that attempt
    must raise. A skipped normal-mode combine is followed by a normal-mode step there (its peers
    wait on signals only a normal-mode call sets); low-latency steps skip nothing (a peer that
    misses a low-latency call is an EPTimeoutError, sticky on a GPU Buffer, or masked with
    ``enable_shrink``: DeepEP's semantics). ``two_buffers``: normal
    and low-latency steps on two Buffers of the group, with ``drop`` faults. On the reference
    backend the call of the rank that skipped pairs with its peers' next one; on a GPU backend the
    call board (gpu/call_board.py) makes both sides raise naming ``call``, so the rank that skipped
    makes its next call again after it raised. ``late`` (the reference backend): ``late`` faults, on
    two more Buffers of the group (with and without ``enable_shrink``, timeout LATE_TIMEOUT_S)."""
    R, rank = world()
    dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    num_experts, M = 2 * R, tokens
    ll_bytes = epcomm.Buffer.get_low_latency_rdma_size_hint(M, hidden + 128, R, num_experts)
    gpu = device == "cuda"
    kwargs = dict(num_nvl_bytes=64 << 20, num_rdma_bytes=ll_bytes, low_latency_mode=True, timeout=20.0,
                  check_values=True)  # (a GPU rank then rejects out-of-range or changed top-k itself)
    if backend is not None:
        kwargs["backend"] = backend
    buffer = epcomm.Buffer(dist.group.WORLD, **kwargs)
    normal_buffer = epcomm.Buffer(dist.group.WORLD, **dict(kwargs, low_latency_mode=False)) if two_buffers else buffer
    late_buffers = {}
    if late:
        assert not gpu, "late faults run on the reference backend (a GPU Buffer's timeout error is sticky)"
        late_buffers = {shrink: epcomm.Buffer(dist.group.WORLD, low_latency_mode=True, enable_shrink=shrink,
                                              timeout=LATE_TIMEOUT_S, **({"backend": backend} if backend else {}))
                        for shrink in (False, True)}
    outcomes: Counter = Counter()
    previous, cached = {"fault": "none", "op": "normal"}, None  # cached: (routing seed, handle) of the last normal step
    retry_pending = False  # this rank skipped a combine: its next call raises, then it makes it again
    previous_mode = "normal"

    def raising(fn):
        """``fn()``, which must raise; on a GPU backend a call that returns reports at the next one."""
        fn()
        if gpu:
            torch.cuda.synchronize()
            fn()

    def collective(fn):
        nonlocal retry_pending
        if retry_pending:
            retry_pending = False
            try:
                raising(fn)
            except epcomm.EPInputError as err:
                assert err.argument == "call", f"rank {rank}: the call after a skipped combine raised {err}"
                outcomes["skipped_call_found"] += 1
            else:
                raise AssertionError(f"rank {rank}: the call after a skipped combine did not raise")
        return fn()

    for step in range(num_steps):
        plan = _plan(seed, step, R, previous, cached is not None, step == num_steps - 1, gpu, two_buffers, late)
        op, fault = plan["op"], plan["fault"]
        if fault == "late":
            outcomes[_late_step(late_buffers, plan, rank, R, num_experts, num_topk, M, hidden)] += 1
            previous = {"fault": fault, "op": op, "next_op": None}
            continue
        where = f"rank {rank} step {step} ({op}, {fault} at {plan['at']}, ranks {plan['bad_ranks']}/{plan['odd_ranks']}/{plan['one']})"

        def expect(argument: str, peer: Optional[int] = None):
            """The call must raise EPInputError naming ``argument`` (and ``peer`` in the message)."""
            def check(fn):
                try:
                    raising(fn)
                except epcomm.EPInputError as err:
                    assert err.argument == argument, f"{where}: raised for {err.argument!r}, expected {argument!r}: {err}"
                    assert peer is None or f"rank {peer}" in str(err), f"{where}: does not name rank {peer}: {err}"
                    raise _Expected() from None
                raise AssertionError(f"{where}: did not raise (expected EPInputError for {argument!r})")
            return check

        if op == "low_latency" and previous_mode == "normal" and buffer.backend_name == "nvshmem" and not two_buffers:
            # nvshmem: the modes share their bytes, as in DeepEP (every rank is at this step)
            buffer.clean_low_latency_buffer(M, hidden, num_experts)
        previous_mode = "low_latency" if op == "low_latency" else "normal"
        try:
            if fault == "drop" and rank == plan["one"]:
                raise _Expected()  # this rank failed before the step's dispatch: it makes none of its calls
            if op == "low_latency":
                _low_latency_step(buffer, plan, rank, R, num_experts, M, hidden, dev, collective, expect, where)
            else:
                if op == "cached" and fault == "layout":
                    fault = plan["fault"] = "bad"
                cached = _normal_step(normal_buffer, plan, rank, R, num_experts, num_topk, M, hidden, dev, collective,
                                      expect, where, cached)
            outcomes["ok" if fault == "none" else f"{fault}_ok"] += 1
        except _Expected:
            outcomes[f"{fault}_raised"] += 1
        same_buffer_next = (plan["next_op"] == "low_latency") == (op == "low_latency") or not two_buffers
        if rank == plan["one"] and (fault == "skip" and gpu or
                                    fault in ("drop", "layout") and gpu and not same_buffer_next):
            # its next call meets the skipped one (same Buffer), or on a GPU backend finds on the
            # call board that its peers are in another call: it raises, then makes it again
            retry_pending = True
        previous = {"fault": fault, "op": op, "next_op": plan["next_op"]}
        if progress is not None and (step + 1) % 100 == 0:
            progress(f"rank {rank}: {step + 1}/{num_steps} steps")
    return dict(outcomes)


def _normal_step(buffer, plan, rank, R, num_experts, num_topk, M, hidden, dev, collective, expect, where, cached):
    op, fault, at = plan["op"], plan["fault"], plan["at"]
    if op == "cached" and fault == "disagree":
        at = "dispatch"  # (a cached handle has no received top-k weights to disagree on at combine)
    one, bad, odd = plan["one"], rank in plan["bad_ranks"], rank in plan["odd_ranks"]
    if op == "cached":
        seed, handle = cached
        xs, topks, weights = make_routing(seed, "uniform", R, num_experts, num_topk, M, hidden, fixed_tokens=M)
    else:
        seed = plan["routing_seed"]
        xs, topks, weights = make_routing(seed, "uniform", R, num_experts, num_topk, M, hidden, fixed_tokens=M)
    x, topk, w = xs[rank].to(dev), topks[rank].to(dev), weights[rank].to(dev)
    payload = x
    if fault == "disagree" and at == "dispatch" and odd:
        payload = epcomm.per_token_cast_to_fp8(x) if plan["variant"] or op == "cached" else \
            torch.cat([x, x[:, :128]], dim=1)  # hidden + 128
    disagreed_field = "x" if plan["variant"] or op == "cached" else "hidden"
    if fault == "bad" and at == "dispatch" and bad:
        payload = x.float()

    if op == "normal":
        layout_topk = topk
        if fault == "layout" and rank == one:
            layout_topk = topk.clone()
            layout_topk[0, 0] = num_experts + 1
            expect("topk_idx")(lambda: buffer.get_dispatch_layout(layout_topk, num_experts))
        per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk, num_experts)
        routing = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                       topk_idx=topk, topk_weights=w)
        call = lambda: buffer.dispatch(payload, **routing)  # noqa: E731
    else:
        call = lambda: buffer.dispatch(payload, handle=handle)  # noqa: E731

    if fault == "drop":
        expect("call")(lambda: collective(call))  # a rank dropped this step: its next call is elsewhere
    if fault == "layout" and (plan["next_op"] == "low_latency") != (op == "low_latency") and plan["next_op"]:
        # the rejecting rank's next call is on the other Buffer: the peers find it waiting there and
        # give this call up (naming call); its stand-in, due at its next call here, is then void
        expect("call")(lambda: collective(call))
    elif fault == "layout":
        expect("topk_idx", peer=one)(lambda: collective(call))
    elif fault == "bad" and at == "dispatch":
        expect("x")(lambda: collective(call))
    elif fault == "disagree" and at == "dispatch":
        expect(disagreed_field)(lambda: collective(call))
    recv_x, recv_idx, recv_w, _, out_handle, _ = collective(call)
    want = reference_dispatch(xs, topks, weights, num_experts)[rank]
    assert torch.equal(_bits(recv_x.cpu()), _bits(want["recv_x"])), f"{where}: dispatch rows differ from the reference"
    if op == "normal":
        assert torch.equal(recv_idx.cpu(), want["recv_topk_idx"]), f"{where}: recv_topk_idx differs"
        handle = out_handle
    expert_out = rank_fn(rank, recv_x.cpu()).to(dev)

    if fault == "skip" and rank == one:
        raise _Expected()  # this rank's expert code failed: no combine
    if fault == "skip":
        expect("call", peer=None)(lambda: buffer.combine(expert_out, handle))
    if fault == "bad" and at == "combine" and bad:
        expect("x")(lambda: buffer.combine(expert_out[1:], handle))
    elif fault == "bad" and at == "combine":
        expect("x")(lambda: buffer.combine(expert_out, handle))
    elif fault == "disagree" and at == "combine":
        weights_arg = recv_w if (op == "normal" and odd) else None
        if op == "normal":
            expect("topk_weights")(lambda: buffer.combine(expert_out, handle, topk_weights=weights_arg))
    combined = buffer.combine(expert_out, handle)[0].cpu()
    want_combined = reference_combine(xs[rank], topks[rank], num_experts, R, rank_fn)
    torch.testing.assert_close(combined, want_combined, rtol=1e-2, atol=1e-2, msg=lambda m: f"{where}: combine: {m}")
    return (seed, handle)


def _low_latency_step(buffer, plan, rank, R, num_experts, M, hidden, dev, collective, expect, where):
    fault, at, one = plan["fault"], plan["at"], plan["one"]
    bad, odd = rank in plan["bad_ranks"], rank in plan["odd_ranks"]
    xs, topks, weights = make_routing(plan["routing_seed"], "uniform", R, num_experts, 2, M, hidden, fixed_tokens=M)
    x, topk, w = xs[rank].to(dev), topks[rank].to(dev), weights[rank].to(dev)
    dispatch_x, dispatch_topk = x, topk
    if fault == "bad" and at == "dispatch" and bad:
        dispatch_x = torch.cat([x, x[:1]])  # more than M tokens
    if fault == "disagree" and at == "dispatch" and odd:
        dispatch_topk = topk[:, :1].contiguous()  # another top-k width
    call = lambda: buffer.low_latency_dispatch(dispatch_x, dispatch_topk, M, num_experts, use_fp8=False)  # noqa: E731
    if fault == "drop":
        expect("call")(lambda: collective(call))  # a rank dropped this round: its next call is elsewhere
    if fault == "bad" and at == "dispatch":
        expect("x")(lambda: collective(call))
    elif fault == "disagree" and at == "dispatch":
        expect("num_topk")(lambda: collective(call))
    recv_x, recv_count, handle, _, _ = collective(call)
    num_local = num_experts // R
    experts = rank * num_local + torch.arange(num_local)
    expert_out = torch.stack([expert_fn(torch.full((recv_x.shape[1],), int(e)), recv_x[i].float().cpu())
                              for i, e in enumerate(experts)]).to(torch.bfloat16).to(dev)
    if fault == "skip" and rank == one:
        raise _Expected()  # this rank's expert code failed: no combine
    combine = lambda t=topk: buffer.low_latency_combine(expert_out, t, w, handle)  # noqa: E731
    if fault == "skip":
        expect("call")(combine)
    elif fault == "bad" and at == "combine":
        # this rank passes another token count than its dispatch: EPInputError before any exchange
        expect("topk_idx")(lambda: combine(topk[1:].contiguous()) if bad else combine())
    elif fault == "disagree" and at == "combine":
        expect("topk_idx")(lambda: combine(topk.flip(0).contiguous()) if odd else combine())
    combined = combine()[0].cpu()
    want = reference_low_latency_combine(xs[rank], topks[rank], weights[rank], expert_fn, use_fp8=False)
    torch.testing.assert_close(combined, want, rtol=2e-2, atol=2e-2, msg=lambda m: f"{where}: combine: {m}")


def _late_step(buffers, plan, rank, R, num_experts, num_topk, M, hidden) -> str:
    """A ``late`` fault: rank ``plan["one"]`` sleeps past LATE_TIMEOUT_S, then every rank makes a
    round trip on ``buffers[shrink]`` (shrink: ``plan["variant"]``; without it the round is
    low-latency or normal as ``plan["op"]`` says). Checks what each rank must see (module
    docstring), then a valid round on that Buffer; returns the outcome's name."""
    import time
    shrink, late = bool(plan["variant"]), plan["one"]
    buffer = buffers[shrink]
    low_latency = shrink or plan["op"] == "low_latency"
    where = f"rank {rank} late step (rank {late} late, shrink={shrink}, {'low_latency' if low_latency else 'normal'})"

    def round_trip(seed, dropped=()):
        xs, topks, weights = make_routing(seed, "uniform", R, num_experts, num_topk, M, hidden, fixed_tokens=M)
        x, topk, w = xs[rank], topks[rank], weights[rank]
        if not low_latency:
            per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk, num_experts)
            recv_x, _, _, _, handle, _ = buffer.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                         num_tokens_per_expert=per_expert, topk_idx=topk,
                                                         topk_weights=w)
            combined = buffer.combine(rank_fn(rank, recv_x), handle)[0]
            want = reference_combine(x, topk, num_experts, R, rank_fn)
            torch.testing.assert_close(combined, want, rtol=1e-2, atol=1e-2, msg=lambda m: f"{where}: {m}")
            return
        recv_x, _, handle, _, _ = buffer.low_latency_dispatch(x, topk, M, num_experts, use_fp8=False)
        num_local = num_experts // R
        experts = rank * num_local + torch.arange(num_local)
        expert_out = torch.stack([expert_fn(torch.full((recv_x.shape[1],), int(e)), recv_x[i].float())
                                  for i, e in enumerate(experts)]).to(torch.bfloat16)
        combined = buffer.low_latency_combine(expert_out, topk, w, handle)[0]
        live = topk.clone()
        for r in dropped:
            live[(live // num_local) == r] = -1
        want = reference_low_latency_combine(x, live, w, expert_fn, use_fp8=False)
        torch.testing.assert_close(combined, want, rtol=2e-2, atol=2e-2, msg=lambda m: f"{where}: {m}")

    if rank == late:
        time.sleep(LATE_TIMEOUT_S + 0.4)
    seed = plan["routing_seed"]
    if not shrink:
        try:
            round_trip(seed)
        except epcomm.EPTimeoutError as err:
            # (a rank the machine slowed past the timeout may be named beside it)
            assert late in err.peers, f"{where}: EPTimeoutError names {err.peers}: {err}"
        else:
            raise AssertionError(f"{where}: the round with a late rank did not raise")
        round_trip(seed + 1)  # the next call pairs on every rank
        return "late_raised"
    if rank == late:
        try:
            round_trip(seed)
        except epcomm.EPError as err:
            assert "masked this rank" in str(err), f"{where}: {err}"
        else:
            raise AssertionError(f"{where}: the late rank's round did not raise (its peers masked it)")
    else:
        round_trip(seed, dropped=(late,))  # the live ranks' sum
    buffer.low_latency_clean_mask_buffer()
    buffer.clean_low_latency_buffer(M, hidden, num_experts)  # (collective: the late rank is here too)
    round_trip(seed + 1)
    return "late_masked"
