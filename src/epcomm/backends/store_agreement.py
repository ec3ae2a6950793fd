"""Collective agreement through the process group's store (used by the ``torch_dist`` backend).

Before a call exchanges anything, every rank posts a fingerprint of it — the call kind and the
arguments all ranks must agree on (hidden size, dtype, top-k width, expert count, ...) — under
``epcomm/<buffer>/<call number>/<rank>``, then waits, bounded by the timeout, for every peer's key
and compares. What this turns into errors, on every rank:

- ranks that disagree → :class:`EPInputError` naming the argument and the ranks;
- a rank that rejected its own input posts an *abort* fingerprint naming the argument → every
  rank raises :class:`EPInputError` for it, instead of pairing with the wrong call;
- a rank that never arrives (stalled, crashed, skipped the call) → :class:`EPTimeoutError` naming it.

Keys of call ``n - 2`` are deleted at call ``n``: by then every rank has read them (a rank posts
call ``n - 1`` only after it finished reading call ``n - 2``).

**A rank that skipped a call.** A rank whose wait lasts past a first 0.1 s posts where it waits
(``epcomm/<group>/at/<rank>``: which Buffer's agreement, which call, which kind, and the call's
first arrival in one group-wide order). A wait whose missing rank waits at a call this rank never
made — another Buffer's, or one this rank has not reached — can never end: the two wait for each
other. One of them gives way — the one more ranks wait in when every rank waits in one of the two
(the fewer skipped a call), else the one waited in longer: its ranks raise :class:`EPInputError`
(argument ``"call"``) naming the ranks and both calls, instead of waiting out the timeout, and seal it *void*
(each call's verdict — made or void — is one compare-and-set in the store, so every rank acts on
the same one). A rank arriving later at a call void for it takes the next call number, so the
other call meets the ranks' next one and they pair again.
"""
from __future__ import annotations

import datetime
import itertools
import json
import time
from typing import Dict, Optional, Sequence, Tuple

import torch.distributed as dist

from ..errors import EPError, EPInputError, EPTimeoutError

_buffer_numbers: Dict[str, itertools.count] = {}
# calls made per agreement prefix, in this process: "has this rank made call c of prefix p?"
_calls_made: Dict[str, int] = {}
# A wait for peers looks for missing ranks waiting at another call after a first 0.1 s, then once a
# second (StoreAgreement._wait_for, _check_elsewhere).
_FIRST_SLICE_S, _WAIT_SLICE_S = 0.1, 1.0
_FIRST_PAUSE_S, _MAX_PAUSE_S = 0.0005, 0.05  # the polling pauses of a wait


class StoreAgreement:
    """Per-buffer call agreement over ``group``'s store. Collective: every rank constructs it in
    the same order (Buffer construction), which numbers buffers identically on all ranks."""

    def __init__(self, group: dist.ProcessGroup, timeout_s: float):
        self.rank = dist.get_rank(group)
        self.num_ranks = dist.get_world_size(group)
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.timeout_s = timeout_s
        self.store = dist.distributed_c10d._get_default_store()
        name = group.group_name
        number = next(_buffer_numbers.setdefault(name, itertools.count()))
        self.prefix = f"epcomm/{name}/{number}"
        self.number = number
        self._where_key = f"epcomm/{name}/at/{self.rank}"
        self._where_prefix = f"epcomm/{name}/at"
        self._waiting_at: Optional[Tuple[int, str]] = None  # the (call, kind) _post_where posted last
        self._first_arrival = 0
        self.calls = 0

    @property
    def calls(self) -> int:
        return _calls_made.get(self.prefix, 0)

    @calls.setter
    def calls(self, value: int) -> None:
        _calls_made[self.prefix] = value

    def _key(self, call: int, rank: int) -> str:
        return f"{self.prefix}/{call}/{rank}"

    def agree(self, kind: str, fingerprint: Optional[Sequence[Tuple[str, object]]],
              error: Optional[EPInputError] = None, rank_mask=None, stand_in: bool = False) -> None:
        """Post this rank's fingerprint (``(argument, value)`` pairs) or, with ``error``, an abort
        naming the rejected argument; return once every rank posted the same fingerprint.

        ``rank_mask`` (low-latency calls, ``[R]`` int32, nonzero = masked): masked ranks are not
        waited for, and a rank that does not arrive in time is masked there instead of raising. A
        rank that a peer masked is masked here too (the masks stay one), and raises itself.

        ``stand_in``: this abort stands in for a call this rank skipped (Buffer: a rejected layout);
        if the peers already gave that call up (this rank was found waiting on another Buffer), there
        is nothing left to stand in for: return without posting."""
        while not self._agree_once(kind, fingerprint, error, rank_mask):
            if stand_in:
                return
            # that call number was given up by the peers while this rank was elsewhere: the next one

    def _agree_once(self, kind, fingerprint, error, rank_mask) -> bool:
        """One call number; False when it is void for this rank (it skipped it: take the next)."""
        call = self.calls
        self.calls += 1
        masked = set() if rank_mask is None else {r for r, m in enumerate(rank_mask.tolist()) if m}
        if error is not None:
            mine = {"kind": kind, "abort": [error.argument, str(error)]}
        else:
            mine = {"kind": kind, "fields": [[name, repr(value)] for name, value in fingerprint]}
        if masked:
            mine["masked"] = sorted(masked)
        self.store.set(self._key(call, self.rank), json.dumps(mine))
        if call >= 2:
            self.store.delete_key(self._key(call - 2, self.rank))
        present = [r for r in range(self.num_ranks) if r not in masked or r == self.rank]
        others = [self._key(call, r) for r in present if r != self.rank]
        if others:
            while True:
                try:
                    missing = self._wait_for(kind, call, [r for r in present if r != self.rank])
                    break
                except _Desync as desync:
                    # first verdict wins: void (the missing ranks are elsewhere) unless every post
                    # arrived meanwhile and a peer sealed the call as made (then wait on: it ends)
                    verdict = desync.verdict or self._seal(call, {"void_for": desync.ranks, "message": desync.message})
                    if "void_for" in verdict:
                        if self.rank in verdict["void_for"]:
                            return False
                        raise EPInputError("call", verdict["message"]) from None
            if missing:
                if rank_mask is None:
                    raise EPTimeoutError(f"rank {self.rank}: {kind} waited {self.timeout_s:g} s for ranks {missing}, "
                                         f"which did not make the call (stalled, exited, or skipped it)",
                                         missing) from None
                rank_mask[missing] = 1  # low-latency mode goes on without them
                present = [r for r in present if r not in missing]
            verdict = self._seal(call, {"made": True})
            if "void_for" in verdict:
                if self.rank in verdict["void_for"]:
                    return False  # this rank was elsewhere when its peers gave this call up: the next one
                raise EPInputError("call", verdict["message"])
        posts = {r: json.loads(self.store.get(self._key(call, r))) for r in present}
        masked_me = [] if self.rank in masked else \
            sorted(r for r, post in posts.items() if self.rank in post.get("masked", ()))
        if masked_me:  # they go on without this rank, which thinks it takes part: it would exchange with nobody
            raise EPError(f"rank {self.rank}: {kind}: ranks {masked_me} masked this rank (a wait for it timed out "
                          f"there), so its low-latency calls no longer pair with theirs: unmask it on every rank "
                          f"(low_latency_update_mask_buffer, then clean_low_latency_buffer) or mask them here too")
        if rank_mask is not None:  # a rank any peer masked takes no part (it raises above): mask it here too
            adopted = sorted({r for post in posts.values() for r in post.get("masked", ())} - masked - {self.rank})
            if adopted:
                rank_mask[adopted] = 1
                posts = {r: post for r, post in posts.items() if r not in adopted}
        _raise_on_disagreement(kind, posts)
        return True


    def _seal(self, call: int, verdict: dict) -> dict:
        """The call's verdict — made, or void for the ranks that were elsewhere — the first one
        any rank posts (an atomic compare-and-set in the store); every rank acts on the same one."""
        key = f"{self.prefix}/{call}/verdict"
        if call >= 2:
            self.store.delete_key(f"{self.prefix}/{call - 2}/verdict")
        return json.loads(self.store.compare_set(key, "", json.dumps(verdict)))

    def _wait_for(self, kind: str, call: int, peers: Sequence[int]) -> list:
        """Wait, bounded by the timeout, for ``peers``' posts of ``call``; returns those still missing.

        It polls the store (``check``, which never blocks) with a growing pause, from half a
        millisecond to 50 ms: a blocking ``store.wait`` that times out makes PyTorch's store client
        log a warning per slice, which reached the users' stderr twice a second while a peer was
        late. About once a second it also looks for a missing rank waiting elsewhere
        (:meth:`_check_elsewhere`). If the store itself goes away meanwhile (its host, rank 0 of the
        group, reached its own timeout and exited), the error still names the ranks this one was
        waiting for."""
        deadline = time.monotonic() + self.timeout_s
        missing, pause = list(peers), _FIRST_PAUSE_S
        next_look = time.monotonic() + _FIRST_SLICE_S
        while True:
            try:
                missing = [r for r in missing if not self.store.check([self._key(call, r)])]
            except Exception as err:  # a dead store
                raise EPTimeoutError(f"rank {self.rank}: {kind}: the process group's store became unreachable "
                                     f"(its host rank exited?) while this rank waited for ranks {missing}, "
                                     f"which had not made the call: {str(err).splitlines()[0][:200]}",
                                     missing) from None
            if not missing:
                return []
            now = time.monotonic()
            if now >= next_look:
                if self._waiting_at != (call, kind):
                    self._post_where(kind, call)  # peers waiting as long post theirs now too:
                    next_look = now + _FIRST_SLICE_S  # look again soon
                else:
                    next_look = now + _WAIT_SLICE_S
                self._check_elsewhere(kind, call, missing, len(peers) + 1)
            if now >= deadline:
                return missing
            time.sleep(min(pause, max(deadline - now, 0.0)))
            pause = min(pause * 2, _MAX_PAUSE_S)

    def _post_where(self, kind: str, call: int) -> None:
        """Post where this rank waits, once per call and only when a wait lasts (the fast path
        posts nothing): the call, its kind, and the call's first arrival in the group's one
        arrival order — of two calls that wait for each other, the one waited in longer gives way.
        A peer reading an older post of this rank finds a call it made: no false alarm."""
        arrival = int(self.store.add(f"{self._where_prefix}/arrivals", 1))
        self._first_arrival = int(self.store.compare_set(f"{self.prefix}/{call}/first", "", str(arrival)))
        self.store.set(self._where_key, json.dumps([self.prefix, self.number, call, kind, self._first_arrival]))
        if call >= 2:
            self.store.delete_key(f"{self.prefix}/{call - 2}/first")
        self._waiting_at = (call, kind)

    def _gives_way(self, num_ranks: int, num_missing: int, their_prefix: str, their_call: int, mine: int,
                   their_first: int) -> bool:
        """Of this call and the one a missing rank waits in (each waiting for the other), does this
        one give way? Decided only once every rank waits in one of the two (then both sides count
        the same ranks): the call more ranks wait in — the fewer ranks are the ones that skipped a
        call (one rank whose code raised, the usual case), so their call goes on and the call they
        skipped is given up, whoever got there first; on a tie, the call waited in longer (the
        arrival order is one for all). While ranks are still on their way, not yet: a rank that
        drops a whole step reaches its next call before its peers reach the dropped one."""
        here = num_ranks - num_missing  # (num_ranks: the ranks taking part; masked ones do not)
        there = _count_posts(self.store, their_prefix, their_call, self.num_ranks)
        if here + there != num_ranks:
            return False
        return here > there if here != there else mine < their_first

    def _check_elsewhere(self, kind: str, call: int, missing: Sequence[int], num_ranks: int) -> None:
        """Raise :class:`_Desync` if this call was given up (a peer sealed it void) or if a missing
        rank waits at a call this rank never made — it can only be waiting for this rank there, as
        this rank waits for it here — and this call was waited in longer, so it gives way (the
        other call then meets this rank's next one)."""
        try:
            sealed = self.store.check([f"{self.prefix}/{call}/verdict"])
            verdict = json.loads(self.store.get(f"{self.prefix}/{call}/verdict")) if sealed else {}
        except Exception:
            verdict = {}
        if "void_for" in verdict:
            raise _Desync(verdict["void_for"], verdict["message"], verdict)
        mine = self._first_arrival
        elsewhere = {}
        for r in missing:
            key = f"{self._where_prefix}/{r}"
            try:
                if not self.store.check([key]):
                    continue
                prefix, number, their_call, their_kind, their_first = json.loads(self.store.get(key))
            except Exception:
                continue
            if (prefix, their_call) != (self.prefix, call) and _calls_made.get(prefix, 0) <= their_call \
                    and self._gives_way(num_ranks, len(missing), prefix, their_call, mine, their_first):
                elsewhere[r] = (number, their_call, their_kind)
        if elsewhere:
            theirs = "; ".join(f"rank {r} waits in {k} (Buffer #{n}, call {c})" for r, (n, c, k) in sorted(elsewhere.items()))
            # void for every rank that has not made this call yet: arriving here, each takes the next
            raise _Desync(sorted(missing),
                          f"ranks are in different calls: rank {self.rank} waits in {kind} (Buffer #{self.number}, "
                          f"call {call}); {theirs}, a call rank {self.rank} did not make: a rank skipped a call its "
                          f"peers made. Every rank raises; each one's next call pairs again")


def _count_posts(store, prefix: str, call: int, num_ranks: int) -> int:
    """How many ranks posted their fingerprint of ``call`` under ``prefix`` (wait there, or passed)."""
    try:
        return sum(1 for r in range(num_ranks) if store.check([f"{prefix}/{call}/{r}"]))
    except Exception:
        return 0


class _Desync(Exception):
    def __init__(self, ranks, message: str, verdict: Optional[dict] = None):
        super().__init__(message)
        self.ranks, self.message, self.verdict = ranks, message, verdict


class StoreRendezvous:
    """A host barrier over ``group``'s store, bounded by the timeout: :class:`EPTimeoutError` names
    the ranks that did not arrive (a ``dist.barrier`` would wait for the process group's own,
    much longer timeout and name nobody). Collective to construct, like :class:`StoreAgreement`."""

    def __init__(self, group: dist.ProcessGroup, timeout_s: float):
        self._agreement = StoreAgreement(group, timeout_s)

    def __call__(self, what: str) -> None:
        self._agreement.agree(what, ())


def _raise_on_disagreement(kind: str, posts: Dict[int, dict]) -> None:
    aborts = {r: p["abort"] for r, p in posts.items() if "abort" in p}
    if aborts:
        rank, (argument, message) = min(aborts.items())
        raise EPInputError(argument, f"rank {rank} rejected its {kind} call ({message}); every rank raises, "
                                     f"ranks {sorted(aborts)} rejected theirs")
    kinds = {r: p["kind"] for r, p in posts.items()}
    if len(set(kinds.values())) > 1:
        raise EPInputError("call", f"ranks are in different calls: {_by_value(kinds)}")
    fields = {r: dict(p["fields"]) for r, p in posts.items()}
    names = [name for name, _ in posts[min(posts)]["fields"]]
    for name in names:
        values = {r: f.get(name) for r, f in fields.items()}
        if len(set(values.values())) > 1:
            raise EPInputError(name, f"ranks disagree in {kind}: {_by_value(values)}")


def _by_value(values: Dict[int, object]) -> str:
    groups: Dict[object, list] = {}
    for rank, value in sorted(values.items()):
        groups.setdefault(value, []).append(rank)
    return "; ".join(f"ranks {ranks}: {value}" for value, ranks in groups.items())
