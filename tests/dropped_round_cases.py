"""Rank bodies for the failure-contract tests of dropped rounds (tests/test_failure_contract.py):
a rank that drops whole rounds on one Buffer of the group, going on to another Buffer's call,
then comes back — its calls must pair again with its peers' (the reference backend's call
agreement, store_agreement.py). Each case is a sequence the random two-Buffer fault sequence
(sequence_cases.py) failed on, one pool's seeds after another's."""
from __future__ import annotations

import torch
import torch.distributed as dist

import epcomm
from epcomm.testing.sweeps import make_routing, world
from failure_cases import _layout_args, _outcome


def dropped_round_then_rejected_layout():
    """On two Buffers of the group (normal mode on ``a``, low latency on ``b``): the last rank drops
    a normal round on ``a`` (its peers raise naming ``call``, finding it in the low-latency round on
    ``b``), everyone makes that low-latency round, then the last rank's get_dispatch_layout on ``a``
    rejects its top-k. Its stand-in must meet the peers' dispatch of that layout, so they raise
    naming topk_idx and the rank, and the next round on ``a`` is right on every rank. (Its stand-in
    met the dropped round's given-up call instead, so its next dispatch met the peers' skipped one:
    a disagreement every rank raised, 2026-11-28h; the random sequence found it at seed 100.)"""
    from epcomm.testing import reference_dispatch
    R, rank = world()
    one = R - 1
    a = epcomm.Buffer(dist.group.WORLD, timeout=20)
    b = epcomm.Buffer(dist.group.WORLD, low_latency_mode=True, timeout=20)
    E, M, H = 2 * R, 8, 128
    xs, topks, ws = make_routing(44, "uniform", R, E, 2, M, H, fixed_tokens=M)
    seen = []

    def normal_round(topk=None):
        topk = topks[rank] if topk is None else topk
        return buffer_dispatch(_layout_args(a, topk, E), topk)

    def buffer_dispatch(args, topk):
        return a.dispatch(xs[rank], topk_idx=topk, topk_weights=ws[rank], **args)[0]

    def named(outcome):  # (kind, argument, names the last rank) of an error; ("ok", None, False)
        return (outcome[0], None, False) if outcome[0] == "ok" else (*outcome[:2], f"rank {one}" in outcome[2])

    if rank != one:  # the dropped round: the last rank makes none of its calls
        seen.append(named(_outcome(normal_round))[:2])
    recv, _, handle, _, _ = b.low_latency_dispatch(xs[rank], topks[rank], M, E, use_fp8=False)
    b.low_latency_combine(recv.to(torch.bfloat16), topks[rank], ws[rank], handle)  # (values unchecked)
    bad = topks[rank].clone()
    bad[0, 0] = E + 1
    if rank == one:
        seen.append(named(_outcome(lambda: a.get_dispatch_layout(bad, E)))[:2])
    else:  # (without the stand-in here this dispatch met the last rank's next one: "ok", with that call's rows)
        seen.append(named(_outcome(normal_round)))
    recv_x = normal_round()
    seen.append(("ok", torch.equal(recv_x, reference_dispatch(xs, topks, ws, E)[rank]["recv_x"])))
    return seen


def dropped_rounds_in_a_row(drops: int = 3, timeout: float = 10.0):
    """Rank 0 drops ``drops`` normal rounds on Buffer ``a`` in a row, each time going on to a
    low-latency round on ``b`` (its peers raise naming ``call`` in each dropped dispatch, finding
    it there), then every rank makes a normal round on ``a``: it pairs and is right on every rank.
    Rank 0 comes back ``drops`` calls behind on ``a``: the verdicts of those calls must still be in
    the store (it waited for deleted ones until its timeout, 2026-11-28h)."""
    from epcomm.testing import reference_dispatch
    R, rank = world()
    a = epcomm.Buffer(dist.group.WORLD, timeout=timeout)
    b = epcomm.Buffer(dist.group.WORLD, low_latency_mode=True, timeout=timeout)
    E, M, H = 2 * R, 8, 128
    xs, topks, ws = make_routing(45, "uniform", R, E, 2, M, H, fixed_tokens=M)
    seen = []

    def normal_round():
        args = _layout_args(a, topks[rank], E)
        return a.dispatch(xs[rank], topk_idx=topks[rank], topk_weights=ws[rank], **args)[0]

    for _ in range(drops):
        if rank != 0:
            seen.append(_outcome(normal_round)[:2])
        recv, _, handle, _, _ = b.low_latency_dispatch(xs[rank], topks[rank], M, E, use_fp8=False)
        b.low_latency_combine(recv.to(torch.bfloat16), topks[rank], ws[rank], handle)  # (values unchecked)
    outcome = _outcome(normal_round)
    want = reference_dispatch(xs, topks, ws, E)[rank]["recv_x"]
    seen.append(("ok", torch.equal(outcome[1], want)) if outcome[0] == "ok" else outcome[:2])
    return seen


def rejected_layout_then_dropped_round(timeout: float = 10.0):
    """Rank 2's layout on Buffer ``a`` rejects its top-k (its next call: a low-latency round on
    ``b``), then it drops a normal round on ``a``; then rank 1 drops a normal round on ``a`` while
    rank 2 takes part. Rank 2's stand-in comes to the first call on ``a`` after its peers sealed it
    void and went two calls on: it must act on that verdict, not read its peers' posts of it (they
    were deleting them: it read an empty post, or waited for a deleted one, 2026-11-28h).
    Returns per rank what each call gave: every error names ``call`` or topk_idx, every
    low-latency round works."""
    R, rank = world()
    a = epcomm.Buffer(dist.group.WORLD, timeout=timeout)
    b = epcomm.Buffer(dist.group.WORLD, low_latency_mode=True, timeout=timeout)
    E, M, H = 2 * R, 8, 128
    xs, topks, ws = make_routing(46, "uniform", R, E, 2, M, H, fixed_tokens=M)
    seen = []

    def normal_round():
        args = _layout_args(a, topks[rank], E)
        return a.dispatch(xs[rank], topk_idx=topks[rank], topk_weights=ws[rank], **args)[0]

    def ll_round():
        recv, _, handle, _, _ = b.low_latency_dispatch(xs[rank], topks[rank], M, E, use_fp8=False)
        return b.low_latency_combine(recv.to(torch.bfloat16), topks[rank], ws[rank], handle)[0]

    if rank == 2:
        bad = topks[rank].clone()
        bad[0, 0] = E + 1
        seen.append(_outcome(lambda: a.get_dispatch_layout(bad, E))[:2])
    else:
        seen.append(_outcome(normal_round)[:2])
    seen.append(_outcome(ll_round)[0])
    if rank != 2:  # rank 2 drops this round
        seen.append(_outcome(normal_round)[:2])
    seen.append(_outcome(ll_round)[0])
    if rank != 1:  # rank 1 drops this one; rank 2's stand-in first
        seen.append(_outcome(normal_round)[:2])
    seen.append(_outcome(ll_round)[0])
    return seen
