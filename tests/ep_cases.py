"""Test bodies that run on every rank of a WorkerPool (importable by spawned ranks).

The randomized sweeps live in :mod:`epcomm.testing.sweeps` (``epcomm check`` runs them too).
"""
from __future__ import annotations


import torch
import torch.distributed as dist

import epcomm
from epcomm.testing import reference_combine, reference_dispatch, reference_low_latency_combine, \
    reference_low_latency_dispatch
from epcomm.testing.sweeps import (SCENARIOS, _buffers_on_gpu, _ll_rows, expert_fn,  # noqa: F401
                                   gpu_normal_against_reference, low_latency_sweep, make_routing, normal_mode_sweep,
                                   rank_fn, to_fp8_input, world)


def worst_tokens_and_options(seed: int = 7):
    """num_worst_tokens padding, dispatch without top-k, async_finish/previous_event, combine without weights."""
    R, rank = world()
    buffer = epcomm.Buffer(dist.group.WORLD)
    num_experts, hidden = 4 * R, 128
    xs, topks, weights = make_routing(seed, "uniform", R, num_experts, 2, 16, hidden)
    ref = reference_dispatch(xs, topks, weights, num_experts)[rank]
    per_rank, _, per_expert, in_rank, event = buffer.get_dispatch_layout(topks[rank], num_experts, async_finish=True)
    event.current_stream_wait()
    worst = sum(x.shape[0] for x in xs) + 3
    recv_x, recv_idx, recv_w, counts, handle, event = buffer.dispatch(
        xs[rank], num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
        topk_idx=topks[rank], topk_weights=weights[rank], num_worst_tokens=worst,
        previous_event=buffer.capture(), async_finish=True)
    with event:
        pass
    n = ref["recv_x"].shape[0]
    assert counts == [] and recv_x.shape[0] == worst and recv_idx.shape[0] == worst
    assert torch.equal(recv_x[:n], ref["recv_x"]) and torch.equal(recv_idx[:n], ref["recv_topk_idx"])
    assert (recv_idx[n:] == -1).all() and (recv_w[n:] == 0).all() and (handle.recv_src_idx[n:] == -1).all()
    # cached dispatch keeps the padded shape
    assert buffer.dispatch(xs[rank], handle=handle)[0].shape[0] == worst
    # combine accepts the padded rows and ignores the padding
    combined, combined_w, _ = buffer.combine(rank_fn(rank, recv_x), handle)
    assert combined_w is None
    torch.testing.assert_close(combined, reference_combine(xs[rank], topks[rank], num_experts, R, rank_fn),
                               rtol=1e-2, atol=1e-2)
    # too small num_worst_tokens raises on the ranks that overflow
    # dispatch without top-k: no top-k outputs, counts still computed
    recv_x2, recv_idx2, recv_w2, counts2, handle2, _ = buffer.dispatch(
        xs[rank], num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
    assert recv_idx2 is None and recv_w2 is None and torch.equal(recv_x2, ref["recv_x"])
    assert counts2 == ref["num_recv_tokens_per_expert_list"]
    # explicit config
    cfg = epcomm.Buffer.get_dispatch_config(R)
    assert torch.equal(buffer.dispatch(xs[rank], handle=handle2, config=cfg)[0], ref["recv_x"])
    return True


def repeated_calls(num_calls: int = 30):
    """Many back-to-back dispatch/combine calls on one buffer with changing routing: no stale state."""
    R, rank = world()
    buffer = epcomm.Buffer(dist.group.WORLD)
    num_experts = 2 * R
    for call in range(num_calls):
        xs, topks, weights = make_routing(1000 + call, SCENARIOS[call % len(SCENARIOS)], R, num_experts, 2, 24, 128)
        per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topks[rank], num_experts)
        recv_x, _, _, _, handle, _ = buffer.dispatch(xs[rank], num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                     num_tokens_per_expert=per_expert)
        assert torch.equal(recv_x, reference_dispatch(xs, topks, weights, num_experts)[rank]["recv_x"])
        combined, _, _ = buffer.combine(rank_fn(rank, recv_x), handle)
        torch.testing.assert_close(combined, reference_combine(xs[rank], topks[rank], num_experts, R, rank_fn),
                                   rtol=1e-2, atol=1e-2)
    return num_calls


def low_latency_two_results_held(hidden: int = 256):
    """Two dispatch results may be held at once (the halves alternate); both stay intact."""
    R, rank = world()
    buffer = epcomm.Buffer(dist.group.WORLD, low_latency_mode=True)
    num_experts, M = 2 * R, 8
    results = []
    for seed in (1, 2):
        xs, topks, weights = make_routing(seed, "uniform", R, num_experts, 2, M, hidden, fixed_tokens=M)
        results.append((xs, topks, buffer.low_latency_dispatch(xs[rank], topks[rank], M, num_experts, use_fp8=False)))
    for xs, topks, (recv_x, recv_count, handle, _, _) in results:
        ref = reference_low_latency_dispatch(xs, topks, num_experts, use_fp8=False)[rank]
        for e in range(num_experts // R):
            rows, src_rank, src_token = _ll_rows(recv_x, recv_count, handle, e, False)
            order = torch.argsort(src_rank * 1_000_000 + src_token)
            assert torch.equal(src_rank[order], ref[e]["src_rank"]) and torch.equal(src_token[order], ref[e]["src_token"])
            assert torch.equal(rows[order], ref[e]["rows"]), "an earlier result was overwritten"
    return True


def low_latency_masking(hidden: int = 128):
    """A masked rank's experts contribute nothing and its tokens are not received; unmasking restores.
    The mask calls need enable_shrink=True, as in DeepEP."""
    R, rank = world()
    plain = epcomm.Buffer(dist.group.WORLD, low_latency_mode=True)
    try:
        plain.low_latency_update_mask_buffer(0, True)
        raise AssertionError("mask call accepted without enable_shrink")
    except epcomm.EPError as err:
        assert "enable_shrink" in str(err)
    buffer = epcomm.Buffer(dist.group.WORLD, low_latency_mode=True, enable_shrink=True)
    num_experts, M = 2 * R, 16
    dead = R - 1
    xs, topks, weights = make_routing(5, "uniform", R, num_experts, 2, M, hidden, fixed_tokens=M)
    buffer.low_latency_update_mask_buffer(dead, True)
    status = torch.zeros(R, dtype=torch.int32)
    buffer.low_latency_query_mask_buffer(status)
    assert status.tolist() == [1 if r == dead else 0 for r in range(R)]
    recv_x, recv_count, handle, _, _ = buffer.low_latency_dispatch(xs[rank], topks[rank], M, num_experts, use_fp8=False)
    num_local = num_experts // R
    expert_out = torch.zeros(num_local, R * M, hidden, dtype=torch.bfloat16)
    for e in range(num_local):
        rows, src_rank, _ = _ll_rows(recv_x, recv_count, handle, e, False)
        assert not (src_rank == dead).any(), "rows from a masked rank"
        expert_out[e, :rows.shape[0]] = expert_fn(torch.full((rows.shape[0],), rank * num_local + e), rows).bfloat16()
    combined, _, _ = buffer.low_latency_combine(expert_out, topks[rank], weights[rank], handle)
    live_topk = topks[rank].clone()
    live_topk[(live_topk // num_local) == dead] = -1
    if rank == dead:
        live_topk[:] = -1  # the masked rank itself takes no part
    want = reference_low_latency_combine(xs[rank], live_topk, weights[rank], expert_fn, use_fp8=False)
    torch.testing.assert_close(combined, want, rtol=2e-2, atol=2e-2)
    buffer.low_latency_clean_mask_buffer()
    buffer.low_latency_query_mask_buffer(status)
    assert status.sum() == 0
    return True


def raise_on_rank(bad_rank: int):
    if dist.get_rank() == bad_rank:
        raise RuntimeError(f"planted failure on rank {bad_rank}")
    return dist.get_rank()


def sleep_forever():
    import time
    time.sleep(3600)


def echo_rank():
    return dist.get_rank(), dist.get_world_size()


# ---------------------------------------------------------------- input validation
def _valid_inputs(R, rank, num_experts=8, num_tokens=6, hidden=256, k=2):
    xs, topks, weights = make_routing(3, "uniform", R, num_experts, k, num_tokens, hidden, fixed_tokens=num_tokens)
    return xs[rank], topks[rank], weights[rank]


def _layout_kwargs(buffer, topk, num_experts=8):
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk, num_experts)
    return dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)


def _bad_dispatch(buffer, default_x, topk, w, **override):
    """A valid dispatch call with some arguments replaced by ``override``."""
    kwargs = dict(_layout_kwargs(buffer, topk), topk_idx=topk, topk_weights=w)
    kwargs.update(override)
    return buffer.dispatch(kwargs.pop("x", default_x), **kwargs)


def _handle(buffer, x, topk, w):
    return _bad_dispatch(buffer, x, topk, w)[4]


VALIDATION_RULES = {
    # rule name: (expected argument, callable(buffer, ll_buffer, x, topk, w))
    "buffer_group_type": ("group", lambda b, l, x, t, w: epcomm.Buffer("not a group")),
    "buffer_negative_nvl_bytes": ("num_nvl_bytes", lambda b, l, x, t, w: epcomm.Buffer(dist.group.WORLD, num_nvl_bytes=-1)),
    "buffer_rdma_bytes_type": ("num_rdma_bytes", lambda b, l, x, t, w: epcomm.Buffer(dist.group.WORLD, num_rdma_bytes=1.5)),
    "buffer_timeout_positive": ("timeout", lambda b, l, x, t, w: epcomm.Buffer(dist.group.WORLD, timeout=0)),
    "buffer_timeout_type": ("timeout", lambda b, l, x, t, w: epcomm.Buffer(dist.group.WORLD, timeout="10")),
    "buffer_backend_name": ("backend", lambda b, l, x, t, w: epcomm.Buffer(dist.group.WORLD, backend="nvshmem_v2")),
    "buffer_ranks_per_node": ("ranks_per_node", lambda b, l, x, t, w: epcomm.Buffer(dist.group.WORLD, ranks_per_node=3)),
    "layout_topk_dtype": ("topk_idx", lambda b, l, x, t, w: b.get_dispatch_layout(t.int(), 8)),
    "layout_topk_ndim": ("topk_idx", lambda b, l, x, t, w: b.get_dispatch_layout(t.flatten(), 8)),
    "layout_topk_range_high": ("topk_idx", lambda b, l, x, t, w: b.get_dispatch_layout(t + 8, 8)),
    "layout_topk_range_low": ("topk_idx", lambda b, l, x, t, w: b.get_dispatch_layout(t - 9, 8)),
    "layout_topk_contiguous": ("topk_idx", lambda b, l, x, t, w: b.get_dispatch_layout(t.repeat(1, 2)[:, ::2], 8)),
    "layout_num_experts_divisible": ("num_experts", lambda b, l, x, t, w: b.get_dispatch_layout(t, 7)),
    "layout_num_experts_type": ("num_experts", lambda b, l, x, t, w: b.get_dispatch_layout(t, 8.0)),
    "dispatch_x_dtype": ("x", lambda b, l, x, t, w: _bad_dispatch(b, x, t, w, x=x.float())),
    "dispatch_x_ndim": ("x", lambda b, l, x, t, w: _bad_dispatch(b, x, t, w, x=x[0])),
    "dispatch_x_contiguous": ("x", lambda b, l, x, t, w: _bad_dispatch(b, x, t, w, x=x.t().contiguous().t())),
    "dispatch_x_type": ("x", lambda b, l, x, t, w: _bad_dispatch(b, x, t, w, x=x.tolist())),
    "dispatch_fp8_pair_length": ("x", lambda b, l, x, t, w: _bad_dispatch(b, x, t, w, x=(x,))),
    "dispatch_fp8_values_dtype": ("x[0]", lambda b, l, x, t, w: _bad_dispatch(b, x, t, w, x=(x, to_fp8_input(x, False)[1]))),
    "dispatch_fp8_hidden_multiple": ("x[0]", lambda b, l, x, t, w: _bad_dispatch(
        b, x, t, w, x=(to_fp8_input(x, False)[0][:, :200].contiguous(), torch.ones(x.shape[0], 2)))),
    "dispatch_fp8_scales_shape": ("x[1]", lambda b, l, x, t, w: _bad_dispatch(
        b, x, t, w, x=(to_fp8_input(x, False)[0], torch.ones(x.shape[0] + 1, 2)))),  # a row per token
    "dispatch_fp8_scales_dtype": ("x[1]", lambda b, l, x, t, w: _bad_dispatch(
        b, x, t, w, x=(to_fp8_input(x, False)[0], to_fp8_input(x, False)[1].double()))),
    "dispatch_fp8_scales_layout": ("x[1]", lambda b, l, x, t, w: _bad_dispatch(
        b, x, t, w, x=(to_fp8_input(x, False)[0], torch.ones(x.shape[0], 2, 1)))),  # 2-D (any width, strides)
    "dispatch_missing_layout": ("num_tokens_per_rank", lambda b, l, x, t, w: b.dispatch(x, topk_idx=t, topk_weights=w)),
    "dispatch_per_rank_dtype": ("num_tokens_per_rank", lambda b, l, x, t, w: _bad_dispatch(
        b, x, t, w, num_tokens_per_rank=_layout_kwargs(b, t)["num_tokens_per_rank"].long())),
    "dispatch_in_rank_shape": ("is_token_in_rank", lambda b, l, x, t, w: _bad_dispatch(
        b, x, t, w, is_token_in_rank=_layout_kwargs(b, t)["is_token_in_rank"][:-1])),
    "dispatch_per_expert_length": ("num_tokens_per_expert", lambda b, l, x, t, w: _bad_dispatch(
        b, x, t, w, num_tokens_per_expert=torch.zeros(7, dtype=torch.int32))),
    "dispatch_weights_without_idx": ("topk_idx", lambda b, l, x, t, w: _bad_dispatch(b, x, t, w, topk_idx=None)),
    "dispatch_weights_dtype": ("topk_weights", lambda b, l, x, t, w: _bad_dispatch(b, x, t, w, topk_weights=w.double())),
    "dispatch_weights_shape": ("topk_weights", lambda b, l, x, t, w: _bad_dispatch(b, x, t, w, topk_weights=w[:, :1].contiguous())),
    "dispatch_topk_rows": ("topk_idx", lambda b, l, x, t, w: _bad_dispatch(
        b, x, t, w, topk_idx=t[:-1].contiguous(), topk_weights=w[:-1].contiguous())),
    "dispatch_x_rows": ("topk_idx", lambda b, l, x, t, w: _bad_dispatch(b, x, t, w, x=x[:-1])),
    "dispatch_topk_range": ("topk_idx", lambda b, l, x, t, w: _bad_dispatch(b, x, t, w, topk_idx=t * 0 + 99)),
    "dispatch_alignment": ("expert_alignment", lambda b, l, x, t, w: _bad_dispatch(b, x, t, w, expert_alignment=0)),
    "dispatch_worst_tokens": ("num_worst_tokens", lambda b, l, x, t, w: _bad_dispatch(b, x, t, w, num_worst_tokens=-1)),
    "dispatch_config_type": ("config", lambda b, l, x, t, w: _bad_dispatch(b, x, t, w, config={"num_sms": 20})),
    "dispatch_previous_event_type": ("previous_event", lambda b, l, x, t, w: _bad_dispatch(b, x, t, w, previous_event=1)),
    "dispatch_handle_kind": ("handle", lambda b, l, x, t, w: b.dispatch(x, handle=(1, 2, 3))),
    "dispatch_cached_with_topk": ("topk_idx", lambda b, l, x, t, w: b.dispatch(x, handle=_handle(b, x, t, w), topk_idx=t)),
    "dispatch_cached_token_count": ("x", lambda b, l, x, t, w: b.dispatch(x[:-1], handle=_handle(b, x, t, w))),
    "combine_handle_kind": ("handle", lambda b, l, x, t, w: b.combine(x, handle=None)),
    "combine_x_rows": ("x", lambda b, l, x, t, w: b.combine(torch.zeros(999, x.shape[1], dtype=torch.bfloat16),
                                                            _handle(b, x, t, w))),
    "combine_x_dtype": ("x", lambda b, l, x, t, w: (lambda out: b.combine(out[0].float(), out[4]))(_bad_dispatch(b, x, t, w))),
    "combine_weights_dtype": ("topk_weights", lambda b, l, x, t, w: (lambda out: b.combine(
        out[0], out[4], topk_weights=out[2].half()))(_bad_dispatch(b, x, t, w))),
    "combine_bias_shape": ("bias[0]", lambda b, l, x, t, w: (lambda out: b.combine(
        out[0], out[4], bias=x[:-1]))(_bad_dispatch(b, x, t, w))),
    "combine_bias_type": ("bias", lambda b, l, x, t, w: (lambda out: b.combine(
        out[0], out[4], bias="zero"))(_bad_dispatch(b, x, t, w))),
    "ll_tokens_over_max": ("x", lambda b, l, x, t, w: l.low_latency_dispatch(x, t, x.shape[0] - 1, 8)),
    "ll_max_tokens_type": ("num_max_dispatch_tokens_per_rank", lambda b, l, x, t, w: l.low_latency_dispatch(x, t, 0, 8)),
    "ll_x_dtype": ("x", lambda b, l, x, t, w: l.low_latency_dispatch(x.float(), t, 16, 8)),
    "ll_topk_range": ("topk_idx", lambda b, l, x, t, w: l.low_latency_dispatch(x, t + 100, 16, 8)),
    "ll_num_experts_divisible": ("num_experts", lambda b, l, x, t, w: l.low_latency_dispatch(x, t, 16, 9)),
    "ll_fp8_hidden": ("x", lambda b, l, x, t, w: l.low_latency_dispatch(x[:, :200].contiguous(), t, 16, 8)),
    "ll_ue8m0_needs_round_scale": ("use_ue8m0", lambda b, l, x, t, w: l.low_latency_dispatch(x, t, 16, 8, use_ue8m0=True)),
    "ll_stats_shape": ("cumulative_local_expert_recv_stats", lambda b, l, x, t, w: l.low_latency_dispatch(
        x, t, 16, 8, cumulative_local_expert_recv_stats=torch.zeros(3, dtype=torch.int32))),
    "ll_wait_stats_dtype": ("dispatch_wait_recv_cost_stats", lambda b, l, x, t, w: l.low_latency_dispatch(
        x, t, 16, 8, dispatch_wait_recv_cost_stats=torch.zeros(dist.get_world_size(), dtype=torch.int32))),
    "ll_combine_handle_kind": ("handle", lambda b, l, x, t, w: l.low_latency_combine(x, t, w, _handle(b, x, t, w))),
    "ll_combine_x_shape": ("x", lambda b, l, x, t, w: (lambda out: l.low_latency_combine(
        x, t, w, out[2]))(l.low_latency_dispatch(x, t, 16, 8))),
    "ll_combine_weights_shape": ("topk_weights", lambda b, l, x, t, w: (lambda out: l.low_latency_combine(
        l.get_next_low_latency_combine_buffer(out[2]), t, w[:, :1].contiguous(), out[2]))(l.low_latency_dispatch(x, t, 16, 8))),
    "ll_combine_out_shape": ("out", lambda b, l, x, t, w: (lambda out: l.low_latency_combine(
        l.get_next_low_latency_combine_buffer(out[2]), t, w, out[2], out=x[:-1]))(l.low_latency_dispatch(x, t, 16, 8))),
    "ll_mask_rank_range": ("rank_to_mask", lambda b, l, x, t, w: l.low_latency_update_mask_buffer(dist.get_world_size())),
    "ll_mask_status_dtype": ("mask_status", lambda b, l, x, t, w: l.low_latency_query_mask_buffer(
        torch.zeros(dist.get_world_size()))),
    "config_num_sms_odd": ("num_sms", lambda b, l, x, t, w: epcomm.Config(num_sms=3)),
    "config_chunk_sizes": ("nvl_chunked_send_tokens", lambda b, l, x, t, w: epcomm.Config(20, 300, 256)),
    "set_num_sms": ("new_num_sms", lambda b, l, x, t, w: epcomm.Buffer.set_num_sms(0)),
    "rdma_size_hint": ("hidden", lambda b, l, x, t, w: epcomm.Buffer.get_low_latency_rdma_size_hint(128, 0, 8, 256)),
}


def validation_case(rule: str):
    """Run one invalid call; return the argument the EPInputError named, after proving the buffer still works."""
    R, rank = world()
    buffer = epcomm.Buffer(dist.group.WORLD)
    ll_buffer = epcomm.Buffer(dist.group.WORLD, low_latency_mode=True, enable_shrink=True)
    x, topk, w = _valid_inputs(R, rank)
    _, call = VALIDATION_RULES[rule]
    named = None
    try:
        call(buffer, ll_buffer, x, topk, w)
    except epcomm.EPInputError as err:
        assert isinstance(err, ValueError)
        assert err.argument in str(err)
        named = err.argument
    # still usable: a valid round trip on both buffers
    out = _bad_dispatch(buffer, x, topk, w)
    buffer.combine(out[0], out[4])
    recv = ll_buffer.low_latency_dispatch(x, topk, 16, 8)
    ll_buffer.low_latency_combine(ll_buffer.get_next_low_latency_combine_buffer(recv[2]), topk, w, recv[2], zero_copy=True)
    return named


def state_errors():
    """Low-latency calls on a normal buffer, and calls after destroy(), raise EPError."""
    buffer = epcomm.Buffer(dist.group.WORLD, explicitly_destroy=True)
    x, topk, _ = _valid_inputs(*world())
    try:
        buffer.low_latency_dispatch(x, topk, 16, 8)
        raise AssertionError("low-latency call on a normal buffer did not raise")
    except epcomm.EPError as err:
        assert "low_latency_mode" in str(err)
    buffer.destroy()
    try:
        buffer.get_dispatch_layout(topk, 8)
        raise AssertionError("call after destroy() did not raise")
    except epcomm.EPError as err:
        assert "destroyed" in str(err)
    return True


def worst_tokens_overflow():
    """num_worst_tokens smaller than what arrives is an error (not silent truncation)."""
    R, rank = world()
    buffer = epcomm.Buffer(dist.group.WORLD)
    x, topk, w = _valid_inputs(R, rank)
    try:
        _bad_dispatch(buffer, x, topk, w, num_worst_tokens=1)
    except epcomm.EPError as err:
        return "num_worst_tokens" in str(err)
    return False


# ---------------------------------------------------------------- GPU: nvlink against torch_dist (NCCL)
def gpu_rounds_counted(configs, num_nvl_bytes: int):
    """gpu_normal_against_reference with the stage launches counted: a batch larger than one half
    of the payload area must take several rounds (one stage launch each)."""
    from epcomm.backends.gpu.normal import one_node as normal
    calls = []
    original = normal.NormalMode._stage

    def counting(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)

    normal.NormalMode._stage = counting
    try:
        checked = gpu_normal_against_reference(configs, num_nvl_bytes)
    finally:
        normal.NormalMode._stage = original
    return checked, len(calls)


def gpu_timeout_names_peer():
    """A rank that stops taking part makes the others raise EPTimeoutError naming it (no hang)."""
    import os
    os.environ["EPCOMM_TIMEOUT_S"] = "3"
    try:
        R, rank = world()
        dev = torch.device("cuda", torch.cuda.current_device())
        fast, _ = _buffers_on_gpu(1 << 26)
    finally:
        os.environ.pop("EPCOMM_TIMEOUT_S")
    absent = R - 1
    if rank == absent:
        return "absent"
    xs, topks, weights = make_routing(1, "uniform", R, 8 * R, 4, 16, 256)
    topk = topks[rank].to(dev)
    per_rank, _, per_expert, in_rank, _ = fast.get_dispatch_layout(topk, 8 * R)
    try:
        fast.dispatch(xs[rank].to(dev), num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                      num_tokens_per_expert=per_expert)
    except epcomm.EPTimeoutError as err:
        assert absent in err.peers, err.peers
        return "raised"
    return "no error"


def gpu_low_latency_dead_rank(hidden: int = 2048, backend=None, ranks_per_node=None):
    """The last rank stops taking part: the others time out once, mask it themselves, and every
    call (that one included) returns correct results for the live ranks; later calls do not wait."""
    import os
    import time
    R, rank = world()
    dev = torch.device("cuda", torch.cuda.current_device())
    num_experts, M, K = 4 * R, 32, 4
    dead = R - 1
    os.environ["EPCOMM_TIMEOUT_S"] = "2"
    try:
        size = epcomm.Buffer.get_low_latency_rdma_size_hint(M, hidden, R, num_experts)
        buffer = epcomm.Buffer(dist.group.WORLD, num_rdma_bytes=size, low_latency_mode=True, enable_shrink=True,
                               backend=backend, ranks_per_node=ranks_per_node)
    finally:
        os.environ.pop("EPCOMM_TIMEOUT_S")
    if rank == dead:
        time.sleep(8)  # stays away from the calls, but keeps its buffer mapped while the others run
        return "dead"
    num_local = num_experts // R
    elapsed = []
    for call in range(3):
        xs, topks, ws = make_routing(40 + call, "uniform", R, num_experts, K, M, hidden, fixed_tokens=M)
        started = time.perf_counter()
        recv, count, handle, _, _ = buffer.low_latency_dispatch(xs[rank].to(dev), topks[rank].to(dev), M, num_experts,
                                                                use_fp8=False)
        scale = ((rank * num_local + torch.arange(num_local, device=dev)).float() + 1) / 8
        expert_out = (recv.float() * scale[:, None, None]).to(torch.bfloat16)
        out = buffer.low_latency_combine(expert_out, topks[rank].to(dev), ws[rank].to(dev), handle)[0].cpu()
        elapsed.append(time.perf_counter() - started)
        live_topk = topks[rank].clone()
        live_topk[(live_topk // num_local) == dead] = -1
        want = reference_low_latency_combine(xs[rank], live_topk, ws[rank], expert_fn, use_fp8=False)
        torch.testing.assert_close(out, want, rtol=2e-2, atol=2e-2, msg=lambda m: f"call {call}: {m}")
    status = torch.zeros(R, dtype=torch.int32, device=dev)
    buffer.low_latency_query_mask_buffer(status)
    assert status.tolist() == [1 if r == dead else 0 for r in range(R)], status.tolist()
    assert elapsed[-1] < 1.0, elapsed  # the masked rank is no longer waited for
    return "masked"


def gpu_low_latency_foreign_handle(hidden: int = 512):
    """A low-latency handle passed to another Buffer's combine raises EPInputError naming handle
    (its slots live in the other Buffer's workspace) on every rank."""
    R, rank = world()
    dev = torch.device("cuda", torch.cuda.current_device())
    num_experts, M = 2 * R, 8
    size = epcomm.Buffer.get_low_latency_rdma_size_hint(M, hidden, R, num_experts)
    first, second = (epcomm.Buffer(dist.group.WORLD, num_rdma_bytes=size, low_latency_mode=True) for _ in range(2))
    xs, topks, weights = make_routing(5, "uniform", R, num_experts, 2, M, hidden, fixed_tokens=M)
    recv, _, handle, _, _ = first.low_latency_dispatch(xs[rank].to(dev), topks[rank].to(dev), M, num_experts,
                                                       use_fp8=False)
    try:
        second.low_latency_combine(recv, topks[rank].to(dev), weights[rank].to(dev), handle)
    except epcomm.EPInputError as err:
        assert err.argument == "handle", err
        return "raised"
    return "combined"


def low_latency_clean_buffer():
    """clean_low_latency_buffer resets state; a later dispatch + combine still matches the reference."""
    R, rank = world()
    buffer = epcomm.Buffer(dist.group.WORLD, low_latency_mode=True)
    num_experts, M, hidden = 2 * R, 8, 128
    xs, topks, weights = make_routing(9, "uniform", R, num_experts, 2, M, hidden, fixed_tokens=M)
    buffer.low_latency_dispatch(xs[rank], topks[rank], M, num_experts, use_fp8=False, return_recv_hook=True)
    buffer.clean_low_latency_buffer(M, hidden, num_experts)  # the hook above is never called
    recv_x, recv_count, handle, _, _ = buffer.low_latency_dispatch(xs[rank], topks[rank], M, num_experts, use_fp8=False)
    ref = reference_low_latency_dispatch(xs, topks, num_experts, use_fp8=False)[rank]
    assert [int(c) for c in recv_count] == [r["rows"].shape[0] for r in ref]
    return True


def backend_choice():
    """gloo groups get torch_dist; nvlink_usable is collective and False without CUDA/Triton."""
    from epcomm.backends import default_backend_name
    from epcomm.backends.nvlink import nvlink_usable
    return default_backend_name(dist.group.WORLD), nvlink_usable(dist.group.WORLD)


def low_latency_duplicate_experts(hidden: int = 128):
    """A token that lists the same expert twice: each (token, k) entry is its own message and gets
    its own weight in low-latency combine (no dedup in low-latency mode)."""
    R, rank = world()
    buffer = epcomm.Buffer(dist.group.WORLD, low_latency_mode=True)
    num_experts, M, T = 2 * R, 8, 4
    xs, topks, weights = make_routing(31, "uniform", R, num_experts, 2, M, hidden, fixed_tokens=T)
    for i in range(R):
        topks[i][:, 1] = topks[i][:, 0]  # every token: its first expert twice, different weights
        weights[i][:, 1] = weights[i][:, 0] * 3 + 0.25
    recv, count, handle, _, _ = buffer.low_latency_dispatch(xs[rank], topks[rank], M, num_experts, use_fp8=False)
    num_local = num_experts // R
    expert_out = torch.zeros(num_local, R * M, hidden, dtype=torch.bfloat16)
    for e in range(num_local):
        rows, _, _ = _ll_rows(recv, count, handle, e, False)
        expert_out[e, :rows.shape[0]] = expert_fn(torch.full((rows.shape[0],), rank * num_local + e), rows).bfloat16()
    combined = buffer.low_latency_combine(expert_out, topks[rank], weights[rank], handle)[0]
    want = reference_low_latency_combine(xs[rank], topks[rank], weights[rank], expert_fn, use_fp8=False)
    torch.testing.assert_close(combined, want, rtol=2e-2, atol=2e-2)
    return True


def virtual_nodes(ranks_per_node: int):
    """ranks_per_node splits the group into nodes: get_dispatch_layout returns the tokens per node
    (a token counts once per node it goes to), dispatch accepts and checks them, and the results
    stay those of the reference."""
    R, rank = world()
    buffer = epcomm.Buffer(dist.group.WORLD, ranks_per_node=ranks_per_node)
    num_nodes = R // ranks_per_node
    assert (buffer.ranks_per_node, buffer.num_nodes) == (ranks_per_node, num_nodes)
    for case in range(6):
        num_experts = 2 * R
        xs, topks, weights = make_routing(90 + case, SCENARIOS[case % len(SCENARIOS)], R, num_experts, 3, 20, 128)
        per_rank, per_node, per_expert, in_rank, _ = buffer.get_dispatch_layout(topks[rank], num_experts)
        if num_nodes == 1:
            assert per_node is None
        else:
            owner = torch.where(topks[rank] >= 0, topks[rank] // (num_experts // R), -1)
            want = torch.tensor([int(((owner // ranks_per_node) == n).any(1).sum()) for n in range(num_nodes)],
                                dtype=torch.int32)
            assert torch.equal(per_node, want), (per_node, want)
        recv_x = buffer.dispatch(xs[rank], num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_node,
                                 is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=topks[rank],
                                 topk_weights=weights[rank])[0]
        assert torch.equal(recv_x, reference_dispatch(xs, topks, weights, num_experts)[rank]["recv_x"])
        if per_node is not None:  # wrong per-node counts are rejected on every rank
            try:
                buffer.dispatch(xs[rank], num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_node + 1,
                                is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
                raise AssertionError("wrong num_tokens_per_rdma_rank accepted")
            except epcomm.EPInputError as err:
                assert err.argument == "num_tokens_per_rdma_rank"
    return True


def _misaligned_copy(t: torch.Tensor, offset: int) -> torch.Tensor:
    """``t``'s values in a tensor whose data starts ``offset`` bytes past a 16-byte boundary."""
    nbytes = t.numel() * t.element_size()
    flat = torch.empty(nbytes + 16, dtype=torch.uint8, device=t.device)
    view = flat[offset:offset + nbytes].view(t.dtype).view(t.shape)
    view.copy_(t)
    assert view.data_ptr() % 16 == offset
    return view


def gpu_misaligned_inputs(hidden: int = 2048):
    """Inputs not 16-byte aligned (8: the kernels' 8-byte path; 2: copied first) give results
    identical to the same values in aligned tensors, in normal and low-latency mode (x, expert
    outputs, out=) — no misaligned-address fault (copy.py)."""
    R, rank = world()
    dev = torch.device("cuda", torch.cuda.current_device())
    num_experts, K, M = 4 * R, 2, 64
    xs, topks, weights = make_routing(31, "uniform", R, num_experts, K, M, hidden, fixed_tokens=M)
    x, topk, w = xs[rank].to(dev), topks[rank].to(dev), weights[rank].to(dev)
    buffer = epcomm.Buffer(dist.group.WORLD, num_nvl_bytes=64 << 20)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk, num_experts)
    kwargs = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                  topk_idx=topk, topk_weights=w)
    recv_x, _, _, _, handle, _ = buffer.dispatch(x, **kwargs)
    y = (recv_x.float() * 0.5).to(torch.bfloat16)
    combined = buffer.combine(y, handle)[0]
    size = epcomm.Buffer.get_low_latency_rdma_size_hint(M, hidden, R, num_experts)
    ll = epcomm.Buffer(dist.group.WORLD, num_rdma_bytes=size, low_latency_mode=True)
    recv, _, ll_handle, _, _ = ll.low_latency_dispatch(x, topk, M, num_experts, use_fp8=False)
    ll_out = ll.low_latency_combine((recv.float() * 0.5).to(torch.bfloat16), topk, w, ll_handle)[0].clone()
    failures = []

    def same(name, got, want):
        if not torch.equal(got, want):
            rows = (got != want).reshape(got.shape[0], -1).any(-1) if got.dim() > 1 else got != want
            failures.append(f"{name}: {int(rows.sum())} of {got.shape[0]} rows differ")

    same("dispatch again, aligned", buffer.dispatch(x, **kwargs)[0], recv_x)
    for offset in (8, 2):
        same(f"dispatch, x at +{offset}", buffer.dispatch(_misaligned_copy(x, offset), **kwargs)[0], recv_x)
        same(f"combine, y at +{offset}", buffer.combine(_misaligned_copy(y, offset), handle)[0], combined)
        # (low-latency rows within an expert come in arrival order: compared through the combine)
        got, _, got_handle, _, _ = ll.low_latency_dispatch(_misaligned_copy(x, offset), topk, M, num_experts,
                                                           use_fp8=False)
        got_y = _misaligned_copy((got.float() * 0.5).to(torch.bfloat16), offset)
        out = _misaligned_copy(torch.zeros(M, hidden, dtype=torch.bfloat16, device=dev), offset)
        same(f"low-latency round trip, x, y and out at +{offset}",
             ll.low_latency_combine(got_y, topk, w, got_handle, out=out)[0], ll_out)
    assert not failures, failures
    torch.cuda.synchronize()
    return True


def gpu_low_latency_one_launch(hidden: int = 2048):
    """EPCOMM_LL_ONE_LAUNCH=1: calls without a hook run both phases in one cooperative launch;
    the randomized sweep (hooks included) and a CUDA graph still match the reference."""
    import os
    os.environ["EPCOMM_LL_ONE_LAUNCH"] = "1"
    try:
        R, _ = world()
        size = epcomm.Buffer.get_low_latency_rdma_size_hint(128, hidden, R, 8 * R)
        from graph_cases import gpu_low_latency_graph
        return low_latency_sweep(8, 500, hidden, 8, 128, "cuda", size), gpu_low_latency_graph(2, hidden)
    finally:
        del os.environ["EPCOMM_LL_ONE_LAUNCH"]


def gpu_user_program_on_nodes(hidden: int = 2048, num_tokens: int = 256):
    """A user's multi-node program, run where ``EPCOMM_RANKS_PER_NODE`` splits the group into nodes:
    the automatic backend, DeepEP-style sizes, layout, BF16 and FP8 dispatch, cached dispatch,
    combine, then a low-latency round trip — each against the torch_dist reference. Returns the
    backend names (fast, low-latency)."""
    R, rank = world()
    dev = torch.device("cuda", torch.cuda.current_device())
    num_experts, k = 8 * R, 8
    xs, topks, weights = make_routing(28, "uniform", R, num_experts, k, num_tokens, hidden, fixed_tokens=num_tokens)
    x, topk, w = xs[rank].to(dev), topks[rank].to(dev), weights[rank].to(dev)
    buffer = epcomm.Buffer(dist.group.WORLD, num_nvl_bytes=1 << 28, num_rdma_bytes=10 ** 9)
    reference = epcomm.Buffer(dist.group.WORLD, backend="torch_dist")
    outs = []
    for b in (buffer, reference):
        per_rank, _, per_expert, in_rank, _ = b.get_dispatch_layout(topk, num_experts)
        kwargs = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                      topk_idx=topk, topk_weights=w)
        recv = b.dispatch(x, **kwargs)
        recv_fp8 = b.dispatch(epcomm.per_token_cast_to_fp8(x), **kwargs)
        cached = b.dispatch(x, handle=recv[4])
        combined = b.combine(recv[0], recv[4], topk_weights=recv[2])
        torch.cuda.synchronize()
        outs.append((recv[0], recv_fp8[0][0].view(torch.uint8), cached[0], combined[0]))
    (recv_fast, fp8_fast, cached_fast, comb_fast), (recv_ref, fp8_ref, cached_ref, comb_ref) = outs
    assert torch.equal(recv_fast, recv_ref) and torch.equal(fp8_fast, fp8_ref) and torch.equal(cached_fast, cached_ref)
    torch.testing.assert_close(comb_fast, comb_ref, rtol=1e-2, atol=1e-2)
    size = epcomm.Buffer.get_low_latency_rdma_size_hint(128, hidden, R, num_experts)
    ll = epcomm.Buffer(dist.group.WORLD, num_rdma_bytes=size, low_latency_mode=True)
    recv_x, recv_count, handle, _, _ = ll.low_latency_dispatch(x[:128], topk[:128], 128, num_experts, use_fp8=False)
    combined, _, _ = ll.low_latency_combine(recv_x, topk[:128], w[:128], handle)
    torch.cuda.synchronize()
    want = reference_low_latency_combine(x[:128].cpu(), topk[:128].cpu(), w[:128].cpu(), lambda e, r: r, False, False)
    torch.testing.assert_close(combined.cpu(), want, rtol=2e-2, atol=2e-2)
    names = (buffer.backend_name, ll.backend_name)
    for b in (buffer, reference, ll):
        b.destroy()
    return names


def gpu_kernel_names_and_default_device(hidden: int = 512):
    """On the GPU backend: under ``torch.set_default_device("cuda")`` a
    Buffer is built and every call runs; a profiler counts kernels whose names contain "dispatch"
    and "combine" as tools written for DeepEP do — one each per low-latency call, two with
    ``return_recv_hook`` (send and receive phase) — and the normal-mode calls' kernels name theirs.
    Returns ``{row: (dispatch kernels, combine kernels)}``."""
    from torch.profiler import ProfilerActivity, profile
    R, rank = world()
    dev = torch.device("cuda", torch.cuda.current_device())
    num_experts, M = 4 * R, 64
    xs, topks, ws = make_routing(90, "uniform", R, num_experts, 2, M, hidden, fixed_tokens=M)
    x, topk, w = xs[rank].to(dev), topks[rank].to(dev), ws[rank].to(dev)
    torch.set_default_device("cuda")
    try:
        # (on nvshmem the normal mode shares num_rdma_bytes with the low-latency one: room for both)
        buffer = epcomm.Buffer(dist.group.WORLD, num_nvl_bytes=64 << 20,
                               num_rdma_bytes=max(64 << 20, epcomm.Buffer.get_low_latency_rdma_size_hint(
                                   M, hidden, R, num_experts)), low_latency_mode=True)
        per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk, num_experts)
        routing = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                       topk_idx=topk, topk_weights=w)

        def counted(fn):
            torch.cuda.synchronize()
            dist.barrier()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                fn()
                torch.cuda.synchronize()
            names = [e.name for e in prof.events() if e.device_type.name == "CUDA"]
            return sum("dispatch" in n for n in names), sum("combine" in n for n in names)

        rows = {}
        recv_x, _, _, _, handle, _ = buffer.dispatch(x, **routing)
        rows["combine"] = counted(lambda: buffer.combine(recv_x, handle))
        rows["dispatch (cached)"] = counted(lambda: buffer.dispatch(x, handle=handle))
        buffer.clean_low_latency_buffer(M, hidden, num_experts)
        state = {}

        def ll_dispatch(hook):
            recv, _, ll_handle, _, receive = buffer.low_latency_dispatch(x, topk, M, num_experts, use_fp8=False,
                                                                         return_recv_hook=hook)
            if hook:
                receive()
            state["out"], state["handle"] = recv, ll_handle

        def ll_combine(hook):
            _, _, receive = buffer.low_latency_combine(state["out"], topk, w, state["handle"], return_recv_hook=hook)
            if hook:
                receive()
        for hook in (False, True):
            rows[f"low_latency_dispatch hook={hook}"] = counted(lambda: ll_dispatch(hook))
            rows[f"low_latency_combine hook={hook}"] = counted(lambda: ll_combine(hook))
    finally:
        torch.set_default_device(None)
    return rows
