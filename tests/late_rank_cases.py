"""Rank bodies for tests/test_no_silent_partial_results.py: late ranks with and without
``enable_shrink``, waits that give up (NaN rows), vLLM's elastic recovery, a skipped combine, and
handles or sizes of another Buffer. Each returns what its rank saw; the tests judge it."""
from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

import epcomm
from epcomm.testing import reference_combine, reference_low_latency_combine
from epcomm.testing.sweeps import expert_fn, make_routing, world

M, HIDDEN = 8, 128


def _outcome(fn):
    """``("ok", value)`` or ``(error class name, argument or peers, message)``."""
    try:
        return ("ok", fn())
    except epcomm.EPInputError as err:
        return ("EPInputError", err.argument, str(err)[:300])
    except epcomm.EPTimeoutError as err:
        return ("EPTimeoutError", err.peers, str(err)[:300])
    except epcomm.EPError as err:
        return ("EPError", None, str(err)[:300])


def _experts_out(recv, rank, num_local):
    """Each local expert's output for its received rows (``expert_fn``), bf16 ``[E_local, R*M, H]``."""
    experts = rank * num_local + torch.arange(num_local)
    return torch.stack([expert_fn(torch.full((recv.shape[1],), int(e)), recv[i].float())
                        for i, e in enumerate(experts)]).to(torch.bfloat16)


def _ll_round(buffer, seed, dropped=(), **dispatch_kwargs):
    """One low-latency round trip on this rank; True when it matches the reference with the experts
    of ``dropped`` ranks contributing nothing (masked)."""
    R, rank = world()
    E = 2 * R
    xs, topks, ws = make_routing(seed, "uniform", R, E, 2, M, HIDDEN, fixed_tokens=M)
    recv, _, handle, _, _ = buffer.low_latency_dispatch(xs[rank], topks[rank], M, E, use_fp8=False,
                                                        **dispatch_kwargs)
    out = buffer.low_latency_combine(_experts_out(recv, rank, E // R), topks[rank], ws[rank], handle)[0]
    live = topks[rank].clone()
    for r in dropped:
        live[(live // (E // R)) == r] = -1
    want = reference_low_latency_combine(xs[rank], live, ws[rank], expert_fn, use_fp8=False)
    return bool(torch.allclose(out.float(), want.float(), rtol=2e-2, atol=2e-2))


def _normal_round(buffer, seed):
    """One normal-mode round trip (layout, dispatch, combine); True when it matches the reference."""
    R, rank = world()
    E = 4 * R
    xs, topks, ws = make_routing(seed, "uniform", R, E, 2, M, HIDDEN, fixed_tokens=M)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topks[rank], E)
    recv_x, _, _, _, handle, _ = buffer.dispatch(xs[rank], num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                 num_tokens_per_expert=per_expert, topk_idx=topks[rank],
                                                 topk_weights=ws[rank])
    combined = buffer.combine(recv_x, handle)[0]
    want = reference_combine(xs[rank], topks[rank], E, R, lambda j, rows: rows)
    return bool(torch.allclose(combined.float(), want.float(), rtol=1e-2, atol=1e-2))


def late_rank(mode: str, shrink: bool, timeout: float = 1.5):
    """The last rank comes ``timeout + 0.5`` s late to a round trip (``mode``: ``"low_latency"`` or
    ``"normal"``). Returns ``(first outcome, [outcomes of the recovery steps])``: without shrink every
    rank raises EPTimeoutError naming it (the late rank too, when it comes) and the next round pairs;
    with shrink (low-latency) the others mask it and get the sum of the live ranks, the late rank
    raises EPError (its peers masked it), and after every rank unmasked it and cleaned the buffer
    the next round is whole again."""
    R, rank = world()
    late = R - 1
    buffer = epcomm.Buffer(dist.group.WORLD, low_latency_mode=mode == "low_latency", enable_shrink=shrink,
                           timeout=timeout)
    if rank == late:
        time.sleep(timeout + 0.5)
    round_trip = (lambda seed: _ll_round(buffer, seed, dropped=(late,) if shrink else ())) \
        if mode == "low_latency" else (lambda seed: _normal_round(buffer, seed))
    started = time.monotonic()
    first = _outcome(lambda: round_trip(60))
    first = first + (round(time.monotonic() - started, 2),)
    after = []
    if shrink:
        mask = torch.zeros(R, dtype=torch.int32)
        if rank != late:
            buffer.low_latency_query_mask_buffer(mask)
            after.append(("mask", mask.tolist()))
        buffer.low_latency_clean_mask_buffer()
        buffer.clean_low_latency_buffer(M, HIDDEN, 2 * R)  # (collective: the late rank is here too)
        after.append(_outcome(lambda: _ll_round(buffer, 61))[:2])
    else:
        after.append(_outcome(lambda: round_trip(61))[:2])
        after.append(_outcome(lambda: round_trip(62))[:2])
    buffer.destroy()
    return first, after


def skipped_combine(timeout: float = 5.0):
    """Rank 1's expert code raises after a dispatch, so it skips the combine; ranks 0, 2, 3 raise
    naming ``call`` at once. Returns ``[(outcome, seconds)]`` of three normal round trips: every
    rank raised once (rank 1 its own expert error), then every round pairs and is right."""
    R, rank = world()
    buffer = epcomm.Buffer(dist.group.WORLD, timeout=timeout)
    E = 4 * R
    xs, topks, ws = make_routing(35, "uniform", R, E, 2, M, HIDDEN, fixed_tokens=M)
    steps = []
    for step in range(3):
        started = time.monotonic()
        try:
            per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topks[rank], E)
            recv_x, _, _, _, handle, _ = buffer.dispatch(xs[rank], num_tokens_per_rank=per_rank,
                                                         is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                                                         topk_idx=topks[rank], topk_weights=ws[rank])
            if step == 0 and rank == 1:
                raise RuntimeError("expert code failed")
            combined = buffer.combine(recv_x, handle)[0]
            want = reference_combine(xs[rank], topks[rank], E, R, lambda j, rows: rows)
            outcome = ("ok", bool(torch.allclose(combined.float(), want.float(), rtol=1e-2, atol=1e-2)))
        except epcomm.EPInputError as err:
            outcome = ("EPInputError", err.argument)
        except RuntimeError as err:
            outcome = ("expert code", str(err)[:100])
        steps.append((outcome, round(time.monotonic() - started, 2)))
    buffer.destroy()
    return steps


def handle_of_another_group_size():
    """A handle made by a 4-rank Buffer given to a 2-rank Buffer (ranks 0 and 1): EPInputError
    naming ``handle`` on both ranks — a normal combine, a cached dispatch, a low-latency combine —
    and the 2-rank Buffer's next call pairs. Ranks 2 and 3 only build the groups."""
    R, rank = world()
    pair = dist.new_group([0, 1])  # (collective over the world)
    wide = epcomm.Buffer(dist.group.WORLD, low_latency_mode=True, timeout=10)
    xs, topks, ws = make_routing(36, "uniform", R, 4 * R, 2, M, HIDDEN, fixed_tokens=M)
    per_rank, _, per_expert, in_rank, _ = wide.get_dispatch_layout(topks[rank], 4 * R)
    recv_x, _, _, _, handle, _ = wide.dispatch(xs[rank], num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                               num_tokens_per_expert=per_expert)
    wide.combine(recv_x, handle)
    recv, _, ll_handle, _, _ = wide.low_latency_dispatch(xs[rank], topks[rank], M, 4 * R, use_fp8=False)
    wide.low_latency_combine(recv, topks[rank], ws[rank], ll_handle)
    if rank >= 2:
        return None
    narrow = epcomm.Buffer(pair, low_latency_mode=True, timeout=10)
    seen = [_outcome(lambda: narrow.combine(recv_x, handle))[:2],
            _outcome(lambda: narrow.dispatch(xs[rank], handle=handle))[:2],
            _outcome(lambda: narrow.low_latency_combine(recv, topks[rank], ws[rank], ll_handle))[:2]]
    xs2, topks2, _ = make_routing(37, "uniform", 2, 8, 2, M, HIDDEN, fixed_tokens=M)
    per_rank, _, per_expert, in_rank, _ = narrow.get_dispatch_layout(topks2[rank], 8)
    got = narrow.dispatch(xs2[rank], num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                          num_tokens_per_expert=per_expert)[0]
    seen.append(("next call", got.shape[1] == HIDDEN))
    return seen


def undersized_rdma_bytes():
    """A low-latency Buffer whose ``num_rdma_bytes`` is below what the call needs: EPInputError
    naming it on every rank, as on the GPU backends; the hint's size works."""
    R, rank = world()
    E = 2 * R
    hint = epcomm.Buffer.get_low_latency_rdma_size_hint(M, HIDDEN, R, E)
    small = epcomm.Buffer(dist.group.WORLD, low_latency_mode=True, num_rdma_bytes=hint // 4, timeout=10)
    xs, topks, _ = make_routing(38, "uniform", R, E, 2, M, HIDDEN, fixed_tokens=M)
    seen = [_outcome(lambda: small.low_latency_dispatch(xs[rank], topks[rank], M, E, use_fp8=False))[:2]]
    fits = epcomm.Buffer(dist.group.WORLD, low_latency_mode=True, num_rdma_bytes=hint, timeout=10)
    seen.append(("hint fits", _ll_round(fits, 39)))
    return seen


def config_capped_for_a_shared_gpu():
    """Buffer's side of the shared-GPU caps: a backend's ``max_num_sms`` caps every Config the calls
    resolve (a given one, the default), a smaller explicit value wins, and the calls still work."""
    buffer = epcomm.Buffer(dist.group.WORLD, timeout=10)
    seen = {"no cap": buffer._resolve_config(epcomm.Config(24, 8, 256), epcomm.Buffer.get_dispatch_config).num_sms}
    buffer._backend.max_num_sms = 4
    seen["given 24"] = buffer._resolve_config(epcomm.Config(24, 8, 256), epcomm.Buffer.get_dispatch_config).num_sms
    seen["given 2"] = buffer._resolve_config(epcomm.Config(2, 8, 256), epcomm.Buffer.get_dispatch_config).num_sms
    seen["default"] = buffer._resolve_config(None, epcomm.Buffer.get_combine_config).num_sms
    config = buffer._resolve_config(epcomm.Config(24, 6, 256), epcomm.Buffer.get_dispatch_config)
    seen["rest kept"] = (config.nvl_chunked_send_tokens, config.nvl_chunked_recv_tokens) == (6, 256)
    seen["round trip"] = _normal_round(buffer, 40)
    # The handle's DeepEP channel fields follow the Config asked for, not the capped one that runs
    # (found beside DeepEP on the bed: 8 ranks on one GPU gave C = 2 where DeepEP had 4).
    R, rank = world()
    xs, topks, ws = make_routing(41, "uniform", R, 4 * R, 2, M, HIDDEN, fixed_tokens=M)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topks[rank], 4 * R)
    handle = buffer.dispatch(xs[rank], num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                             num_tokens_per_expert=per_expert, topk_idx=topks[rank], topk_weights=ws[rank],
                             config=epcomm.Config(24, 8, 256))[4]
    seen["handle's channels"] = (handle.num_channels, tuple(handle[1].shape), tuple(handle[5].shape))
    handle = buffer.dispatch(xs[rank], num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                             num_tokens_per_expert=per_expert, topk_idx=topks[rank], topk_weights=ws[rank])[4]
    seen["default's channels"] = handle.num_channels == epcomm.Buffer.get_dispatch_config(R).num_sms // 2
    return seen


# ---------------------------------------------------------------------- processes of their own
def _init_gloo(rank: int, world_size: int, port: int) -> None:
    import datetime
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=60))


def _finish(results, done, rank: int) -> None:
    results.close()
    results.join_thread()  # the result is flushed before the process goes
    done.wait(60)  # (rank 0 hosts the store; the others' sockets stay open until the test has its results)
    os._exit(0)  # no teardown: a rank stalled or exited


def stalled_exchange_main(rank: int, world_size: int, port: int, call: str, results, done) -> None:
    """The last rank makes the call (its fingerprint arrives) but stalls before its rows go out
    (``call``: ``"dispatch"`` or ``"combine"``, each with a hook; the combine writes into ``out=``).
    The others' hooks raise EPTimeoutError naming it, and the rows they know are missing are NaN:
    in a dispatch, the stalled source's rows (``recv_layout_range`` says where); in a combine, the
    tokens with an expert on the stalled rank — the rest right. Puts ``(rank, outcome, checks)``."""
    _init_gloo(rank, world_size, port)
    try:
        R, E, timeout = world_size, 2 * world_size, 1.0
        stalled = R - 1
        buffer = epcomm.Buffer(dist.group.WORLD, low_latency_mode=True, timeout=timeout)
        xs, topks, ws = make_routing(41, "uniform", R, E, 2, M, HIDDEN, fixed_tokens=M)
        x, topk, w = xs[rank], topks[rank], ws[rank]
        backend = buffer._backend
        if rank == stalled:  # its rows for the stalled call go out only after the peers gave up
            original = backend._ll_rows

            def stall(*args, **kwargs):
                if getattr(backend, "_stall", None) == call:
                    time.sleep(timeout + 1.0)
                return original(*args, **kwargs)
            backend._ll_rows = stall
        checks = {}
        if call == "dispatch":
            backend._stall = "dispatch"
            recv, count, handle, _, hook = buffer.low_latency_dispatch(x, topk, M, E, use_fp8=False,
                                                                       return_recv_hook=True)
            outcome = _outcome(hook)[:2]
            if rank != stalled:
                layout = handle.recv_layout_range
                for e in range(E // R):
                    for src in range(R):
                        start, n = int(layout[e, src] >> 32), int(layout[e, src] & 0xFFFFFFFF)
                        rows = recv[e, start:start + n].float()
                        if n:
                            key = "stalled rows NaN" if src == stalled else "other rows finite"
                            checks[key] = checks.get(key, True) and bool(
                                rows.isnan().all() if src == stalled else rows.isfinite().all())
        else:
            recv, _, handle, _, _ = buffer.low_latency_dispatch(x, topk, M, E, use_fp8=False)
            expert_out = _experts_out(recv, rank, E // R)
            out = torch.zeros(M, HIDDEN, dtype=torch.bfloat16)
            backend._stall = "combine"
            _, _, hook = buffer.low_latency_combine(expert_out, topk, w, handle, out=out, return_recv_hook=True)
            outcome = _outcome(hook)[:2]
            if rank != stalled:
                lost = ((topk // (E // R)) == stalled).any(dim=1)
                want = reference_low_latency_combine(x, topk, w, expert_fn, use_fp8=False)
                checks["lost tokens NaN"] = bool(out[lost].float().isnan().all()) and bool(lost.any())
                checks["other tokens right"] = bool(torch.allclose(out[~lost].float(), want[~lost].float(),
                                                                   rtol=2e-2, atol=2e-2))
        results.put((rank, outcome, checks))
    finally:
        _finish(results, done, rank)


def elastic_recovery_main(rank: int, world_size: int, port: int, results, done) -> None:
    """vLLM's elastic recovery as vLLM calls it: ``enable_shrink``, a round trip, then the last
    rank dies. The live ranks' next round masks it and is right for the live ranks; then each calls
    ``get_local_buffer_tensor(torch.int8, use_rdma_buffer=True).zero_()`` and
    ``low_latency_clean_mask_buffer()``, and the next round trips are right again (the dead rank is
    masked again at its first wait). Puts ``(rank, [checks])``."""
    _init_gloo(rank, world_size, port)
    try:
        R, E = world_size, 2 * world_size
        dead = R - 1
        buffer = epcomm.Buffer(dist.group.WORLD, low_latency_mode=True, enable_shrink=True, timeout=1.0,
                               num_rdma_bytes=epcomm.Buffer.get_low_latency_rdma_size_hint(M, HIDDEN, R, E))
        seen = [("whole", _ll_round(buffer, 70))]
        dist.barrier()
        if rank == dead:
            os._exit(0)  # gone: its sockets close
        seen.append(("dead rank masked", _ll_round(buffer, 71, dropped=(dead,))))
        mask = torch.zeros(R, dtype=torch.int32)
        buffer.low_latency_query_mask_buffer(mask)
        seen.append(("mask", mask.tolist()))
        buffer.get_local_buffer_tensor(torch.int8, use_rdma_buffer=True).zero_()
        buffer.low_latency_clean_mask_buffer()
        for seed in (72, 73):
            seen.append((f"after clean {seed}", _ll_round(buffer, seed, dropped=(dead,))))
        buffer.low_latency_query_mask_buffer(mask)
        seen.append(("mask again", mask.tolist()))
        results.put((rank, seen))
    finally:
        _finish(results, done, rank)


# ---------------------------------------------------------------------- GPU (the one-GPU bed)
def _gpu_round_trip(buffer, seed: int, num_experts: int, hidden: int):
    """One low-latency round trip of M tokens (top-2, BF16) on ``buffer``, the experts applied on the
    GPU with no host sync: the combine is queued behind the dispatch's wait, as in a serving loop (a
    sync between would let the combine itself raise: the dispatch's report). Returns ``(out on the
    CPU, xs, topks, weights)`` of the routing."""
    R, rank = world()
    dev = torch.device("cuda", torch.cuda.current_device())
    E = num_experts
    xs, topks, ws = make_routing(seed, "uniform", R, E, 2, M, hidden, fixed_tokens=M)
    x, topk, w = xs[rank].to(dev), topks[rank].to(dev), ws[rank].to(dev)
    recv, _, handle, _, _ = buffer.low_latency_dispatch(x, topk, M, E, use_fp8=False)
    scale = ((rank * (E // R) + torch.arange(E // R, device=dev)).float() + 1) / 8  # (expert_fn)
    out = buffer.low_latency_combine((recv.float() * scale[:, None, None]).to(torch.bfloat16), topk, w, handle)[0]
    return out.cpu(), xs, topks, ws


def gpu_late_rank_without_shrink(hidden: int = 512, timeout: float = 3.0):
    """A low-latency Buffer without ``enable_shrink`` on a GPU backend; after a round that compiles
    every kernel, the last rank comes ``timeout + 2`` s late to a round trip. The others' combine
    returns NaN rows for the tokens with an expert on the late rank (never its stale slots) and the
    rest right, and their next call raises EPTimeoutError naming it; the late rank's own waits for
    its peers' combine give up (they no longer signal it), and its next call raises too. Returns
    ``(rows check, next call's outcome)``."""
    R, rank = world()
    E = 2 * R
    late = R - 1
    size = epcomm.Buffer.get_low_latency_rdma_size_hint(M, hidden, R, E)
    buffer = epcomm.Buffer(dist.group.WORLD, num_rdma_bytes=size, low_latency_mode=True, timeout=timeout)

    def round_trip(seed):
        out, xs, topks, ws = _gpu_round_trip(buffer, seed, E, hidden)
        want = reference_low_latency_combine(xs[rank], topks[rank], ws[rank], expert_fn, use_fp8=False)
        return out, want, topks[rank]

    out, want, _ = round_trip(80)  # compiles every kernel of the shape on every rank
    assert torch.allclose(out.float(), want.float(), rtol=2e-2, atol=2e-2), "the warm-up round differs"
    dist.barrier()
    if rank == late:
        time.sleep(timeout + 2)
    try:
        out, want, topk = round_trip(81)
    except epcomm.EPTimeoutError as err:  # (the dispatch reported before the combine started: also right)
        rows = ("the combine raised", late in err.peers or rank == late)
    else:
        if rank == late:
            rows = ("late rank: some rows NaN", bool(out.float().isnan().any()))
        else:
            lost = ((topk // (E // R)) == late).any(dim=1)
            rows = ("lost rows NaN, the rest right", bool(lost.any()) and bool(out[lost].float().isnan().all())
                    and bool(torch.allclose(out[~lost].float(), want[~lost].float(), rtol=2e-2, atol=2e-2)))
    following = _outcome(lambda: round_trip(82))[:2]
    dist.barrier()
    buffer.destroy()
    return rows, following


def gpu_elastic_recovery(hidden: int = 512, timeout: float = 2.0):
    """vLLM's elastic recovery on a GPU backend, as vLLM calls it: ``enable_shrink``; after a round
    that compiles every kernel the last rank stops taking part (it stays away, its memory mapped).
    The live ranks' next round masks it and is right for them; then, between barriers of the live
    ranks, ``get_local_buffer_tensor(torch.int8, use_rdma_buffer=True).zero_()`` and
    ``low_latency_clean_mask_buffer()``; the next two rounds are right again (the first masks the
    absent rank again at its wait). Returns this rank's checks (the absent rank: ``"absent"``)."""
    R, rank = world()
    dev = torch.device("cuda", torch.cuda.current_device())
    E = 2 * R
    gone = R - 1
    live = dist.new_group(list(range(R - 1)))  # (collective over the world)
    size = epcomm.Buffer.get_low_latency_rdma_size_hint(M, hidden, R, E)
    buffer = epcomm.Buffer(dist.group.WORLD, num_rdma_bytes=size, low_latency_mode=True, enable_shrink=True,
                           timeout=timeout)

    def round_trip(seed, dropped=()):
        out, xs, topks, ws = _gpu_round_trip(buffer, seed, E, hidden)
        kept = topks[rank].clone()
        for r in dropped:
            kept[(kept // (E // R)) == r] = -1
        want = reference_low_latency_combine(xs[rank], kept, ws[rank], expert_fn, use_fp8=False)
        return bool(torch.allclose(out.float(), want.float(), rtol=2e-2, atol=2e-2))

    seen = [("whole", round_trip(90))]
    dist.barrier()
    if rank == gone:
        time.sleep(6 * timeout + 10)  # away from every call below, its buffer still mapped
        dist.barrier()
        return "absent"
    seen.append(("absent rank masked", round_trip(91, dropped=(gone,))))
    mask = torch.zeros(R, dtype=torch.int32, device=dev)
    buffer.low_latency_query_mask_buffer(mask)
    seen.append(("mask", mask.tolist()))
    torch.cuda.synchronize()
    dist.barrier(group=live)  # (no live rank writes into another's memory while it is zeroed)
    buffer.get_local_buffer_tensor(torch.int8, use_rdma_buffer=True).zero_()
    buffer.low_latency_clean_mask_buffer()
    torch.cuda.synchronize()
    dist.barrier(group=live)
    for seed in (92, 93):
        seen.append((f"after clean {seed}", round_trip(seed, dropped=(gone,))))
    buffer.low_latency_query_mask_buffer(mask)
    seen.append(("mask again", mask.tolist()))
    dist.barrier()
    return seen
