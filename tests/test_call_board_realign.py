"""The call board starts its numbers again at every Buffer construction (gpu/call_board.py): a rank
left behind by a stall or a timeout no longer reads its peers' older calls as "another call" in a
fresh Buffer, and a resync asked for only by a Buffer dropped before its own no longer holds the
group. Host side with stand-ins, two boards standing for two ranks (the kernels' read of a peer's
ring is call_board.posted_elsewhere on the word in ring_slot); on GPUs: tests/board_cases.py."""
import torch

from epcomm.backends.gpu import call_board

from test_call_board import FakeBackend, make_board

LL_DISPATCH, LL_COMBINE = 4, 5  # (agreement.CALLS)


class Rank:
    """One rank's board and the ring of words it posted on its peers' boards (its row there)."""

    def __init__(self):
        self.board = make_board()
        self.ring = [0] * call_board.RING

    def join(self):
        backend = FakeBackend()
        return self.board.seat(backend), backend

    def call(self, seat, kind):
        """Make a call: its tag, posted in this rank's row (what its first kernel stores on every peer)."""
        tag = seat.tag()
        self.ring[call_board.ring_slot(tag)] = call_board.board_word(tag, kind)
        return tag

    def waiting_sees_elsewhere(self, tag, kind, peer: "Rank") -> bool:
        """The kernels' test of a wait in call ``tag`` against ``peer``'s word of that number."""
        return call_board.posted_elsewhere(peer.ring[call_board.ring_slot(tag)], tag, kind)


def _round(rank, seat):
    return [rank.call(seat, LL_DISPATCH), rank.call(seat, LL_COMBINE)]


def test_a_rank_left_behind_by_a_stall_pairs_in_a_fresh_buffer():
    """Rank 3 never makes a round its peer made (it stalled; the peer's Buffer then raises
    EPTimeoutError, sticky; nobody resyncs). A Buffer made afterwards: both ranks' calls carry the
    same numbers, and neither wait reads the other's older call as another call."""
    peer, stalled = Rank(), Rank()
    seat_p, _ = peer.join()
    seat_s, _ = stalled.join()
    assert _round(peer, seat_p) == _round(stalled, seat_s)  # a round both made
    _round(peer, seat_p)  # the round the stalled rank never made
    fresh_p, _ = peer.join()
    fresh_s, _ = stalled.join()
    for _ in range(3):
        for kind in (LL_DISPATCH, LL_COMBINE):
            tag_p, tag_s = peer.call(fresh_p, kind), stalled.call(fresh_s, kind)
            assert tag_p == tag_s
            assert not stalled.waiting_sees_elsewhere(tag_s, kind, peer)
            assert not peer.waiting_sees_elsewhere(tag_p, kind, stalled)


def test_without_a_construction_the_rank_behind_would_read_another_call():
    """What the construction's new start prevents: numbers one call apart on the same Buffers, the
    rank behind reads its peer's older call of its number — another kind — as a skip."""
    peer, behind = Rank(), Rank()
    seat_p, _ = peer.join()
    seat_b, _ = behind.join()
    _round(peer, seat_p), _round(behind, seat_b)
    peer.call(seat_p, LL_DISPATCH)  # one call the other rank never made
    _round(peer, seat_p)  # the next round of both: one number apart
    behind.call(seat_b, LL_DISPATCH)
    tag = behind.call(seat_b, LL_COMBINE)
    assert behind.waiting_sees_elsewhere(tag, LL_COMBINE, peer)  # the peer's dispatch of that number


def test_calls_in_flight_from_before_a_construction_match_no_later_call():
    """A wait still running from an older era and a call made after the construction: their
    numbers differ (the era), so neither takes the other for another call."""
    a, b = Rank(), Rank()
    seat_a, _ = a.join()
    seat_b, _ = b.join()
    old = b.call(seat_b, LL_DISPATCH)
    fresh_a, _ = a.join()
    new = a.call(fresh_a, LL_COMBINE)
    assert call_board.ring_slot(old) == call_board.ring_slot(new)
    assert not b.waiting_sees_elsewhere(old, LL_DISPATCH, a)
    assert not call_board.posted_elsewhere(call_board.board_word(old, LL_DISPATCH), new, LL_COMBINE)


def test_eras_agree_after_a_join_whatever_resyncs_each_rank_made():
    """A resync that failed on one rank (its rendezvous timed out) leaves its era apart — its waits
    then see nothing, never a false skip — until the next Buffer construction brings them together."""
    a, b = Rank(), Rank()
    a.join(), b.join()
    a.board.resync(torch.device("cpu"))  # (b's did not complete)
    assert a.board.era != b.board.era
    seat_a, _ = a.join()
    seat_b, _ = b.join()
    assert a.board.era == b.board.era and seat_a.tag() == seat_b.tag()


def test_a_construction_keeps_tags_positive_and_the_resync_generation():
    """The era stays in its bits (a tag is never negative, never RESYNC_TAG), and a construction is
    no resync: Buffer's low-latency halves restart only on a resync (resync_generation)."""
    board = make_board()
    board._joined = (1 << 40) - 2
    seat = board.seat(FakeBackend())
    tag = seat.tag()
    assert tag > 0 and tag != call_board.RESYNC_TAG and board.era <= call_board.ERA_MASK
    assert board.generation == 0


def test_a_buffer_dropped_before_its_resync_no_longer_holds_a_fresh_buffer():
    """The late rank of the bed (nvlink, 4 ranks on one GPU): its Buffer raised and asked for a
    resync its peers, their Buffers broken by the timeout, never join; it was destroyed. A fresh
    Buffer's first call must not resync alone (it would wait out the timeout and raise)."""
    board = make_board()
    old, new = FakeBackend(), FakeBackend()
    board.seat(old)
    old.mailbox.resync_needed = True
    old.released = True
    board.seat(new)
    assert not board.needs_resync and new.resets == 0


def test_a_live_buffer_still_resyncs_and_one_asking_after_the_construction_still_holds_the_group():
    board = make_board()
    live = FakeBackend()
    board.seat(live)
    live.mailbox.resync_needed = True  # asked before the construction: its own signals are out of step
    board.seat(FakeBackend())
    assert board.needs_resync
    live.released = True  # dropped before its resync: the numbers it left apart started again already
    assert not board.needs_resync
    later = FakeBackend()
    board.seat(later)
    later.mailbox.resync_needed = True  # asked after the construction, then dropped: the group resyncs
    later.released = True
    assert board.needs_resync
    board.resync(torch.device("cpu"))
    assert not board.needs_resync
