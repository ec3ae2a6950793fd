"""Rank bodies for the call board's bed tests (tests/test_shared_gpu.py, ``-k call_board``): a rank
left behind in the board's numbers by a stall, a late rank without ``enable_shrink``, and a skipped
combine — each followed by calls that must pair. (Host side: tests/test_call_board_realign.py.)

Why a stall first. A rank that never makes a call its peers made (it stalled, or died; their
Buffer then raises EPTimeoutError, sticky) leaves the group's call board numbers apart: before the
board started them again at every Buffer construction (gpu/call_board.py), that rank's waits in a
fresh Buffer read its peers' *older* calls of the same number as "another call" — EPInputError('call')
where nobody skipped anything, then a resync its peers never join. The bed's tests of one shape share
one group, in file order, so any case after a stalled-rank test ran in that state."""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

import epcomm
from epcomm.testing import reference_combine, reference_low_latency_combine
from epcomm.testing.sweeps import expert_fn, make_routing, world

M, HIDDEN = 8, 512
PEERS_PAUSE_S = 0.05  # the peers come this late to each call after the stall: the stalled rank waits, reads the board


def _outcome(fn):
    """``("ok", value)`` or ``(error class name, argument or peers)``."""
    try:
        return ("ok", fn())
    except epcomm.EPInputError as err:
        return ("EPInputError", err.argument)
    except epcomm.EPTimeoutError as err:
        return ("EPTimeoutError", sorted(err.peers))
    except epcomm.EPError as err:
        return ("EPError", str(err)[:200])


def _device():
    return torch.device("cuda", torch.cuda.current_device())


def _ll_buffer(timeout: float, **kwargs):
    R, _ = world()
    size = epcomm.Buffer.get_low_latency_rdma_size_hint(M, HIDDEN, R, 2 * R)
    return epcomm.Buffer(dist.group.WORLD, num_rdma_bytes=size, low_latency_mode=True, timeout=timeout, **kwargs)


def _ll_round(buffer, seed: int, pause: float = 0.0):
    """One low-latency round trip (experts on the GPU, no host sync between dispatch and combine);
    returns ``(out, want, topk)`` on the CPU."""
    R, rank = world()
    E, dev = 2 * R, _device()
    xs, topks, ws = make_routing(seed, "uniform", R, E, 2, M, HIDDEN, fixed_tokens=M)
    x, topk, w = xs[rank].to(dev), topks[rank].to(dev), ws[rank].to(dev)
    time.sleep(pause)
    recv, _, handle, _, _ = buffer.low_latency_dispatch(x, topk, M, E, use_fp8=False)
    scale = ((rank * (E // R) + torch.arange(E // R, device=dev)).float() + 1) / 8  # (expert_fn)
    time.sleep(pause)
    out = buffer.low_latency_combine((recv.float() * scale[:, None, None]).to(torch.bfloat16), topk, w,
                                     handle)[0].cpu()
    return out, reference_low_latency_combine(xs[rank], topks[rank], ws[rank], expert_fn, use_fp8=False), topks[rank]


def _ll_right(buffer, seed: int, pause: float = 0.0) -> bool:
    out, want, _ = _ll_round(buffer, seed, pause)
    return bool(torch.allclose(out.float(), want.float(), rtol=2e-2, atol=2e-2))


def _normal_round(buffer, seed: int, pause: float = 0.0, fail_after_dispatch: bool = False):
    """One normal-mode round trip (layout, dispatch, combine); True when it matches the reference,
    ``"reported"`` when the GPU finished and reported an error the next call raises (a peer in
    another call: the round's rows are NaN). ``fail_after_dispatch``: the expert code raises."""
    R, rank = world()
    E, dev = 4 * R, _device()
    xs, topks, ws = make_routing(seed, "uniform", R, E, 2, M, HIDDEN, fixed_tokens=M)
    x, topk, w = xs[rank].to(dev), topks[rank].to(dev), ws[rank].to(dev)
    time.sleep(pause)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk, E)
    recv_x, _, recv_w, _, handle, _ = buffer.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                      num_tokens_per_expert=per_expert, topk_idx=topk, topk_weights=w)
    if fail_after_dispatch:
        raise RuntimeError("expert code failed")
    time.sleep(pause)
    combined = buffer.combine(recv_x, handle, topk_weights=recv_w)[0]
    torch.cuda.synchronize()
    if any(member.mailbox.view[0] != 0 for member in buffer._backend.seat.board.members()):
        return "reported"
    want = reference_combine(xs[rank], topks[rank], E, R, lambda j, rows: rows)
    return bool(torch.allclose(combined.float().cpu(), want.float(), rtol=1e-2, atol=1e-2))


def stall(timeout: float = 1.5) -> str:
    """The last rank never makes a low-latency round its peers make, on a Buffer of its own (a
    stalled rank): their waits give up and their next call raises EPTimeoutError naming it (the
    Buffer is broken, by design). Every rank then destroys that Buffer. Returns what this rank saw:
    ``"absent"`` (the last rank) or the peers' error class."""
    R, rank = world()
    stalled = _ll_buffer(timeout)
    seen = "absent"
    if rank != R - 1:
        first = _outcome(lambda: _ll_right(stalled, 70))
        torch.cuda.synchronize()
        second = first if first[0] != "ok" else _outcome(lambda: _ll_right(stalled, 71))
        seen = second[0] if second[0] != "EPTimeoutError" or R - 1 in second[1] else f"{second}"
    dist.barrier()
    stalled.destroy()
    return seen


def fresh_buffers_after_a_stall():
    """A stall (:func:`stall`), then a low-latency and a normal Buffer made by every rank: every
    round on them pairs and is right on every rank, the stalled rank's waits included (the peers
    come 50 ms late to each call, so it waits and reads the board). Returns ``(stall outcome,
    [round outcomes])``."""
    stalled = stall()
    low_latency, normal = _ll_buffer(10.0), epcomm.Buffer(dist.group.WORLD, num_nvl_bytes=64 << 20, timeout=10.0)
    R, rank = world()
    pause = PEERS_PAUSE_S if rank != R - 1 else 0.0
    rounds = [_outcome(lambda: _ll_right(low_latency, 72, pause)), _outcome(lambda: _normal_round(normal, 73, pause)),
              _outcome(lambda: _ll_right(low_latency, 74, pause)), _outcome(lambda: _normal_round(normal, 75, pause))]
    torch.cuda.synchronize()
    dist.barrier()
    low_latency.destroy()
    normal.destroy()
    return stalled, rounds


def late_rank_then_fresh_buffer(timeout: float = 3.0):
    """After a stall (:func:`stall`), a low-latency Buffer without ``enable_shrink``; after a warm
    round the last rank comes ``timeout + 2`` s late to a round trip. The peers' rows that needed it
    are NaN (or their call raises), and every rank's next call raises EPTimeoutError — the peers
    naming the late rank, the late rank naming peers whose call it missed (never the call board's
    EPInputError('call'), which asked for a resync its peers, their Buffer broken, never join).
    Then a fresh Buffer: two rounds right on every rank. Returns ``(stall, warm, late round,
    next call, [fresh rounds])``."""
    stalled = stall()
    R, rank = world()
    late = R - 1
    buffer = _ll_buffer(timeout)
    warm = _outcome(lambda: _ll_right(buffer, 80))
    dist.barrier()
    if rank == late:
        time.sleep(timeout + 2)
    late_round = _outcome(lambda: _ll_round(buffer, 81))
    if late_round[0] == "ok":
        out, want, topk = late_round[1]
        if rank == late:
            late_round = ("ok", "late rank: some rows NaN" if bool(out.float().isnan().any()) else "no NaN row")
        else:
            lost = ((topk // 2) == late).any(dim=1)
            right = bool(lost.any()) and bool(out[lost].float().isnan().all()) and \
                bool(torch.allclose(out[~lost].float(), want[~lost].float(), rtol=2e-2, atol=2e-2))
            late_round = ("ok", "lost rows NaN, the rest right" if right else "wrong rows")
    following = _outcome(lambda: _ll_right(buffer, 82))
    torch.cuda.synchronize()
    dist.barrier()
    buffer.destroy()
    fresh = _ll_buffer(10.0)
    rounds = [_outcome(lambda: _ll_right(fresh, 83)), _outcome(lambda: _ll_right(fresh, 84))]
    torch.cuda.synchronize()
    dist.barrier()
    fresh.destroy()
    return stalled, warm, late_round, following, rounds


def skipped_combine_costs_one_error(after_stall: bool, steps: int = 4, timeout: float = 10.0):
    """Rank 1's expert code raises after a dispatch, so it skips the combine its peers make (one
    normal Buffer; ``after_stall``: a :func:`stall` first). Returns per step ``(outcome, seconds)``:
    ``"expert code"``, ``"reported"`` (the combine's rows NaN, its error at the next call), an
    error, or ``("ok", right)``. Judged by :func:`judge_one_error_per_rank`."""
    stalled = stall() if after_stall else None
    R, rank = world()
    buffer = epcomm.Buffer(dist.group.WORLD, num_nvl_bytes=64 << 20, timeout=timeout)
    _normal_round(buffer, 90)  # compiles every kernel of the shape first: the steps below time the calls
    torch.cuda.synchronize()
    dist.barrier()
    seen = []
    for step in range(steps):
        started = time.monotonic()
        try:
            outcome = _outcome(lambda: _normal_round(buffer, 91 + step, fail_after_dispatch=step == 0 and rank == 1))
            outcome = ("reported",) if outcome == ("ok", "reported") else outcome
        except RuntimeError as err:
            outcome = ("expert code", str(err)[:100])
        seen.append((outcome, round(time.monotonic() - started, 2)))
    torch.cuda.synchronize()
    dist.barrier()
    buffer.destroy()
    return stalled, seen


def judge_one_error_per_rank(results, timeout: float = 10.0) -> None:
    """Every rank raised one EPInputError('call') for the skip, well before the timeout (rank 1 its
    own expert error first; the peers after a combine whose rows the GPU reported as not valid),
    and every step after that error pairs and is right."""
    for rank, (_, steps) in enumerate(results):
        outcomes = [outcome for outcome, _ in steps]
        errors = [i for i, outcome in enumerate(outcomes) if outcome[0] not in ("ok", "reported", "expert code")]
        assert len(errors) == 1 and outcomes[errors[0]] == ("EPInputError", "call"), (rank, steps)
        first = errors[0]
        assert first <= 1 and steps[first][1] < timeout / 3, (rank, steps)
        before = [outcome[0] for outcome in outcomes[:first]]
        assert before == (["expert code"] if rank == 1 else ["reported"] if first == 1 else []), (rank, steps)
        assert outcomes[first + 1:] == [("ok", True)] * (len(steps) - first - 1), (rank, steps)
