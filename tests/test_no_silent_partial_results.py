"""No silent partial results (issue 50), on the reference backend (CPU ranks): a late rank is an
error unless ``enable_shrink`` is on, a wait that gave up leaves NaN where rows are missing, vLLM's
elastic recovery works as vLLM calls it, a skipped combine costs one error per rank, and a handle
or a size of another Buffer is named. The GPU halves: the kernels' side is compile-checked in
test_low_latency_kernels_host.py; Buffer's part of the shared-GPU caps is checked here."""
import pytest

import failure_cases
import late_rank_cases


@pytest.mark.parametrize("mode", ["low_latency", "normal"])
def test_a_late_rank_without_shrink_is_an_error_on_every_rank_then_calls_pair(pools, mode):
    """4 ranks, rank 3 comes 0.5 s after the timeout (1.5 s). No rank gets data: ranks 0-2 raise
    EPTimeoutError naming rank 3 within the timeout, rank 3 raises it too when it comes (the call
    is void everywhere), and the next two round trips pair and are right on every rank. (Before:
    low-latency mode masked rank 3 without enable_shrink and ranks 0-2 got wrong sums silently.)"""
    results = pools.get(4).run(late_rank_cases.late_rank, mode, False, timeout_s=120)
    for rank, (first, after) in enumerate(results):
        kind, peers, message, seconds = first
        assert kind == "EPTimeoutError" and 3 in peers, (rank, first)  # (a rank slowed by the machine may join it)
        if rank != 3:
            assert seconds < 1.5 + 1.5, (rank, first)
        assert after == [("ok", True), ("ok", True)], (rank, after)


def test_a_late_rank_with_shrink_is_masked_and_the_call_goes_on(pools):
    """The same late rank with enable_shrink: ranks 0-2 mask it and their round trip is the sum over
    the live ranks' experts (DeepEP's semantics); rank 3 raises EPError (its peers masked it). After
    low_latency_clean_mask_buffer and clean_low_latency_buffer on every rank the next round is whole."""
    results = pools.get(4).run(late_rank_cases.late_rank, "low_latency", True, timeout_s=120)
    for rank, (first, after) in enumerate(results):
        if rank == 3:
            assert first[0] == "EPError" and "masked this rank" in first[2], first
            assert after == [("ok", True)], after
        else:
            assert first[:2] == ("ok", True), (rank, first)
            assert after == [("mask", [0, 0, 0, 1]), ("ok", True)], (rank, after)


def test_a_skipped_combine_costs_one_error_per_rank(pools):
    """Rank 1's expert code raises after dispatch and it skips the combine; ranks 0, 2, 3 raise
    EPInputError naming ``call`` at once, rank 1's next dispatch pairs with their next one (the
    skipped combine gives way), and every later round is right: one error per rank, not two."""
    timeout = 5.0
    results = pools.get(4).run(late_rank_cases.skipped_combine, timeout, timeout_s=120)
    for rank, steps in enumerate(results):
        (first, seconds), rest = steps[0], steps[1:]
        assert first == (("expert code", "expert code failed") if rank == 1 else ("EPInputError", "call")), \
            (rank, steps)
        assert seconds < timeout / 3, (rank, steps)
        assert [outcome for outcome, _ in rest] == [("ok", True)] * 2, (rank, steps)


def test_a_handle_of_another_group_size_is_named(pools):
    """A handle made by a 4-rank Buffer given to a 2-rank Buffer: EPInputError naming ``handle``
    (not a peer failure), in combine, cached dispatch and low-latency combine; calls pair after."""
    results = pools.get(4).run(late_rank_cases.handle_of_another_group_size, timeout_s=120)
    for rank in (0, 1):
        assert results[rank] == [("EPInputError", "handle")] * 3 + [("next call", True)], results[rank]


def test_undersized_num_rdma_bytes_is_named_on_cpu_too(pools):
    assert pools.get(2).run(late_rank_cases.undersized_rdma_bytes, timeout_s=120) == \
        [[("EPInputError", "num_rdma_bytes"), ("hint fits", True)]] * 2


def test_the_buffer_caps_every_config_at_the_backends_max_num_sms(pools):
    """Ranks sharing a GPU: the GPU backends set ``max_num_sms`` (gpu/shared_grids.py) and Buffer
    caps every Config it resolves, a given one or the default; a smaller explicit value wins."""
    seen = pools.get(1).run(late_rank_cases.config_capped_for_a_shared_gpu, timeout_s=120)[0]
    assert seen == {"no cap": 24, "given 24": 4, "given 2": 2, "default": 4, "rest kept": True,
                    "round trip": True, "handle's channels": (12, (1, 12), (late_rank_cases.M, 1)),
                    "default's channels": True}, seen


def _processes(target, world_size: int, args: tuple, needed) -> dict:
    """``{rank: result}`` of ``target`` run in a process per rank, once the ``needed`` ranks put theirs
    (the stalled or dead rank is not waited for)."""
    got = {}
    with failure_cases.ranks_in_processes(target, world_size, args, join_s=1.0) as results:
        while not set(needed) <= set(got):
            item = results.get(timeout=60)
            got[item[0]] = item[1:]
    return got


@pytest.mark.parametrize("call", ["dispatch", "combine"])
def test_a_wait_that_gave_up_leaves_nan_where_rows_are_missing(call):
    """Rank 2 makes the low-latency call but its rows go out only after its peers' waits gave up:
    their hooks raise EPTimeoutError naming it, and the rows they know are missing are NaN — the
    stalled source's rows of a dispatch, the combined rows of tokens with an expert on rank 2 (in
    ``out=``) — while every other row is right. No plausible data from a call that failed."""
    got = _processes(late_rank_cases.stalled_exchange_main, 3, (call,), needed=(0, 1))
    for rank in (0, 1):
        outcome, checks = got[rank]
        assert outcome == ("EPTimeoutError", [2]), (rank, outcome)
        assert checks and all(checks.values()), (rank, checks)


def test_vllm_elastic_recovery_as_vllm_calls_it():
    """enable_shrink, rank 3 dies: the live ranks mask it and their rounds are right; then
    get_local_buffer_tensor(int8, use_rdma_buffer=True).zero_() and low_latency_clean_mask_buffer(),
    and the next round trips are right (the dead rank masked again at the first wait)."""
    got = _processes(late_rank_cases.elastic_recovery_main, 4, (), needed=(0, 1, 2))
    assert sorted(got) == [0, 1, 2], got
    for rank, (seen,) in got.items():
        assert seen == [("whole", True), ("dead rank masked", True), ("mask", [0, 0, 0, 1]),
                        ("after clean 72", True), ("after clean 73", True), ("mask again", [0, 0, 0, 1])], (rank, seen)
