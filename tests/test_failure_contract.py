"""The failure contract on the reference backend (CPU ranks): errors on every rank, naming the
argument or the rank, instead of hangs, aborts or wrong results."""
import pytest

import dropped_round_cases
import failure_cases


@pytest.mark.parametrize("case", ["hidden", "x", "topk_idx", "num_experts", "num_topk"])
def test_ranks_that_disagree_all_raise_naming_the_argument(pools, case):
    results = pools.get(2).run(failure_cases.disagreement, case, timeout_s=120)
    for kind, argument, message in results:
        assert kind == "EPInputError" and argument == case, (kind, argument, message)
        assert "ranks [0]" in message and "ranks [1]" in message, message


def test_bad_argument_on_one_rank_raises_on_every_rank(pools):
    assert pools.get(2).run(failure_cases.one_rank_bad_argument, timeout_s=120) == [("EPInputError", "x")] * 2


@pytest.mark.parametrize("call", ["dispatch", "combine"])
def test_absent_rank_is_named_within_the_timeout(pools, call):
    """Normal mode raises; low-latency mode masks instead (test_low_latency_masks_a_dead_rank...).
    The error names the call and says where the late rank last waited, or that it never waited
    long: a skipped or stalled call then reads apart from an exited process."""
    results = pools.get(3).run(failure_cases.absent_rank, call, with_message=True, timeout_s=120)
    assert results[-1] == ("absent",)
    for kind, peers, message, seconds in results[:-1]:
        assert kind == "EPTimeoutError" and peers == [2], (kind, peers)
        assert seconds < 2.0 + 5.0, seconds
        assert f"{call} (call " in message and "rank 2 has not waited long in any call" in message, message


def test_a_late_ranks_error_says_where_it_last_waited(pools):
    """A rank that waited long in a call and then never made the next one: the peers' error names
    the call it last waited in (here a dispatch they made), which tells a stalled or skipped call
    apart from an exited process (2026-11-28f: one CI run met such a timeout and said no more)."""
    results = pools.get(3).run(failure_cases.late_rank_last_seen, timeout_s=120)
    assert results[-1] == ("absent",)
    for kind, peers, message in results[:-1]:
        assert kind == "EPTimeoutError" and peers == [2], (kind, peers, message)
        assert "rank 2 last waited in dispatch (Buffer #" in message, message


def _processes(target, world_size: int, args: tuple, num_results: int) -> list:
    """The first ``num_results`` results of ``target`` run in a process per rank."""
    with failure_cases.ranks_in_processes(target, world_size, args) as results:
        return [results.get(timeout=90) for _ in range(num_results)]


@pytest.mark.parametrize("call", ["dispatch", "combine"])
def test_exited_rank_is_named_within_the_timeout(call):
    """A rank whose process exits (sockets closed): the others raise EPTimeoutError naming it."""
    got = sorted(_processes(failure_cases.exited_rank_main, 3, (call,), 2))
    for rank, kind, peers, seconds in got:
        assert kind == "EPTimeoutError" and peers == [2], (rank, kind, peers)
        assert seconds < 2.0 + 5.0, seconds


def test_store_host_exit_still_names_the_stalled_rank():
    """Rank 2 stalls; rank 0 (the store's host) times out first and exits; rank 1, still waiting
    when the store goes, names rank 2 — the rank it was waiting for — not only the dead store."""
    got = dict((item[0], item[1:]) for item in _processes(failure_cases.store_host_exit_main, 3, (), 2))
    assert got[0][:2] == ("EPTimeoutError", [2]), got[0]
    kind, peers, message = got[1]
    assert kind == "EPTimeoutError" and peers == [2] and "unreachable" in message, got[1]


@pytest.mark.parametrize("case", ["num_tokens_per_rank", "is_token_in_rank", "num_tokens_per_expert", "topk_idx"])
def test_counts_that_do_not_match_the_routing_are_rejected(pools, case):
    assert pools.get(2).run(failure_cases.inconsistent_counts, case, timeout_s=120) == [("EPInputError", case)] * 2


def test_low_latency_masks_a_dead_rank_and_goes_on(pools):
    assert pools.get(3).run(failure_cases.low_latency_dead_rank, timeout_s=120) == ["masked", "masked", "dead"]


def test_rejected_layout_stands_in_for_the_skipped_dispatch(pools):
    """Calls pair by identity after a local layout error."""
    results = pools.get(4).run(failure_cases.rejected_layout_stands_in, timeout_s=120)
    for rank, seen in enumerate(results):
        first = ("EPInputError", "topk_idx", True) if rank != 1 else ("EPInputError", "topk_idx", False)
        assert seen[0] == first, (rank, seen)
        assert seen[1:] == [("ok", True)] * 2, (rank, seen)


@pytest.mark.parametrize("case", ["shape", "values"])
def test_low_latency_combine_checks_topk_idx_against_its_dispatch(pools, case):
    """EPInputError naming topk_idx on every rank, nothing exchanged, then usable."""
    assert pools.get(4).run(failure_cases.low_latency_combine_topk_idx, case, timeout_s=120) == \
        [("EPInputError", "topk_idx")] * 4


def test_a_rank_masked_by_its_peers_raises_instead_of_exchanging(pools):
    """No call returns data after a desync unless it paired."""
    results = pools.get(4).run(failure_cases.masked_rank_learns_it, timeout_s=120)
    assert results == [("ok", True), ("EPError", True), ("ok", True), ("ok", True)], results


def test_random_sequence_of_faults(pools):
    """200 steps of valid calls, bad inputs on random ranks, disagreements, rejected
    layouts and skipped combines; after each step every rank raised naming the argument (and
    the rank) or returned the reference's result, and the next valid call succeeded."""
    from sequence_cases import error_sequence
    results = pools.get(4).run(error_sequence, 200, 11, timeout_s=300)
    assert all(r == results[0] or set(r) == set(results[0]) for r in results), results
    for key in ("ok", "bad_raised", "disagree_raised", "layout_raised", "skip_raised"):
        assert results[0].get(key, 0) > 0, results[0]


def test_random_sequence_with_skipped_calls_on_two_buffers(pools):
    """300 steps on two Buffers of one group (normal mode on one, low-latency on the other), the
    faults above plus skipped calls: a rank skips a combine or a low-latency combine (its next call
    on the same Buffer or on the other one), or drops a whole step before its dispatch. Every step
    either raised EPInputError naming the argument or ``call`` on every rank the plan says, or
    returned the reference's result; the next step is correct on every rank — no wrong data."""
    from sequence_cases import error_sequence
    results = pools.get(4).run(error_sequence, 300, 23, two_buffers=True, timeout_s=400)
    assert all(set(r) == set(results[0]) for r in results), results
    for key in ("ok", "bad_raised", "disagree_raised", "layout_raised", "skip_raised", "drop_raised"):
        assert results[0].get(key, 0) > 0, results[0]


def test_a_rejected_layout_after_a_dropped_round_stands_in_for_its_own_call(pools):
    results = pools.get(4).run(dropped_round_cases.dropped_round_then_rejected_layout, timeout_s=120)
    peer = [("EPInputError", "call"), ("EPInputError", "topk_idx", True), ("ok", True)]
    assert results == [peer] * 3 + [[("EPInputError", "topk_idx"), ("ok", True)]], results


def test_a_rank_that_dropped_rounds_in_a_row_pairs_again_when_it_comes_back(pools):
    results = pools.get(4).run(dropped_round_cases.dropped_rounds_in_a_row, timeout_s=120)
    assert results == [[("ok", True)]] + [[("EPInputError", "call")] * 3 + [("ok", True)]] * 3, results


def test_a_stand_in_that_comes_after_its_call_was_given_up_acts_on_the_verdict(pools):
    results = pools.get(4).run(dropped_round_cases.rejected_layout_then_dropped_round, timeout_s=120)
    call = ("EPInputError", "call")
    assert results == [[call, "ok", call, "ok", call, "ok"], [call, "ok", call, "ok", "ok"],
                       [("EPInputError", "topk_idx"), "ok", "ok", call, "ok"], [call, "ok", call, "ok", call, "ok"]], \
        results


def test_rejected_layout_then_clean_low_latency_buffer(pools):
    """The stand-in comes before a collective clean too (no barrier against peers still in the call)."""
    results = pools.get(3).run(failure_cases.rejected_layout_then_clean, timeout_s=120)
    assert results == [(("EPInputError", "topk_idx"), True)] * 3, results


def test_buffer_resyncs_and_aborts_as_the_gpu_backends_ask(pools):
    """Buffer's part of the GPU recovery (a rejected call), checked on CPU with a recording backend."""
    seen = pools.get(1).run(failure_cases.buffer_resync_rules, timeout_s=120)[0]
    assert all(seen.values()), seen


@pytest.mark.parametrize("skipped", ["combine", "ll_combine", "dispatch"])
def test_a_rank_that_skips_a_call_never_gets_wrong_data(pools, skipped):
    """Rank 1's expert code fails, so it skips a call its peers make (a normal combine, a
    low-latency combine, a whole low-latency round), then every rank goes on with normal and
    low-latency round trips on two Buffers of one group, dropping any step that raises. Every
    error is EPInputError('call') raised at once (no waiting out the timeout, no raw gloo error),
    no step returns wrong data, and every rank ends with a normal and a low-latency round that
    pair. (The last two steps are not judged: a rank that dropped fewer steps than rank 1 has
    calls left over once rank 1 returns — a rank that left, which the timeout covers.)"""
    timeout = 5.0
    results = pools.get(4).run(failure_cases.skipped_call_then_next_calls, skipped, timeout, timeout_s=300)
    for rank, steps in enumerate(results):
        judged = steps[:-2]
        for name, outcome, seconds in judged:
            assert outcome[0] in ("ok", "expert code", "EPInputError"), (rank, steps)
            if outcome[0] == "EPInputError":
                assert outcome[1] == "call" and seconds < timeout / 2, (rank, steps)
        assert [o[0] for _, o, _ in judged[-2:]] == ["ok", "ok"], (rank, steps)


def test_random_sequence_with_late_ranks(pools):
    """30 steps of the fault sequence with late ranks among the faults (tests/sequence_cases.py): a rank
    comes past the timeout to a round on a Buffer of its own — without enable_shrink every rank
    raises EPTimeoutError naming it and the next round pairs; with it the others mask it and get
    the live ranks' sum, the late rank raises, and after every rank unmasked and cleaned the next
    round is whole. The other faults and valid steps in between stay right."""
    from sequence_cases import error_sequence
    results = pools.get(4).run(error_sequence, 30, 41, late=True, timeout_s=300)
    assert all(r == results[0] for r in results), results
    for key in ("ok", "late_raised", "late_masked", "skip_raised"):
        assert results[0].get(key, 0) > 0, results[0]
