"""Rank bodies for the failure-contract tests (tests/test_failure_contract.py): each returns what
its rank saw, so the test asserts that every rank raised, and what they named."""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

import epcomm
from epcomm.testing.sweeps import make_routing, world


def _layout_args(buffer, topk, num_experts):
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk, num_experts)
    return dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)


def _outcome(fn):
    """``("ok", value)`` or ``(error class name, argument or peers, message)``."""
    try:
        return "ok", fn()
    except epcomm.EPInputError as err:
        return "EPInputError", err.argument, str(err)
    except epcomm.EPTimeoutError as err:
        return "EPTimeoutError", err.peers, str(err)


def disagreement(case: str):
    """Ranks call with different arguments; every rank must raise EPInputError naming it."""
    R, rank = world()
    buffer = epcomm.Buffer(dist.group.WORLD, low_latency_mode=True, timeout=20)
    num_experts = 4 * R
    hidden = 256 if case != "hidden" or rank == 0 else 384
    xs, topks, weights = make_routing(3, "uniform", R, num_experts, 2, 8, hidden, fixed_tokens=8)
    x, topk, w = xs[rank], topks[rank], weights[rank]

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
    args = _layout_args(buffer, topks[rank], num_experts)
    xs2, _, _ = make_routing(3, "uniform", R, num_experts, 2, 8, 256, fixed_tokens=8)
    assert buffer.dispatch(xs2[rank], **args)[0].shape[1] == 256
    return result[:2] + (result[2][:300],) if len(result) == 3 else result


def one_rank_bad_argument():
    """Only rank 1's input is invalid: it raises before communicating, and so do all the others
    (abort fingerprint), instead of pairing with its next call."""
    R, rank = world()
    buffer = epcomm.Buffer(dist.group.WORLD, timeout=20)
    num_experts = 4 * R
    xs, topks, weights = make_routing(4, "uniform", R, num_experts, 2, 8, 128, fixed_tokens=8)
    args = _layout_args(buffer, topks[rank], num_experts)
    x = xs[rank].float() if rank == 1 else xs[rank]  # float32 is invalid
    result = _outcome(lambda: buffer.dispatch(x, **args))
    ok = buffer.dispatch(xs[rank], **args)[0]  # usable afterwards, calls still paired
    assert ok.dtype == torch.bfloat16
    return result[:2]


def absent_rank(call: str, timeout: float = 2.0):
    """The last rank builds the buffer but never makes the call (stalled, crashed in expert code,
    or skipped it): every other rank raises EPTimeoutError naming it, within timeout + 5 s."""
    R, rank = world()
    buffer = epcomm.Buffer(dist.group.WORLD, low_latency_mode=True, timeout=timeout)
    num_experts = 4 * R
    xs, topks, weights = make_routing(5, "uniform", R, num_experts, 2, 8, 128, fixed_tokens=8)
    args = _layout_args(buffer, topks[rank], num_experts)
    handle = buffer.dispatch(xs[rank], **args)[4] if call == "combine" else None
    if rank == R - 1:
        return ("absent",)
    started = time.monotonic()
    if call == "dispatch":
        result = _outcome(lambda: buffer.dispatch(xs[rank], **args))
    else:
        result = _outcome(lambda: buffer.combine(torch.zeros(handle.num_recv_rows, 128, dtype=torch.bfloat16), handle))
    return result[:2] + (time.monotonic() - started,)


def inconsistent_counts(case: str):
    """Counts that do not summarise the routing they come with raise EPInputError naming them."""
    R, rank = world()
    buffer = epcomm.Buffer(dist.group.WORLD, timeout=20)
    num_experts = 4 * R
    xs, topks, weights = make_routing(6, "uniform", R, num_experts, 2, 12, 128, fixed_tokens=12)
    args = _layout_args(buffer, topks[rank], num_experts)
    if case == "num_tokens_per_rank":
        args["num_tokens_per_rank"] = args["num_tokens_per_rank"] + 1
    elif case == "is_token_in_rank":  # taken from another routing
        other = make_routing(60, "skewed", R, num_experts, 2, 12, 128, fixed_tokens=12)[1][rank]
        other_args = _layout_args(buffer, other, num_experts)
        args["is_token_in_rank"], args["num_tokens_per_rank"] = other_args["is_token_in_rank"], \
            other_args["num_tokens_per_rank"]
    elif case == "num_tokens_per_expert":
        args["num_tokens_per_expert"] = torch.zeros_like(args["num_tokens_per_expert"])
    result = _outcome(lambda: buffer.dispatch(xs[rank], topk_idx=topks[rank], topk_weights=weights[rank], **args))
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
