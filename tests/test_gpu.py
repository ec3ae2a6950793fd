"""GPU tests: the nvlink backend (and, on two or more GPUs, the nvshmem backend on virtual
nodes) against the torch_dist reference (NCCL) on the same inputs.

Skipped without CUDA. Run on a GPU machine with ``scripts/gpu_check.sh`` (or ``pytest -m gpu``). On a
machine with one GPU the suite runs on one rank (every kernel, the peer being the rank itself);
the tests that need peers (timeouts, masking, disagreeing ranks) are skipped there.
"""
import pytest
import torch

import ep_cases
import epcomm
import failure_cases
import graph_cases
import recovery_cases
import single_launch_cases
import training_cases
from epcomm.testing import WorkerPool

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(GPUS == 0, reason="needs CUDA GPUs")]
needs_peers = pytest.mark.skipif(GPUS < 2, reason="needs at least 2 CUDA GPUs (ranks that disagree or go missing)")



def _world_sizes():
    """Ranks per pool: 2, 4 and 8 where the GPUs allow; ``EPCOMM_GPU_WORLD_SIZES=4`` (comma-separated)
    keeps only those, so a 4-GPU machine can spend one device call on R=4 alone."""
    import os
    sizes = [n for n in (2, 4, 8) if n <= GPUS] or [1]
    asked = os.environ.get("EPCOMM_GPU_WORLD_SIZES", "")
    if asked:
        wanted = {int(n) for n in asked.split(",")}
        too_many = sorted(n for n in wanted if n > max(GPUS, 1))
        assert not too_many, f"EPCOMM_GPU_WORLD_SIZES asks for {too_many} ranks; this machine has {GPUS} GPUs"
        sizes = sorted(wanted)
    return sizes


WORLD_SIZES = _world_sizes()


@pytest.fixture(scope="module", params=WORLD_SIZES)
def gpu_pool(request):
    pool = WorkerPool(request.param, backend="nccl")
    yield pool
    pool.close()


@needs_peers
@pytest.mark.parametrize("case", ["vllm_high_throughput", "vllm_low_latency", "vllm_low_latency_graph",
                                  "sglang_dispatchers", "megatron_fused"])
def test_engines_through_deep_ep(gpu_pool, case):
    """``import deep_ep`` driven as each engine drives DeepEP (tests/engine_cases.py), one rank per
    GPU: vLLM's buffers on a plain gloo group take the nvlink backend on one node all the same."""
    import engine_cases
    assert all(gpu_pool.run(getattr(engine_cases, case), timeout_s=600))


SCENARIO_CONFIGS = [(scenario, tokens, hidden, False, False)
                    for scenario in ep_cases.SCENARIOS for tokens, hidden in ((0, 2048), (300, 4096), (1000, 7168))]
EDGE_CONFIGS = [("uniform", 4096, 7168, True, False), ("skewed", 2048, 7168, True, False),
                ("uniform", 1500, 2048, False, True), ("holes", 700, 4096, True, True),
                ("uniform", 16384, 7168, False, False)]


def test_routings_and_sizes(gpu_pool):
    n = gpu_pool.run(ep_cases.gpu_normal_against_reference, SCENARIO_CONFIGS, timeout_s=600)
    assert n == [len(SCENARIO_CONFIGS)] * gpu_pool.world_size


def test_fp8_worst_tokens_and_large_batches(gpu_pool):
    n = gpu_pool.run(ep_cases.gpu_normal_against_reference, EDGE_CONFIGS, timeout_s=600)
    assert n == [len(EDGE_CONFIGS)] * gpu_pool.world_size


def test_rounds_when_batch_exceeds_buffer(gpu_pool):
    # 8 MB of payload: a 2000-token batch of 7168-wide rows needs several rounds.
    configs = [("uniform", 2000, 7168, False, False), ("skewed", 1200, 4096, True, False)]
    results = gpu_pool.run(ep_cases.gpu_rounds_counted, configs, 8 << 20, timeout_s=600)
    for checked, stage_launches in results:
        # one stage per round, for the full and the cached dispatch of each config: more than one round each
        assert checked == 2 and stage_launches > 2 * 2 * len(configs), stage_launches


@needs_peers
@pytest.mark.parametrize("world_size,ranks_per_node", [(n, k) for n in WORLD_SIZES for k in (1, 2) if n > k])
def test_nvshmem_virtual_nodes_against_reference(world_size, ranks_per_node):
    """The multi-node backend on virtual nodes (NVSHMEM puts between them): normal mode with the
    routings, sizes, FP8 and num_worst_tokens of the tests above against torch_dist, repeated
    calls; low-latency mode against the reference (formats, hooks, zero-copy), in a CUDA graph, and
    with a rank that stops taking part (masked).
    Its own worker processes: NVSHMEM becomes their symmetric-memory backend for good."""
    from epcomm import Buffer
    pool = WorkerPool(world_size, backend="nccl")
    try:
        configs = SCENARIO_CONFIGS + EDGE_CONFIGS
        n = pool.run(ep_cases.gpu_normal_against_reference, configs, 0, 1, ranks_per_node, timeout_s=600)
        assert n == [len(configs)] * world_size
        repeated = [("uniform", 512, 2048, False, False), ("holes", 256, 2048, True, False)]
        n = pool.run(ep_cases.gpu_normal_against_reference, repeated, 0, 10, ranks_per_node, timeout_s=600)
        assert n == [20] * world_size
        for hidden, cases in ((2048, 16), (7168, 6)):
            size = Buffer.get_low_latency_rdma_size_hint(128, hidden, world_size, 8 * world_size)
            n = pool.run(ep_cases.low_latency_sweep, cases, 400, hidden, 8, 128, "cuda", size, False, "nvshmem",
                         ranks_per_node, timeout_s=600)
            assert n == [cases] * world_size
        assert pool.run(graph_cases.gpu_low_latency_graph, 4, 2048, "nvshmem", ranks_per_node,
                        timeout_s=300) == [4] * world_size
        # last: the dead rank leaves the pool's ranks out of step
        assert pool.run(ep_cases.gpu_low_latency_dead_rank, 2048, "nvshmem", ranks_per_node,
                        timeout_s=120) == ["masked"] * (world_size - 1) + ["dead"]
    finally:
        pool.close()


def test_repeated_calls(gpu_pool):
    configs = [("uniform", 512, 2048, False, False), ("holes", 256, 2048, True, False)]
    n = gpu_pool.run(ep_cases.gpu_normal_against_reference, configs, 1 << 28, 10, timeout_s=600)
    assert n == [20] * gpu_pool.world_size


@needs_peers
def test_timeout_raises_naming_the_peer():
    with WorkerPool(2, backend="nccl") as pool:
        assert pool.run(ep_cases.gpu_timeout_names_peer, timeout_s=120) == ["raised", "absent"]


def test_low_latency_against_reference(gpu_pool):
    # T in [0, M], H = 7168 and 2048, FP8 (plain, power-of-two, UE8M0) and BF16, hooks, zero-copy, out=.
    from epcomm import Buffer
    # hidden sizes DeepEP does not compile (any multiple of 128 works here) next to the usual ones
    for hidden, cases in ((2048, 24), (7168, 8), (2560, 6), (5120, 6), (6144, 4)):
        size = Buffer.get_low_latency_rdma_size_hint(128, hidden, gpu_pool.world_size, 8 * gpu_pool.world_size)
        n = gpu_pool.run(ep_cases.low_latency_sweep, cases, 300, hidden, 8, 128, "cuda", size, timeout_s=600)
        assert n == [cases] * gpu_pool.world_size


def test_low_latency_cuda_graph(gpu_pool):
    assert gpu_pool.run(graph_cases.gpu_low_latency_graph, timeout_s=300) == [4] * gpu_pool.world_size


@pytest.mark.parametrize("variant", ["", "serial-dispatch"])
def test_num_worst_tokens_step_in_a_cuda_graph(gpu_pool, variant):
    """Layout, a num_worst_tokens dispatch and the combine replayed from one CUDA graph match the
    reference; serial-dispatch: the dispatch in turn, its count exchange and stage in one launch."""
    assert gpu_pool.run(graph_cases.gpu_normal_worst_graph, 4, 2048, variant, timeout_s=300) == [4] * gpu_pool.world_size


def test_a_num_worst_tokens_dispatch_whose_count_exchange_never_ends_is_nan_and_raises(gpu_pool):
    """ep_dispatch with NOTIFY when NOTIFIED never comes (normal_nan_cases.py): every row NaN, the
    next call raises EPTimeoutError, a new Buffer works (the path of a launch whose notify programs
    never ran)."""
    import normal_nan_cases
    assert gpu_pool.run(normal_nan_cases.count_exchange_never_released, timeout_s=120) == \
        ["nan, then raised, then a new Buffer works"] * gpu_pool.world_size


def test_the_count_exchange_and_stage_in_one_launch_match_the_reference(gpu_pool):
    """ep_dispatch_notify_stage on small batches of four routings, rows, top-k, handles and combine
    against the reference (single_launch_cases.py): at 8 GPUs, the R = 8 form users run."""
    assert gpu_pool.run(single_launch_cases.gpu_single_launch_small_batches, timeout_s=300) == \
        [4] * gpu_pool.world_size


def test_bench_normal_measures_and_checks_every_row(gpu_pool):
    """``epcomm bench normal``'s rank function on a small batch, epcomm beside NCCL: every check of
    the point passes (the rows equal NCCL's; the num_worst_tokens rows, eager and from one CUDA
    graph, equal the full dispatch's), and every row has its figures."""
    from epcomm.tools import bench
    settings = bench.NormalBenchSettings(tokens=256, hidden=2048, extra_tokens=[], reps=3, num_nvl_bytes=1 << 28)
    for result in gpu_pool.run(bench.bench_normal_rank, settings, timeout_s=300):
        point = result["points"][0]
        assert point["ok"] and all(point["checks"].values()), point["checks"]
        calls = [row["call"] for row in point["rows"]]
        assert bench.WORST_EAGER in calls and bench.WORST_GRAPH in calls, calls
        assert all(row["epcomm"]["gpu"] > 0 for row in point["rows"])


def test_a_full_dispatch_captured_in_a_cuda_graph_raises(gpu_pool):
    assert gpu_pool.run(graph_cases.gpu_captured_calls_refused, timeout_s=120) == ["raised"] * gpu_pool.world_size


def test_low_latency_handle_of_another_buffer_raises(gpu_pool):
    assert gpu_pool.run(ep_cases.gpu_low_latency_foreign_handle, timeout_s=120) == ["raised"] * gpu_pool.world_size


@needs_peers
def test_low_latency_dead_rank_is_masked():
    with WorkerPool(2, backend="nccl") as pool:
        assert pool.run(ep_cases.gpu_low_latency_dead_rank, timeout_s=120) == ["masked", "dead"]


def test_autograd_gradients_match_dense(gpu_pool):
    errors = gpu_pool.run(training_cases.autograd_against_dense, 6, 256, "cuda", timeout_s=300)
    assert max(errors) <= 2e-2, errors


def test_autograd_on_a_side_stream(gpu_pool):
    errors = gpu_pool.run(training_cases.autograd_against_dense, 3, 256, "cuda", side_stream=True, timeout_s=300)
    assert max(errors) <= 2e-2, errors


def test_moe_layer_matches_dense(gpu_pool):
    errors = gpu_pool.run(training_cases.moe_layer_against_dense, 256, 128, 2, 2, "cuda", timeout_s=300)
    assert all(max(e.values()) <= 2e-2 for e in errors), errors


@pytest.mark.parametrize("shape", [
    dict(),  # 4 experts per rank, top-3, up to 16 tokens; FP8 on odd cases
    dict(num_nvl_bytes=8192),  # a few tokens per round: several stage/pull rounds
    dict(experts_per_rank=128, num_topk=8, max_tokens=300),  # 256 experts: several position programs
], ids=["small", "rounds", "wide"])
def test_expert_major_layout(gpu_pool, shape):
    """The nvlink kernels' expert-major rows (pull) and fold (combine push) against the reference
    and the torch re-layout of a plain dispatch, bf16 and FP8."""
    assert gpu_pool.run(training_cases.expert_major_against_reference, 8, 256, "cuda", fp8=True, timeout_s=300,
                        **shape) == [8] * gpu_pool.world_size


@pytest.mark.parametrize("num_plain,hidden,num_topk,num_local,alignment", [
    (0, 512, 4, 4, 1), (1, 256, 1, 1, 1), (37, 384, 3, 5, 4), (300, 2048, 8, 16, 8), (2000, 7168, 8, 128, 1)])
def test_expert_major_kernels_equal_the_torch_relayout(num_plain, hidden, num_topk, num_local, alignment):
    """gpu/expert_major_kernels.py (the nvshmem backend's re-layout) against expert_major.expand / fold
    bit for bit: bf16 rows, FP8 values and scales, padding rows, entries with no local expert; the
    plan and both kernels without a host synchronisation (CUDA's sync debug mode raises on one)."""
    from epcomm import expert_major
    from epcomm.backends.gpu import expert_major_kernels as kernels
    from epcomm.fp8 import per_token_cast_to_fp8
    dev = torch.device("cuda", torch.cuda.current_device())
    g = torch.Generator(device=dev).manual_seed(num_plain)
    topk = torch.randint(-1, num_local, (num_plain, num_topk), device=dev, generator=g)
    weights = torch.rand(num_plain, num_topk, device=dev, generator=g)
    counts = torch.bincount(topk[topk >= 0], minlength=num_local).tolist()
    sizes = [-(-c // alignment) * alignment for c in counts]
    x = torch.randn(num_plain, hidden, device=dev, generator=g).to(torch.bfloat16)
    y = torch.randn(sum(sizes), hidden, device=dev, generator=g).to(torch.bfloat16)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # the plan and the kernels never wait for the GPU
    try:
        mapping = expert_major.plan(topk, weights, sizes)
        expanded, folded = kernels.expand(x, mapping), kernels.fold(y, mapping)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(expanded, expert_major.expand(x, mapping))
    x8 = per_token_cast_to_fp8(x)
    got, want = kernels.expand(x8, mapping), expert_major.expand(x8, mapping)
    assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8)) and torch.equal(got[1], want[1])
    assert torch.equal(folded, expert_major.fold(y, mapping))


def test_misaligned_inputs_take_the_8_byte_path(gpu_pool):
    assert gpu_pool.run(ep_cases.gpu_misaligned_inputs, timeout_s=300) == [True] * gpu_pool.world_size


def test_low_latency_in_one_launch(gpu_pool):
    assert gpu_pool.run(ep_cases.gpu_low_latency_one_launch, timeout_s=300) == [(8, 2)] * gpu_pool.world_size


@needs_peers
@pytest.mark.parametrize("case", sorted(failure_cases.GPU_CASES))
def test_failure_contract_on_nvlink(gpu_pool, case):
    """Disagreeing ranks, a rank that rejects its input, counts that do not match the routing:
    every rank raises EPInputError naming the argument (no hang, no crash), and a new Buffer works."""
    results = gpu_pool.run(failure_cases.gpu_contract, case, timeout_s=120)
    assert results == [("EPInputError", failure_cases.GPU_CASES[case])] * gpu_pool.world_size, results


@needs_peers
@pytest.mark.parametrize("case", ["disagree_hidden", "disagree_x", "disagree_num_topk", "one_rank_bad",
                                  "absent_dispatch", "absent_combine", "counts_num_tokens_per_rank",
                                  "counts_num_tokens_per_expert", "counts_topk_idx"])
def test_failure_contract_on_torch_dist_nccl(gpu_pool, case):
    """The reference backend on GPU tensors (NCCL): the same contract as on CPU ranks."""
    kind, _, detail = case.partition("_")
    R = gpu_pool.world_size
    if kind == "disagree":
        for got, argument, message in gpu_pool.run(failure_cases.disagreement, detail, "cuda", timeout_s=120):
            assert (got, argument) == ("EPInputError", detail), (got, argument, message)
    elif kind == "one":
        assert gpu_pool.run(failure_cases.one_rank_bad_argument, "cuda", timeout_s=120) == [("EPInputError", "x")] * R
    elif kind == "absent":
        results = gpu_pool.run(failure_cases.absent_rank, detail, 2.0, "cuda", timeout_s=120)
        assert results[-1] == ("absent",)
        for got, peers, seconds in results[:-1]:
            assert got == "EPTimeoutError" and peers == [R - 1] and seconds < 2.0 + 5.0, (got, peers, seconds)
    else:
        assert gpu_pool.run(failure_cases.inconsistent_counts, detail, "cuda", timeout_s=120) == \
            [("EPInputError", detail)] * R


def test_fuzz_on_nvlink(gpu_pool):
    """The failure contract's fuzz on the GPU backend: >= 1000 valid normal-mode cases (expert-major
    on every fifth) and >= 1000 low-latency cases against the reference, with empty ranks, -1
    holes, skewed and one-rank routings, duplicate experts, zero tokens and NaN/inf rows."""
    from epcomm.testing.sweeps import normal_mode_sweep
    assert gpu_pool.run(normal_mode_sweep, 1000, 50_000, 128, 4, 24, True, "cuda", timeout_s=900) == \
        [1000] * gpu_pool.world_size
    size = epcomm.Buffer.get_low_latency_rdma_size_hint(16, 512, gpu_pool.world_size, 4 * gpu_pool.world_size)
    assert gpu_pool.run(ep_cases.low_latency_sweep, 1000, 60_000, 512, 4, 16, "cuda", size, True, timeout_s=900) == \
        [1000] * gpu_pool.world_size


def test_out_of_range_expert_ids_raise_without_a_device_assert(gpu_pool):
    assert gpu_pool.run(failure_cases.gpu_out_of_range_expert, timeout_s=120) == \
        [("EPInputError", "topk_idx")] * gpu_pool.world_size


# ---------------------------------------------------------------------- every GPU its own node
def test_kernel_names_and_default_device(gpu_pool):
    """A CUDA default device, and kernels named by their call: each call's
    kernels name it and not the other; a low-latency call with return_recv_hook launches two (send
    and receive phase), without it one or two (one launch, or the two phases back to back)."""
    for rows in gpu_pool.run(ep_cases.gpu_kernel_names_and_default_device):
        for row, (dispatch, combine) in rows.items():
            mine, other = (combine, dispatch) if "combine" in row else (dispatch, combine)
            allowed = {2} if "hook=True" in row else {1, 2} if row.startswith("low_latency") else range(1, 8)
            assert mine in allowed and other == 0, rows


def test_a_host_stalled_before_the_doorbell_raises_and_the_next_call_matches(gpu_pool):
    """A full dispatch launched before its count wait waits for the host's doorbell at most 2 x the
    timeout: a host that rings go later raises (no unwritten rows returned), and the Buffer goes on."""
    results = gpu_pool.run(recovery_cases.gpu_host_stall_before_the_doorbell)
    assert results == [("EPTimeoutError", True)] * gpu_pool.world_size, results


@needs_peers
@pytest.mark.parametrize("case", recovery_cases.GPU_RECOVERY_CASES)
def test_a_call_that_raised_everywhere_leaves_the_buffer_usable(gpu_pool, case):
    """A rejected call and a disagreement on nvlink: every rank raises naming the argument, then resyncs at its
    next call, which pairs and matches the reference."""
    results = gpu_pool.run(recovery_cases.gpu_recovery, case)
    want = {"layout": "topk_idx", "ll_one_bad": "x"}.get(case, "x")
    for rank, (first, after) in enumerate(results):
        assert first[:2] == ("EPInputError", want), (rank, first)
        if case == "layout" and rank != 1:
            assert first[2], (rank, first)  # the peers name rank 1
        assert after == [True, True], (rank, after)


@needs_peers
def test_random_sequence_of_faults_on_nvlink(gpu_pool):
    """1000 steps of valid calls, bad inputs on random ranks, disagreements, rejected
    layouts and skipped combines on the GPU backend (sequence_cases.py says how deferred reports
    are expected there)."""
    from sequence_cases import error_sequence
    results = gpu_pool.run(error_sequence, 1000, 5, "cuda", timeout_s=1200)
    for key in ("ok", "bad_raised", "disagree_raised", "layout_raised", "skip_raised"):
        assert results[0].get(key, 0) > 0, results[0]


@needs_peers
def test_random_sequence_with_skipped_calls_on_two_buffers_on_nvlink(gpu_pool):
    """The fault sequence with a normal and a low-latency Buffer on the group, 1000 steps: skipped
    combines, low-latency combines and whole rounds across the two, on the nvlink backend's call
    board (gpu/call_board.py)."""
    from sequence_cases import error_sequence
    results = gpu_pool.run(error_sequence, 1000, 23, "cuda", two_buffers=True, timeout_s=1200)
    for key in ("ok", "skip_raised", "drop_raised", "skipped_call_found"):
        assert sum(r.get(key, 0) for r in results) > 0, results


@needs_peers
@pytest.mark.parametrize("skipped", ["combine", "ll_combine", "dispatch"])
def test_a_rank_that_skips_a_call_never_gets_wrong_data_on_nvlink(gpu_pool, skipped):
    """Rank 1 skips a call, then every rank runs normal and low-latency rounds on two Buffers of the
    group: every error is EPInputError('call') raised long before the timeout, no wrong data."""
    timeout = 30.0
    results = gpu_pool.run(failure_cases.skipped_call_then_next_calls, skipped, timeout, "cuda", timeout_s=300)
    failure_cases.judge_skipped_call_steps(results, timeout)


@pytest.fixture(scope="module")
def node_pool():
    """Ranks whose nodes are one GPU each (``EPCOMM_RANKS_PER_NODE=1``) and the automatic backend:
    every Buffer the cases make without naming a backend runs on nvshmem."""
    if GPUS < 2:
        pytest.skip("needs at least 2 CUDA GPUs (one node each)")
    import os
    env = {"EPCOMM_RANKS_PER_NODE": "1", "NVSHMEM_SYMMETRIC_SIZE": str(16 << 30)}
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)  # the workers inherit it at spawn
    try:
        pool = WorkerPool(GPUS, backend="nccl")
    finally:
        for name, value in saved.items():
            os.environ.pop(name) if value is None else os.environ.__setitem__(name, value)
    yield pool
    pool.close()


def test_nodes_user_program_runs_on_the_automatic_backend(node_pool):
    assert node_pool.run(ep_cases.gpu_user_program_on_nodes, timeout_s=300) == [("nvshmem", "nvshmem")] * GPUS


@pytest.mark.parametrize("case", sorted(failure_cases.GPU_CASES))
def test_nodes_failure_contract(node_pool, case):
    # 30 s: the nvshmem kernels specialise on row sizes, so the rank that differs compiles new
    # kernels (seconds) inside the failing call; a shorter timeout makes its peers time out first.
    results = node_pool.run(failure_cases.gpu_contract, case, 30.0, timeout_s=120)
    assert results == [("EPInputError", failure_cases.GPU_CASES[case])] * GPUS, results


@pytest.mark.parametrize("case", recovery_cases.GPU_RECOVERY_CASES)
def test_nodes_a_call_that_raised_everywhere_leaves_the_buffer_usable(node_pool, case):
    """A rejected call and a disagreement on nvshmem (virtual nodes)."""
    test_a_call_that_raised_everywhere_leaves_the_buffer_usable(node_pool, case)


def test_nodes_random_sequence_of_faults(node_pool):
    """The fault sequence on nvshmem (virtual nodes), 1000 steps."""
    test_random_sequence_of_faults_on_nvlink(node_pool)


def test_nodes_kernel_names_and_default_device(node_pool):
    """A CUDA default device and kernel names on nvshmem (virtual nodes)."""
    test_kernel_names_and_default_device(node_pool)


def test_nodes_timeout_names_the_peer(node_pool):
    assert node_pool.run(ep_cases.gpu_timeout_names_peer, timeout_s=120) == ["raised"] * (GPUS - 1) + ["absent"]


def test_nodes_autograd_and_moe_layer_match_dense(node_pool):
    errors = node_pool.run(training_cases.autograd_against_dense, 6, 256, "cuda", timeout_s=300)
    assert max(errors) <= 2e-2, errors
    errors = node_pool.run(training_cases.moe_layer_against_dense, 256, 128, 2, 2, "cuda", timeout_s=300)
    assert all(max(e.values()) <= 2e-2 for e in errors), errors


def test_nodes_fuzz(node_pool):
    """>= 1000 normal-mode and >= 1000 low-latency cases on nvshmem against the reference."""
    from epcomm.testing.sweeps import normal_mode_sweep
    assert node_pool.run(normal_mode_sweep, 1000, 50_000, 128, 4, 24, True, "cuda", timeout_s=900) == [1000] * GPUS
    size = epcomm.Buffer.get_low_latency_rdma_size_hint(16, 512, GPUS, 4 * GPUS)
    assert node_pool.run(ep_cases.low_latency_sweep, 1000, 60_000, 512, 4, 16, "cuda", size, True,
                         timeout_s=900) == [1000] * GPUS
