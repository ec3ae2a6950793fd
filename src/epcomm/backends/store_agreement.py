"""Collective agreement through the process group's store (used by the ``torch_dist`` backend).

Before a call exchanges anything, every rank posts a fingerprint of it — the call kind and the
arguments all ranks must agree on (hidden size, dtype, top-k width, expert count, ...) — under
``epcomm/<buffer>/<call number>/<rank>``, then waits, bounded by the timeout, for every peer's key
and compares. What this turns into errors, on every rank:

- ranks that disagree → :class:`EPInputError` naming the argument and the ranks;
- a rank that rejected its own input posts an *abort* fingerprint naming the argument → every
  rank raises :class:`EPInputError` for it, instead of pairing with the wrong call;
- a rank that never arrives (stalled, crashed, skipped the call) → :class:`EPTimeoutError` naming it,
  on every rank that waited and on the late rank itself when it comes: the wait that gave up seals
  the call *late*, nothing is exchanged, and every rank's next call pairs again. Under a rank mask
  (low-latency calls with ``enable_shrink``) the late rank is masked instead and the call goes on;
- two kinds of call at one number (a rank skipped a combine its peers are in, and its next call
  met their combine) → the call is void for the ranks that skipped (their call takes the next
  number) and the others raise :class:`EPInputError` naming ``call``: one error per rank.

Keys of call ``n - 2`` are deleted at call ``n``: by then every rank has read them (a rank posts
call ``n - 1`` only after it finished reading call ``n - 2``).

**A rank that skipped a call.** A rank whose wait lasts past a first 0.1 s posts where it waits
(``epcomm/<group>/at/<rank>``: which Buffer's agreement, which call, which kind, and the call's
first arrival in one group-wide order). A wait whose missing rank waits at a call this rank never
made — another Buffer's, or one this rank has not reached — can never end: the two wait for each
other. One of them gives way — the one more ranks wait in when every rank waits in one of the two
(the fewer skipped a call), else the one waited in longer: its ranks raise :class:`EPInputError`
(argument ``"call"``) naming the ranks and both calls, instead of waiting out the timeout, and seal it *void*
(each call's verdict — made, masked, late or void — is one compare-and-set in the store, so every
rank acts on the same one). A rank arriving later at a call void for it takes the next call number, so the
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
# A call's verdict stays in the store for this many later calls of its Buffer: a rank that dropped
# several calls in a row (each given up while it was in another Buffer's call) finds their verdicts
# when it comes back, and passes them (StoreAgreement._posts_of reads a call's verdict first). With
# two kept, a rank three calls behind waited for verdicts and posts already deleted, until its
# timeout (2026-11-28h).
_KEPT_VERDICTS = 1024


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

        ``rank_mask`` (low-latency calls of a Buffer made with ``enable_shrink``, ``[R]`` int32,
        nonzero = masked): masked ranks are not waited for, and a rank that does not arrive in time
        is masked there instead of raising. A rank that a peer masked is masked here too (the masks
        stay one), and raises itself. Without ``rank_mask`` a rank that does not arrive in time is
        an :class:`EPTimeoutError` on every rank, the late one included when it comes.

        ``stand_in``: this abort stands in for a call this rank skipped (Buffer: a rejected layout);
        if the peers already gave that call up (this rank was found waiting on another Buffer), there
        is nothing left to stand in for: return without posting. A call number already given up
        for this rank is passed at once (its verdict is read before any wait: :meth:`_posts_of`)."""
        while not self._agree_once(kind, fingerprint, error, rank_mask):
            if stand_in:
                return
            # that call number was given up by the peers while this rank was elsewhere: the next one

    def pass_given_up(self) -> None:
        """Take, without posting, the call numbers whose verdict is already sealed void for this
        rank: calls its peers gave up while it was elsewhere (it dropped them), which its next call
        would otherwise post and pass one by one. Buffer calls it (backend.pass_given_up_calls)
        when a rejected layout makes this rank skip a call: its stand-in (``agree(..., stand_in=True)``) then meets the call it skips,
        where without this it met an older given-up call, took it for the skipped one and posted
        nothing, and the rank's next call met the skipped one (2026-11-28h: a drop, then a rejected
        layout on the same Buffer). A given-up call whose verdict is not sealed yet is left: the
        peers are still in it, and the stand-in meets it."""
        while True:
            verdict = self._sealed_verdict(self.calls)
            if self.rank not in verdict.get("void_for", ()):
                return
            if self.calls >= 2:
                self.store.delete_key(self._key(self.calls - 2, self.rank))  # (as a post of this number would)
            self.calls += 1

    def _agree_once(self, kind, fingerprint, error, rank_mask) -> bool:
        """One call number; False when it is void for this rank (it skipped it: take the next).

        Every call that waits for peers ends in one verdict, sealed by the first rank that reaches
        one (:meth:`_seal`) and acted on by every rank alike (:meth:`_act_on`): made (with the
        ranks masked for not arriving, under a rank mask), void for the ranks that skipped a call,
        or late — the ranks that did not arrive in time, an error on every rank."""
        call = self.calls
        self.calls += 1
        masked = set() if rank_mask is None else {r for r, m in enumerate(rank_mask.tolist()) if m}
        if error is not None:
            mine = {"kind": kind, "abort": [error.argument, str(error)]}
        else:
            mine = {"kind": kind, "fields": [[name, repr(value)] for name, value in fingerprint]}
        if masked:
            mine["masked"] = sorted(masked)
        mine["t"] = time.time()  # (breaks a tie between two calls met at one number: _skip_verdict)
        self.store.set(self._key(call, self.rank), json.dumps(mine))
        if call >= 2:
            self.store.delete_key(self._key(call - 2, self.rank))
        present = [r for r in range(self.num_ranks) if r not in masked or r == self.rank]
        try:
            posts = self._posts_of(kind, call, mine, present, rank_mask)
        except _Void:
            return False  # this rank was elsewhere when its peers gave this call up: the next one
        masked_me = [] if self.rank in masked else \
            sorted(r for r, post in posts.items() if self.rank in post.get("masked", ()))
        if masked_me:  # they go on without this rank, which thinks it takes part: it would exchange with nobody
            raise _masked_error(self.rank, kind, masked_me)
        if rank_mask is not None:  # a rank any peer masked takes no part (it raises above): mask it here too
            adopted = sorted({r for post in posts.values() for r in post.get("masked", ())} - masked - {self.rank})
            if adopted:
                rank_mask[adopted] = 1
                posts = {r: post for r, post in posts.items() if r not in adopted}
        _raise_on_disagreement(kind, posts)
        return True

    def _posts_of(self, kind: str, call: int, mine: dict, present: list, rank_mask) -> Dict[int, dict]:
        """Wait for the posts of ``present`` (the ranks not masked, this one included) and seal the
        call's verdict; returns the posts of the ranks that take part. Raises what the verdict says
        (:meth:`_act_on`); :class:`_Void` when the call is void for this rank."""
        if len(present) == 1:
            return {self.rank: mine}
        sealed = self._sealed_verdict(call)
        if "void_for" in sealed:  # given up before this rank came (a stand-in's call): the posts may be gone
            if self.rank in sealed["void_for"]:
                raise _Void()
            raise EPInputError("call", sealed["message"])
        while True:
            try:
                missing, verdict = self._wait_for(kind, call, [r for r in present if r != self.rank])
                break
            except _Desync as desync:
                # first verdict wins: void (the missing ranks are elsewhere) unless every post
                # arrived meanwhile and a peer sealed the call as made (then wait on: it ends)
                verdict = desync.verdict or self._seal(call, {"void_for": desync.ranks, "message": desync.message})
                if "void_for" in verdict:
                    if self.rank in verdict["void_for"]:
                        raise _Void() from None
                    raise EPInputError("call", verdict["message"]) from None
        if verdict is None and missing:  # this wait gave up: masked (shrink) or late, unless a peer saw them
            verdict = self._seal(call, {"made": True, "masked": missing} if rank_mask is not None else
                                 {"late": missing, "waiter": self.rank, "kind": kind, "seen": self._last_seen(missing)})
        if verdict is not None:
            present = self._act_on(verdict, kind, call, present, rank_mask)
            unposted = [r for r in present if not self.store.check([self._key(call, r)])]
            if unposted:  # (a peer whose mask differed sealed it: these are late here)
                raise EPTimeoutError(f"rank {self.rank}: {kind}: ranks {unposted} did not make the call in time",
                                     unposted)
        posts = {r: json.loads(self.store.get(self._key(call, r))) for r in present}
        if verdict is None:  # every post is here: made, or void for the ranks that skipped a call
            verdict = self._seal(call, _skip_verdict(kind, posts) or {"made": True})
            present = self._act_on(verdict, kind, call, present, rank_mask)
            posts = {r: post for r, post in posts.items() if r in present}
        return posts

    def _act_on(self, verdict: dict, kind: str, call: int, present: list, rank_mask) -> list:
        """Act on a call's sealed verdict; returns the ranks taking part in it (``present`` less the
        ranks masked for not arriving). Raises for a void call this rank made, a late call (every
        rank: the ranks waited for, and the late ranks when they come), or a call that masked this
        rank; a void call this rank did not make raises :class:`_Void` (it takes the next number)."""
        if "void_for" in verdict:
            if self.rank in verdict["void_for"]:
                raise _Void()
            raise EPInputError("call", verdict["message"])
        if "late" in verdict:
            late = verdict["late"]
            if self.rank in late:
                raise EPTimeoutError(f"rank {self.rank}: {kind} (call {call}) came after rank {verdict['waiter']} gave up "
                                     f"waiting for ranks {late} ({self.timeout_s:g} s): the call is void on every rank, "
                                     f"and each rank's next call pairs again", late)
            raise EPTimeoutError(f"rank {self.rank}: {kind} (call {call}) waited for ranks {late}, which did not make "
                                 f"the call within {self.timeout_s:g} s (stalled, exited, or skipped it); no data was "
                                 f"exchanged" + (f". {verdict['seen']}" if verdict.get("seen") else ""), late)
        gone = verdict.get("masked", ())
        if gone:
            if self.rank in gone:  # the peers went on without this rank
                raise _masked_error(self.rank, kind, sorted(set(present) - set(gone)))
            if rank_mask is None:  # (ranks agree on enable_shrink: a Buffer's setting is everyone's)
                raise EPTimeoutError(f"rank {self.rank}: {kind}: ranks {list(gone)} did not arrive in time", gone)
            rank_mask[list(gone)] = 1  # low-latency mode goes on without them (enable_shrink)
        return [r for r in present if r not in gone]

    def _sealed_verdict(self, call: int) -> dict:
        """The verdict sealed for ``call`` so far; empty if none (or the store is gone)."""
        key = f"{self.prefix}/{call}/verdict"
        try:
            return json.loads(self.store.get(key)) if self.store.check([key]) else {}
        except Exception:
            return {}

    def _seal(self, call: int, verdict: dict) -> dict:
        """The call's verdict — made, or void for the ranks that were elsewhere — the first one
        any rank posts (an atomic compare-and-set in the store); every rank acts on the same one."""
        key = f"{self.prefix}/{call}/verdict"
        if call >= _KEPT_VERDICTS:
            self.store.delete_key(f"{self.prefix}/{call - _KEPT_VERDICTS}/verdict")
        return json.loads(self.store.compare_set(key, "", json.dumps(verdict)))

    def _wait_for(self, kind: str, call: int, peers: Sequence[int]) -> Tuple[list, Optional[dict]]:
        """Wait, bounded by the timeout, for ``peers``' posts of ``call``; returns ``(those still
        missing, None)``, or ``(missing, verdict)`` as soon as a peer sealed the call meanwhile (it
        gave up waiting, or masked a rank: this rank need not wait out its own timeout).

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
                return [], None
            now = time.monotonic()
            if now >= next_look:
                if self._waiting_at != (call, kind):
                    self._post_where(kind, call)  # peers waiting as long post theirs now too:
                    next_look = now + _FIRST_SLICE_S  # look again soon
                else:
                    next_look = now + _WAIT_SLICE_S
                verdict = self._check_elsewhere(kind, call, missing, len(peers) + 1)
                if verdict:
                    return missing, verdict
            if now >= deadline:
                return missing, None
            time.sleep(min(pause, max(deadline - now, 0.0)))
            pause = min(pause * 2, _MAX_PAUSE_S)

    def _last_seen(self, ranks: Sequence[int]) -> str:
        """Where ``ranks`` last waited, from their posts of where a wait lasted (:meth:`_post_where`),
        for a late call's error: a rank waiting in another call, or in an older one of this Buffer,
        tells a skipped or stalled call apart from an exited process."""
        seen = []
        for r in ranks:
            key = f"{self._where_prefix}/{r}"
            try:
                post = json.loads(self.store.get(key)) if self.store.check([key]) else None
            except Exception:  # (a dead store: nothing to tell)
                post = None
            seen.append(f"rank {r} last waited in {post[3]} (Buffer #{post[1]}, call {post[2]})" if post else
                        f"rank {r} has not waited long in any call")
        return "; ".join(seen)

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

    def _check_elsewhere(self, kind: str, call: int, missing: Sequence[int], num_ranks: int) -> dict:
        """The call's verdict if a peer sealed it (made, masked or late; empty if none). Raise
        :class:`_Desync` if this call was given up (a peer sealed it void) or if a missing
        rank waits at a call this rank never made — it can only be waiting for this rank there, as
        this rank waits for it here — and this call was waited in longer, so it gives way (the
        other call then meets this rank's next one)."""
        verdict = self._sealed_verdict(call)
        if "void_for" in verdict:
            raise _Desync(verdict["void_for"], verdict["message"], verdict)
        if verdict:
            return verdict
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
        return {}


def _count_posts(store, prefix: str, call: int, num_ranks: int) -> int:
    """How many ranks posted their fingerprint of ``call`` under ``prefix`` (wait there, or passed)."""
    try:
        return sum(1 for r in range(num_ranks) if store.check([f"{prefix}/{call}/{r}"]))
    except Exception:
        return 0


class _Void(Exception):
    """The call is void for this rank (its peers gave it up while this rank was in another call,
    or this rank's call met theirs at one number after it skipped one): it takes the next number."""


def _skip_verdict(kind: str, posts: Dict[int, dict]) -> Optional[dict]:
    """Two kinds of call met at one call number (and no rank aborted): the ranks of one skipped a
    call the others are in — the fewer ranks, as one rank whose expert code raised skips its
    combine; on a tie, the call posted later. The call is void for them (their call takes the next
    number and pairs with the others' next call) and the others raise naming ``call``: one error
    each, then every rank's next call pairs. None when the posts show no such skip."""
    if any("abort" in post for post in posts.values()):
        return None
    groups: Dict[str, list] = {}
    for rank, post in sorted(posts.items()):
        groups.setdefault(post["kind"], []).append(rank)
    if len(groups) != 2:
        return None
    (kind_a, ranks_a), (kind_b, ranks_b) = groups.items()
    first = {k: min(posts[r].get("t", 0.0) for r in ranks) for k, ranks in groups.items()}
    if (len(ranks_a), -first[kind_a]) < (len(ranks_b), -first[kind_b]):
        (kind_a, ranks_a), (kind_b, ranks_b) = (kind_b, ranks_b), (kind_a, ranks_a)
    # ranks_a stay in kind_a (it gives way: they raise); ranks_b's call goes on at the next number
    return {"void_for": ranks_b,
            "message": f"ranks are in different calls: ranks {ranks_a} are in {kind_a}, ranks {ranks_b} in {kind_b} "
                       f"(they skipped a call: their {kind_b} pairs with the next call of ranks {ranks_a}). "
                       f"Ranks {ranks_a} raise; each rank's next call pairs again"}


def _masked_error(rank: int, kind: str, by: Sequence[int]) -> EPError:
    return EPError(f"rank {rank}: {kind}: ranks {list(by)} masked this rank (a wait for it timed out there), so its "
                   f"low-latency calls no longer pair with theirs: unmask it on every rank "
                   f"(low_latency_update_mask_buffer or low_latency_clean_mask_buffer, then clean_low_latency_buffer) "
                   f"or mask them here too")


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
