"""DeepEP's internode usage against the single-process reference, on any world of nodes.

:func:`internode_against_reference` is what a DeepEP internode user does per layer — group-limited
routing over node groups, an internode ``Config``, ``get_dispatch_layout``, BF16 and FP8 dispatch
with ``async_finish`` / ``previous_event``, ``num_worst_tokens``, a cached dispatch from the handle,
and combine — with every output compared to :func:`reference.reference_dispatch` /
:func:`reference.reference_combine` on every rank. A mismatch names the output, how many rows
differ and the first of them, so a failure at 16 ranks says where to look.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

import epcomm
from epcomm import fp8
from epcomm.testing.reference import reference_combine, reference_dispatch
from epcomm.testing.routing import group_limited_topk, random_weights


def _rows_differ(got: torch.Tensor, want: torch.Tensor, source_ends=None) -> str:
    """``""`` when equal bit for bit, else how many rows differ and the first one; with
    ``source_ends`` (the received rows' end per source: a rank_prefix_matrix column), also how many
    per source — whole sources missing and parts of several tell different faults apart."""
    got, want = got.cpu(), want.cpu()
    if got.shape != want.shape:
        return f"shape {tuple(got.shape)} != {tuple(want.shape)}"
    if got.dtype.is_floating_point and got.element_size() in (1, 2, 4, 8):
        view = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[got.element_size()]
        got, want = got.contiguous().view(view), want.contiguous().view(view)
    differ = (got != want).reshape(got.shape[0], -1).any(dim=1) if got.dim() else (got != want).reshape(1)
    bad = differ.nonzero().flatten()
    if bad.numel() == 0:
        return ""
    first = int(bad[0])
    text = (f"{bad.numel()} of {got.shape[0]} rows differ, first row {first}: got {got[first].flatten()[:8].tolist()} "
            f"want {want[first].flatten()[:8].tolist()}")
    if source_ends is not None:
        ends = [int(e) for e in source_ends]
        per_source = torch.bucketize(bad, torch.tensor(ends), right=True).bincount(minlength=len(ends)).tolist()
        sizes = [end - start for start, end in zip([0] + ends[:-1], ends)]
        text += f"; per source (rows differing / received): {list(zip(per_source[:len(ends)], sizes))}"
    return text


def _gpu_state(buffer) -> str:
    """For a failure on a GPU backend: this rank's device-side epochs (sync.py's state words) and
    whether its own workspace base in the peer table is its buffer (diagnosis only)."""
    backend = getattr(buffer, "_backend", None)
    state = getattr(backend, "state", None)
    if state is None:
        return ""
    text = f"device state words (epochs first) {state.tolist()[:8]}"
    workspace = getattr(backend, "ws", None)
    if workspace is not None:
        bases = workspace.bases.tolist()
        text += f"; own base in the peer table is the buffer: {bases[buffer.rank] == workspace.buffer.data_ptr()}"
        text += f"; peers unmapped: {[i for i, b in enumerate(bases) if b == 0]}"
    return text


def _inputs(seed: int, num_ranks: int, num_tokens: int, hidden: int, num_experts: int, num_topk: int,
            num_nodes: int, topk_groups: int):
    xs, topks, weights = [], [], []
    for i in range(num_ranks):
        g = torch.Generator().manual_seed(seed * 7919 + i)
        xs.append((torch.randn(num_tokens, hidden, generator=g) * (1 + i % 5)).to(torch.bfloat16))
        topk = group_limited_topk(num_tokens, num_experts, num_topk, num_nodes, topk_groups, generator=g)
        topks.append(topk)
        weights.append(random_weights(topk, generator=g))
    return xs, topks, weights


def internode_against_reference(num_tokens: int = 1024, hidden: int = 7168, num_experts_per_rank: int = 16,
                                num_topk: int = 8, topk_groups: int = 2, config=(24, 8, 512, 16, 128),
                                seed: int = 0, repeats: int = 2) -> dict:
    """Run on every rank of a world whose Buffer spans nodes (the automatic backend, or
    ``EPCOMM_BACKEND``; ``EPCOMM_RANKS_PER_NODE`` for virtual nodes). ``num_experts_per_rank * R``
    experts, top-``num_topk`` within the best ``topk_groups`` node groups. Each repeat runs: layout;
    BF16 dispatch (``async_finish``, ``previous_event``) with top-k, FP8 dispatch with
    ``num_worst_tokens``, a cached dispatch, combine with weights — each checked. Returns
    ``{"backend": name, "checked": calls checked}``; raises AssertionError naming the first wrong output."""
    R, rank = dist.get_world_size(), dist.get_rank()
    dev = torch.device("cuda", torch.cuda.current_device())
    num_experts = num_experts_per_rank * R
    cfg = epcomm.Config(*config)
    from epcomm.backends.nvshmem import bytes_for_tokens
    # the workspace: DeepEP sizes it from the config hints; here exactly what the batch needs
    ranks_per_node = int(os.environ.get("EPCOMM_RANKS_PER_NODE", R))
    size = bytes_for_tokens(num_tokens, R, ranks_per_node, num_experts, hidden, num_topk)
    buffer = epcomm.Buffer(dist.group.WORLD, num_nvl_bytes=size, num_rdma_bytes=size)
    checked = 0
    try:
        for repeat in range(repeats):
            xs, topks, weights = _inputs(seed + repeat, R, num_tokens, hidden, num_experts, num_topk,
                                         buffer.num_nodes, topk_groups)
            want = reference_dispatch(xs, topks, weights, num_experts)[rank]
            x, topk, w = xs[rank].to(dev), topks[rank].to(dev), weights[rank].to(dev)
            what = f"rank {rank} repeat {repeat} ({buffer.backend_name}, R={R}, nodes of {buffer.ranks_per_node})"

            previous = epcomm.Buffer.capture()
            per_rank, per_rdma, per_expert, in_rank, event = buffer.get_dispatch_layout(
                topk, num_experts, previous_event=previous, async_finish=True, allocate_on_comm_stream=True)
            event.current_stream_wait()
            home_ranks = torch.zeros(num_tokens, R, dtype=torch.bool)
            for j in range(R):
                home_ranks[:, j] = ((topks[rank] >= j * num_experts_per_rank) &
                                    (topks[rank] < (j + 1) * num_experts_per_rank)).any(dim=1)
            assert torch.equal(in_rank.cpu(), home_ranks), f"{what}: is_token_in_rank"
            assert torch.equal(per_rank.cpu(), home_ranks.sum(0).to(per_rank.dtype)), f"{what}: num_tokens_per_rank"
            routing = dict(num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank,
                           num_tokens_per_expert=per_expert, topk_idx=topk, topk_weights=w, config=cfg)

            recv_x, recv_idx, recv_w, counts, handle, event = buffer.dispatch(
                x, previous_event=epcomm.Buffer.capture(), async_finish=True, allocate_on_comm_stream=True, **routing)
            event.current_stream_wait()
            n = want["recv_x"].shape[0]
            for label, got, ref in (("recv_x", recv_x, want["recv_x"]), ("recv_topk_idx", recv_idx, want["recv_topk_idx"]),
                                    ("recv_topk_weights", recv_w, want["recv_topk_weights"]),
                                    ("recv_src_idx", handle.recv_src_idx, want["recv_src_idx"]),
                                    ("rank_prefix_matrix", handle.rank_prefix_matrix, want["rank_prefix_matrix"])):
                differ = _rows_differ(got, ref, want["rank_prefix_matrix"][:, rank] if label != "rank_prefix_matrix"
                                      else None)
                assert not differ, f"{what}: BF16 dispatch {label}: {differ}"
            assert counts == want["num_recv_tokens_per_expert_list"], f"{what}: per-expert counts {counts}"

            worst = num_tokens * R
            # every rank casts every rank's rows alike (on the GPU: fast), the reference sees the same bytes
            xs8 = [tuple(t.cpu() for t in fp8.per_token_cast_to_fp8(v.to(dev))) for v in xs]
            (fp8_x, fp8_scales), idx8, _, counts8, _, _ = buffer.dispatch(
                (xs8[rank][0].to(dev), xs8[rank][1].to(dev)), num_worst_tokens=worst, **routing)
            want8 = reference_dispatch(xs8, topks, weights, num_experts)[rank]
            assert fp8_x.shape[0] == worst, f"{what}: FP8 dispatch with num_worst_tokens: {fp8_x.shape[0]} rows"
            for label, got, ref in (("values", fp8_x[:n].view(torch.uint8), want8["recv_x"][0].view(torch.uint8)),
                                    ("scales", fp8_scales[:n], want8["recv_x"][1]),
                                    ("recv_topk_idx", idx8[:n], want8["recv_topk_idx"])):
                differ = _rows_differ(got, ref)
                assert not differ, f"{what}: FP8 dispatch {label}: {differ}"
            assert bool((idx8[n:] == -1).all()), f"{what}: FP8 dispatch padding rows past {n} are not -1"
            assert counts8 == [], f"{what}: num_worst_tokens returns no per-expert counts, got {counts8}"

            cached, *_ = buffer.dispatch(x, handle=handle, config=cfg)
            differ = _rows_differ(cached, want["recv_x"], want["rank_prefix_matrix"][:, rank])
            assert not differ, f"{what}: cached dispatch recv_x: {differ}"

            expert_out = (recv_x.float() * (rank + 1) * 0.5).to(torch.bfloat16)
            combined, combined_w, event = buffer.combine(expert_out, handle, topk_weights=recv_w, config=cfg,
                                                         previous_event=epcomm.Buffer.capture(), async_finish=True)
            event.current_stream_wait()
            home = reference_combine(xs[rank], topks[rank], num_experts, R,
                                     lambda j, rows: (rows.float() * (j + 1) * 0.5).to(torch.bfloat16))
            torch.testing.assert_close(combined.cpu(), home, rtol=1e-2, atol=1e-2, msg=lambda m: f"{what}: combine {m}")
            torch.testing.assert_close(combined_w.cpu(), weights[rank], rtol=1e-6, atol=1e-6,
                                       msg=lambda m: f"{what}: combined weights {m}")
            checked += 5
        return {"backend": buffer.backend_name, "checked": checked}
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{_gpu_state(buffer)}") from None
    finally:
        buffer.destroy()


def round_trip_times(num_tokens: int = 256, hidden: int = 2048, reps: int = 10) -> dict:
    """Median milliseconds of a cached dispatch + combine and of a low-latency dispatch + combine
    on the automatic backend, every call synchronised. On ranks sharing a GPU this measures no
    speed, but a wait that ends only through a backoff or a timeout shows as milliseconds."""
    import time
    R, rank = dist.get_world_size(), dist.get_rank()
    dev = torch.device("cuda", torch.cuda.current_device())
    num_experts, num_topk = 8 * R, min(8, 8 * R)
    xs, topks, weights = _inputs(11, R, num_tokens, hidden, num_experts, num_topk, 1, 1)
    x, topk, w = xs[rank].to(dev), topks[rank].to(dev), weights[rank].to(dev)
    size = epcomm.Buffer.get_low_latency_rdma_size_hint(num_tokens, hidden, R, num_experts)
    buffer = epcomm.Buffer(dist.group.WORLD, num_nvl_bytes=256 << 20, num_rdma_bytes=max(size, 256 << 20),
                           low_latency_mode=True)
    times = {}
    try:
        per_rank, per_rdma, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk, num_experts)
        recv_x, _, recv_w, _, handle, _ = buffer.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                          num_tokens_per_rdma_rank=per_rdma,
                                                          num_tokens_per_expert=per_expert, topk_idx=topk,
                                                          topk_weights=w)

        def normal():
            got, *_ = buffer.dispatch(x, handle=handle)
            buffer.combine(got, handle)

        def low_latency():
            got, _, ll_handle, _, _ = buffer.low_latency_dispatch(x, topk, num_tokens, num_experts, use_fp8=False)
            buffer.low_latency_combine(got, topk, w, ll_handle)

        for name, step in (("normal", normal), ("low_latency", low_latency)):
            if name == "low_latency":
                buffer.clean_low_latency_buffer(num_tokens, hidden, num_experts)
            samples = []
            for _ in range(reps + 2):
                torch.cuda.synchronize()
                started = time.perf_counter()
                step()
                torch.cuda.synchronize()
                samples.append((time.perf_counter() - started) * 1e3)
            times[name] = sorted(samples[2:])[reps // 2]
        return times
    finally:
        buffer.destroy()
