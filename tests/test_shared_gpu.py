"""Many ranks on one GPU: the nvshmem backend on the real NVSHMEM runtime at DeepEP's shapes.

Every rank is a process on GPU 0 under CUDA MPS (NVSHMEM's full multi-process-per-GPU mode), the
process group ``"cpu:gloo,cuda:gloo"`` (NCCL and PyTorch's CUDA symmetric memory refuse two ranks
on one GPU, so the automatic backend is nvshmem here, also for one node). This checks correctness
and memory ordering on the real runtime, not speed: the ranks share one GPU's SMs and memory.

Skipped unless ``EPCOMM_SHARED_GPU=1`` (MPS running): ``GPU_CHECK=shared-gpu-<part>
scripts/gpu_check.sh`` starts MPS, sets it, picks the shapes (``EPCOMM_SHARED_GPU_SHAPES``, e.g.
``16x8,16x2``: ranks x ranks per node) and stops MPS afterwards. A pool per shape; the tests of one
shape share it, in file order (the dead-rank and timeout cases last: they leave it out of step).

``EPCOMM_SHARED_GPU_BACKEND=nvlink`` runs the same tests on the nvlink backend instead (one-node
shapes only: ``8x8``), its workspace then in NVSHMEM's mapping (backends/nvlink/backend.py), and
``EPCOMM_SHARED_GPU_VARIANT`` (e.g. ``tile-reduce``) its normal mode in one of ``epcomm bench
normal --variants`` (tests/bed_choices.py).

The ranks share the GPU's SMs; the Buffer caps every grid so that all ranks' programs fit with room
for a late sender (gpu/shared_grids.py; finding 14), whatever Config the tests pass, so the bed sets
no SM count of its own (``EPCOMM_SHARED_GPU_NUM_SMS`` still sets one, for experiments).
"""
import os

import pytest
import torch

import bed_choices
import ep_cases
import epcomm
import failure_cases
import graph_cases
import lifetime_cases
import recovery_cases
import single_launch_cases
import training_cases
from epcomm.testing import WorkerPool

ALL_SHAPES = "2x1,4x2,8x1,8x4,8x8,16x8,16x2"
BACKEND = os.environ.get("EPCOMM_SHARED_GPU_BACKEND", "nvshmem")
VARIANT = os.environ.get("EPCOMM_SHARED_GPU_VARIANT", "")  # (the nvlink backend's one-node experiments)
if VARIANT and BACKEND != "nvlink":  # (the nvshmem backend would run its defaults under the variant's name)
    raise RuntimeError(f"EPCOMM_SHARED_GPU_VARIANT={VARIANT} is a one-node variant: it needs the nvlink backend")
SHAPES = [tuple(int(v) for v in s.split("x")) for s in os.environ.get("EPCOMM_SHARED_GPU_SHAPES", ALL_SHAPES).split(",")]
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(os.environ.get("EPCOMM_SHARED_GPU") != "1" or not torch.cuda.is_available(),
                                 reason="needs CUDA MPS running and EPCOMM_SHARED_GPU=1 (GPU_CHECK=shared-gpu-*)")]


class SharedPool:
    """A WorkerPool of ``ranks`` processes on GPU 0, started again when a failed test closed it
    (so one failure costs one test, not the shape's others)."""

    def __init__(self, ranks: int, per_node: int):
        if BACKEND == "nvlink" and per_node != ranks:
            pytest.skip(f"the nvlink backend runs one node: {ranks}x{per_node} is {ranks // per_node} nodes")
        self.world_size, self.per_node = ranks, per_node
        self._pool = None
        # the SMs the tests' Configs ask for: DeepEP's 24 (the Buffer caps it to what fits), or an experiment's
        self.set_num_sms = int(os.environ.get("EPCOMM_SHARED_GPU_NUM_SMS") or 0)
        self.num_sms = self.set_num_sms or 24

    def run(self, fn, *args, timeout_s=None, **kwargs):
        if self._pool is None or self._pool.closed:
            env = {"EPCOMM_RANKS_PER_NODE": str(self.per_node),
                   # each rank's symmetric heap: the largest workspace here (1024 tokens of 7168) fits
                   "NVSHMEM_SYMMETRIC_SIZE": str(3 << 30), "NVSHMEM_IGNORE_CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "1"}
            saved = {name: os.environ.get(name) for name in env}
            os.environ.update(env)  # the workers inherit it at spawn
            try:
                self._pool = WorkerPool(self.world_size, backend="shared-gpu", start_timeout_s=300)
            finally:
                for name, value in saved.items():
                    os.environ.pop(name) if value is None else os.environ.__setitem__(name, value)
            if self.set_num_sms:  # (otherwise the defaults', capped by the Buffer as any Config)
                self._pool.run(epcomm.Buffer.set_num_sms, self.set_num_sms)
            if BACKEND != "nvshmem":  # (the automatic choice here is nvshmem: ranks share a GPU)
                self._pool.run(bed_choices.choose_when_automatic, BACKEND)
            if VARIANT:  # an experiment's one-node kernels under the same tests
                self._pool.run(bed_choices.use_normal_variant_from_now, VARIANT)
        timeout_s = timeout_s or float(os.environ.get("EPCOMM_SHARED_GPU_CALL_S", "240"))
        try:
            return self._pool.run(fn, *args, timeout_s=timeout_s, **kwargs)
        except Exception as exc:  # shown at once: a run cut off at its limit prints no summary
            print(f"\nR={self.world_size}x{self.per_node} {getattr(fn, '__name__', fn)}: {type(exc).__name__}: "
                  f"{str(exc)[-3000:]}", flush=True)
            raise

    def close(self):
        if self._pool is not None:
            self._pool.close(force=True)


@pytest.fixture(scope="module", params=SHAPES, ids=[f"R{r}x{k}" for r, k in SHAPES])
def shared_pool(request):
    pool = SharedPool(*request.param)
    yield pool
    pool.close()


def _all(pool, fn, *args, timeout_s=None, **kwargs):
    return pool.run(fn, *args, timeout_s=timeout_s, **kwargs)


# ------------------------------------------------------------------ engines
@pytest.mark.parametrize("case", ["vllm_high_throughput", "vllm_low_latency", "vllm_low_latency_graph",
                                  "sglang_dispatchers", "megatron_fused"])
def test_engines_through_deep_ep(shared_pool, case):
    """``import deep_ep`` driven as each engine drives DeepEP (tests/engine_cases.py); vLLM's buffers
    on a plain gloo group, as vLLM passes it: the GPU backend on the current device all the same."""
    import engine_cases
    results = _all(shared_pool, getattr(engine_cases, case))
    assert all(results), results


# ------------------------------------------------------------------ normal mode
def test_buffers_dropped_unevenly(shared_pool):
    """Buffers ending at different points on different ranks (reference cycles, uneven collection)
    never hang or skew the symmetric heap; the ledger lets go of every old allocation."""
    for rank, result in enumerate(_all(shared_pool, lifetime_cases.buffers_dropped_unevenly, 6, 512)):
        assert result is not None, rank
        held, holders = result
        assert [let_go for _, _, let_go in held].count(False) == 0, (rank, [h for h in held if not h[2]], holders)


def test_peer_loads_see_released_stores(shared_pool):
    """A pull's hand-off alone (tests/reach_cases.py): each rank stages words in its own NVSHMEM
    memory and releases them; every peer acquires and loads them through the mapping, 20 rounds.
    Every word is right and every rank's own base is its buffer (docs/notes/multinode-log.md, finding 14)."""
    import reach_cases  # (Triton: only where the bed runs)
    for rank, result in enumerate(_all(shared_pool, reach_cases.peer_loads_see_released_stores)):
        assert result["bases"], f"rank {rank}: a peer unmapped, or its own base is not its buffer"
        wrong = [(round_, peer, n) for round_, row in enumerate(result["wrong"]) for peer, n in enumerate(row) if n]
        assert not wrong, f"rank {rank}: (round, peer, words wrong or -1 timed out): {wrong[:10]}"


def test_internode_deepep_usage(shared_pool):
    """DeepEP's internode test shape: 1024 tokens, H=7168, top-8 of 16 experts per rank within
    the best 2 node groups, Config(num_sms, 8, 512, 16, 128), BF16 + FP8, async_finish and
    previous_event, num_worst_tokens, cached dispatch, combine (internode_cases.py)."""
    from internode_cases import internode_against_reference
    config = (shared_pool.num_sms, 8, 512, 16, 128)  # DeepEP's (24 SMs: the Buffer caps them here)
    results = _all(shared_pool, internode_against_reference, 1024, 7168, 16, 8, 2, config)
    assert results == [{"backend": BACKEND, "checked": 10}] * shared_pool.world_size, results


SWEEP = [(scenario, tokens, hidden, False, False) for scenario in ep_cases.SCENARIOS
         for tokens, hidden in ((0, 2048), (300, 4096))] + \
    [("uniform", 1000, 7168, True, False), ("holes", 700, 4096, True, True), ("skewed", 512, 2048, False, True)]


def test_routings_sizes_fp8_worst_tokens(shared_pool):
    n = _all(shared_pool, ep_cases.gpu_normal_against_reference, SWEEP, 0, 1, shared_pool.per_node)
    assert n == [len(SWEEP)] * shared_pool.world_size


def test_rounds_of_repeated_calls(shared_pool):
    repeated = [("uniform", 512, 2048, False, False), ("holes", 256, 2048, True, False)]
    n = _all(shared_pool, ep_cases.gpu_normal_against_reference, repeated, 0, 5, shared_pool.per_node)
    assert n == [10] * shared_pool.world_size


# ------------------------------------------------------------------ low-latency mode
def test_low_latency_sweep(shared_pool):
    R = shared_pool.world_size
    for hidden, cases in ((2048, 12), (7168, 4)):
        size = epcomm.Buffer.get_low_latency_rdma_size_hint(128, hidden, R, 8 * R)
        n = _all(shared_pool, ep_cases.low_latency_sweep, cases, 400, hidden, 8, 128, "cuda", size, False, BACKEND,
                 shared_pool.per_node)
        assert n == [cases] * R


def test_low_latency_cuda_graph(shared_pool):
    assert _all(shared_pool, graph_cases.gpu_low_latency_graph, 4, 2048, BACKEND, shared_pool.per_node) == \
        [4] * shared_pool.world_size


@pytest.mark.skipif(BACKEND != "nvlink", reason="the one-node normal mode's paths (the nvlink backend)")
@pytest.mark.parametrize("variant", ["", "serial-dispatch"])
def test_num_worst_tokens_step_in_a_cuda_graph(shared_pool, variant):
    assert _all(shared_pool, graph_cases.gpu_normal_worst_graph, 4, 2048, variant) == [4] * shared_pool.world_size


@pytest.mark.skipif(BACKEND != "nvlink", reason="the one-node normal mode's paths (the nvlink backend)")
def test_the_count_exchange_and_stage_in_one_launch_at_every_group_size(shared_pool):
    """The single launches against the reference where the bed's grid caps would refuse them at 8
    ranks (num_sms 4: 8 notify + 8 list + 1 copy = 17 waiting programs > 16; a num_worst_tokens
    dispatch's whole launch up to 21): the bound raised to 6 x num_sms, with small batches
    (single_launch_cases.py); their prefix at R_P2 = 8, 16 warps."""
    assert _all(shared_pool, single_launch_cases.gpu_single_launch_small_batches, 6) == [4] * shared_pool.world_size


def test_expert_major_layout_at_every_group_size(shared_pool):
    """dispatch(expert_major=True) at DeepEP's routing width (top-8 of about 256 experts) with
    batches up to 1024 tokens: the position programs, the group-start table and the fold at every
    group size of the bed (R = 6 and 8 included), bf16 and FP8, against the reference and the torch
    re-layout of a plain dispatch (training_cases.py)."""
    R = shared_pool.world_size
    assert _all(shared_pool, training_cases.expert_major_against_reference, 4, 2048, "cuda", fp8=True,
                experts_per_rank=256 // R, num_topk=8, max_tokens=1024) == [4] * R


def _skip_where_deep_ep_cannot_run(pool) -> None:
    if pool.world_size not in (2, 4, 8) or pool.per_node != pool.world_size:
        pytest.skip("DeepEP's one-node kernels take 2, 4 or 8 ranks")


def _skip_without_the_peer(results) -> None:
    """Skip where the workers found no DeepEP, unless a wheel was carried for this run
    (peer_cases.peer_required): then a DeepEP that does not import fails the test."""
    import peer_cases
    missing = [result for result in results if isinstance(result, str)]
    if missing:
        assert not peer_cases.peer_required(), f"a DeepEP wheel was carried but the workers found none: {missing[0]}"
        pytest.skip(f"DeepEP V1 is not importable in the workers: {missing[0]}")


def test_the_bench_point_beside_deep_ep(shared_pool):
    """``epcomm bench normal --peer deep_ep``'s rank function on one small point, both libraries on
    the bed (peer_cases.py): every check passes, DeepEP's num_worst_tokens rows (eager and one CUDA
    graph's replay) among them, so a multi-GPU lease finds the peer's paths working. Skipped
    where DeepEP itself is not importable (``use_peer`` in scripts/gpu_env.sh)."""
    _skip_where_deep_ep_cannot_run(shared_pool)
    if VARIANT:  # (the bench sets the defaults for its point: it would run them under the variant's name)
        pytest.skip("the bench's point runs epcomm's defaults, not a variant")
    import peer_cases
    results = _all(shared_pool, peer_cases.bench_point_beside_the_peer)
    _skip_without_the_peer(results)
    for rank, result in enumerate(results):
        assert result["ok"] and all(result["checks"].values()), (rank, result["checks"])
    from epcomm.tools.bench import WORST_GRAPH
    assert WORST_GRAPH in results[0]["peer_calls"], results[0]["peer_calls"]


def test_outputs_and_handles_equal_deep_eps(shared_pool):
    """epcomm's one-node normal mode beside DeepEP V1 on the same batches (peer_cases.py): the
    layout, the dispatch's rows, top-k, counts and the handle's DeepEP fields that engines may read
    (all but recv_channel_prefix_matrix, DeepEP's receiver-side channel bookkeeping) are equal, and
    the combine agrees within bf16 rounding. Skipped where DeepEP itself is not importable."""
    _skip_where_deep_ep_cannot_run(shared_pool)
    import peer_cases
    results = _all(shared_pool, peer_cases.outputs_and_handles_beside_the_peer)
    _skip_without_the_peer(results)
    print(f"\nR={shared_pool.world_size}: rank 0's details (differences shown small): {results[0]['details']}")
    for rank, result in enumerate(results):
        differed = result["differed"]
        assert len(differed) == 8 + len(peer_cases.COMPARED_FIELDS), (rank, sorted(differed))  # every check ran
        assert not any(differed.values()), (rank, {check: cases for check, cases in differed.items() if cases},
                                            result["details"])


def test_captured_normal_calls_that_wait_on_the_host_are_refused(shared_pool):
    """nvlink: a full dispatch without num_worst_tokens; nvshmem (host-side epochs): every
    normal-mode dispatch and combine (graph_cases.gpu_captured_calls_refused)."""
    per_node = shared_pool.per_node if BACKEND == "nvshmem" else 0
    assert _all(shared_pool, graph_cases.gpu_captured_calls_refused, per_node) == ["raised"] * shared_pool.world_size


# ------------------------------------------------------------------ training
def test_autograd_and_moe_layer_match_dense(shared_pool):
    errors = _all(shared_pool, training_cases.autograd_against_dense, 3, 256, "cuda")
    assert max(errors) <= 2e-2, errors
    errors = _all(shared_pool, training_cases.moe_layer_against_dense, 256, 128, 2, 2, "cuda")
    assert all(max(e.values()) <= 2e-2 for e in errors), errors


def test_fuzz_normal_mode(shared_pool):
    """Valid but unusual inputs (duplicates, NaN/inf, empty ranks) against the reference."""
    from epcomm.testing.sweeps import normal_mode_sweep
    R = shared_pool.world_size
    assert _all(shared_pool, normal_mode_sweep, 100, 50_000, 128, 4, 24, True, "cuda") == [100] * R


def test_fuzz_low_latency(shared_pool):
    """The same unusual inputs in low-latency mode, every format and call style."""
    R = shared_pool.world_size
    size = epcomm.Buffer.get_low_latency_rdma_size_hint(16, 512, R, 4 * R)
    assert _all(shared_pool, ep_cases.low_latency_sweep, 100, 60_000, 512, 4, 16, "cuda", size, True) == [100] * R


def test_round_trips_end_without_a_backoff(shared_pool):
    """A cached dispatch + combine and a low-latency round trip, synchronised, take milliseconds at
    most even with the ranks sharing one GPU: a wait that ends only through a backoff or a timeout
    (hundreds of ms) would cost the same on real machines."""
    from internode_cases import round_trip_times
    times = _all(shared_pool, round_trip_times, 256, 2048, 10)
    print(f"R={shared_pool.world_size} nodes of {shared_pool.per_node}: median ms per rank {times}")
    worst = {name: max(t[name] for t in times) for name in times[0]}
    assert all(ms < 50 for ms in worst.values()), worst


# ------------------------------------------------------------------ failures (last: they can leave ranks out of step)
def test_one_node_schedule_serves_every_peer_at_once(shared_pool):
    """The nvlink backend's pull and push (schedule.py), traced: in rank order every rank's program 0
    starts on peer 0 and each quarter of a rank's work goes to one or two peers; every peer at once
    starts rank r on peer r + 1 and keeps every peer's share near 1/R over the whole call."""
    if BACKEND != "nvlink":
        pytest.skip("the one-node kernels run on the nvlink backend (nvshmem runs the two-level ones)")
    import schedule_trace_cases
    per_rank = _all(shared_pool, schedule_trace_cases.trace_calls, num_sms=shared_pool.num_sms)
    lines, largest = schedule_trace_cases.schedule_table(per_rank)
    print("\n" + "\n".join(lines), flush=True)
    R = shared_pool.world_size
    for kernel in ("pull", "push"):
        firsts = [min((rec for rec in result["every peer"][kernel] if rec[0] == 0), key=lambda rec: rec[3])[1]
                  for result in per_rank]
        assert firsts == [(rank + 1) % R for rank in range(R)], (kernel, firsts)
        assert all(min((rec for rec in result["rank order"][kernel] if rec[0] == 0), key=lambda rec: rec[3])[1] == 0
                   for result in per_rank)
        rank_order, every_peer = largest[("rank order", kernel)], largest[("every peer", kernel)]
        assert max(every_peer) < 1.5 and sum(every_peer) < sum(rank_order), (kernel, every_peer, rank_order)


def test_out_of_range_expert_ids_raise(shared_pool):
    """An expert id >= num_experts: get_dispatch_layout on nvshmem rejects it as nvlink does (the
    next call raises EPInputError naming topk_idx) and the Buffer stays usable."""
    assert _all(shared_pool, failure_cases.gpu_out_of_range_expert) == \
        [("EPInputError", "topk_idx")] * shared_pool.world_size


@pytest.mark.parametrize("case", sorted(failure_cases.GPU_CASES))
def test_failure_contract(shared_pool, case):
    results = _all(shared_pool, failure_cases.gpu_contract, case, 60.0, timeout_s=240)
    assert results == [("EPInputError", failure_cases.GPU_CASES[case])] * shared_pool.world_size, results


@pytest.mark.parametrize("case", recovery_cases.GPU_RECOVERY_CASES)
def test_a_call_that_raised_everywhere_leaves_the_buffer_usable(shared_pool, case):
    results = _all(shared_pool, recovery_cases.gpu_recovery, case, 60.0, timeout_s=240)
    want = {"layout": "topk_idx", "ll_one_bad": "x"}.get(case, "x")
    for rank, (first, after) in enumerate(results):
        assert first[:2] == ("EPInputError", want), (rank, first)
        assert after == [True, True], (rank, after)


def test_random_sequence_of_faults(shared_pool):
    from sequence_cases import error_sequence
    results = _all(shared_pool, error_sequence, int(os.environ.get("EPCOMM_SHARED_GPU_STEPS", "200")), 5, "cuda")
    for key in ("ok", "bad_raised", "disagree_raised", "layout_raised", "skip_raised"):
        assert results[0].get(key, 0) > 0, results[0]


def test_random_sequence_with_skipped_calls_on_two_buffers(shared_pool):
    """The fault sequence with a normal and a low-latency Buffer on the group: skipped combines,
    low-latency combines and whole rounds across the two (the call board, gpu/call_board.py)."""
    from sequence_cases import error_sequence
    steps = int(os.environ.get("EPCOMM_SHARED_GPU_STEPS", "200"))
    results = _all(shared_pool, error_sequence, steps, 23, "cuda", two_buffers=True)
    for key in ("ok", "skip_raised", "drop_raised", "skipped_call_found"):
        assert sum(r.get(key, 0) for r in results) > 0, results


@pytest.mark.parametrize("skipped", ["combine", "ll_combine", "dispatch"])
def test_a_rank_that_skips_a_call_never_gets_wrong_data(shared_pool, skipped):
    """Rank 1 skips a call (a normal combine, a low-latency combine, a whole low-latency round),
    then every rank runs normal and low-latency rounds on two Buffers of the group, dropping a
    step that raises. Every error is EPInputError('call'), raised long before the timeout; no round
    returns wrong data unreported; the ranks' last two rounds pair."""
    timeout = 30.0
    results = _all(shared_pool, failure_cases.skipped_call_then_next_calls, skipped, timeout, "cuda")
    failure_cases.judge_skipped_call_steps(results, timeout)


def test_timeout_names_the_stalled_rank(shared_pool):
    """A rank that stops taking part: every other rank raises EPTimeoutError naming it within the
    timeout + 5 s (no hang at 16 ranks)."""
    R = shared_pool.world_size
    assert _all(shared_pool, ep_cases.gpu_timeout_names_peer, timeout_s=180) == ["raised"] * (R - 1) + ["absent"]


@pytest.mark.parametrize("call", ["cached dispatch", "combine", "num_worst_tokens dispatch"])
def test_timeout_leaves_nan_rows_in_a_normal_call(shared_pool, call):
    """A rank stops after a full dispatch: the others' next cached dispatch, combine or
    num_worst_tokens dispatch gives up waiting, returns NaN in every row (no plausible data), and
    their next call names the rank. (nvlink: the pull's or reduce's wait gives up, a num_worst_tokens
    dispatch's count exchange first, in one launch with them where the bed's grid caps let it: 4
    ranks sharing the GPU, not 8; nvshmem: the step barrier, and the call's kernels skip.)"""
    import normal_nan_cases
    R = shared_pool.world_size
    shared_pool.close()  # fresh ranks: the timeout cases before this one leave the pool out of step
    one_launch = call == "num_worst_tokens dispatch" and BACKEND == "nvlink" and R <= 4
    assert _all(shared_pool, normal_nan_cases.missing_rows_are_nan, call, timeout_s=180) == \
        ["nan, then raised" + (" (one launch)" if one_launch else "")] * (R - 1) + ["absent"]


def test_low_latency_dead_rank_is_masked(shared_pool):
    R = shared_pool.world_size
    assert _all(shared_pool, ep_cases.gpu_low_latency_dead_rank, 2048, BACKEND, shared_pool.per_node,
                timeout_s=240) == ["masked"] * (R - 1) + ["dead"]


def test_vllm_elastic_recovery_as_vllm_calls_it(shared_pool):
    """enable_shrink, a rank stops taking part: the live ranks mask it and their rounds are right;
    then get_local_buffer_tensor(int8, use_rdma_buffer=True).zero_() and
    low_latency_clean_mask_buffer() between barriers of the live ranks, and the next rounds are
    right (the absent rank masked again at the first wait; tests/late_rank_cases.py)."""
    import late_rank_cases
    R = shared_pool.world_size
    results = _all(shared_pool, late_rank_cases.gpu_elastic_recovery, timeout_s=240)
    assert results[-1] == "absent", results[-1]
    for rank, seen in enumerate(results[:-1]):
        mask = [1 if r == R - 1 else 0 for r in range(R)]
        assert seen == [("whole", True), ("absent rank masked", True), ("mask", mask), ("after clean 92", True),
                        ("after clean 93", True), ("mask again", mask)], (rank, seen)


def test_low_latency_late_rank_without_shrink_is_an_error(shared_pool):
    """No enable_shrink: a rank late past the timeout is never a silently smaller sum (issue 50).
    The others' combine rows that needed it are NaN, the rest right, and their next call raises
    EPTimeoutError naming it; the late rank's rows from them are NaN and its next call raises too
    (tests/late_rank_cases.py). Last of the shape's tests: the group's call board is left out of
    step when the late rank's error is the board's (a new Buffer of the group then fails once)."""
    import late_rank_cases
    R = shared_pool.world_size
    for rank, (rows, following) in enumerate(_all(shared_pool, late_rank_cases.gpu_late_rank_without_shrink,
                                                  timeout_s=240)):
        print(f"rank {rank}: {rows}, next call {following}", flush=True)
        assert rows[1], (rank, rows)
        if rank < R - 1:
            assert following[0] == "EPTimeoutError" and R - 1 in following[1], (rank, following)
        else:  # the late rank: its waits gave up, or its call board found the peers gone on (nvlink, 4 x 4)
            assert following[0] == "EPTimeoutError" or following[:2] == ("EPInputError", "call"), (rank, following)


# ------------------------------------------------------------------ the call board after faults (tests/board_cases.py)
def test_call_board_fresh_buffers_after_a_stalled_rank(shared_pool):
    """A rank never makes a round its peers make (they raise EPTimeoutError naming it); Buffers made
    afterwards pair on every rank, the stalled rank's waits reading the board included (its call
    numbers start again with the peers' at the construction: gpu/call_board.py)."""
    import board_cases
    R = shared_pool.world_size
    for rank, (stalled, rounds) in enumerate(_all(shared_pool, board_cases.fresh_buffers_after_a_stall,
                                                  timeout_s=240)):
        assert stalled == ("absent" if rank == R - 1 else "EPTimeoutError"), (rank, stalled)
        assert rounds == [("ok", True)] * 4, (rank, rounds)


def test_call_board_late_rank_is_a_timeout_and_a_fresh_buffer_works(shared_pool):
    """No enable_shrink, after a stall: a rank late past the timeout raises EPTimeoutError naming
    peers, as they raise it naming it (never the board's EPInputError('call') and a resync its peers
    never join); then a fresh Buffer's rounds are right on every rank."""
    import board_cases
    R = shared_pool.world_size
    for rank, (stalled, warm, late_round, following, rounds) in enumerate(
            _all(shared_pool, board_cases.late_rank_then_fresh_buffer, timeout_s=240)):
        print(f"rank {rank}: late round {late_round}, next call {following}, fresh {rounds}", flush=True)
        assert warm == ("ok", True), (rank, warm)
        assert following[0] == "EPTimeoutError", (rank, following)
        if rank < R - 1:
            assert R - 1 in following[1], (rank, following)
            assert late_round == ("ok", "lost rows NaN, the rest right") or \
                (late_round[0] == "EPTimeoutError" and R - 1 in late_round[1]), (rank, late_round)
        else:
            assert following[1] and R - 1 not in following[1], (rank, following)
            assert late_round == ("ok", "late rank: some rows NaN") or late_round[0] == "EPTimeoutError", \
                (rank, late_round)
        assert rounds == [("ok", True)] * 2, (rank, rounds)


@pytest.mark.parametrize("after_stall", [False, True])
def test_call_board_skipped_combine_costs_one_error_per_rank(shared_pool, after_stall):
    """Rank 1 skips a normal combine (its expert code raised): every rank raises EPInputError('call')
    once — the peers at the call after the combine (its rows NaN), rank 1 in the dispatch that met
    their combine — and every later round pairs and is right (after a stall too)."""
    import board_cases
    board_cases.judge_one_error_per_rank(_all(shared_pool, board_cases.skipped_combine_costs_one_error, after_stall,
                                              timeout_s=240))
