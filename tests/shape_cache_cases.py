"""Test bodies for the argument checks kept per shape (checks.ShapeCache), run on every rank of a
WorkerPool: after a valid call, a call of the same shapes with a bad argument is still rejected."""
from __future__ import annotations

import torch
import torch.distributed as dist

import epcomm
from epcomm.fp8 import per_token_cast_to_fp8
from epcomm.handle import LowLatencyHandle
from epcomm.testing.sweeps import make_routing, world

NUM_EXPERTS = 8


def _inputs(R: int, rank: int):
    xs, topks, weights = make_routing(3, "uniform", R, NUM_EXPERTS, 2, 6, 256, fixed_tokens=6)
    return xs[rank], topks[rank], weights[rank]


def _full(buffer, default_x, topk, w, **override):
    """A valid full dispatch with some arguments replaced by ``override``."""
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk, NUM_EXPERTS)
    kwargs = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                  topk_idx=topk, topk_weights=w)
    kwargs.update(override)
    return buffer.dispatch(kwargs.pop("x", default_x), **kwargs)


def _non_contiguous(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values and shape, column-major (not contiguous)."""
    return t.t().contiguous().t()


# rule: (argument the error must name, the bad call (buffer, x, topk, w, handle)), each made after valid
# calls of the same shapes (full, cached and layout)
RULES = {
    "dispatch_weights_not_contiguous": ("topk_weights", lambda b, x, t, w, h: _full(b, x, t, w, topk_weights=_non_contiguous(w))),
    "dispatch_topk_not_contiguous": ("topk_idx", lambda b, x, t, w, h: _full(b, x, t, w, topk_idx=_non_contiguous(t))),
    "dispatch_per_rank_dtype": ("num_tokens_per_rank", lambda b, x, t, w, h: _full(
        b, x, t, w, num_tokens_per_rank=b.get_dispatch_layout(t, NUM_EXPERTS)[0].long())),
    "dispatch_per_rank_list": ("num_tokens_per_rank", lambda b, x, t, w, h: _full(
        b, x, t, w, num_tokens_per_rank=b.get_dispatch_layout(t, NUM_EXPERTS)[0].tolist())),
    "dispatch_x_other_device": ("x", lambda b, x, t, w, h: _full(b, x, t, w, x=x.to("meta"))),
    "dispatch_x_dtype": ("x", lambda b, x, t, w, h: _full(b, x, t, w, x=x.half())),
    "dispatch_topk_values": ("topk_idx", lambda b, x, t, w, h: _full(b, x, t, w, topk_idx=t * 0 + 99)),
    "dispatch_counts_values": ("num_tokens_per_expert", lambda b, x, t, w, h: _full(
        b, x, t, w, num_tokens_per_expert=b.get_dispatch_layout(t, NUM_EXPERTS)[2] + 1)),
    "dispatch_alignment_zero": ("expert_alignment", lambda b, x, t, w, h: _full(b, x, t, w, expert_alignment=0)),
    "dispatch_alignment_bool": ("expert_alignment", lambda b, x, t, w, h: _full(b, x, t, w, expert_alignment=True)),
    "dispatch_worst_tokens_float": ("num_worst_tokens", lambda b, x, t, w, h: _full(b, x, t, w, num_worst_tokens=0.0)),
    "dispatch_without_layout_after_cached": ("num_tokens_per_rank", lambda b, x, t, w, h: b.dispatch(x)),
    "dispatch_cached_with_topk": ("topk_idx", lambda b, x, t, w, h: b.dispatch(x, handle=h, topk_idx=t)),
    "dispatch_cached_other_handle_kind": ("handle", lambda b, x, t, w, h: b.dispatch(x, handle=tuple(h))),
    "dispatch_fp8_scales_dtype": ("x[1]", lambda b, x, t, w, h: _full(b, x, t, w, x=(_fp8(x)[0], _fp8(x)[1].half()))),
    "dispatch_fp8_values_dtype": ("x[0]", lambda b, x, t, w, h: _full(b, x, t, w, x=(x, _fp8(x)[1]))),
    "dispatch_fp8_scales_rows": ("x[1]", lambda b, x, t, w, h: _full(b, x, t, w, x=(_fp8(x)[0], _fp8(x)[1][:-1]))),
    "dispatch_fp8_three_items": ("x", lambda b, x, t, w, h: _full(b, x, t, w, x=_fp8(x) + (x,))),
    "layout_topk_values": ("topk_idx", lambda b, x, t, w, h: b.get_dispatch_layout(t + NUM_EXPERTS, NUM_EXPERTS)),
    "layout_topk_not_contiguous": ("topk_idx", lambda b, x, t, w, h: b.get_dispatch_layout(_non_contiguous(t),
                                                                                           NUM_EXPERTS)),
    "layout_num_experts_float": ("num_experts", lambda b, x, t, w, h: b.get_dispatch_layout(t, float(NUM_EXPERTS))),
}


def _fp8(x: torch.Tensor) -> tuple:
    """``x`` as an FP8 pair (e4m3 values, float32 scales per 128 channels)."""
    return tuple(per_token_cast_to_fp8(x))


def rejected_after_valid_calls(rule: str):
    """Valid full, cached and layout calls, then ``rule``'s bad call of the same shapes; returns the
    argument its EPInputError named (None: it was accepted), after a valid call that still works."""
    R, rank = world()
    buffer = epcomm.Buffer(dist.group.WORLD)
    x, topk, w = _inputs(R, rank)
    handle = _full(buffer, x, topk, w)[4]
    _full(buffer, x, topk, w, x=_fp8(x))  # (the FP8 rules' pair, of the same shapes)
    buffer.dispatch(x, handle=handle)
    buffer.get_dispatch_layout(topk, NUM_EXPERTS)
    _, call = RULES[rule]
    named = None
    try:
        call(buffer, x, topk, w, handle)
    except epcomm.EPInputError as err:
        named = err.argument
    out = _full(buffer, x, topk, w)  # still usable
    buffer.combine(out[0], out[4])
    return named


# Low-latency calls (Buffer.low_latency_dispatch / low_latency_combine keep their shape checks per
# shape too): rule: (argument the error must name, the bad call (buffer, x, topk, w, handle, y)),
# each made after a valid dispatch and combine of the same shapes
LL_TOKENS = 8  # num_max_dispatch_tokens_per_rank
LL_RULES = {
    "ll_dispatch_x_dtype": ("x", lambda b, x, t, w, h, y: b.low_latency_dispatch(x.half(), t, LL_TOKENS, NUM_EXPERTS)),
    "ll_dispatch_topk_not_contiguous": ("topk_idx", lambda b, x, t, w, h, y: b.low_latency_dispatch(
        x, _non_contiguous(t), LL_TOKENS, NUM_EXPERTS)),
    "ll_dispatch_topk_values": ("topk_idx", lambda b, x, t, w, h, y: b.low_latency_dispatch(
        x, t * 0 + 99, LL_TOKENS, NUM_EXPERTS)),
    "ll_dispatch_over_m": ("x", lambda b, x, t, w, h, y: b.low_latency_dispatch(x, t, x.shape[0] - 1, NUM_EXPERTS)),
    "ll_dispatch_m_float": ("num_max_dispatch_tokens_per_rank", lambda b, x, t, w, h, y: b.low_latency_dispatch(
        x, t, float(LL_TOKENS), NUM_EXPERTS)),
    "ll_dispatch_ue8m0_without_round_scale": ("use_ue8m0", lambda b, x, t, w, h, y: b.low_latency_dispatch(
        x, t, LL_TOKENS, NUM_EXPERTS, use_fp8=True, use_ue8m0=True)),
    "ll_dispatch_stats_dtype": ("cumulative_local_expert_recv_stats", lambda b, x, t, w, h, y: b.low_latency_dispatch(
        x, t, LL_TOKENS, NUM_EXPERTS, cumulative_local_expert_recv_stats=torch.zeros(
            NUM_EXPERTS // world()[0], dtype=torch.int64))),
    "ll_combine_x_dtype": ("x", lambda b, x, t, w, h, y: b.low_latency_combine(y.float(), t, w, h)),
    "ll_combine_weights_dtype": ("topk_weights", lambda b, x, t, w, h, y: b.low_latency_combine(y, t, w.double(), h)),
    "ll_combine_topk_values": ("topk_idx", lambda b, x, t, w, h, y: b.low_latency_combine(y, t * 0 + 99, w, h)),
    "ll_combine_out_shape": ("out", lambda b, x, t, w, h, y: b.low_latency_combine(
        y, t, w, h, out=torch.zeros(x.shape[0] + 1, x.shape[1], dtype=torch.bfloat16))),
    # the handle: one this Buffer made in its last two dispatches is taken as its own; any other
    # object, or a copy of one laid out for another group size, is checked in full
    "ll_combine_not_a_handle": ("handle", lambda b, x, t, w, h, y: b.low_latency_combine(y, t, w, tuple(h))),
    "ll_combine_handle_of_another_group": ("handle", lambda b, x, t, w, h, y: b.low_latency_combine(
        y, t, w, LowLatencyHandle(h.recv_src_info, torch.zeros(h.recv_layout_range.shape[0], world()[0] + 1,
                                                                 dtype=torch.int64), *tuple(h)[2:], h.backend_state))),
    "ll_combine_topk_of_other_tokens": ("topk_idx", lambda b, x, t, w, h, y: b.low_latency_combine(
        y, t[:-1], w[:-1], h)),
}


def ll_rejected_after_valid_calls(rule: str):
    """A valid low-latency dispatch and combine, then ``rule``'s bad call of the same shapes (the
    dispatch's rules with the x, topk_idx and flags the valid one had, but the one argument);
    returns the argument its EPInputError named (None: it was accepted), after a valid round trip
    that still works."""
    R, rank = world()
    size = epcomm.Buffer.get_low_latency_rdma_size_hint(LL_TOKENS, 256, R, NUM_EXPERTS)
    buffer = epcomm.Buffer(dist.group.WORLD, low_latency_mode=True, num_rdma_bytes=size)
    x, topk, w = _inputs(R, rank)

    def round_trip(use_fp8=False):
        recv, _, handle, _, _ = buffer.low_latency_dispatch(x, topk, LL_TOKENS, NUM_EXPERTS, use_fp8=use_fp8)
        return handle, recv if not use_fp8 else None
    round_trip(use_fp8=True)  # (the rules' FP8 flags: a shape of its own)
    handle, recv = round_trip()
    buffer.low_latency_combine(recv, topk, w, handle)
    _, call = LL_RULES[rule]
    named = None
    try:
        call(buffer, x, topk, w, handle, recv)
    except epcomm.EPInputError as err:
        named = err.argument
    handle, recv = round_trip()  # still usable
    buffer.low_latency_combine(recv, topk, w, handle)
    return named


def fp8_pairs_after_a_checked_call():
    """FP8 pairs through a full and a cached dispatch, each form after a checked call of its shapes:
    a float32 pair of the slot's width (fp8.plain_pair) goes to the backend as the caller's tensors
    (no DispatchPayload) once checked, in any strides and as a list (with async_finish: the inputs
    kept for the communication stream are the pair's); an int32 pair of the same width
    (another key) still gets its payload. Returns (payloads made per call, whether every call's rows
    and scales equal the first's, the received scales' dtypes)."""
    from epcomm import fp8
    R, rank = world()
    buffer = epcomm.Buffer(dist.group.WORLD)
    x, topk, w = _inputs(R, rank)
    values, scales = _fp8(x)
    made, original = [], fp8.dispatch_payload

    def counted(*args, **kwargs):
        made[-1] += 1
        return original(*args, **kwargs)
    fp8.dispatch_payload = counted
    try:
        forms = {"first": (values, scales), "checked": (values, scales), "column-major": (values, _non_contiguous(scales)),
                 "list": [values, scales], "int32": (values, scales.view(torch.int32)),
                 "int32 checked": (values, scales.view(torch.int32))}
        received, handle = {}, None
        for name, pair in forms.items():
            asynchronous = dict(async_finish=True) if name == "list" else {}  # (the inputs' stream bookkeeping)
            made.append(0)
            out = _full(buffer, x, topk, w, x=pair, **asynchronous)
            handle = out[4]
            made.append(0)
            cached = buffer.dispatch(pair, handle=handle, **asynchronous)
            received[name] = (out[0], cached[0])
    finally:
        fp8.dispatch_payload = original
    first = received["first"][0]
    same = all(torch.equal(got[0].view(torch.uint8), first[0].view(torch.uint8)) and
               torch.equal(got[1].view(torch.int32), first[1].view(torch.int32))
               for both in received.values() for got in both)
    return made, same, sorted({str(got[1].dtype) for both in received.values() for got in both})
