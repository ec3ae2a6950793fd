"""The call board's host side (gpu/call_board.py): tags, what the kernels record, and the group
resync. The kernels' side runs on GPUs (tests/test_shared_gpu.py, the loopback suite)."""
import pytest
import torch

from epcomm import EPInputError
from epcomm.backends.gpu import call_board


def host_mailbox(num_ranks):
    """The GPU layer's host mailbox, unpinned (its module compiles a probe kernel: needs Triton)."""
    pytest.importorskip("triton")
    from epcomm.backends.gpu.mailbox import HostMailbox
    return HostMailbox(num_ranks, 8, pinned=False)


class Mailbox:
    """A member's mailbox as the board sees it (the real one in the tests that decode records)."""

    def __init__(self):
        self.resync_needed = False
        self.disagreement_reads = 0

    def raise_pending(self, rank, timeout_s):
        pass

    def raise_disagreement(self):
        self.disagreement_reads += 1

    def clear(self):
        self.resync_needed = False


class FakeBackend:
    """What the board asks of a member: its mailbox, rank, timeout, and a reset."""

    def __init__(self, num_ranks=4, rank=0):
        self.mailbox = Mailbox()
        self.rank, self.timeout_s = rank, 1.0
        self.resets = 0

    def reset_signals(self):
        self.resets += 1
        self.mailbox.clear()


def make_board(num_ranks=4, rendezvous=None):
    words = torch.zeros(call_board.board_words(num_ranks), dtype=torch.int64)
    bases = torch.zeros(num_ranks, dtype=torch.int64)
    return call_board.CallBoard(0, num_ranks, words, bases, rendezvous or (lambda what: None))


def record(mailbox, num_ranks, posted_words, own_word):
    """What sync.record_elsewhere stores for senders found in another call."""
    view, base = mailbox.view, mailbox._agreement
    for sender, word in posted_words.items():
        view[base + 2 * sender] = call_board.as_fingerprint(word)
        view[base + 2 * sender + 1] = 0
    view[base + 2 * num_ranks] = call_board.as_fingerprint(own_word)
    view[0] = 1


def test_calls_on_every_buffer_of_a_group_share_one_number_sequence():
    board = make_board()
    normal, low_latency = board.seat(FakeBackend()), board.seat(FakeBackend())
    assert (normal.slot, low_latency.slot) == (1, 2)
    tags = [normal.tag(), low_latency.tag(), normal.tag()]
    count = (1 << call_board.GENERATION_SHIFT) - 1  # (above it: the era, call_board.py)
    assert [(t >> call_board.NUMBER_SHIFT) & count for t in tags] == [1, 2, 3]
    assert len({t >> (call_board.NUMBER_SHIFT + call_board.GENERATION_SHIFT) for t in tags}) == 1
    assert [(t >> call_board.BUFFER_SHIFT) & call_board.NUM_SLOTS for t in tags] == [1, 2, 1]


def test_buffer_slots_wrap_after_seven_and_are_never_zero():
    board = make_board()
    slots = [board.seat(FakeBackend()).slot for _ in range(9)]
    assert slots == [1, 2, 3, 4, 5, 6, 7, 1, 2]


def test_a_seat_without_a_board_tags_nothing():
    seat = call_board.unseated(torch.device("cpu"), 4)
    assert seat.tag() == 0 and seat.bases_address != 0


def test_board_words_hold_every_lane_the_kernels_read_and_a_scratch_word():
    for R in (1, 2, 3, 4, 5, 8, 16, 17):
        lanes = 1 << (R - 1).bit_length()
        assert call_board.board_words(R) >= max(lanes, R + 1) + 1


def test_the_recorded_words_decode_to_the_fingerprint_fields():
    pytest.importorskip("triton")
    from epcomm.backends.gpu import agreement
    assert agreement.field("call")[1:] == (0, call_board.KIND_MASK)
    assert agreement.field("buffer")[1] == call_board.FP_BUFFER_SHIFT
    word = call_board.board_word((5 << call_board.NUMBER_SHIFT) | (3 << call_board.BUFFER_SHIFT),
                                 agreement.CALL_LL_DISPATCH)
    assert agreement.unpack((call_board.as_fingerprint(word), 0)) == dict(
        agreement.unpack((0, 0)), call=agreement.CALL_LL_DISPATCH, buffer=3)


def test_a_skip_across_buffers_raises_naming_both_calls_and_buffers():
    """Ranks 0, 2, 3 wait in a combine on Buffer 1; rank 1 is in a low-latency dispatch on Buffer 2."""
    R = 4
    mailbox = host_mailbox(R)
    from epcomm.backends.gpu import agreement
    tag = lambda slot: (7 << call_board.NUMBER_SHIFT) | (slot << call_board.BUFFER_SHIFT)  # noqa: E731
    record(mailbox, R, {1: call_board.board_word(tag(2), agreement.CALL_LL_DISPATCH)},
           call_board.board_word(tag(1), agreement.CALL_COMBINE))
    with pytest.raises(EPInputError) as info:
        mailbox.raise_pending(0, 1.0)
    assert info.value.argument == "call"
    message = str(info.value)
    assert "ranks [0, 2, 3]: combine on Buffer 1" in message
    assert "ranks [1]: low_latency_dispatch on Buffer 2" in message
    assert mailbox.resync_needed


def test_a_call_raises_what_another_buffer_of_the_group_recorded():
    """The rank that skipped learns it from the Buffer it skipped on while it calls another."""
    board = make_board()
    normal, low_latency = FakeBackend(), FakeBackend()
    normal.mailbox = host_mailbox(4)
    from epcomm.backends.gpu import agreement  # (after host_mailbox: needs Triton)
    board.seat(normal), board.seat(low_latency)
    board.raise_pending(low_latency)  # nothing recorded anywhere
    record(normal.mailbox, 4, {2: call_board.board_word(1 << 8 | 2 << 4, agreement.CALL_LL_COMBINE)},
           call_board.board_word(1 << 8 | 1 << 4, agreement.CALL_DISPATCH))
    with pytest.raises(EPInputError, match="different calls"):
        board.raise_pending(low_latency)
    assert board.needs_resync


def test_every_call_asks_each_other_live_buffer_and_no_destroyed_one():
    """Every call checks the other Buffers' mailboxes for a disagreement (a rank that skipped a
    call learns it there), but not its own again, nor a destroyed Buffer's."""
    board = make_board()
    current, quiet, reporting, destroyed = FakeBackend(), FakeBackend(), FakeBackend(), FakeBackend()
    for member in (current, quiet, reporting, destroyed):
        board.seat(member)
    destroyed.released = True
    board.raise_pending(current)
    assert [m.mailbox.disagreement_reads for m in (current, quiet, reporting, destroyed)] == [0, 1, 1, 0]


def test_a_disagreement_whose_pending_word_is_not_set_still_raises_at_another_buffers_call():
    """The agreement words decide, not the pending word: a host that cleared the pending word while
    a kernel recorded, or a record whose pending store has not landed yet, still raises."""
    board = make_board()
    normal, low_latency = FakeBackend(), FakeBackend()
    normal.mailbox = host_mailbox(4)
    from epcomm.backends.gpu import agreement  # (after host_mailbox: needs Triton)
    board.seat(normal), board.seat(low_latency)
    record(normal.mailbox, 4, {2: call_board.board_word(1 << 8 | 2 << 4, agreement.CALL_LL_COMBINE)},
           call_board.board_word(1 << 8 | 1 << 4, agreement.CALL_DISPATCH))
    normal.mailbox.view[0] = 0
    with pytest.raises(EPInputError, match="different calls"):
        board.raise_pending(low_latency)


def test_the_resync_covers_every_buffer_of_the_group():
    seen = []
    board = make_board(rendezvous=seen.append)
    members = [FakeBackend(), FakeBackend()]
    seats = [board.seat(m) for m in members]
    members[0].mailbox.resync_needed = True
    seats[1].tag()
    board.words[3] = 99
    assert board.needs_resync
    board.resync(torch.device("cpu"))
    assert [m.resets for m in members] == [1, 1] and not board.needs_resync
    assert board.number == 0 and board.generation == 1 and not board.words.any()
    assert seen == ["call board resync", "call board resync done"]
    # numbers start again on every rank, in the next era (a number posted before never matches)
    era = board.era
    assert seats[0].tag() >> call_board.NUMBER_SHIFT == (era << call_board.GENERATION_SHIFT) | 1
    assert era == ((2 << call_board.ERA_JOIN_SHIFT) | 1)  # two Buffers joined, one resync since


def test_a_destroyed_or_collected_buffer_leaves_the_board():
    board = make_board()
    kept, gone, destroyed = FakeBackend(), FakeBackend(), FakeBackend()
    for member in (kept, gone, destroyed):
        board.seat(member)
    destroyed.released = True
    del gone
    assert board.members() == [kept]


def test_a_buffer_dropped_before_its_resync_leaves_the_group_to_resync():
    """Ranks that raised may have given their calls different numbers; calls made afterwards must
    not pair by those numbers: the group's next call resyncs it — unless a Buffer was made since
    (its construction, collective, started the numbers again: tests/test_call_board_realign.py)."""
    board = make_board()
    old, kept = FakeBackend(), FakeBackend()
    board.seat(kept)
    board.seat(old)
    old.mailbox.resync_needed = True
    old.released = True
    assert board.needs_resync
    board.resync(torch.device("cpu"))
    assert not board.needs_resync and kept.resets == 1


DISPATCH, COMBINE, LL_DISPATCH, LL_COMBINE, ABORT = 1, 3, 4, 5, call_board.ABORT_KIND  # (agreement.CALLS)


def word_of(seat_tag, kind):
    return call_board.board_word(seat_tag, kind)


def test_a_peer_in_another_call_of_the_same_number_is_elsewhere():
    """Rank 1 skipped the combine (number 7 on Buffer 1) and made its next call, a low-latency
    dispatch on Buffer 2, with that number: each side sees the other elsewhere."""
    board = make_board()
    normal, low_latency = board.seat(FakeBackend()), board.seat(FakeBackend())
    board.number = 6
    combine_tag = normal.tag()
    board.number = 6  # (rank 1's counter: it made no combine)
    dispatch_tag = low_latency.tag()
    assert combine_tag >> call_board.NUMBER_SHIFT == dispatch_tag >> call_board.NUMBER_SHIFT
    assert call_board.ring_slot(combine_tag) == call_board.ring_slot(dispatch_tag)
    assert call_board.posted_elsewhere(word_of(dispatch_tag, LL_DISPATCH), combine_tag, COMBINE)
    assert call_board.posted_elsewhere(word_of(combine_tag, COMBINE), dispatch_tag, LL_DISPATCH)
    assert not call_board.posted_elsewhere(word_of(combine_tag, COMBINE), combine_tag, COMBINE)  # the same call


def test_peers_behind_ahead_or_from_before_a_resync_are_not_elsewhere():
    board = make_board()
    seat = board.seat(FakeBackend())
    board.number = 9
    mine = seat.tag()  # call 10
    behind = mine - (1 << call_board.NUMBER_SHIFT)
    assert not call_board.posted_elsewhere(0, mine, COMBINE)  # nothing posted yet
    assert not call_board.posted_elsewhere(word_of(behind, DISPATCH), mine, COMBINE)
    # a peer RING calls ahead overwrote the slot with a larger number: not taken for a skip
    ahead = mine + (call_board.RING << call_board.NUMBER_SHIFT)
    assert call_board.ring_slot(ahead) == call_board.ring_slot(mine)
    assert not call_board.posted_elsewhere(word_of(ahead, LL_DISPATCH), mine, COMBINE)
    # a post still in flight from before a resync carries the old generation
    board.resync(torch.device("cpu"))
    board.number = 9
    after = seat.tag()
    assert call_board.ring_slot(after) == call_board.ring_slot(mine)
    assert not call_board.posted_elsewhere(word_of(mine, LL_DISPATCH), after, COMBINE)


def test_an_abort_is_elsewhere_only_on_another_buffer_and_a_resync_always():
    board = make_board()
    normal, low_latency = board.seat(FakeBackend()), board.seat(FakeBackend())
    board.number = 2
    mine = normal.tag()
    board.number = 2
    other = low_latency.tag()
    # a rejected input on this Buffer: its own signals end the wait and name the argument
    assert not call_board.posted_elsewhere(word_of(mine, ABORT), mine, DISPATCH)
    # a rejected layout's stand-in made on the other Buffer: the peers' wait here ends
    assert call_board.posted_elsewhere(word_of(other, ABORT), mine, DISPATCH)
    assert call_board.posted_elsewhere(call_board.RESYNC_TAG, mine, DISPATCH)
