"""Loopback cases of valid calls (loopback_suite.py runs them): the send layout, normal-mode dispatch /
cached dispatch / combine, low-latency rounds, both modes on one backend — each against the
references."""
from __future__ import annotations

from typing import Optional

import torch

from epcomm import fp8
from epcomm.backends.base import DispatchArgs, LowLatencyCombineArgs, LowLatencyDispatchArgs
from epcomm.backends.nvshmem.backend import NvshmemBackend
from epcomm.backends.gpu.workspace import low_latency_bytes
from epcomm.backends.nvshmem import bytes_for_tokens
from epcomm.config import Config
from epcomm.layout import dispatch_layout
from epcomm.testing.reference import (reference_combine, reference_dispatch, reference_low_latency_combine,
                                      reference_low_latency_dispatch)
from epcomm.testing.sweeps import _equal_payload, _ll_rows, expert_fn, make_routing, rank_fn, to_fp8_input
from epcomm.testing.two_level import two_level_combine, two_level_dispatch
from loopback_common import (HandleView, bits16, differing_rows, low_latency_words, run_ranks, to_cpu, wait_stream,
                             xs_home)


def layout_case(seed: int, num_ranks: int, ranks_per_node: int, scenario: str = "uniform", num_tokens: int = 300,
                device: Optional[torch.device] = None) -> None:
    """get_dispatch_layout's kernel (gpu/normal/layout_kernel.py, both GPU backends) against
    layout.dispatch_layout: the counts per rank, per node (None on one node) and per expert, and
    is_token_in_rank; then one expert id out of range, which counts nowhere and is reported to the
    host mailbox (EPInputError naming topk_idx at the next look)."""
    from epcomm.backends.gpu.mailbox import HostMailbox
    from epcomm.backends.gpu.normal.layout_kernel import LayoutKernel
    from epcomm.backends.gpu.sync import device_state
    from epcomm.errors import EPInputError
    device = device or torch.device("cuda", torch.cuda.current_device())
    R, k, E = num_ranks, ranks_per_node, 4 * num_ranks
    _, topks, _ = make_routing(seed, scenario, R, E, 4, num_tokens, 128, fixed_tokens=num_tokens)
    mailbox = HostMailbox(R, 64)
    layout = LayoutKernel(R, k, device, device_state(device), mailbox.address)
    what = f"layout seed={seed} {scenario} R={R} k={k} T={num_tokens}"
    for rank in range(R):
        topk = topks[rank].to(device)
        got = layout(topk, E)
        want = dispatch_layout(topk, E, R, k)
        for name, g, w in zip(("num_tokens_per_rank", "num_tokens_per_rdma_rank", "num_tokens_per_expert",
                               "is_token_in_rank"), got, want):
            assert (g is None) == (w is None), f"{what} rank {rank}: {name} {g} against {w}"
            assert g is None or torch.equal(g, w), f"{what} rank {rank}: {name} {g.tolist()} != {w.tolist()}"
        mailbox.raise_pending(rank, 1.0)
    if num_tokens:
        bad = topks[0].to(device).clone()
        bad[0, 0] = E
        layout(bad, E)
        torch.cuda.synchronize(device)
        try:
            mailbox.raise_pending(0, 1.0)
        except EPInputError as err:
            assert err.argument == "topk_idx", f"{what}: an id out of range raised for {err.argument}"
        else:
            raise AssertionError(f"{what}: an id out of range was not reported")


def send_layout_case(seed: int, num_ranks: int, ranks_per_node: int, scenario: str = "uniform",
                     num_tokens: int = 300, num_channels: int = 3, device: Optional[torch.device] = None) -> None:
    """ml_dispatch_send_layout (one program) against hierarchy.send_layout, rows.node_tokens and
    rows.count_row on one routing: masks, each node's token list, the whole count row."""
    from epcomm.backends.gpu.normal.two_level.dispatch import SEND_LAYOUT
    from epcomm.backends.gpu.normal.two_level.rows import MetaRow, count_row, node_tokens
    from epcomm.backends.gpu.normal.two_level.hierarchy import Topology, send_layout
    device = device or torch.device("cuda", torch.cuda.current_device())
    R, k, E = num_ranks, ranks_per_node, 4 * num_ranks
    topology = Topology(R, k)
    N = topology.num_nodes
    _, topks, _ = make_routing(seed, scenario, R, E, 4, num_tokens, 128, fixed_tokens=num_tokens)
    per_rank, _, per_expert, in_rank = dispatch_layout(topks[0].to(device), E, R)
    meta = MetaRow(R, E, N, num_channels)
    masks = torch.full((num_tokens, N), -7, dtype=torch.int32, device=device)
    lists = torch.full((N, num_tokens), -7, dtype=torch.int32, device=device)
    row = torch.full((meta.length,), -7, dtype=torch.int32, device=device)
    p2 = lambda n: 1 << (max(n, 1) - 1).bit_length()  # noqa: E731
    topk = topks[0].to(device)
    SEND_LAYOUT.bind(num_warps=4, HAS_TOPK=True, BLOCK_T=128, R_P2=p2(R), N_P2=p2(N), BLOCK_E=256, K_P2=4).launch(
        1, 1, torch.cuda.current_stream(device).cuda_stream, in_rank.data_ptr(), topk.data_ptr(), per_rank.data_ptr(),
        per_expert.data_ptr(), masks.data_ptr(), lists.data_ptr(), row.data_ptr(), num_tokens, R, k, E, num_channels,
        4, meta.per_expert, meta.per_node, meta.num_tokens, meta.gbl_prefix, meta.rdma_prefix, meta.abort)
    want = send_layout(in_rank, topology, num_channels)
    want_row = count_row(meta, want.gbl_channel_prefix_matrix[:, -1], per_expert, want.num_tokens_per_rdma_rank,
                         want.gbl_channel_prefix_matrix, want.rdma_channel_prefix_matrix, num_tokens)
    what = f"send layout seed={seed} {scenario} R={R} k={k} T={num_tokens} C={num_channels}"
    assert torch.equal(masks, want.in_node_masks), f"{what}: in-node masks"
    assert torch.equal(row, want_row), f"{what}: count row {row.tolist()} != {want_row.tolist()}"
    want_lists = node_tokens(want.is_token_in_node)
    for n in range(N):
        used = int(want.num_tokens_per_rdma_rank[n])
        assert torch.equal(lists[n, :used], want_lists[n, :used]), f"{what}: node {n}'s token list"


def normal_case(seed: int, num_ranks: int, ranks_per_node: int, scenario: str = "uniform", hidden: int = 256,
                num_experts: int = 16, num_topk: int = 4, max_tokens: int = 40, use_fp8: bool = False,
                with_weights: bool = True, num_bias: int = 0, num_worst_tokens: int = 0, num_channels: int = 2,
                expert_alignment: int = 1, send_parts: int = 1, p2p: bool = False,
                device: Optional[torch.device] = None) -> None:
    """One multi-node dispatch + cached dispatch + combine on loopback ranks; raises AssertionError
    naming what differs from the references. ``send_parts`` and ``p2p`` as in NvshmemBackend
    (``p2p``: rows for another node stored straight into it, not put)."""
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
        backend.normal._dispatch_plan(x_bytes, num_scales, num_topk_sent, num_experts, num_channels, False)
        backend.normal._dispatch_plan(x_bytes, num_scales, 0, num_experts, num_channels, True)
        backend.normal._combine_plan(hidden, num_topk_sent, num_bias, num_channels)

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
        wait_stream(device)  # the kernels' reports land in the mailbox
        backend.raise_pending()
        return dict(recv_x=to_cpu(result.recv_x), recv_topk_idx=to_cpu(result.recv_topk_idx),
                    recv_topk_weights=to_cpu(result.recv_topk_weights), recv_src_idx=to_cpu(handle.recv_src_idx),
                    rank_prefix_matrix=to_cpu(handle.rank_prefix_matrix), counts=result.num_recv_tokens_per_expert_list,
                    cached_x=to_cpu(cached.recv_x), y=to_cpu(y), combined=to_cpu(combined), combined_w=to_cpu(combined_w),
                    num_rows=handle.num_recv_rows)

    what = f"case seed={seed} {scenario} R={num_ranks} k={ranks_per_node} fp8={use_fp8} worst={num_worst_tokens}" \
           f" parts={send_parts} p2p={p2p}"
    try:
        got = run_ranks(num_ranks, ranks_per_node, rank_body, num_bytes, device=device, warm=warm,
                        send_parts=send_parts, p2p=p2p)
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
            raise AssertionError(f"{err} ({differing_rows(part(mine['cached_x']), want['recv_x'])})") from None
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
            assert torch.equal(bits16(combined), bits16(two_level[rank])), f"{what} rank {rank} combine (two-level)"
        torch.testing.assert_close(combined.float(), ref.float(), rtol=2e-2, atol=2e-2,
                                   msg=lambda m: f"{what} rank {rank} combine: {m}")
        if with_weights:
            want_w = torch.where(topks[rank] >= 0, weights[rank], 0.0)
            torch.testing.assert_close(got[rank]["combined_w"], want_w, msg=lambda m: f"{what} rank {rank} weights: {m}")


def warm_low_latency(backend: NvshmemBackend, num_experts: int, max_tokens: int, hidden: int, num_topk: int,
                     use_fp8: bool = False, round_scale: bool = False, use_ue8m0: bool = False,
                     stats: bool = False) -> None:
    """Compile the low-latency specialisations a case launches (send and receive, aligned inputs,
    hooks or not; ``stats``: the dispatch receive with both stats tensors), before the ranks start."""
    ll = backend.low_latency
    plan = ll._dispatch_plan(num_experts, max_tokens, hidden, num_topk, use_fp8, round_scale, use_ue8m0)
    for key in ((True, False, False, False, True), (False, True, stats, stats, False)):
        plan.kernels[key]
    combine = ll._combine_plan(num_experts, max_tokens, hidden, num_topk)
    for key in ((True, False, False, True), (False, True, False, True)):
        combine.kernels[key]


def low_latency_case(seed: int, num_ranks: int, ranks_per_node: int, scenario: str = "uniform", hidden: int = 512,
                     num_experts: int = 16, num_topk: int = 4, max_tokens: int = 24, use_fp8: bool = False,
                     round_scale: bool = False, use_ue8m0: bool = False, rounds: int = 3,
                     ll_ranks_per_node: Optional[int] = None, device: Optional[torch.device] = None) -> None:
    """``rounds`` low-latency dispatch + combine calls on loopback ranks (fresh routing each round;
    the hook style alternates, so both buffer halves and both launch styles run); raises
    AssertionError naming what differs from the references. ``ll_ranks_per_node=1``: every
    message to another rank goes the far way (DeepEP's allow_nvlink_for_low_latency_mode=False)."""
    device = device or torch.device("cuda", torch.cuda.current_device())
    R, E, M = num_ranks, num_experts, max_tokens
    num_local = E // R
    routings = [make_routing(seed * 100 + r, scenario, R, E, num_topk, M, hidden) for r in range(rounds)]
    num_ll_bytes = low_latency_bytes(M, hidden, R, E)

    def warm(backend: NvshmemBackend) -> None:  # the specialisations the rounds launch (stats on)
        warm_low_latency(backend, E, M, hidden, num_topk, use_fp8, round_scale, use_ue8m0, stats=True)

    def rank_body(rank: int, backend: NvshmemBackend):
        mask = torch.zeros(R, dtype=torch.int32, device=device)
        stats = torch.zeros(num_local, dtype=torch.int32, device=device)
        results = []
        for r, (xs, topks, weights) in enumerate(routings):
            hook = r % 2 == 1
            x, topk = xs[rank].to(device), topks[rank].to(device)
            wait_stats = torch.zeros(R, dtype=torch.int64, device=device)
            combine_wait_stats = torch.zeros(R, dtype=torch.int64, device=device)
            args = LowLatencyDispatchArgs(x, topk, M, E, use_fp8, round_scale, use_ue8m0, stats, wait_stats, hook,
                                          mask)
            backend.check_low_latency_dispatch(args)
            recv_x, recv_count, handle, receive = backend.low_latency_dispatch(args)
            if receive is not None:
                receive()
            # The experts, without a host sync (wait_stream says why): every slot, the empty ones zeroed.
            rows = fp8.per_token_cast_back(recv_x[0], recv_x[1], torch.float32) if use_fp8 else recv_x.float()
            experts = rank * num_local + torch.arange(num_local, device=device)
            valid = torch.arange(R * M, device=device)[None, :] < recv_count[:, None]
            expert_out = torch.where(valid[..., None], expert_fn(experts.repeat_interleave(R * M),
                                                                 rows.reshape(-1, hidden)).reshape(rows.shape),
                                     0.0).to(torch.bfloat16)
            # (the handle's tensors and recv_count are reused two dispatches later: keep copies)
            got = dict(recv_x=recv_x, recv_count=recv_count.clone(), src_info=handle.recv_src_info.clone(),
                       layout=handle.recv_layout_range.clone())
            cargs = LowLatencyCombineArgs(expert_out, topk, weights[rank].to(device), handle, None, combine_wait_stats,
                                          hook, mask)
            backend.check_low_latency_combine(cargs)
            combined, receive = backend.low_latency_combine(cargs)
            if receive is not None:
                receive()
            got["combined"] = combined
            got["waits"] = (wait_stats, combine_wait_stats)
            results.append(got)
        wait_stream(device)
        backend.raise_pending()
        results = [{key: to_cpu(value) for key, value in got.items()} for got in results]
        for got in results:
            got["waits"] = tuple(w.tolist() for w in got["waits"])
        return dict(rounds=results, stats=stats.cpu(), mask=mask.cpu(), words=low_latency_words(backend, E))

    what = f"low-latency case seed={seed} {scenario} R={R} k={ranks_per_node} fp8={use_fp8}"
    try:
        got = run_ranks(R, ranks_per_node, rank_body, 1 << 20, timeout_s=5.0, device=device, warm=warm,
                        num_ll_bytes=num_ll_bytes, ll_ranks_per_node=ll_ranks_per_node)
    except RuntimeError as err:
        raise RuntimeError(f"{what}: {err}") from err
    if any(got[rank]["mask"].any() for rank in range(R)):
        waits = "\n".join(f"rank {rank} round {r}: wait ns (dispatch, combine) per source {mine['waits']}"
                          for rank in range(R) for r, mine in enumerate(got[rank]["rounds"]))
        words = "\n".join(got[rank]["words"] for rank in range(R))
        masks = [got[rank]["mask"].tolist() for rank in range(R)]
        raise AssertionError(f"{what}: ranks masked (a wait timed out), masks by rank {masks}\n{waits}\n{words}")
    for rank in range(R):
        total = torch.zeros(num_local, dtype=torch.int32)
        for r, (xs, topks, weights) in enumerate(routings):
            mine = got[rank]["rounds"][r]
            handle = HandleView(mine["src_info"], mine["layout"])
            ref = reference_low_latency_dispatch(xs, topks, E, use_fp8, round_scale)[rank]
            total += mine["recv_count"]
            for e in range(num_local):
                want = ref[e]
                assert int(mine["recv_count"][e]) == want["rows"].shape[0], f"{what} round {r} rank {rank} expert {e} count"
                rows, src_rank, src_token = _ll_rows(mine["recv_x"], mine["recv_count"], handle, e, use_fp8)
                order = torch.argsort(src_rank * 1_000_000 + src_token)
                assert torch.equal(src_rank[order], want["src_rank"]), f"{what} round {r} rank {rank} expert {e} sources"
                assert torch.equal(src_token[order], want["src_token"]), f"{what} round {r} rank {rank} expert {e} tokens"
                torch.testing.assert_close(rows[order], want["rows"], rtol=0, atol=0,
                                           msg=lambda m: f"{what} round {r} rank {rank} expert {e} rows: {m}")
            want = reference_low_latency_combine(xs[rank], topks[rank], weights[rank], expert_fn, use_fp8, round_scale)
            torch.testing.assert_close(mine["combined"], want, rtol=2e-2, atol=2e-2,
                                       msg=lambda m: f"{what} round {r} rank {rank} combine: {m}")
        assert torch.equal(got[rank]["stats"], total), f"{what} rank {rank} cumulative stats"


def mixed_modes_case(num_ranks: int, ranks_per_node: int, hidden: int = 512,
                     device: Optional[torch.device] = None) -> None:
    """Both modes on one backend, whose normal-mode areas overlap the low-latency workspace (as
    DeepEP's modes share num_rdma_bytes): low-latency round, normal round, a low-latency call that
    must raise EPError (no clean since the normal calls), clean_low_latency, low-latency round,
    normal round — every round against the references."""
    from epcomm.errors import EPError
    device = device or torch.device("cuda", torch.cuda.current_device())
    R, E, M, K = num_ranks, 4 * num_ranks, 32, 4
    num_local = E // R
    routings = [make_routing(70 + r, "uniform", R, E, K, M, hidden, fixed_tokens=M) for r in range(4)]
    config = Config(num_sms=4)
    num_bytes = bytes_for_tokens(M, R, ranks_per_node, E, hidden, K)
    num_ll_bytes = low_latency_bytes(M, hidden, R, E)

    def low_latency_round(rank, backend, routing):
        xs, topks, weights = routing
        mask = torch.zeros(R, dtype=torch.int32, device=device)
        x, topk = xs[rank].to(device), topks[rank].to(device)
        args = LowLatencyDispatchArgs(x, topk, M, E, False, False, False, None, None, False, mask)
        backend.check_low_latency_dispatch(args)
        recv_x, _, handle, _ = backend.low_latency_dispatch(args)
        scale = ((rank * num_local + torch.arange(num_local, device=device)).float() + 1) / 8
        cargs = LowLatencyCombineArgs((recv_x.float() * scale[:, None, None]).to(torch.bfloat16), topk,
                                      weights[rank].to(device), handle, None, None, False, mask)
        backend.check_low_latency_combine(cargs)
        return backend.low_latency_combine(cargs)[0]

    def normal_round(rank, backend, routing):
        xs, topks, weights = routing
        x, topk = xs[rank].to(device), topks[rank].to(device)
        per_rank, _, per_expert, in_rank = dispatch_layout(topk, E, R)
        args = DispatchArgs(x=x, handle=None, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                            num_tokens_per_expert=per_expert, topk_idx=topk, topk_weights=weights[rank].to(device),
                            expert_alignment=1, num_worst_tokens=0, config=config)
        backend.check_dispatch(args)
        result = backend.dispatch(args)
        y = rank_fn(rank, result.recv_x)
        backend.check_combine(y, result.handle, result.recv_topk_weights, ())
        return backend.combine(y, result.handle, result.recv_topk_weights, (), config)[0]

    def rank_body(rank: int, backend: NvshmemBackend):
        outs = [("ll", low_latency_round(rank, backend, routings[0])), ("normal", normal_round(rank, backend, routings[1]))]
        try:
            low_latency_round(rank, backend, routings[2])
            refused = False
        except EPError as err:
            refused = "clean_low_latency_buffer" in str(err)
        backend.clean_low_latency()  # collective: every rank's thread
        outs += [("ll", low_latency_round(rank, backend, routings[2])), ("normal", normal_round(rank, backend, routings[3]))]
        wait_stream(device)
        backend.raise_pending()
        return refused, [(kind, out.cpu()) for kind, out in outs]

    def warm(backend: NvshmemBackend) -> None:  # the abort kernels too (a rank compiling one stalls the others)
        backend.normal._dispatch_plan(2 * hidden, 0, K, E, 2, False)
        backend.normal._combine_plan(hidden, K, 0, 2)
        warm_low_latency(backend, E, M, hidden, K)
        backend.warm_abort()

    what = f"mixed modes R={R} k={ranks_per_node}"
    got = run_ranks(R, ranks_per_node, rank_body, num_bytes, device=device, warm=warm, num_ll_bytes=num_ll_bytes)
    for rank in range(R):
        refused, outs = got[rank]
        assert refused, f"{what} rank {rank}: a low-latency call after normal-mode calls was not refused"
        for (kind, out), routing in zip(outs, (routings[0], routings[1], routings[2], routings[3])):
            xs, topks, weights = routing
            if kind == "ll":
                want = reference_low_latency_combine(xs[rank], topks[rank], weights[rank], expert_fn, use_fp8=False)
            else:
                want = reference_combine(xs[rank], topks[rank], E, R, rank_fn)
            torch.testing.assert_close(out, want, rtol=2e-2, atol=2e-2, msg=lambda m: f"{what} rank {rank} {kind}: {m}")
