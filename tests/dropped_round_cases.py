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


class _Rounds:
    """Two Buffers of the group (normal mode on ``a``, low latency on ``b``) and one batch per rank
    (routing ``seed``, E = 2R experts, top-2, 8 tokens of 128): ``normal()`` a layout and full
    dispatch on ``a`` (its received rows), ``low_latency()`` a round trip on ``b``."""

    def __init__(self, seed: int, timeout: float):
        self.R, self.rank = world()
        self.a = epcomm.Buffer(dist.group.WORLD, timeout=timeout)
        self.b = epcomm.Buffer(dist.group.WORLD, low_latency_mode=True, timeout=timeout)
        self.E, self.M = 2 * self.R, 8
        self.xs, self.topks, self.ws = make_routing(seed, "uniform", self.R, self.E, 2, self.M, 128,
                                                    fixed_tokens=self.M)

    def normal(self):
        rank, topk = self.rank, self.topks[self.rank]
        args = _layout_args(self.a, topk, self.E)
        return self.a.dispatch(self.xs[rank], topk_idx=topk, topk_weights=self.ws[rank], **args)[0]

    def low_latency(self):
        rank = self.rank
        recv, _, handle, _, _ = self.b.low_latency_dispatch(self.xs[rank], self.topks[rank], self.M, self.E,
                                                            use_fp8=False)
        return self.b.low_latency_combine(recv.to(torch.bfloat16), self.topks[rank], self.ws[rank], handle)[0]

    def bad_topk(self):
        """This rank's top-k with an expert id out of range (get_dispatch_layout rejects it)."""
        bad = self.topks[self.rank].clone()
        bad[0, 0] = self.E + 1
        return bad

    def received_right(self, recv_x) -> bool:
        from epcomm.testing import reference_dispatch
        return torch.equal(recv_x, reference_dispatch(self.xs, self.topks, self.ws, self.E)[self.rank]["recv_x"])


def dropped_round_then_rejected_layout():
    """On two Buffers of the group (normal mode on ``a``, low latency on ``b``): the last rank drops
    a normal round on ``a`` (its peers raise naming ``call``, finding it in the low-latency round on
    ``b``), everyone makes that low-latency round, then the last rank's get_dispatch_layout on ``a``
    rejects its top-k. Its stand-in must meet the peers' dispatch of that layout, so they raise
    naming topk_idx and the rank, and the next round on ``a`` is right on every rank. (Its stand-in
    met the dropped round's given-up call instead, so its next dispatch met the peers' skipped one:
    a disagreement every rank raised, 2026-11-28h; the random sequence found it at seed 100.)"""
    rounds = _Rounds(44, timeout=20)
    rank, one = rounds.rank, rounds.R - 1
    seen = []

    def named(outcome):  # (kind, argument, names the last rank) of an error; ("ok", None, False)
        return (outcome[0], None, False) if outcome[0] == "ok" else (*outcome[:2], f"rank {one}" in outcome[2])

    if rank != one:  # the dropped round: the last rank makes none of its calls
        seen.append(named(_outcome(rounds.normal))[:2])
    rounds.low_latency()  # (values unchecked)
    if rank == one:
        seen.append(named(_outcome(lambda: rounds.a.get_dispatch_layout(rounds.bad_topk(), rounds.E)))[:2])
    else:  # (without the stand-in here this dispatch met the last rank's next one: "ok", with that call's rows)
        seen.append(named(_outcome(rounds.normal)))
    seen.append(("ok", rounds.received_right(rounds.normal())))
    return seen


def dropped_rounds_in_a_row(drops: int = 3, timeout: float = 10.0):
    """Rank 0 drops ``drops`` normal rounds on Buffer ``a`` in a row, each time going on to a
    low-latency round on ``b`` (its peers raise naming ``call`` in each dropped dispatch, finding
    it there), then every rank makes a normal round on ``a``: it pairs and is right on every rank.
    Rank 0 comes back ``drops`` calls behind on ``a``: the verdicts of those calls must still be in
    the store (it waited for deleted ones until its timeout, 2026-11-28h)."""
    rounds = _Rounds(45, timeout)
    seen = []
    for _ in range(drops):
        if rounds.rank != 0:
            seen.append(_outcome(rounds.normal)[:2])
        rounds.low_latency()  # (values unchecked)
    outcome = _outcome(rounds.normal)
    seen.append(("ok", rounds.received_right(outcome[1])) if outcome[0] == "ok" else outcome[:2])
    return seen


def rejected_layout_then_dropped_round(timeout: float = 10.0):
    """Rank 2's layout on Buffer ``a`` rejects its top-k (its next call: a low-latency round on
    ``b``), then it drops a normal round on ``a``; then rank 1 drops a normal round on ``a`` while
    rank 2 takes part. Rank 2's stand-in comes to the first call on ``a`` after its peers sealed it
    void and went two calls on: it must act on that verdict, not read its peers' posts of it (they
    were deleting them: it read an empty post, or waited for a deleted one, 2026-11-28h).
    Returns per rank what each call gave: every error names ``call`` or topk_idx, every
    low-latency round works."""
    rounds = _Rounds(46, timeout)
    rank = rounds.rank
    seen = []
    if rank == 2:
        seen.append(_outcome(lambda: rounds.a.get_dispatch_layout(rounds.bad_topk(), rounds.E))[:2])
    else:
        seen.append(_outcome(rounds.normal)[:2])
    seen.append(_outcome(rounds.low_latency)[0])
    if rank != 2:  # rank 2 drops this round
        seen.append(_outcome(rounds.normal)[:2])
    seen.append(_outcome(rounds.low_latency)[0])
    if rank != 1:  # rank 1 drops this one; rank 2's stand-in first
        seen.append(_outcome(rounds.normal)[:2])
    seen.append(_outcome(rounds.low_latency)[0])
    return seen
