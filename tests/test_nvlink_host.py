"""Host-side logic of the nvlink backend that needs no GPU: the mailbox the kernels report through,
and the launch layer's checks. Skipped where Triton is not installed (CI installs only torch)."""
import pytest

pytest.importorskip("triton")

from epcomm.backends.gpu import agreement  # noqa: E402
from epcomm.backends.gpu.copy import copy_block_shape
from epcomm.backends.gpu.launch import cdiv, p2  # noqa: E402
from epcomm.backends.gpu.mailbox import HostMailbox  # noqa: E402
from epcomm.errors import EPInputError, EPTimeoutError  # noqa: E402


def test_mailbox_quiet_by_default():
    box = HostMailbox(4, 8, pinned=False)
    box.raise_pending(0, 1.0)  # nothing reported: no error


def test_mailbox_timeout_names_peers_and_stays_raised():
    box = HostMailbox(4, 8, pinned=False)
    box.view[0] = 1  # pending
    box.view[1 + 2] = 1  # peer 2 timed out
    for _ in range(2):  # sticky: the buffer cannot be trusted afterwards
        with pytest.raises(EPTimeoutError) as err:
            box.raise_pending(0, 5.0)
        assert err.value.peers == [2]


def test_mailbox_dropped_ids_raise_once_naming_topk_idx():
    box = HostMailbox(2, 8, pinned=False)
    box.view[0] = 1
    box.view[2 + 1] = 3  # three ids outside [-1, E)
    with pytest.raises(EPInputError, match="topk_idx"):
        box.raise_pending(0, 1.0)
    box.raise_pending(0, 1.0)  # reported once; the buffer stays usable


def test_mailbox_notify_wait_is_bounded():
    box = HostMailbox(2, 8, pinned=False)
    with pytest.raises(EPTimeoutError, match="count exchange"):
        box.wait_notify(box.next_sequence(), 0, timeout_s=0.01)


def test_mailbox_notify_returns_counts():
    box = HostMailbox(2, 8, pinned=False)
    sequence = box.next_sequence()
    notify = 3 * 2 + 4
    box.view[notify + 1], box.view[notify + 2] = 17, 9
    box.view[notify + 3:notify + 6] = [4, 8, 5]
    box.view[notify] = sequence  # published last, as the kernel does
    num_recv, max_tokens, per_expert = box.wait_notify(sequence, 0, timeout_s=1.0)
    assert (num_recv, max_tokens, per_expert[:3].tolist()) == (17, 9, [4, 8, 5])


def test_mailbox_wait_yields_the_gil_to_other_threads():
    """A long count wait must not stall the process's other Python threads (each of which would
    otherwise get the GIL back only every switch interval, 5 ms, while the wait spins)."""
    import threading
    import time
    box = HostMailbox(2, 8, pinned=False)
    sequence = box.next_sequence()
    waiter = threading.Thread(target=box.wait_notify, args=(sequence, 0, 30.0))
    waiter.start()
    time.sleep(0.01)  # the waiter is past its spin phase
    started = time.monotonic()
    for _ in range(400):  # each releases and takes back the GIL
        time.sleep(0)
    elapsed = time.monotonic() - started
    box.view[3 * 2 + 4] = sequence
    waiter.join(5)
    assert not waiter.is_alive()
    assert elapsed < 1.0, f"400 GIL hand-offs took {elapsed:.2f} s beside a waiting rank"


def test_host_arithmetic_helpers():
    assert [p2(n) for n in (0, 1, 2, 3, 128, 129)] == [1, 1, 2, 4, 128, 256]
    assert [cdiv(a, b) for a, b in ((0, 4), (1, 4), (8, 4), (9, 4))] == [0, 1, 2, 3]
    assert copy_block_shape(1792) == (8, 2048)  # H=7168 bf16 rows: 8 whole rows per step
    assert copy_block_shape(40000) == (1, 16384)


def _post(box, rank, words, own):
    """What check_fingerprints writes when ``rank``'s row differs from this rank's call ``own``."""
    R = box.num_ranks
    box.view[R + 2 + 2 * rank:R + 4 + 2 * rank] = words
    box.view[R + 2 + 2 * R:R + 4 + 2 * R] = own
    box.view[0] = 1


def test_fingerprint_fields_round_trip():
    words = agreement.pack(call=agreement.CALL_DISPATCH, hidden=7168, x=2, num_topk=8, num_experts=256,
                           handle=12345, num_worst_tokens=1)
    fields = agreement.unpack(words)
    assert (fields["hidden"], fields["x"], fields["num_topk"], fields["num_experts"], fields["handle"]) == \
        (7168, 2, 8, 256, 12345)
    word, shift, mask = agreement.field("handle")
    assert (words[word] >> shift) & mask == 12345
    with pytest.raises(KeyError):
        agreement.pack(hiden=1)


def test_mailbox_disagreement_names_the_argument_and_ranks_and_stays_raised():
    box = HostMailbox(3, 8, pinned=False)
    own = agreement.pack(call=agreement.CALL_DISPATCH, hidden=256, x=1, num_topk=2, num_experts=12)
    _post(box, 2, agreement.pack(call=agreement.CALL_DISPATCH, hidden=384, x=1, num_topk=2, num_experts=12), own)
    for _ in range(2):  # sticky
        with pytest.raises(EPInputError) as err:
            box.raise_pending(0, 1.0)
        assert err.value.argument == "hidden"
        assert "ranks [0, 1]: 256" in str(err.value) and "ranks [2]: 384" in str(err.value)


def test_mailbox_different_calls_name_the_call():
    box = HostMailbox(2, 8, pinned=False)
    own = agreement.pack(call=agreement.CALL_COMBINE, hidden=256, x=1)
    _post(box, 1, agreement.pack(call=agreement.CALL_CACHED, hidden=256, x=1), own)
    with pytest.raises(EPInputError, match="combine.*dispatch \\(cached\\)") as err:
        box.raise_pending(0, 1.0)
    assert err.value.argument == "call"


def test_mailbox_abort_names_the_rejected_argument():
    box = HostMailbox(2, 8, pinned=False)
    own = agreement.pack(call=agreement.CALL_DISPATCH, hidden=256, x=1)
    _post(box, 1, agreement.abort_words("topk_weights"), own)
    with pytest.raises(EPInputError, match="rank 1 rejected its input") as err:
        box.raise_pending(0, 1.0)
    assert err.value.argument == "topk_weights"


@pytest.mark.parametrize("code,argument", [(agreement.ABORT_NUM_TOKENS_PER_RANK, "num_tokens_per_rank"),
                                           (agreement.ABORT_NUM_TOKENS_PER_EXPERT, "num_tokens_per_expert")])
def test_mailbox_device_count_check_names_the_count(code, argument):
    box = HostMailbox(2, 8, pinned=False)
    own = agreement.pack(call=agreement.CALL_DISPATCH, hidden=256, x=1)
    _post(box, 0, (own[0], own[1] | code), own)  # the staging kernel folded the code into rank 0's row
    with pytest.raises(EPInputError, match="checked on device") as err:
        box.raise_pending(0, 1.0)
    assert err.value.argument == argument


def test_mailbox_disagreement_asks_for_a_resync_and_clear_forgets_it():
    """A disagreement raises until the resync (the ranks' signals are out of step), which clears
    every word and the notify sequence; timeouts stay (a peer's state is unknown)."""
    box = HostMailbox(2, 8, pinned=False)
    own = agreement.pack(call=agreement.CALL_DISPATCH, hidden=256, x=1)
    _post(box, 1, agreement.pack(call=agreement.CALL_DISPATCH, hidden=512, x=1), own)
    for _ in range(2):
        with pytest.raises(EPInputError, match="re-pair"):
            box.raise_pending(0, 1.0)
    assert box.resync_needed
    box.sequence = 5
    box.clear()
    assert not box.resync_needed and box.sequence == 0
    box.raise_pending(0, 1.0)  # nothing left


def test_fill_value_writes_every_share_and_nothing_past_the_count():
    """copy.fill_value (-1 into recv_src_idx and the top-k ids of a call whose count exchange never
    came, one_node/dispatch.py) and fill_nan on top of it, under Triton's interpreter: every
    element of ``count`` gets the value, whatever the programs' shares, and nothing after it
    (tests/fill_cases.py)."""
    import json

    from interpreted import run_cases
    results = [json.loads(line) for line in run_cases("fill_cases.py").splitlines()]
    assert len(results) == 4 and all(r["filled"] and r["untouched_after"] for r in results), results
