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
"""
from __future__ import annotations

import datetime
import itertools
import json
from typing import Dict, Optional, Sequence, Tuple

import torch.distributed as dist

from ..errors import EPError, EPInputError, EPTimeoutError

_buffer_numbers: Dict[str, itertools.count] = {}


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
        self.calls = 0

    def _key(self, call: int, rank: int) -> str:
        return f"{self.prefix}/{call}/{rank}"

    def agree(self, kind: str, fingerprint: Optional[Sequence[Tuple[str, object]]],
              error: Optional[EPInputError] = None, rank_mask=None) -> None:
        """Post this rank's fingerprint (``(argument, value)`` pairs) or, with ``error``, an abort
        naming the rejected argument; return once every rank posted the same fingerprint.

        ``rank_mask`` (low-latency calls, ``[R]`` int32, nonzero = masked): masked ranks are not
        waited for, and a rank that does not arrive in time is masked there instead of raising."""
        call = self.calls
        self.calls += 1
        if error is not None:
            mine = {"kind": kind, "abort": [error.argument, str(error)]}
        else:
            mine = {"kind": kind, "fields": [[name, repr(value)] for name, value in fingerprint]}
        self.store.set(self._key(call, self.rank), json.dumps(mine))
        if call >= 2:
            self.store.delete_key(self._key(call - 2, self.rank))
        masked = set() if rank_mask is None else {r for r, m in enumerate(rank_mask.tolist()) if m}
        present = [r for r in range(self.num_ranks) if r not in masked or r == self.rank]
        others = [self._key(call, r) for r in present if r != self.rank]
        if others:
            try:
                self.store.wait(others, self.timeout)
            except Exception:  # the store's timeout error type differs between torch versions
                try:
                    missing = [r for r in present if r != self.rank and not self.store.check([self._key(call, r)])]
                except Exception as err:  # the store itself is gone: its host (rank 0 of the group) exited
                    raise EPError(f"rank {self.rank}: {kind}: the process group's store is unreachable (its host "
                                  f"rank exited?): {str(err).splitlines()[0][:200]}") from None
                if rank_mask is None:
                    raise EPTimeoutError(f"rank {self.rank}: {kind} waited {self.timeout_s:g} s for ranks {missing}, "
                                         f"which did not make the call (stalled, exited, or skipped it)",
                                         missing) from None
                rank_mask[missing] = 1  # low-latency mode goes on without them
                present = [r for r in present if r not in missing]
        posts = {r: json.loads(self.store.get(self._key(call, r))) for r in present}
        _raise_on_disagreement(kind, posts)


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
