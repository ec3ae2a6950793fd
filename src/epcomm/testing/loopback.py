"""The multi-node backend's kernels on one GPU: every rank a thread of this process (loopback
transport, backends/nvshmem/transport.py), checked against the references.

Normal mode: dispatch, cached dispatch, combine (:func:`normal_case`). Low-latency mode: a few
rounds of dispatch + combine with and without hooks, FP8 variants, messages to near and far
ranks (:func:`low_latency_case`), against the references as the GPU suite checks them.

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

from .. import fp8
from ..backends.base import DispatchArgs, LowLatencyCombineArgs, LowLatencyDispatchArgs
from ..backends.nvshmem.backend import NvshmemBackend
from ..backends.nvshmem.transport import LoopbackWorld
from ..backends.nvlink.workspace import low_latency_bytes
from ..backends.nvshmem.workspace import bytes_for_tokens
from ..config import Config
from ..layout import dispatch_layout
from .reference import (reference_combine, reference_dispatch, reference_low_latency_combine,
                        reference_low_latency_dispatch)
from .sweeps import _equal_payload, _ll_rows, expert_fn, make_routing, rank_fn, to_fp8_input
from .two_level import two_level_combine, two_level_dispatch


def run_ranks(num_ranks: int, ranks_per_node: int, fn: Callable[[int, NvshmemBackend], object], num_bytes: int,
              timeout_s: float = 20.0, device: Optional[torch.device] = None,
              warm: Optional[Callable[[NvshmemBackend], None]] = None, num_ll_bytes: int = 0,
              ll_ranks_per_node: Optional[int] = None) -> List[object]:
    """``fn(rank, backend)`` for every rank, each in its own thread and CUDA stream, over one
    :class:`LoopbackWorld`; returns the results by rank, or raises the first rank's exception.
    ``warm(backend)`` runs first, in this thread: compile the kernels ``fn`` will launch there,
    since a rank compiling inside ``fn`` holds up the others' waits (by seconds per kernel).
    ``num_ll_bytes``: the backends' low-latency workspace (0: none)."""
    device = device or torch.device("cuda", torch.cuda.current_device())
    world = LoopbackWorld(num_ranks, device,
                          NvshmemBackend.allocation_bytes(num_bytes, num_ll_bytes, num_ranks, ranks_per_node))
    backends = [NvshmemBackend(None, device, num_bytes, ranks_per_node, timeout_s, world.transport(rank),
                               num_ll_bytes=num_ll_bytes, ll_ranks_per_node=ll_ranks_per_node)
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
                wait_stream(device)
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


def wait_stream(device: torch.device) -> None:
    """Wait for this thread's current stream without holding the GIL: a rank that blocks in a
    synchronising call that keeps the GIL (``tolist()`` does) stops the other ranks' threads from
    launching the kernels its own spinning kernels wait for — the waits then time out."""
    import time
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(device))
    while not done.query():
        time.sleep(1e-4)


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
        wait_stream(device)  # the kernels' reports land in the mailbox
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
        results = [{key: _cpu(value) for key, value in got.items()} for got in results]
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
            handle = _HandleView(mine["src_info"], mine["layout"])
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


def send_layout_case(seed: int, num_ranks: int, ranks_per_node: int, scenario: str = "uniform",
                     num_tokens: int = 300, num_channels: int = 3, device: Optional[torch.device] = None) -> None:
    """ml_dispatch_send_layout (one program) against hierarchy.send_layout, rows.node_tokens and
    rows.count_row on one routing: masks, each node's token list, the whole count row."""
    from ..backends.nvshmem.normal import SEND_LAYOUT
    from ..backends.nvshmem.rows import MetaRow, count_row, node_tokens
    from ..hierarchy import Topology, send_layout
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


def low_latency_dead_rank_case(num_ranks: int, ranks_per_node: int, hidden: int = 512, rounds: int = 3,
                               device: Optional[torch.device] = None) -> None:
    """The last rank makes no call: every other rank times out once (1 s), masks it, and gets the
    live ranks' results — dispatch counts without the dead rank's messages, combine without its
    experts — in every round; raises AssertionError naming what differs."""
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

    what = f"low-latency dead rank R={R} k={ranks_per_node}"
    got = run_ranks(R, ranks_per_node, rank_body, 1 << 20, timeout_s=1.0, device=device, warm=warm,
                    num_ll_bytes=low_latency_bytes(M, hidden, R, E))
    for rank in range(R - 1):
        results, mask = got[rank]
        assert mask.tolist() == [int(r == dead) for r in range(R)], f"{what} rank {rank}: mask {mask.tolist()}"
        for r, ((counts, out), (xs, topks, weights)) in enumerate(zip(results, routings)):
            live = [x for i, x in enumerate(xs) if i != dead] + [xs[dead][:0]]
            live_topks = [t for i, t in enumerate(topks) if i != dead] + [topks[dead][:0]]
            ref = reference_low_latency_dispatch(live, live_topks, E, False)[rank]
            assert counts.tolist() == [e["rows"].shape[0] for e in ref], f"{what} round {r} rank {rank} counts"
            live_topk = topks[rank].clone()
            live_topk[(live_topk // num_local) == dead] = -1
            want = reference_low_latency_combine(xs[rank], live_topk, weights[rank], expert_fn, use_fp8=False)
            torch.testing.assert_close(out, want, rtol=2e-2, atol=2e-2,
                                       msg=lambda m: f"{what} round {r} rank {rank} combine: {m}")


def bad_counts_case(num_ranks: int, ranks_per_node: int, argument: str = "num_tokens_per_expert",
                    device: Optional[torch.device] = None) -> None:
    """The last rank passes counts that do not summarise its routing (``argument``): every rank's
    full dispatch raises EPInputError naming it (the count rows carry the abort code; no hang)."""
    from ..errors import EPInputError
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
    """A rejected call costs nothing (issue 26 case 2), in both modes: the last rank rejects its
    input and aborts; the others' call raises EPInputError naming the argument (a full dispatch at
    its count wait; a low-latency dispatch at the next look at the mailbox); every rank then
    resyncs (what Buffer does at the next call) and the next call pairs and matches the reference."""
    from ..errors import EPInputError
    device = device or torch.device("cuda", torch.cuda.current_device())
    R, E, T, M, K = num_ranks, 4 * num_ranks, 24, 16, 4
    normal = make_routing(83, "uniform", R, E, K, T, hidden, fixed_tokens=T)
    ll = make_routing(84, "uniform", R, E, K, M, hidden, fixed_tokens=M)
    config = Config(num_sms=4)
    planted = EPInputError("x", "planted on the last rank")

    def warm(backend: NvshmemBackend) -> None:  # the abort kernels too (a rank compiling one stalls the others)
        backend._dispatch_plan(2 * hidden, 0, K, E, 2, False)
        backend._combine_plan(hidden, K, 0, 2)
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
        return dict(seen=seen, recv_x=_cpu(result.recv_x), combined=_cpu(combined), ll_combined=_cpu(ll_combined),
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
    """Ranks that disagree move nothing (issue 26, found on 2 x H200): a cached dispatch in which the
    last rank sends FP8 and the others BF16 (rows of another size), then a combine in which only
    the last rank passes top-k weights (combine rows of another size). Neither call waits on the
    host, so each returns; every later kernel of the call must return at once (the step barrier
    failed: nvshmem/step.py), since reading the peers' rows with this rank's layout indexes
    anything. Every rank then raises EPInputError naming the argument at its next look at the
    mailbox, resyncs, and the next full dispatch and combine match the reference."""
    from ..errors import EPInputError
    from ..fp8 import per_token_cast_to_fp8
    device = device or torch.device("cuda", torch.cuda.current_device())
    R, E, T, K = num_ranks, 4 * num_ranks, 24, 4
    routing = make_routing(85, "uniform", R, E, K, T, hidden, fixed_tokens=T)
    config = Config(num_sms=4)

    def warm(backend: NvshmemBackend) -> None:
        backend._dispatch_plan(2 * hidden, 0, K, E, 2, False)
        backend._dispatch_plan(2 * hidden, 0, 0, E, 2, True)
        backend._dispatch_plan(hidden, hidden // 128, 0, E, 2, True)
        for num_topk in (0, K):
            backend._combine_plan(hidden, num_topk, 0, 2)

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
        return dict(seen=seen, recv_x=_cpu(result.recv_x), combined=_cpu(combined))

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
    """Issue 28's ``ll_num_experts`` case, near and far: the last rank's low-latency dispatch has
    twice the others' expert count, so its count words lie elsewhere. Every rank's receive must
    end its wait by the senders' fingerprint rows — well before the timeout, nobody masked — and
    raise EPInputError naming num_experts; after the resync a round trip matches the reference."""
    import time

    from ..errors import EPInputError
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
        return dict(seconds=seconds, raised=raised, masked=masked, combined=_cpu(combined))

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


def bad_counts_cases(num_ranks: int, ranks_per_node: int):
    """Both caller counts the send-layout kernel checks (:func:`bad_counts_case`)."""
    return [(0, "uniform", dict(argument="num_tokens_per_rank")), (0, "uniform", dict(argument="num_tokens_per_expert"))]


def mixed_modes_case(num_ranks: int, ranks_per_node: int, hidden: int = 512,
                     device: Optional[torch.device] = None) -> None:
    """Both modes on one backend, whose normal-mode areas overlap the low-latency workspace (as
    DeepEP's modes share num_rdma_bytes): low-latency round, normal round, a low-latency call that
    must raise EPError (no clean since the normal calls), clean_low_latency, low-latency round,
    normal round — every round against the references."""
    from ..errors import EPError
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
        backend._dispatch_plan(2 * hidden, 0, K, E, 2, False)
        backend._combine_plan(hidden, K, 0, 2)
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


def low_latency_words(backend: NvshmemBackend, num_experts: int) -> str:
    """One rank's low-latency epochs, combine flags and count words (both halves; nonzero ones as
    source:local expert=epoch/messages): what a timed-out wait read."""
    from ..backends.nvlink import sync
    ws, R = backend.ll_ws, backend.num_ranks
    state = backend.state.cpu().tolist()
    words = ws.buffer.view(torch.int64)
    flags = words[sync.FLAGS_LL_COMBINE * R:(sync.FLAGS_LL_COMBINE + 1) * R].tolist()
    parts = [f"rank {backend.rank} epochs dispatch {state[sync.EPOCH_LL_DISPATCH]} combine "
             f"{state[sync.EPOCH_LL_COMBINE]} halves {state[sync.LL_DISPATCH_HALF_EPOCH:sync.LL_DISPATCH_HALF_EPOCH + 2]}"
             f" {state[sync.LL_COMBINE_HALF_EPOCH:sync.LL_COMBINE_HALF_EPOCH + 2]}; combine flags {flags}"]
    num_local = num_experts // R
    for half in (0, 1):
        start = ws.ll_half_offset(half) // 8
        counts = words[start:start + num_experts].tolist()
        shown = " ".join(f"{i // num_local}:{i % num_local}={c >> 32}/{c & 0xFFFFFFFF}" for i, c in enumerate(counts))
        parts.append(f"half {half} counts {shown}")
    return "; ".join(parts)


class _HandleView:
    """The two index tensors of a LowLatencyHandle that ``sweeps._ll_rows`` reads (CPU copies)."""

    def __init__(self, recv_src_info: torch.Tensor, recv_layout_range: torch.Tensor):
        self.recv_src_info, self.recv_layout_range = recv_src_info, recv_layout_range


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


def low_latency_cases(num_ranks: int, ranks_per_node: int):
    """The low-latency suite for one topology: ``(seed, scenario, keyword arguments)`` of
    :func:`low_latency_case`."""
    E = 4 * num_ranks
    return [
        (20, "uniform", dict(num_experts=E)),
        (21, "skewed", dict(num_experts=E, use_fp8=True)),
        (22, "holes", dict(num_experts=2 * num_ranks, use_fp8=True, round_scale=True)),
        (23, "one_rank", dict(num_experts=E, use_fp8=True, round_scale=True, use_ue8m0=True, hidden=1024)),
        (24, "empty_rank", dict(num_experts=E, ll_ranks_per_node=1)),
        (25, "uniform", dict(num_experts=8 * num_ranks, num_topk=8, max_tokens=64, hidden=2048, use_fp8=True)),
    ]


def send_layout_cases(num_ranks: int, ranks_per_node: int):
    """The send-layout kernel on its own (:func:`send_layout_case`): sizes around the block and
    channel edges, holes, a hot rank, an empty batch."""
    return [(30, "uniform", dict(num_tokens=300, num_channels=3)), (31, "holes", dict(num_tokens=129, num_channels=1)),
            (32, "one_rank", dict(num_tokens=1, num_channels=4)), (33, "skewed", dict(num_tokens=0, num_channels=2)),
            (34, "holes", dict(num_tokens=1000, num_channels=12))]


def dead_rank_cases(num_ranks: int, ranks_per_node: int):
    """The masking case for one topology (:func:`low_latency_dead_rank_case`): once."""
    return [(0, "uniform", {})]


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
    parser.add_argument("--mode", choices=("normal", "low_latency", "both"), default="both")
    parser.add_argument("--only", default=None, help="run only the cases of this function (e.g. recovery_case)")
    args = parser.parse_args(argv)
    if os.environ.get("CUDA_MODULE_LOADING") != "EAGER":  # see the module's docstring
        env = dict(os.environ, CUDA_MODULE_LOADING="EAGER")
        return subprocess.call([sys.executable, "-m", "epcomm.testing.loopback"] + list(argv or sys.argv[1:]),
                               env=env)
    topologies = [tuple(int(v) for v in t.split(",")) for t in args.topology] or TOPOLOGIES
    failed = 0
    suites = [(send_layout_case, send_layout_cases), (normal_case, cases), (bad_counts_case, bad_counts_cases)] \
        if args.mode != "low_latency" else []
    suites += [(low_latency_case, low_latency_cases), (low_latency_dead_rank_case, dead_rank_cases),
               (mixed_modes_case, dead_rank_cases), (recovery_case, dead_rank_cases),
               (disagreement_case, dead_rank_cases),
               (ll_other_call_case, dead_rank_cases)] if args.mode != "normal" else []
    if args.only:
        suites = [(run_case, suite) for run_case, suite in suites if run_case.__name__ == args.only]
    for num_ranks, ranks_per_node in topologies:
        for run_case, suite in suites:
            for seed, scenario, kwargs in suite(num_ranks, ranks_per_node):
                started = time.monotonic()
                try:
                    if run_case in (low_latency_dead_rank_case, mixed_modes_case, bad_counts_case, recovery_case,
                                    disagreement_case, ll_other_call_case):
                        run_case(num_ranks, ranks_per_node, **kwargs)
                    else:
                        run_case(seed, num_ranks, ranks_per_node, scenario, **kwargs)
                    status = "ok"
                except (AssertionError, RuntimeError) as err:
                    failed += 1
                    status = f"FAILED: {str(err)[:2000]}"
                print(f"{run_case.__name__} R={num_ranks} k={ranks_per_node} seed={seed} {scenario} {kwargs}: "
                      f"{status} ({time.monotonic() - started:.1f} s)", flush=True)
    print(f"{failed} failed" if failed else "all passed", flush=True)
    return 1 if failed else 0


__all__ = ["run_ranks", "send_layout_case", "normal_case", "cases", "low_latency_case", "low_latency_cases",
           "low_latency_dead_rank_case", "mixed_modes_case", "bad_counts_case", "recovery_case", "disagreement_case",
           "ll_other_call_case", "main"]


if __name__ == "__main__":
    raise SystemExit(main())
