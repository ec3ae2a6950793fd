"""The call board: which call each rank of a process group is in, across every Buffer of the group.

Why. Calls pair by order. A rank whose own code raised between two calls (an expert that ran out of
memory, a NaN check) skips a call its peers make, and its next call — on the same Buffer, or on
another Buffer of the same group (a server's prefill and decode Buffers) — meets theirs. Each
Buffer's fingerprints (agreement.py) see only that Buffer's calls, so a wait for a rank that is in
another Buffer's call would last the whole timeout. The board ends it at once.

What. One small int64 array of symmetric memory per group and process, shared by every GPU Buffer of
the group on this process. Row ``i`` of a rank's board holds what rank ``i`` posted for its last
``RING`` calls, call ``n`` in word ``n % RING``::

    (call number << 8) | (Buffer slot << 4) | call kind        (sync.board_word)

- The call number counts this process's calls on all Buffers of the group since the group's last
  resync or Buffer construction, above an *era* (host counters; every rank makes the same calls,
  resyncs and constructions, so the numbers agree, and a post still in flight from before matches
  no later call). A rank that skipped a call gives its next call the skipped one's number.
- The slot names the Buffer (1..7, in construction order, the same on every rank); the kind is the
  fingerprint's ``call`` field (dispatch, cached dispatch, combine, low-latency dispatch, combine).

Each call's first kernel posts its word on every peer's board at its start (``post_call_any``: plain
stores, or signals to other nodes: gpu/reach). A wait that has lasted ``ROW_CHECK_NS`` also reads the
awaited peers' words on its own board (``sync.posted_elsewhere``): a word with this call's number
and another slot or kind means that peer's call of this number is another call, so the wait for it
ends and the mismatch goes to the host mailbox; the host raises :class:`EPInputError` naming the
ranks and both calls. The detection is symmetric — the rank that skipped waits in its own call for
peers whose words show theirs — so every rank raises, at its next call at the latest. A peer behind
has not posted this number yet; one that moved on left its word for this number in the ring. An
abort posted on the waiter's own Buffer is left to that Buffer's signals (they end the wait and
name the rejected argument); an abort on another Buffer — a rejected layout's stand-in made
there — is another call.

Recovery. Every rank that raised resyncs at its next call, and the resync covers the whole group
(:meth:`CallBoard.resync`): after a cross-Buffer skip, each Buffer of the group is out of step on
some rank, so every Buffer's signals, epochs and mailbox, the board and the call numbers go back to
zero together, between two host rendezvous. A rank entering the resync first posts RESYNC in
every slot of its row on every peer (on a side stream: its own stream may hold a waiting kernel),
so a peer's kernel still waiting for it — a call its host queued before it learned of the error —
ends at once instead of at the timeout.

Realignment at every Buffer construction. A rank can make fewer calls than its peers without any
rank raising a disagreement: one that stalled, died, or came late past the timeout while its peers
went on (their calls posted numbers it never used; their Buffers then raise EPTimeoutError, which
is sticky, and nobody resyncs). Its numbers would stay behind its peers' for the rest of the group's
life, and its waits in a fresh Buffer would read a peer's *older* call of the same number as
"another call": EPInputError('call') where nobody skipped anything, and a resync request its peers
never join. Buffer construction is collective — every rank seats the new Buffer at the same point
of its calls — so :meth:`CallBoard.seat` restarts the count there, under a new era (the Buffers
joined so far: the same on every rank), and forgets a group resync that only a Buffer dropped
before its resync asked for (the numbers it could have left apart start again here). A wait still
running from before (an older era) and a call made after never take each other for another call:
their numbers differ. The cost: a skip made before a construction and not yet detected when it
happens ends in its peers' timeout instead of an EPInputError.

Limits. Calls captured in a CUDA graph post and check nothing (tag 0): a replay repeats the
numbers it was captured with. Calls on the Buffers of one group must be made in the same order on
every rank (as calls on one Buffer must): ranks that interleave two Buffers' calls differently
are taken for a skip.
"""
from __future__ import annotations

import weakref
from typing import Callable, Dict, List, Optional, Tuple

import torch

# A board word: (call number << NUMBER_SHIFT) | (Buffer slot << BUFFER_SHIFT) | call kind. The
# kernels read these as constexprs (sync.py); agreement.py checks them against its fields.
NUMBER_SHIFT = 8
BUFFER_SHIFT = 4
NUM_SLOTS = 7  # slots 1..7 (0: nothing posted); also the mask of the slot field
KIND_MASK = 15  # the fingerprint's ``call`` field, bits 0-3 of word 0 (agreement.py)
ABORT_KIND = 15  # the kind an abort posts (agreement.CALL_ABORT)
FP_BUFFER_SHIFT = 60  # where the fingerprint's ``buffer`` field lies in word 0 (agreement.py)
# Each rank's row on a board keeps its last RING calls (call number % RING): a peer that has moved
# on past the call a waiter is in (its calls that do not wait returned) still shows what that call was.
RING = 8
RESYNC_TAG = -1  # posted into every slot of a rank's row when it resyncs: every wait for it ends
GENERATION_SHIFT = 32  # a call's number: (the era << 32) | calls since the last resync or construction
# The era: (Buffers of the group joined << ERA_JOIN_SHIFT) + resyncs since the last join, in 23 bits
# (a tag stays positive, never RESYNC_TAG). A resync that failed on one rank leaves that rank's era
# apart from its peers' (their boards then see nothing, never a false skip) until the next join.
ERA_JOIN_SHIFT = 12
ERA_MASK = (1 << (63 - NUMBER_SHIFT - GENERATION_SHIFT)) - 1


def board_word(tag: int, kind: int) -> int:
    """What a call posts (sync.board_word, on the host): its tag and its kind (agreement.CALLS)."""
    return tag | (kind & KIND_MASK)


def as_fingerprint(word: int) -> int:
    """A board word as the fingerprint word 0 the kernels record (sync.record_elsewhere): its kind
    in the ``call`` field, its Buffer slot in ``buffer``."""
    slot = (word >> BUFFER_SHIFT) & NUM_SLOTS
    return (word & KIND_MASK) | (slot << FP_BUFFER_SHIFT)


def ring_slot(tag: int) -> int:
    """The word of a rank's row that holds its call of this tag's number (sync.board_slot)."""
    return (tag >> NUMBER_SHIFT) % RING


def posted_elsewhere(posted: int, tag: int, kind: int) -> bool:
    """The kernels' test (sync.posted_elsewhere, on the host; keep the two alike): does ``posted``,
    a sender's word in the slot of this call's number, say the sender is in another call than
    ``(tag, kind)`` — or resyncs? A word of another number (the sender is behind, or the word is
    older than a resync) says nothing; an abort on this call's own Buffer is left to its signals."""
    if posted == RESYNC_TAG:
        return True
    slot_bits = NUM_SLOTS << BUFFER_SHIFT
    abort_here = (posted & KIND_MASK) == ABORT_KIND and (posted & slot_bits) == (tag & slot_bits)
    return (posted >> NUMBER_SHIFT) == (tag >> NUMBER_SHIFT) and posted != board_word(tag, kind) and not abort_here


def board_words(num_ranks: int) -> int:
    """int64 words of one rank's board: a row of RING words per rank, rows up to the next power of
    two (kernels read whole ``R_P2`` vectors), and a scratch word after them (far SETs of dead lanes)."""
    return (1 << (num_ranks - 1).bit_length()) * RING + 1


class CallBoard:
    """One group's board on this process (see the module docstring). Made by :func:`join`.

    Args:
        words: this rank's board, int64 ``[board_words(R)]`` of symmetric memory (zeroed).
        bases: ``[R]`` int64 device tensor: each rank's board address as the kernels reach it.
        rendezvous: ``rendezvous(what)``, a bounded host barrier of the group.
        keep: whatever must live as long as the memory (a rendezvous handle, a transport).
        post_resync: launches the kernel that posts RESYNC on every peer's board and waits for it
            (agreement.launch_post_resync), not behind this rank's stream.
    """

    def __init__(self, rank: int, num_ranks: int, words: torch.Tensor, bases: torch.Tensor,
                 rendezvous: Callable[[str], None], keep=None, post_resync: Callable[[], None] = lambda: None):
        self.rank, self.num_ranks = rank, num_ranks
        self.post_resync = post_resync
        self.words, self.bases, self._keep = words, bases, keep
        self.bases_address = bases.data_ptr()
        self.rendezvous = rendezvous
        self.number = 0  # calls made on the group's Buffers since the last resync or join
        self.generation = 0  # resyncs so far (Buffer restarts its low-latency halves when it moves)
        self.era = 0  # above the number in every tag (ERA_JOIN_SHIFT; the module docstring)
        # (backend, its mailbox, whether the resync it asks for predates the last join)
        self._members: List[Tuple[weakref.ref, object, bool]] = []
        self._joined = 0
        # A Buffer destroyed or collected while it still had to resync: the call numbers may differ
        # between ranks (each raised at its own calls), so the group resyncs at its next call anyway
        # — unless a Buffer joined since (the numbers started again there).
        self._left_out_of_step = False

    def seat(self, backend) -> "Seat":
        """Register a backend (a Buffer) of the group: its slot, and a place in the resync. Collective
        (Buffer construction): every rank's numbers start again here, under a new era (the module
        docstring: a rank left behind by a timeout no longer reads its peers' older calls as
        another call), and a group resync asked for only by Buffers dropped before theirs is
        forgotten. The live members' own resyncs stay asked for (their signals are out of step);
        one of them dropped later no longer asks for the group's (its numbers are gone)."""
        self.members()
        # a live member's resync asked for so far predates the new numbers (kept: its signals)
        self._members = [(ref, mailbox, before or mailbox.resync_needed) for ref, mailbox, before in self._members]
        self._members.append((weakref.ref(backend), backend.mailbox, False))
        self._joined += 1
        self.number = 0
        self.era = (self._joined << ERA_JOIN_SHIFT) & ERA_MASK
        self._left_out_of_step = False
        return Seat(self, (self._joined - 1) % NUM_SLOTS + 1)

    def members(self) -> list:
        """The group's live backends on this process (destroyed or collected ones leave)."""
        live = []
        for ref, mailbox, before_join in self._members:
            backend = ref()
            if backend is None or getattr(backend, "released", False):
                # (a resync it asked for before the last join: the numbers started again there)
                self._left_out_of_step |= mailbox.resync_needed and not before_join
            else:
                live.append((ref, mailbox, before_join))
        self._members = live
        return [ref() for ref, _, _ in live]

    @property
    def needs_resync(self) -> bool:
        """A Buffer of the group raised for a disagreement, a skip or an abort: its signals (and,
        after a skip, another Buffer's) are out of step. (Asked at every call: the members are
        read in place, and pruned by :meth:`members` only once one of them is gone.)"""
        for ref, mailbox, _ in self._members:
            backend = ref()
            if backend is None or getattr(backend, "released", False):
                return any(b.mailbox.resync_needed for b in self.members()) or self._left_out_of_step
            if mailbox.resync_needed:
                return True
        return self._left_out_of_step

    def raise_pending(self, current) -> None:
        """What ``current``'s kernels reported, then any other Buffer's disagreement: a rank that
        skipped a call can learn it from the Buffer it skipped on while it calls another.

        Every call of every Buffer comes here (Buffer._check_alive), so the other members are read
        from the list as it stands (a destroyed or collected one skipped, not pruned), and each
        other mailbox's check reads its own two agreement words first (HostMailbox.raise_disagreement).
        Not the pending word: a host that clears it while a kernel records, or a record whose pending
        store lands before its agreement words, would leave a disagreement that only those words show."""
        mailbox = current.mailbox
        mailbox.raise_pending(current.rank, current.timeout_s)
        for ref, other, _ in self._members:
            if other is not mailbox:
                backend = ref()
                if backend is not None and not getattr(backend, "released", False):
                    other.raise_disagreement()

    def resync(self, device: torch.device) -> None:
        """Collective over the group (every rank that raised comes here at its next call): once
        every rank's kernels have finished, every member's signals, epochs and mailbox, this board
        and the call numbers go back to zero; a second rendezvous keeps any rank from posting or
        signalling before every rank has zeroed."""
        self.post_resync()  # (a peer's kernel still waiting for this rank ends)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        self.rendezvous("call board resync")
        for backend in self.members():
            backend.reset_signals()
        self._members = [(ref, mailbox, False) for ref, mailbox, _ in self._members]
        self.words.zero_()
        self.number = 0
        self._left_out_of_step = False
        self.generation += 1
        self.era = (self.era + 1) & ERA_MASK
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        self.rendezvous("call board resync done")


class Seat:
    """A Buffer's place on its group's board: what its kernels get (``bases_address``, :meth:`tag`).
    Without a board (``board=None``: kernels launched on their own, in tests) tags are 0 and the
    board pointer points at ``zeros``, which the kernels then never use."""

    def __init__(self, board: Optional[CallBoard], slot: int, zeros: Optional[torch.Tensor] = None):
        self.board, self.slot = board, slot
        self._zeros = zeros
        self.bases_address = board.bases_address if board is not None else zeros.data_ptr()
        # (the runtime's query itself: torch.cuda.is_current_stream_capturing wraps it in Python, on
        # every call's host path)
        self._capturing = torch._C._cuda_isCurrentStreamCapturing if torch.cuda.is_available() else (lambda: False)

    def tag(self, capturing: Optional[bool] = None) -> int:
        """The next call's tag: a new call number with this Buffer's slot; 0 (nothing posted or
        checked) in a CUDA graph capture, or without a board. ``capturing``: whether the current
        stream is being captured, where the caller asked already (None: asked here)."""
        board = self.board
        if board is None or (self._capturing() if capturing is None else capturing):
            return 0
        board.number += 1
        # The era above the count: a post still in flight from before a resync or a join (a signal
        # lands late) carries an older number, which no later call has — every rank resyncs and
        # joins alike.
        return (((board.era << GENERATION_SHIFT) | board.number) << NUMBER_SHIFT) | (self.slot << BUFFER_SHIFT)


def unseated(device: torch.device, num_ranks: int) -> Seat:
    """A seat without a board."""
    return Seat(None, 0, torch.zeros(max(num_ranks, 1), dtype=torch.int64, device=device))


_boards: Dict[Tuple, CallBoard] = {}


def join(key: Tuple, backend, make: Callable[[], CallBoard], home: Optional[dict] = None) -> Seat:
    """``backend``'s seat on the board of ``key`` (a group, and the kind of memory its backend
    uses), made with ``make()`` on the first Buffer of the group — collective, like every Buffer's
    construction, so every rank makes it at the same call. The board then stays for as long as
    ``home`` (default: the process's life): a few hundred bytes, and freeing symmetric memory can
    be a barrier (reach/symmetric_heap.py). A test transport whose ranks are threads keeps their
    boards in its own ``home``."""
    boards = _boards if home is None else home
    board = boards.get(key)
    if board is None:
        board = boards[key] = make()
    return board.seat(backend)


def kept_board_addresses() -> set:
    """Where the boards this process keeps for its life lie (``words.data_ptr()``): a ledger of
    symmetric memory (reach/symmetric_heap.py) lists them as held by design, not as leaks."""
    return {board.words.data_ptr() for board in _boards.values()}
