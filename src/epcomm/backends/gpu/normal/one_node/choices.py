"""The one-node normal mode's kernel choices (KernelChoices, NormalMode's base in mode.py): the
defaults, and the variants that measurements set (``epcomm bench normal --variants``,
scripts/kernels_alone.py, the shared-GPU bed's ``VARIANT``). Each is compiled into the plans of a
shape, so setting one drops the plans and the next call binds the kernels anew; the calls
themselves look nothing up per choice."""
from __future__ import annotations

from typing import Any, Callable, Tuple


class Choice:
    """A NormalMode attribute whose setting converts the value (``convert``: ``bool`` for the
    switches), stores it in the instance's ``__dict__`` under the same name and calls the owner's
    ``_choice_changed()``. It has no ``__get__``, so reading one is a plain instance attribute read
    (the calls read several per call); on the class the name is this Choice, whose ``__doc__`` says
    what it does. KernelChoices._default_choices stores the defaults the same way."""

    def __init__(self, doc: str, convert: Callable[[Any], Any] = bool):
        self.__doc__, self.convert = doc, convert

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def __set__(self, mode, value) -> None:
        mode.__dict__[self.name] = self.convert(value)
        mode._choice_changed()


def programs_per_sm(value) -> int:
    """A count of programs per Config.num_sms, checked: 1 to 4 (the grid caps of ranks sharing a
    GPU count 4 x num_sms waiting programs: gpu/shared_grids.py)."""
    count = int(value)
    if not 1 <= count <= 4:
        raise ValueError(f"programs per num_sms must be 1 to 4 (shared_grids.py counts 4 x num_sms), got {value!r}")
    return count


def combine_split(split) -> Tuple[int, int]:
    """``(push, reduce)`` programs per Config.num_sms of the one-launch combine, checked: each at
    least 1, together at most 4 (the grid caps of ranks sharing a GPU count 4 x num_sms)."""
    push, reduce = (int(n) for n in split)
    if push < 1 or reduce < 1 or push + reduce > 4:
        raise ValueError(f"combine_split {split!r}: push and reduce programs per num_sms must each be >= 1 "
                         f"and together <= 4 (shared_grids.py counts 4 x num_sms)")
    return push, reduce


# The combine in turn pushes on num_sms programs and reduces on 4 x num_sms. In one launch it pushes
# on PUSH_PROGRAMS_PER_SM x num_sms and reduces on REDUCE_PROGRAMS_PER_SM x num_sms: 4 x num_sms in
# all, what the grid caps of shared_grids.py count. Half the grid pushes, not a quarter: across
# 4 H200s (same run, T=4096) the combine took 547 µs against 646 with 1 + 3 (DeepEP V1 620), and
# 198 against 239 at 2 ranks (notes/performance-log.md, 2026-11-28): the push's rate per program,
# not the links, set the pace; the reduce keeps up on 2 x num_sms.
PUSH_PROGRAMS_PER_SM = 2
REDUCE_PROGRAMS_PER_SM = 2
# The pull in turn (a full dispatch's, and every round of one in rounds) runs on this many times
# num_sms programs: its rate per program, not the links, set its pace. Same run on 4 H200s (T=4096,
# side loads first): the full dispatch took 649 / 643 / 636 µs on 2 / 3 / 4 x num_sms against 746
# on num_sms (DeepEP V1 855); at 2 ranks 299 / 269 / 263 against 373 (performance-log, 2026-11-28).
PULL_PROGRAMS_PER_SM = 3
# The stage in turn (a full dispatch's, before its pull) copies on this many times num_sms programs:
# local copies at a rate per program. Each kernel alone on one H200 (T=4096, H=7168, Config(24)):
# 62.1 µs on num_sms, 40.2 on 2 x num_sms (H100: 65.4, 49.0; 4 x num_sms 49.5): performance-log,
# 2026-11-28c. The stage in turn waits for nothing, so no grid cap limits it (in one launch with the
# count exchange its programs wait for it: NormalMode.notify_stage_fits bounds that grid).
STAGE_PROGRAMS_PER_SM = 2
# ep_dispatch_notify_stage (the count exchange and the stage in turn in one launch) goes only where its
# programs, which all wait, are at most this many times num_sms (NormalMode.notify_stage_fits): the
# waiting programs gpu/shared_grids.py counts per rank where ranks share a GPU; on a GPU of its own,
# what the other waiting grids use (the pull in turn 3 x, the combine 4 x num_sms).
WAITING_PROGRAMS_PER_SM = 4
# A full dispatch's stage stores each token list into its receiver's workspace, so the pull reads its
# entries locally (receive_index.list_of). Same run on 2 H200s (T=4096, H=7168, Config(24)): the full
# dispatch took 241 µs GPU / 301 synced against 263 / 414 with the lists left at their sources, and
# 123 against 138 at T=512 (performance-log, 2026-11-28d); the cached dispatch reads no lists.
PUSHED_LISTS = True
# bench --variants small-one-launch: a full dispatch in one launch after the wait where the group's
# largest batch is at most this many tokens; a larger batch stages during the wait and pulls in turn,
# as by default. Same runs on 2 H200s: at T=512 the one launch took 88 / 123 µs GPU against 100 / 138
# staged during the wait; at T=4096, 337 / 381 against 263 / 250 (performance-log, 2026-11-28d). Not the
# default yet: the split as a whole has not run on a GPU.
SMALL_ONE_LAUNCH_TOKENS = 1024


def token_count(value) -> int:
    """A count of tokens, checked: 0 (no bound) or more."""
    count = int(value)
    if count < 0:
        raise ValueError(f"a token count must be 0 (no bound) or more, got {value!r}")
    return count


class KernelChoices:
    """The kernel choices of a one-node NormalMode, each a Choice; ``_default_choices`` sets them
    (NormalMode.__init__ calls it), and setting one drops the mode's plans (``_dispatch_plans``,
    ``_combine_plans``) and re-reads the trace buffer's address."""

    def _default_choices(self) -> None:
        """The defaults (the Choice attributes below; measurements set them)."""
        vars(self).update(
            every_peer=True, trace=None, pipelined_pull=False, overlapped_combine=True, overlapped_dispatch=True,
            doorbell_dispatch=False, rank_loop_reduce=True, reduce_warps_apart=False, side_loads_first=True,
            gathered_index=False, full_one_launch=False, one_launch_tokens=0, pull_programs_per_sm=PULL_PROGRAMS_PER_SM,
            stage_programs_per_sm=STAGE_PROGRAMS_PER_SM, pushed_lists=PUSHED_LISTS, notify_with_stage=True,
            combine_split=(PUSH_PROGRAMS_PER_SM, REDUCE_PROGRAMS_PER_SM))

    def _choice_changed(self) -> None:
        self._dispatch_plans.clear()
        self._combine_plans.clear()
        self.trace_address = self.bases if self.trace is None else self.trace.data_ptr()

    # Setting one drops the plans, which are made with them.
    every_peer = Choice("The pull and push take every peer at once (schedule.py); False: the rank-order walk.")
    trace = Choice("An int64 trace buffer the pull and push record each item into (schedule.py), or None.",
                   convert=lambda buffer: buffer)
    pipelined_pull = Choice(
        """An experiment for a multi-GPU lease (bench --variants pipelined-pull): the pull stores an
        item's rows after the next item's loads are issued (dispatch.py, PIPELINE).""")
    side_loads_first = Choice(
        """The pull loads an item's scales (FP8) and top-k rows (a full dispatch) before its x rows,
        both in flight together (dispatch.py, SIDE_FIRST); False: after them, a second remote round
        trip per item (bench --variants side-loads-after, the default before 2026-11-28: across 4
        H200s the FP8 cached dispatch took 344-362 µs against 301-307 first).""")
    gathered_index = Choice(
        """An experiment for a lease (bench --variants gathered-index): a full dispatch's pull in turn
        gathers its receive index before its items, then reads each item's entries locally
        (dispatch.py, GATHER_INDEX).""")
    full_one_launch = Choice(
        """An experiment for a lease (bench --variants full-one-launch): a full dispatch of one round
        runs as one launch after the host's count wait (ep_dispatch, as a cached one, its pull on
        pull_programs_per_sm x num_sms programs), instead of staging during the wait and pulling in
        turn after it. On num_sms pull programs it was slower (918 against 741 µs, 4 H200s). Every
        rank of the group must set the same (it is not in the fingerprint: ranks that differ wait
        for each other's signals until the timeout).""")
    one_launch_tokens = Choice(
        """With full_one_launch, a bound in tokens (0: none): a rank whose batch is larger stages
        during the count wait, as by default, and the group takes the one launch only where its
        largest batch (max_tokens, the same on every rank) is within the bound, so that no rank has
        staged; otherwise every rank pulls in turn (bench --variants small-one-launch:
        SMALL_ONE_LAUNCH_TOKENS). doorbell_dispatch, where set, decides instead. Every rank of the
        group must set the same, as for full_one_launch.""",
        convert=token_count)
    pull_programs_per_sm = Choice(
        """Programs of the pull in turn per Config.num_sms (1 to 4, PULL_PROGRAMS_PER_SM; bench
        --variants pull-1x ... pull-4x): more bytes in flight where the rate per program, not the
        links, sets the pull's pace.""",
        convert=programs_per_sm)
    pushed_lists = Choice(
        """The stage stores each list into its receiver's workspace, so a full dispatch's pull reads
        its entries locally (receive_index.py, list_of; default PUSHED_LISTS); False: each list stays
        at its source and the pull reads it remotely (bench --variants pulled-lists, the default
        before 2026-11-28d). Every rank of the group must set the same.""")
    notify_with_stage = Choice(
        """A full dispatch's count exchange and its stage in turn go as one launch (notify.py,
        ep_dispatch_notify_stage; only where its waiting programs are within 4 x num_sms,
        NormalMode.notify_stage_fits; its waits are on device epochs, so a captured num_worst_tokens
        dispatch replays correctly too): one launch less on the host's path, which sets a small batch's pace. Same
        run on 2 H200s, T=512 (2026-11-29, when the stage still waited for the host's notify
        number): the full dispatch took 115 µs host against 137 with two launches (DeepEP V1
        85-89; performance-log). A num_worst_tokens dispatch's count exchange goes the same way into
        its one launch (dispatch.py, ep_dispatch with NOTIFY, within the same bound): the whole
        dispatch one launch (2026-11-29g). False: the notify alone first (bench --variants
        notify-apart, the default before 2026-11-29). Each rank may choose alone: the launch signals
        its peers as the two did.""")
    stage_programs_per_sm = Choice(
        """Copy programs of the stage in turn per Config.num_sms (1 to 4; default
        STAGE_PROGRAMS_PER_SM; bench --variants stage-1x ... stage-4x): the stage is local copies at
        a rate per program.""",
        convert=programs_per_sm)
    rank_loop_reduce = Choice(
        """The combine's reduce sums a token's ranks one row at a time, nothing meeting the other
        warps (combine.py, RANK_LOOP); False: the [R_P2, BLOCK_C] tile, summed across warps from 8
        ranks on (bench --variants tile-reduce; 4.8x slower at 8 ranks' tiles, performance-log).""")
    reduce_warps_apart = Choice(
        """An experiment for a lease (bench --variants reduce-warps-apart): the one-launch combine's
        reduce programs decide their chunks' waits per warp, no barrier per chunk (combine.py).""")
    combine_split = Choice(
        """``(push, reduce)``: the one-launch combine's push and reduce programs, each in units of
        Config.num_sms (PUSH_PROGRAMS_PER_SM, REDUCE_PROGRAMS_PER_SM; bench --variants single-push:
        (1, 3), the split before 2026-11-28). At most 4 together: shared_grids.py counts 4 x num_sms.""",
        convert=combine_split)
    overlapped_combine = Choice(
        """The combine's push and reduce in one launch, the reduce summing tokens as their blocks land
        (combine.py, ep_combine); False: in turn, a barrier between them (bench --variants
        serial-combine). Every rank of the group must set the same.""")
    overlapped_dispatch = Choice(
        """The dispatch's stage and pull in one launch, the pull starting on each block of rows as it
        is staged (dispatch.py, ep_dispatch); False: in turn, a barrier between them (bench
        --variants serial-dispatch). Every rank of the group must set the same.""")
    doorbell_dispatch = Choice(
        """A full dispatch in one launch too, launched before the host's count wait with its pull
        waiting for the doorbell (bench --variants doorbell-dispatch; mailbox.py, ring). Off by
        default: on one H100 (T=4096, one rank) its pull ran 7.1 µs per item against 5.3 in turn,
        and the call 205 µs against 165 in turn (the stage runs during the wait either way; notes:
        performance-log.md). Every rank of the group must set the same.""")
