"""Test bodies that run on every rank of a WorkerPool (importable by spawned ranks).

Every rank rebuilds every rank's inputs from the same seeds, so each can compare its own outputs
with the single-process reference without extra communication.
"""
from __future__ import annotations

import random

import torch
import torch.distributed as dist

import epcomm
from epcomm import fp8
from epcomm.testing import (random_weights, reference_combine, reference_dispatch, reference_low_latency_combine,
                            reference_low_latency_dispatch, single_rank_topk, skewed_topk, uniform_topk, with_holes)

SCENARIOS = ("uniform", "skewed", "holes", "one_rank", "empty_rank", "all_holes")


def world():
    return dist.get_world_size(), dist.get_rank()


def make_routing(seed: int, scenario: str, num_ranks: int, num_experts: int, num_topk: int, max_tokens: int,
                 hidden: int, fixed_tokens=None):
    """Per-rank ``(xs, topk_idxs, topk_weights)`` for one scenario, identical on every rank."""
    rng = random.Random(seed)
    xs, topks, weights = [], [], []
    hot_rank = rng.randrange(num_ranks)
    empty_rank = rng.randrange(num_ranks)
    for i in range(num_ranks):
        g = torch.Generator().manual_seed(seed * 1009 + i)
        num_tokens = fixed_tokens if fixed_tokens is not None else rng.randint(0, max_tokens)
        if scenario == "empty_rank" and i == empty_rank:
            num_tokens = 0
        if scenario == "skewed":
            topk = skewed_topk(num_tokens, num_experts, num_topk, generator=g)
        elif scenario == "one_rank":
            topk = single_rank_topk(num_tokens, num_experts, num_topk, hot_rank, num_ranks, generator=g)
        else:
            topk = uniform_topk(num_tokens, num_experts, num_topk, generator=g)
        if scenario == "holes":
            topk = with_holes(topk, 0.3, generator=g)
        elif scenario == "all_holes":
            topk = torch.full_like(topk, -1)
        xs.append((torch.randn(num_tokens, hidden, generator=g) * (1 + i)).to(torch.bfloat16))
        topks.append(topk)
        weights.append(random_weights(topk, generator=g))
    return xs, topks, weights


def rank_fn(j: int, rows: torch.Tensor) -> torch.Tensor:
    """Stand-in for 'the experts on rank j': a per-rank scaling, rounded to bf16."""
    return (rows.float() * (0.5 + j)).to(torch.bfloat16)


def expert_fn(experts: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Stand-in for expert e: scale by (e + 1) / 8."""
    return rows.float() * ((experts.float() + 1) / 8).unsqueeze(1)


def to_fp8_input(x: torch.Tensor, column_major: bool):
    values, scales = fp8.per_token_cast_to_fp8(x)
    if column_major:
        scales = scales.t().contiguous().t()  # [T, H/128] with strides (1, T), as DeepEP's tests pass them
    return values, scales


def _equal_payload(got, want, what):
    if isinstance(want, tuple):
        assert isinstance(got, tuple), f"{what}: expected an FP8 pair"
        assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8)), f"{what}: fp8 values differ"
        assert torch.equal(got[1].contiguous(), want[1].contiguous()), f"{what}: scales differ"
    else:
        assert torch.equal(got, want), f"{what}: rows differ"


def normal_mode_sweep(num_cases: int, seed0: int = 0, hidden: int = 256, num_topk: int = 4, max_tokens: int = 40):
    """Randomized normal-mode dispatch + combine (full and cached) against the reference."""
    R, rank = world()
    buffer = epcomm.Buffer(dist.group.WORLD)
    checked = 0
    for case in range(num_cases):
        seed = seed0 + case
        rng = random.Random(seed)
        scenario = SCENARIOS[case % len(SCENARIOS)]
        num_experts = R * rng.choice((1, 2, 4, 8))
        k = min(num_topk, num_experts)
        xs, topks, weights = make_routing(seed, scenario, R, num_experts, k, max_tokens, hidden)
        use_fp8 = case % 3 == 1
        column_major = case % 2 == 0
        alignment = rng.choice((1, 1, 4, 128))
        ins = [to_fp8_input(x, column_major) for x in xs] if use_fp8 else xs
        ref = reference_dispatch(ins, topks, weights, num_experts, alignment)[rank]

        per_rank, per_rdma, per_expert, in_rank, _ = buffer.get_dispatch_layout(topks[rank], num_experts)
        assert per_rdma is None
        recv_x, recv_idx, recv_w, counts, handle, event = buffer.dispatch(
            ins[rank], num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
            topk_idx=topks[rank], topk_weights=weights[rank], expert_alignment=alignment)
        _equal_payload(recv_x, ref["recv_x"], f"case {case} ({scenario}) recv_x")
        assert torch.equal(recv_idx, ref["recv_topk_idx"]), f"case {case} recv_topk_idx"
        assert torch.equal(recv_w, ref["recv_topk_weights"]), f"case {case} recv_topk_weights"
        assert counts == ref["num_recv_tokens_per_expert_list"], f"case {case} counts {counts}"
        assert torch.equal(handle[0], ref["rank_prefix_matrix"]), f"case {case} rank_prefix_matrix"
        assert torch.equal(handle.recv_src_idx, ref["recv_src_idx"]), f"case {case} recv_src_idx"

        # Cached mode reproduces recv_x without top-k outputs.
        cached = buffer.dispatch(ins[rank], handle=handle)
        _equal_payload(cached[0], ref["recv_x"], f"case {case} cached recv_x")
        assert cached[1] is None and cached[2] is None and cached[3] is None

        # Combine: plain sum of what each receiving rank sends back (+ optional biases).
        values = recv_x[0] if use_fp8 else recv_x
        if use_fp8:
            values = fp8.per_token_cast_back(recv_x[0], recv_x[1])
        expert_out = rank_fn(rank, values)
        num_bias = case % 3
        biases = [torch.randn(xs[rank].shape, generator=torch.Generator().manual_seed(seed + b)).to(torch.bfloat16)
                  for b in range(num_bias)]
        bias_arg = None if num_bias == 0 else (biases[0] if num_bias == 1 else tuple(biases))
        combined, combined_w, _ = buffer.combine(expert_out, handle, topk_weights=recv_w, bias=bias_arg)
        home = xs[rank] if not use_fp8 else fp8.per_token_cast_back(*ins[rank])
        want = reference_combine(home, topks[rank], num_experts, R, rank_fn, biases)
        assert combined.dtype == torch.bfloat16 and combined.shape == xs[rank].shape
        torch.testing.assert_close(combined, want, rtol=1e-2, atol=1e-2, msg=lambda m: f"case {case}: {m}")
        torch.testing.assert_close(combined_w, weights[rank], rtol=1e-6, atol=1e-6)
        checked += 1
    return checked


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


def _ll_rows(recv_x, recv_count, handle, local_expert: int, use_fp8: bool):
    """Valid rows of one local expert as float32, with (source rank, source token) per row."""
    n = int(recv_count[local_expert])
    if use_fp8:
        values, scales = recv_x
        rows = fp8.per_token_cast_back(values[local_expert, :n], scales[local_expert, :n], torch.float32)
    else:
        rows = recv_x[local_expert, :n].float()
    layout = handle.recv_layout_range[local_expert]
    src_rank = torch.empty(n, dtype=torch.int64)
    for source, packed in enumerate(layout.tolist()):
        offset, count = packed >> 32, packed & 0xFFFFFFFF
        src_rank[offset:offset + count] = source
    return rows, src_rank, handle.recv_src_info[local_expert, :n].to(torch.int64)


def _to_cpu(value):
    if isinstance(value, tuple):
        return tuple(_to_cpu(v) for v in value)
    if isinstance(value, torch.Tensor):
        return value.cpu()
    return value


def low_latency_sweep(num_cases: int, seed0: int = 0, hidden: int = 512, num_topk: int = 4, max_tokens: int = 24,
                      device: str = "cpu", num_rdma_bytes: int = 0):
    """Randomized low-latency dispatch + combine against the reference, all formats and call styles.
    On ``device="cuda"`` the group's GPU backend runs and results are compared on the CPU."""
    R, rank = world()
    dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    buffer = epcomm.Buffer(dist.group.WORLD, num_rdma_bytes=num_rdma_bytes, low_latency_mode=True)
    for case in range(num_cases):
        seed = seed0 + case
        rng = random.Random(seed)
        scenario = SCENARIOS[case % len(SCENARIOS)]
        num_experts = R * rng.choice((1, 2, 4))
        num_local = num_experts // R
        k = min(num_topk, num_experts)
        M = max_tokens
        xs, topks, weights = make_routing(seed, scenario, R, num_experts, k, max_tokens, hidden)
        use_fp8 = case % 2 == 0
        round_scale = use_fp8 and case % 4 == 0
        use_ue8m0 = round_scale and case % 8 == 0
        use_hook = case % 3 == 0
        zero_copy = case % 5 == 1
        stats = torch.zeros(num_local, dtype=torch.int32, device=dev)
        wait_stats = torch.zeros(R, dtype=torch.int64, device=dev) if dev.type == "cpu" else None
        recv_x, recv_count, handle, _, hook = buffer.low_latency_dispatch(
            xs[rank].to(dev), topks[rank].to(dev), M, num_experts, cumulative_local_expert_recv_stats=stats,
            dispatch_wait_recv_cost_stats=wait_stats, use_fp8=use_fp8, round_scale=round_scale,
            use_ue8m0=use_ue8m0, return_recv_hook=use_hook)
        assert (hook is not None) == use_hook
        if hook is not None:
            hook()
        gpu_handle = handle
        recv_x, recv_count, stats, handle = _to_cpu(recv_x), recv_count.cpu(), stats.cpu(), handle._replace(
            recv_src_info=handle.recv_src_info.cpu(), recv_layout_range=handle.recv_layout_range.cpu())
        if use_fp8:
            scales = recv_x[1]
            groups = hidden // (512 if use_ue8m0 else 128)
            assert scales.shape == (num_local, R * M, groups) and scales.stride(1) == 1, "scales must be column-major"
            assert scales.dtype == (torch.int32 if use_ue8m0 else torch.float32)
        else:
            assert recv_x.shape == (num_local, R * M, hidden) and recv_x.dtype == torch.bfloat16
        ref = reference_low_latency_dispatch(xs, topks, num_experts, use_fp8, round_scale)[rank]
        assert torch.equal(stats, recv_count), "cumulative stats"
        expert_out = torch.zeros(num_local, R * M, hidden, dtype=torch.bfloat16)
        for e in range(num_local):
            want = ref[e]
            assert int(recv_count[e]) == want["rows"].shape[0], f"case {case} expert {e} count"
            rows, src_rank, src_token = _ll_rows(recv_x, recv_count, handle, e, use_fp8)
            # order within a source block is free on GPU backends: compare sorted by (source, token)
            order = torch.argsort(src_rank * 1_000_000 + src_token)
            assert torch.equal(src_rank[order], want["src_rank"]) and torch.equal(src_token[order], want["src_token"])
            torch.testing.assert_close(rows[order], want["rows"], rtol=0, atol=0)
            global_e = torch.full((rows.shape[0],), rank * num_local + e)
            expert_out[e, :rows.shape[0]] = expert_fn(global_e, rows).to(torch.bfloat16)
        out = torch.empty(xs[rank].shape, dtype=torch.bfloat16, device=dev) if case % 4 == 3 else None
        x_arg = expert_out.to(dev)
        if zero_copy:
            buffer.get_next_low_latency_combine_buffer(gpu_handle).copy_(expert_out)
            x_arg = torch.zeros_like(x_arg)  # ignored: zero_copy reads the buffer
        combined, _, hook = buffer.low_latency_combine(x_arg, topks[rank].to(dev), weights[rank].to(dev), gpu_handle,
                                                       zero_copy=zero_copy, return_recv_hook=use_hook, out=out)
        if hook is not None:
            hook()
        if out is not None:
            assert combined.data_ptr() == out.data_ptr()
        combined = combined.cpu()
        want = reference_low_latency_combine(xs[rank], topks[rank], weights[rank], expert_fn, use_fp8, round_scale)
        torch.testing.assert_close(combined, want, rtol=2e-2, atol=2e-2, msg=lambda m: f"case {case}: {m}")
    return num_cases


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
            rows, _, _ = _ll_rows(recv_x, recv_count, handle, e, False)
            assert rows.shape == ref[e]["rows"].shape
    return True


def low_latency_masking(hidden: int = 128):
    """A masked rank's experts contribute nothing and its tokens are not received; unmasking restores."""
    R, rank = world()
    buffer = epcomm.Buffer(dist.group.WORLD, low_latency_mode=True)
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
        b, x, t, w, x=(to_fp8_input(x, False)[0], torch.ones(x.shape[0], 3)))),
    "dispatch_fp8_scales_dtype": ("x[1]", lambda b, l, x, t, w: _bad_dispatch(
        b, x, t, w, x=(to_fp8_input(x, False)[0], to_fp8_input(x, False)[1].double()))),
    "dispatch_fp8_scales_layout": ("x[1]", lambda b, l, x, t, w: _bad_dispatch(
        b, x, t, w, x=(to_fp8_input(x, False)[0], torch.ones(x.shape[0], 4)[:, ::2]))),
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
    "dispatch_in_rank_rows": ("is_token_in_rank", lambda b, l, x, t, w: _bad_dispatch(b, x, t, w, x=x[:-1])),
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
    ll_buffer = epcomm.Buffer(dist.group.WORLD, low_latency_mode=True)
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
def _buffers_on_gpu(num_nvl_bytes: int):
    import os
    os.environ.pop("EPCOMM_BACKEND", None)
    fast = epcomm.Buffer(dist.group.WORLD, num_nvl_bytes=num_nvl_bytes)
    os.environ["EPCOMM_BACKEND"] = "torch_dist"
    try:
        reference = epcomm.Buffer(dist.group.WORLD)
    finally:
        os.environ.pop("EPCOMM_BACKEND")
    assert fast.backend_name == "nvlink" and reference.backend_name == "torch_dist"
    return fast, reference


def _valid_rows(payload, n):
    if isinstance(payload, tuple):
        return payload[0][:n].view(torch.uint8), payload[1][:n]
    return payload[:n]


def gpu_normal_against_reference(configs, num_nvl_bytes: int = 1 << 30, repeats: int = 1):
    """For each (scenario, tokens, hidden, use_fp8, num_worst) config: nvlink == torch_dist on the
    same inputs — bitwise for dispatch (full and cached), float tolerance for combine."""
    R, rank = world()
    dev = torch.device("cuda", torch.cuda.current_device())
    fast, reference = _buffers_on_gpu(num_nvl_bytes)
    checked = 0
    for index, (scenario, max_tokens, hidden, use_fp8, worst) in enumerate(configs * repeats):
        seed = 10_000 + index
        num_experts, k = 8 * R, min(8, 8 * R)
        xs, topks, weights = make_routing(seed, scenario, R, num_experts, k, max_tokens, hidden)
        x = xs[rank].to(dev)
        x_in = to_fp8_input(x, column_major=index % 2 == 0) if use_fp8 else x
        topk, w = topks[rank].to(dev), weights[rank].to(dev)
        outs = {}
        for name, buffer in (("fast", fast), ("ref", reference)):
            per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk, num_experts)
            kwargs = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                          topk_idx=topk, topk_weights=w)
            if worst:
                kwargs["num_worst_tokens"] = sum(t.shape[0] for t in xs)
            recv = buffer.dispatch(x_in, **kwargs)
            cached = buffer.dispatch(x_in, handle=recv[4])
            values = fp8.per_token_cast_back(recv[0][0], recv[0][1]) if use_fp8 else recv[0]
            expert_out = (values.float() * (rank + 1) * 0.5).to(torch.bfloat16)
            combined = buffer.combine(expert_out, recv[4], topk_weights=recv[2])
            torch.cuda.synchronize()
            outs[name] = (recv, cached, combined)
        (f_recv, f_cached, f_comb), (r_recv, r_cached, r_comb) = outs["fast"], outs["ref"]
        n = int(r_recv[4].num_recv_tokens)
        what = f"config {index} {scenario} T<={max_tokens} H={hidden} fp8={use_fp8} worst={worst}"
        for got, want, label in ((f_recv[0], r_recv[0], "recv_x"), (f_cached[0], r_cached[0], "cached recv_x")):
            g, wv = _valid_rows(got, n), _valid_rows(want, n)
            if use_fp8:
                assert torch.equal(g[0], wv[0]) and torch.equal(g[1], wv[1]), f"{what}: {label}"
            else:
                assert torch.equal(g, wv), f"{what}: {label}"
        assert torch.equal(f_recv[1][:n], r_recv[1][:n]), f"{what}: recv_topk_idx"
        assert torch.equal(f_recv[2][:n], r_recv[2][:n]), f"{what}: recv_topk_weights"
        if worst:
            assert (f_recv[1][n:] == -1).all(), f"{what}: padding rows"
        assert f_recv[3] == r_recv[3], f"{what}: per-expert counts"
        assert torch.equal(f_recv[4][0], r_recv[4][0]), f"{what}: rank_prefix_matrix"
        assert torch.equal(f_recv[4].recv_src_idx[:n], r_recv[4].recv_src_idx[:n]), f"{what}: recv_src_idx"
        torch.testing.assert_close(f_comb[0], r_comb[0], rtol=1e-2, atol=1e-2, msg=lambda m: f"{what}: combine {m}")
        torch.testing.assert_close(f_comb[1], r_comb[1], rtol=1e-5, atol=1e-5)
        checked += 1
    fast.destroy()
    return checked


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


def gpu_low_latency_graph(replays: int = 4, hidden: int = 2048):
    """Dispatch + stand-in expert + combine captured in one CUDA graph; each replay on fresh inputs
    (copied into the captured tensors) matches the reference."""
    R, rank = world()
    dev = torch.device("cuda", torch.cuda.current_device())
    num_experts, M, K = 8 * R, 64, 4
    size = epcomm.Buffer.get_low_latency_rdma_size_hint(M, hidden, R, num_experts)
    buffer = epcomm.Buffer(dist.group.WORLD, num_rdma_bytes=size, low_latency_mode=True)
    x = torch.zeros(M, hidden, dtype=torch.bfloat16, device=dev)
    topk = torch.zeros(M, K, dtype=torch.int64, device=dev)
    weights = torch.zeros(M, K, dtype=torch.float32, device=dev)

    def step():
        recv, count, handle, _, _ = buffer.low_latency_dispatch(x, topk, M, num_experts, use_fp8=True)
        rows = fp8.per_token_cast_back(recv[0], recv[1], torch.float32)
        scale = ((rank * (num_experts // R) + torch.arange(num_experts // R, device=dev)).float() + 1) / 8
        expert_out = (rows * scale[:, None, None]).to(torch.bfloat16)
        return buffer.low_latency_combine(expert_out, topk, weights, handle)[0]

    def load(seed):
        xs, topks, ws = make_routing(seed, "uniform", R, num_experts, K, M, hidden, fixed_tokens=M)
        x.copy_(xs[rank])
        topk.copy_(topks[rank])
        weights.copy_(ws[rank])
        return xs, topks, ws

    load(0)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    dist.barrier()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for replay in range(replays):
        xs, topks, ws = load(100 + replay)
        graph.replay()
        torch.cuda.synchronize()
        want = reference_low_latency_combine(xs[rank], topks[rank], ws[rank], expert_fn, use_fp8=True)
        torch.testing.assert_close(out.cpu(), want, rtol=2e-2, atol=2e-2, msg=lambda m: f"replay {replay}: {m}")
    return replays


def gpu_low_latency_dead_rank(hidden: int = 2048):
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
        buffer = epcomm.Buffer(dist.group.WORLD, num_rdma_bytes=size, low_latency_mode=True)
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
