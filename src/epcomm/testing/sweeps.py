"""Randomized correctness sweeps against the single-process reference, run on every rank.

Every rank rebuilds every rank's inputs from the same seeds, so each can compare its own outputs
with the reference without extra communication. Kept in the package (not with the project's tests)
because ``epcomm check`` — a command of the installed package, which cannot import tests/ — runs
these sweeps on a user's machine; a user's tests may call them too. The test suite uses them and
their helpers (``make_routing``, ``expert_fn``, ``cuda_graph_replays``).
"""
from __future__ import annotations

import os

import random
import time

import torch
import torch.distributed as dist

import epcomm
from epcomm import fp8
from epcomm.testing.reference import (reference_combine, reference_dispatch, reference_low_latency_combine,
                                      reference_low_latency_dispatch)
from epcomm.testing.routing import random_weights, single_rank_topk, skewed_topk, uniform_topk, with_holes


SCENARIOS = ("uniform", "skewed", "holes", "one_rank", "empty_rank", "all_holes")
# The fuzz adds valid but unusual inputs (failure contract): a token listing an expert twice.
FUZZ_SCENARIOS = SCENARIOS + ("duplicates",)


def world():
    return dist.get_world_size(), dist.get_rank()


def make_routing(seed: int, scenario: str, num_ranks: int, num_experts: int, num_topk: int, max_tokens: int,
                 hidden: int, fixed_tokens=None, special_rows: bool = False):
    """Per-rank ``(xs, topk_idxs, topk_weights)`` for one scenario, identical on every rank.
    ``special_rows``: token 0 is NaN and token 1 is +inf/-inf (they must stay in their own tokens)."""
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
        elif scenario == "duplicates" and num_topk >= 2:
            topk[::2, 1] = topk[::2, 0]  # every other token lists its first expert twice
        x = (torch.randn(num_tokens, hidden, generator=g) * (1 + i)).to(torch.bfloat16)
        if special_rows and num_tokens >= 2:
            x[0] = float("nan")
            x[1, ::2], x[1, 1::2] = float("inf"), float("-inf")
        xs.append(x)
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


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Bit patterns, so NaN rows compare equal to themselves."""
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _equal_payload(got, want, what):
    if isinstance(want, tuple):
        assert isinstance(got, tuple), f"{what}: expected an FP8 pair"
        assert torch.equal(_bits(got[0]), _bits(want[0])), f"{what}: fp8 values differ"
        assert torch.equal(_bits(got[1]), _bits(want[1])), f"{what}: scales differ"
    else:
        assert torch.equal(_bits(got), _bits(want)), f"{what}: rows differ"


def normal_mode_sweep(num_cases: int, seed0: int = 0, hidden: int = 256, num_topk: int = 4, max_tokens: int = 40,
                      unusual: bool = False, device: str = "cpu", num_nvl_bytes: int = 256 << 20):
    """Randomized normal-mode dispatch + combine (full and cached) against the reference; every
    fifth case also the expert-major layout against the re-laid plain rows. ``unusual``: also
    duplicate experts in a token's top-k and NaN/inf rows (the fuzz). On ``device="cuda"`` the
    group's GPU backend runs and results are compared on the CPU."""
    from .. import expert_major as layout
    R, rank = world()
    dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    buffer = epcomm.Buffer(dist.group.WORLD, num_nvl_bytes=num_nvl_bytes)

    def to_dev(value):
        return tuple(to_dev(v) for v in value) if isinstance(value, tuple) else value.to(dev)
    checked = 0
    for case in range(num_cases):
        seed = seed0 + case
        rng = random.Random(seed)
        scenarios = FUZZ_SCENARIOS if unusual else SCENARIOS
        scenario = scenarios[case % len(scenarios)]
        num_experts = R * rng.choice((1, 2, 4, 8))
        k = min(num_topk, num_experts)
        xs, topks, weights = make_routing(seed, scenario, R, num_experts, k, max_tokens, hidden,
                                          special_rows=unusual and case % 4 == 0)
        use_fp8 = case % 3 == 1
        column_major = case % 2 == 0
        alignment = rng.choice((1, 1, 4, 128))
        ins = [to_fp8_input(x, column_major) for x in xs] if use_fp8 else xs
        ref = reference_dispatch(ins, topks, weights, num_experts, alignment)[rank]

        x_in, topk, w = to_dev(ins[rank]), topks[rank].to(dev), weights[rank].to(dev)
        per_rank, per_rdma, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk, num_experts)
        if buffer.num_nodes == 1:
            assert per_rdma is None
        else:  # tokens per node: a token counts once for each node holding one of its ranks
            nodes = in_rank.view(in_rank.shape[0], buffer.num_nodes, buffer.ranks_per_node).any(dim=2)
            assert torch.equal(per_rdma.cpu(), nodes.sum(dim=0).to(per_rdma.dtype).cpu())
        routing = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                       topk_idx=topk, topk_weights=w, expert_alignment=alignment)
        recv_x, recv_idx, recv_w, counts, handle, event = buffer.dispatch(x_in, **routing)
        _equal_payload(_to_cpu(recv_x), ref["recv_x"], f"case {case} ({scenario}) recv_x")
        assert torch.equal(recv_idx.cpu(), ref["recv_topk_idx"]), f"case {case} recv_topk_idx"
        assert torch.equal(recv_w.cpu(), ref["recv_topk_weights"]), f"case {case} recv_topk_weights"
        assert counts == ref["num_recv_tokens_per_expert_list"], f"case {case} counts {counts}"
        assert torch.equal(handle.rank_prefix_matrix.cpu(), ref["rank_prefix_matrix"]), f"case {case} rank_prefix_matrix"
        assert torch.equal(handle.recv_src_idx.cpu(), ref["recv_src_idx"]), f"case {case} recv_src_idx"

        # Cached mode reproduces recv_x without top-k outputs.
        cached = buffer.dispatch(x_in, handle=handle)
        _equal_payload(_to_cpu(cached[0]), ref["recv_x"], f"case {case} cached recv_x")
        assert cached[1] is None and cached[2] is None and cached[3] is None

        if case % 5 == 2:  # the expert-major layout: the plain rows re-laid
            rows, row_experts, row_weights, em_counts, _, _ = buffer.dispatch(x_in, expert_major=True, **routing)
            want = layout.plan(ref["recv_topk_idx"], ref["recv_topk_weights"], counts)
            assert em_counts == counts and torch.equal(row_experts.cpu(), want.row_experts) and \
                torch.equal(row_weights.cpu(), want.row_weights), f"case {case} expert-major entries"
            _equal_payload(_to_cpu(rows), layout.expand(ref["recv_x"], want), f"case {case} expert-major rows")

        # Combine: plain sum of what each receiving rank sends back (+ optional biases).
        values = recv_x[0] if use_fp8 else recv_x
        if use_fp8:
            values = fp8.per_token_cast_back(recv_x[0], recv_x[1])
        expert_out = rank_fn(rank, values.cpu()).to(dev)
        num_bias = case % 3
        biases = [torch.randn(xs[rank].shape, generator=torch.Generator().manual_seed(seed + b)).to(torch.bfloat16)
                  for b in range(num_bias)]
        bias_arg = None if num_bias == 0 else (biases[0].to(dev) if num_bias == 1 else to_dev(tuple(biases)))
        combined, combined_w, _ = buffer.combine(expert_out, handle, topk_weights=recv_w, bias=bias_arg)
        combined, combined_w = combined.cpu(), combined_w.cpu()
        home = xs[rank] if not use_fp8 else fp8.per_token_cast_back(*ins[rank])
        want = reference_combine(home, topks[rank], num_experts, R, rank_fn, biases,
                                 ranks_per_node=buffer.ranks_per_node if buffer.backend_name == "nvshmem" else 0)
        assert combined.dtype == torch.bfloat16 and combined.shape == xs[rank].shape
        torch.testing.assert_close(combined, want, rtol=1e-2, atol=1e-2, equal_nan=True, msg=lambda m: f"case {case}: {m}")
        torch.testing.assert_close(combined_w, weights[rank], rtol=1e-6, atol=1e-6)
        checked += 1
    return checked

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
                      device: str = "cpu", num_rdma_bytes: int = 0, unusual: bool = False, backend=None,
                      ranks_per_node=None):
    """Randomized low-latency dispatch + combine against the reference, all formats and call styles.
    On ``device="cuda"`` the group's GPU backend runs (or ``backend`` on nodes of ``ranks_per_node``)
    and results are compared on the CPU. ``unusual``: also duplicate experts in a token's top-k (at
    most M/2 tokens, so no (expert, source) receives more than M messages) and NaN/inf rows (the fuzz)."""
    R, rank = world()
    dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    buffer = epcomm.Buffer(dist.group.WORLD, num_rdma_bytes=num_rdma_bytes, low_latency_mode=True, backend=backend,
                           ranks_per_node=ranks_per_node)
    if backend is not None:
        assert buffer.backend_name == backend
    for case in range(num_cases):
        seed = seed0 + case
        rng = random.Random(seed)
        scenarios = FUZZ_SCENARIOS if unusual else SCENARIOS
        scenario = scenarios[case % len(scenarios)]
        num_experts = R * rng.choice((1, 2, 4))
        num_local = num_experts // R
        k = min(num_topk, num_experts)
        M = max_tokens
        xs, topks, weights = make_routing(seed, scenario, R, num_experts, k, M // 2 if scenario == "duplicates" else M,
                                          hidden, special_rows=unusual and case % 4 == 1)
        use_fp8 = case % 2 == 0
        round_scale = use_fp8 and case % 4 == 0
        use_ue8m0 = round_scale and case % 8 == 0
        use_hook = case % 3 == 0
        zero_copy = case % 5 == 1
        stats = torch.zeros(num_local, dtype=torch.int32, device=dev)
        wait_stats = torch.zeros(R, dtype=torch.int64, device=dev)
        combine_wait_stats = torch.zeros(R, dtype=torch.int64, device=dev) if case % 2 else None
        started = time.perf_counter()
        recv_x, recv_count, handle, _, hook = buffer.low_latency_dispatch(
            xs[rank].to(dev), topks[rank].to(dev), M, num_experts, cumulative_local_expert_recv_stats=stats,
            dispatch_wait_recv_cost_stats=wait_stats, use_fp8=use_fp8, round_scale=round_scale,
            use_ue8m0=use_ue8m0, return_recv_hook=use_hook)
        assert (hook is not None) == use_hook
        if hook is not None:
            hook()
        recv_count.cpu()  # (synchronises: the call's time, for the report below)
        took_s = time.perf_counter() - started
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
            if int(recv_count[e]) != want["rows"].shape[0]:  # say which sources, and whether a timeout masked one
                got_per_source = (handle.recv_layout_range[e] & 0xFFFFFFFF).tolist()
                want_per_source = torch.bincount(want["src_rank"], minlength=R).tolist()
                raise AssertionError(f"case {case} expert {e} count {int(recv_count[e])} != {want['rows'].shape[0]}: "
                                     f"per source got {got_per_source}, want {want_per_source}; masked ranks "
                                     f"{buffer._rank_mask.nonzero().flatten().tolist()}; call took {took_s:.1f} s")
            rows, src_rank, src_token = _ll_rows(recv_x, recv_count, handle, e, use_fp8)
            # order within a source block is free on GPU backends: compare sorted by (source, token)
            order = torch.argsort(src_rank * 1_000_000 + src_token)
            assert torch.equal(src_rank[order], want["src_rank"]) and torch.equal(src_token[order], want["src_token"])
            torch.testing.assert_close(rows[order], want["rows"], rtol=0, atol=0, equal_nan=True)
            global_e = torch.full((rows.shape[0],), rank * num_local + e)
            expert_out[e, :rows.shape[0]] = expert_fn(global_e, rows).to(torch.bfloat16)
        out = torch.empty(xs[rank].shape, dtype=torch.bfloat16, device=dev) if case % 4 == 3 else None
        x_arg = expert_out.to(dev)
        if zero_copy:
            buffer.get_next_low_latency_combine_buffer(gpu_handle).copy_(expert_out)
            x_arg = torch.zeros_like(x_arg)  # ignored: zero_copy reads the buffer
        combined, _, hook = buffer.low_latency_combine(x_arg, topks[rank].to(dev), weights[rank].to(dev), gpu_handle,
                                                       zero_copy=zero_copy, return_recv_hook=use_hook, out=out,
                                                       combine_wait_recv_cost_stats=combine_wait_stats)
        if hook is not None:
            hook()
        for stats_name, wait in (("dispatch", wait_stats), ("combine", combine_wait_stats)):
            if wait is not None:
                assert (wait.cpu() >= 0).all(), f"case {case}: {stats_name}_wait_recv_cost_stats {wait.tolist()}"
        if out is not None:
            assert combined.data_ptr() == out.data_ptr()
        combined = combined.cpu()
        want = reference_low_latency_combine(xs[rank], topks[rank], weights[rank], expert_fn, use_fp8, round_scale)
        torch.testing.assert_close(combined, want, rtol=2e-2, atol=2e-2, equal_nan=True, msg=lambda m: f"case {case}: {m}")
    return num_cases


def _buffers_on_gpu(num_nvl_bytes: int, ranks_per_node: int = 0, max_tokens: int = 0, hidden: int = 0):
    """The GPU backend under test and the torch_dist reference. ``ranks_per_node`` > 0: the
    nvshmem backend on virtual nodes of that many ranks, sized for ``max_tokens`` of ``hidden``."""
    if ranks_per_node:
        from epcomm.backends.nvshmem import bytes_for_tokens
        R = dist.get_world_size()
        rdma = bytes_for_tokens(max(max_tokens, 1), R, ranks_per_node, 8 * R, hidden, min(8, 8 * R))
        fast = epcomm.Buffer(dist.group.WORLD, num_rdma_bytes=rdma, backend="nvshmem", ranks_per_node=ranks_per_node)
        expected = ("nvshmem",)
    elif os.environ.get("EPCOMM_RANKS_PER_NODE"):  # the GPU suite on (virtual) nodes: the automatic choice
        fast = epcomm.Buffer(dist.group.WORLD, num_nvl_bytes=num_nvl_bytes)
        expected = ("nvshmem", "nvlink")  # (nvlink where the shared-GPU bed's nvlink presets made it automatic)
    else:
        fast = epcomm.Buffer(dist.group.WORLD, num_nvl_bytes=num_nvl_bytes, backend="nvlink")
        expected = ("nvlink",)
    reference = epcomm.Buffer(dist.group.WORLD, backend="torch_dist")
    assert fast.backend_name in expected and reference.backend_name == "torch_dist", fast.backend_name
    return fast, reference


def _valid_rows(payload, n):
    if isinstance(payload, tuple):
        return payload[0][:n].view(torch.uint8), payload[1][:n]
    return payload[:n]


def assert_same_handle(got, want, what: str = "") -> None:
    """Two dispatches' handles hold the same layout: rank_prefix_matrix, is_token_in_rank and the
    received rows' recv_src_idx, compared by name. (Not by index: a handle across nodes is DeepEP's
    internode tuple, whose ``[0]`` is is_token_in_rank, where a one-node handle's is
    rank_prefix_matrix; comparing ``[0]`` failed every virtual-nodes run against a one-node reference.)"""
    n = int(want.num_recv_tokens)
    for name in ("rank_prefix_matrix", "is_token_in_rank"):
        assert torch.equal(getattr(got, name), getattr(want, name)), f"{what}: {name}"
    assert torch.equal(got.recv_src_idx[:n], want.recv_src_idx[:n]), f"{what}: recv_src_idx"


def gpu_normal_against_reference(configs, num_nvl_bytes: int = 1 << 30, repeats: int = 1, ranks_per_node: int = 0):
    """For each (scenario, tokens, hidden, use_fp8, num_worst) config: nvlink (or, with
    ``ranks_per_node``, nvshmem on virtual nodes) == torch_dist on the same inputs — bitwise for
    dispatch (full and cached), float tolerance for combine."""
    R, rank = world()
    dev = torch.device("cuda", torch.cuda.current_device())
    fast, reference = _buffers_on_gpu(num_nvl_bytes, ranks_per_node, max(c[1] for c in configs),
                                      max(c[2] for c in configs))
    checked = 0
    for index, (scenario, max_tokens, hidden, use_fp8, worst) in enumerate(configs * repeats):
        seed = 10_000 + index
        num_experts, k = 8 * R, min(8, 8 * R)
        xs, topks, weights = make_routing(seed, scenario, R, num_experts, k, max_tokens, hidden)
        x = xs[rank].to(dev)
        x_in = to_fp8_input(x, column_major=index % 2 == 0) if use_fp8 else x
        topk, w = topks[rank].to(dev), weights[rank].to(dev)
        outs, layouts = {}, {}
        for name, buffer in (("fast", fast), ("ref", reference)):
            per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk, num_experts)
            layouts[name] = (per_rank, per_expert, in_rank)
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
        for got, want, label in zip(layouts["fast"], layouts["ref"], ("num_tokens_per_rank", "num_tokens_per_expert",
                                                                       "is_token_in_rank")):
            assert got.dtype == want.dtype and torch.equal(got, want), f"config {index}: layout {label}"
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
        assert_same_handle(f_recv[4], r_recv[4], what)
        torch.testing.assert_close(f_comb[0], r_comb[0], rtol=1e-2, atol=1e-2, msg=lambda m: f"{what}: combine {m}")
        torch.testing.assert_close(f_comb[1], r_comb[1], rtol=1e-5, atol=1e-5)
        checked += 1
    fast.destroy()
    return checked


def routing_loader(inputs, num_experts: int, num_topk: int, num_tokens: int, hidden: int):
    """A :func:`cuda_graph_replays` ``load``: ``load(seed)`` copies this rank's part of the seed's
    uniform routing (:func:`make_routing`, ``num_tokens`` on every rank) into ``inputs`` (the
    captured x, topk_idx and topk_weights) and returns every rank's ``(xs, topk_idxs, weights)``."""
    R, rank = world()

    def load(seed):
        routing = make_routing(seed, "uniform", R, num_experts, num_topk, num_tokens, hidden, fixed_tokens=num_tokens)
        for tensor, values in zip(inputs, routing):
            tensor.copy_(values[rank])
        return routing
    return load


def cuda_graph_replays(step, load, seeds, group=None, back_to_back: bool = False):
    """Capture ``step()`` in a CUDA graph and replay it on new inputs; yields ``(load(seed), out)``
    per seed, after the replay finished (``out``: what ``step`` returned during the capture).
    ``back_to_back``: the replays of ``seeds[1:]`` (each after its inputs' copies, in stream order)
    are queued without waiting between them, and only the last is yielded, once it finished; for
    that ``load`` must not wait either (copies from the device, not from pageable host memory).

    ``load(seed)`` copies a seed's inputs into the tensors ``step`` reads (and returns what the
    caller checks against). ``step`` runs once on a side stream first (warm-up outside the capture,
    as engines' graph runners do); every rank of ``group`` then meets at a barrier before the
    capture, so no rank's capture overlaps a peer's warm-up. Collective over ``group``."""
    load(seeds[0])
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    dist.barrier(group=group)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for index, seed in enumerate(seeds[1:], 2):
        loaded = load(seed)
        graph.replay()
        if back_to_back and index < len(seeds):
            continue
        torch.cuda.synchronize()
        yield loaded, out

