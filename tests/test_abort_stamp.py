"""A rank that rejects its input aborts its peers' waits (gpu/agreement.py, ep_abort), and the abort
covers exactly the calls it never signalled (issue 50). Before, it said "aborted" to every call: a
peer still checking the round trip the aborter had just finished took it for a failed one and
returned NaN rows (ll_one_bad on the one-GPU bed). The abort's stamp (ABORT_EPOCH + the epoch a
signal word last carried) and the receiver's verdict are the kernels' own device functions, run
here by Triton's interpreter on the CPU (tests/abort_stamp_cases.py) over a model of one sender's
signals: a receiver behind the aborter, in the aborted call, or ahead of it by one or two calls on
either half (as a receiver is after the aborter skipped a call: "the half of the aborter's next
call" is then the wrong one, which broke the narrowed abort of 7aa8827), or a call late through a
hook; and the same for normal mode (one node: the flag word, halves by the epoch's parity, and the
overlapped combine's wait on blocks the abort does not stamp). Skipped where Triton is not installed."""
import json

import pytest

pytest.importorskip("triton")

from interpreted import run_cases  # noqa: E402

from epcomm.backends.gpu.agreement import abort_words, pack, unpack  # noqa: E402

ABORT = 1 << 30  # sync.ABORT_EPOCH
FP = pack(call=5, hidden=256, x=1, num_topk=2, num_experts=32, num_max_dispatch_tokens_per_rank=32)  # a combine's
ABORT_FP = abort_words("x")
MESSAGES = 7  # a dispatch count: what the sender's call c sent this receiver is MESSAGES + c


def _run(specs):
    return json.loads(run_cases("abort_stamp_cases.py", stdin=json.dumps(specs)))


def _sender(last, count_word: bool, first_half: int = 0):
    """One sender's signals to one receiver after its calls 1..last of one kind, then its abort
    (ep_abort): ``(rows by half, signal words by half)`` before the stamp. Call c used half
    ``(c - 1 + first_half) % 2`` (first_half 1: halves that do not follow the epochs from 0, as in
    graph replays). The abort row goes into the half without the last row, stamped with ``last``."""
    rows, sent = [[0, 0, 0], [0, 0, 0]], [0, 0]
    for c in range(1, last + 1):
        half = (c - 1 + first_half) % 2
        rows[half], sent[half] = [*FP, c], c
    abort_half = 1 if sent[1] < sent[0] else 0
    rows[abort_half] = [*ABORT_FP, ABORT + last]
    if count_word:  # per half: (epoch << 32) | messages
        words = [(sent[h] << 32) | (MESSAGES + sent[h] if sent[h] else 0) for h in (0, 1)]
    else:  # the combine flag: one word, the last epoch
        words = [last, last]
    return rows, words


def _cases(count_word: bool):
    """Receivers of every call around the abort, for senders that made 0..5 calls."""
    cases = []
    for last in range(0, 6):
        for first_half in (0, 1):
            rows, words = _sender(last, count_word, first_half)
            for epoch in range(max(1, last - 1), last + 4):
                half = (epoch - 1 + first_half) % 2
                cases.append(dict(last=last, epoch=epoch, half=half, rows=rows, words=words))
    return cases


@pytest.fixture(scope="module")
def results():
    """Per kind of signal word: its stamp spec and result, the cases, and the receivers' verdicts
    on the stamped words (two interpreter runs: the stamps, then the verdicts)."""
    kinds = {count_word: _cases(count_word) for count_word in (False, True)}
    specs = {count_word: dict(words=sorted({w for case in cases for w in case["words"]}),
                              shift=32 if count_word else 0, fp=list(FP), rows=[])
             for count_word, cases in kinds.items()}
    stamps = dict(zip(kinds, _run([specs[k] for k in kinds])))
    verdict_specs = []
    for count_word, cases in kinds.items():
        stamped = dict(zip(specs[count_word]["words"], stamps[count_word]["stamped_words"]))
        rows = []
        for case in cases:
            case["signal"] = stamped[case["words"][case["half"]]]
            own, other = case["rows"][case["half"]], case["rows"][1 - case["half"]]
            rows.append([*own, *other, case["signal"], case["epoch"]])
        verdict_specs.append(dict(words=[], shift=specs[count_word]["shift"], fp=list(FP), rows=rows))
    verdicts = dict(zip(kinds, (done["verdicts"] for done in _run(verdict_specs))))
    return {k: (specs[k], stamps[k], kinds[k], verdicts[k]) for k in kinds}


@pytest.mark.parametrize("count_word", [False, True], ids=["combine flag", "dispatch count word"])
def test_a_stamp_keeps_what_the_word_carried(results, count_word):
    spec, done, _, _ = results[count_word]
    shift = spec["shift"]
    for word, stamped in zip(spec["words"], done["stamped_words"]):
        assert stamped >> shift == ABORT + (word >> shift), (word, stamped)
        assert stamped & ((1 << shift) - 1) == word & ((1 << shift) - 1)  # a count word's messages stay
    again = _run([dict(words=done["stamped_words"], shift=shift, fp=list(FP), rows=[])])[0]["stamped_words"]
    assert again == done["stamped_words"]  # a second abort before the resync changes nothing


@pytest.mark.parametrize("count_word", [False, True], ids=["combine flag", "dispatch count word"])
def test_the_abort_covers_exactly_the_calls_the_sender_never_signalled(results, count_word):
    """Behind (the call the sender finished just before aborting: the race of issue 50) and a hook a
    call late: agreed, and a count word still gives the call's messages. The aborted call and every
    later one, on either half, one call off or not: failed, naming the rejected argument."""
    _, _, cases, verdicts = results[count_word]
    for case, (differ, word0, word1) in zip(cases, verdicts):
        aborted = case["epoch"] > case["last"]
        assert bool(differ) == aborted, case
        if aborted:
            assert unpack((word0, word1))["abort"] == unpack(ABORT_FP)["abort"], case
        elif count_word and case["epoch"] == case["last"]:
            assert case["signal"] & 0xFFFFFFFF == MESSAGES + case["last"], case


def test_a_finished_call_is_failed_by_the_old_abort_and_not_by_the_stamp():
    """The round trip the sender finished (epoch 3) seen by a receiver still checking it: the old
    abort (ABORT_EPOCH into the flag and both halves' rows) fails it; the stamp does not. An
    ABORT_EPOCH signal itself still covers every call (a sender that aborted before any call)."""
    own_real = [*FP, 3]
    old = [*ABORT_FP, ABORT, *ABORT_FP, ABORT, ABORT, 3]
    new = [*own_real, *ABORT_FP, ABORT + 3, ABORT + 3, 3]
    first = [*ABORT_FP, ABORT, 0, 0, 0, ABORT, 1]
    out = _run([dict(words=[], shift=0, fp=list(FP), rows=[old, new, first])])[0]["verdicts"]
    assert [v[0] for v in out] == [1, 0, 1]


def test_a_torn_read_of_an_abort_row_is_settled_by_the_second_look():
    """A receiver a call late (a hook's receive) reading the half the abort is writing: the words of
    the abort with the row's old epoch seem to differ; read again in order (check_rows: the words
    acquired, then the epoch field), the abort's epoch comes with them and the call agrees. A row of
    this call with other words (a real disagreement) differs both times."""
    torn = [*ABORT_FP, 2, *FP, 3, 3, 2]
    again = [*ABORT_FP, ABORT + 3, *FP, 3, 3, 2]
    other_call = [FP[0] ^ 4, FP[1], 2, *FP, 1, 2, 2]
    out = _run([dict(words=[], shift=0, fp=list(FP), rows=[torn, again, other_call])])[0]["verdicts"]
    assert [v[0] for v in out] == [1, 0, 1]
    assert out[2][1:] == [FP[0] ^ 4, FP[1]]  # the differing words are recorded


def test_a_receiver_the_sender_never_reached_is_covered():
    """A count word of an older call (the sender masked this receiver, or skipped a call): the stamp
    over it covers the receiver's call, and with no abort row the record still names an abort."""
    word = (2 << 32) | 5
    spec = dict(words=[word], shift=32, fp=list(FP), rows=[])
    stamped = _run([spec])[0]["stamped_words"][0]
    out = _run([dict(words=[], shift=32, fp=list(FP), rows=[[*FP, 2, *FP, 1, stamped, 4]])])[0]["verdicts"]
    differ, word0, word1 = out[0]
    assert differ == 1 and unpack((word0, word1))["call"] == 15 and unpack((word0, word1))["abort"] == 255


# ---------------------------------------------------------------------- normal mode (one node)
def _normal_sender(last):
    """One sender's normal-mode signals to one receiver after its normal signals 1..last (a notify,
    a stage, a push: one epoch each, ``sync.EPOCH_NORMAL`` after them), then its abort: ``(rows by
    half, flag word)`` before the stamp. The signal of epoch c posts its row in half ``c % 2`` (the
    kernels' half is the epoch's parity); the abort row goes into half ``(last + 1) % 2`` (ep_abort),
    stamped with ``last``, and the flag word carried ``last``."""
    rows = [[0, 0, 0], [0, 0, 0]]
    for c in range(1, last + 1):
        rows[c % 2] = [*FP, c]
    rows[(last + 1) % 2] = [*ABORT_FP, ABORT + last]
    return rows, last


@pytest.fixture(scope="module")
def normal_results():
    """Receivers of every normal call around the abort (a hook a call late, the call the sender
    finished, the aborted call, one and two calls ahead), for senders that made 0..5 signals: the
    flag's stamp, the verdict (acquire_and_agree, the notify: check_rows with the flag's stamp) and
    whether the rows end a wait on blocks the abort never stamps (the overlapped combine's reduce:
    sync.row_ends_wait over this call's half and the other)."""
    cases = []
    for last in range(0, 6):
        rows, flag = _normal_sender(last)
        for epoch in range(max(1, last - 1), last + 4):
            cases.append(dict(last=last, epoch=epoch, own=rows[epoch % 2], other=rows[1 - epoch % 2], flag=flag))
    flags = sorted({case["flag"] for case in cases})
    stamped = dict(zip(flags, _run([dict(words=flags, shift=0, fp=list(FP), rows=[])])[0]["stamped_words"]))
    spec = dict(words=[], shift=0, fp=list(FP),
                rows=[[*c["own"], *c["other"], stamped[c["flag"]], c["epoch"]] for c in cases],
                waits=[[*c["own"], c["other"][2], c["epoch"]] for c in cases])
    done = _run([spec])[0]
    return cases, stamped, done["verdicts"], done["ends"]


def test_normal_flag_stamps_keep_the_last_epoch(normal_results):
    _, stamped, _, _ = normal_results
    assert all(word == ABORT + flag for flag, word in stamped.items())


def test_normal_abort_covers_exactly_the_calls_the_sender_never_signalled(normal_results):
    """The flag's stamp ends every wait (it is above every epoch); the verdict fails the call iff
    the sender never signalled it, naming the argument; a wait on the overlapped combine's blocks
    ends by the rows iff the call is aborted (never earlier: a sender that signalled the call is
    still pushing its blocks, and the verdict would pass)."""
    cases, stamped, verdicts, ends = normal_results
    for case, (differ, word0, word1), end in zip(cases, verdicts, ends):
        aborted = case["epoch"] > case["last"]
        assert stamped[case["flag"]] >= case["epoch"], case
        assert bool(differ) == aborted, case
        assert bool(end) == aborted, case
        if aborted:
            assert unpack((word0, word1))["abort"] == unpack(ABORT_FP)["abort"], case


def test_normal_peer_behind_in_and_ahead_of_the_aborted_call():
    """A sender whose last normal signal was epoch 4 (a combine's push) aborts its next call. A peer
    still checking epoch 4 (its reduce, behind): agreed — the old abort (ABORT_EPOCH into the flag
    and both halves' rows) failed it, the race of issue 50 in normal mode. A peer in the aborted
    call (epoch 5, the abort row in its half) and one a call ahead (epoch 6: its half still holds
    the sender's row of epoch 4, the abort row is in the other one): failed."""
    rows, flag = _normal_sender(4)
    stamp = ABORT + flag
    behind = [*rows[0], *rows[1], stamp, 4]
    old_behind = [*ABORT_FP, ABORT, *ABORT_FP, ABORT, ABORT, 4]
    in_call = [*rows[1], *rows[0], stamp, 5]
    ahead = [*rows[0], *rows[1], stamp, 6]
    waits = [[*rows[0], rows[1][2], 4], [*rows[1], rows[0][2], 5], [*rows[0], rows[1][2], 6]]
    done = _run([dict(words=[], shift=0, fp=list(FP), rows=[behind, old_behind, in_call, ahead], waits=waits)])[0]
    assert [v[0] for v in done["verdicts"]] == [0, 1, 1, 1]
    assert done["ends"] == [0, 1, 1]
    for v in done["verdicts"][2:]:
        assert unpack((v[1], v[2]))["abort"] == unpack(ABORT_FP)["abort"]
