"""The multi-node backend's kernels on one GPU: every rank a thread of this process (loopback
transport, src/epcomm/backends/gpu/reach/transport.py), checked against the references. The
project's own suite: tests/test_nvshmem_loopback.py runs it per topology on a machine with a GPU.

Normal mode: dispatch, cached dispatch, combine (:func:`normal_case`). Low-latency mode: a few
rounds of dispatch + combine with and without hooks, FP8 variants, messages to near and far
ranks (:func:`low_latency_case`), against the references as the GPU suite checks them.

Run it as ``python3 tests/loopback_suite.py [--topology R,k ...] [--mode normal|low_latency]
[--only CASE]`` (with epcomm importable: ``pip install -e .`` or ``PYTHONPATH=src``): it runs in a process with
``CUDA_MODULE_LOADING=EAGER`` and PyTorch's stream-ordered allocator
(``PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync``), starting one if needed. Both avoid a host
call that waits for, or orders work behind, the GPU's running kernels — here another rank's
kernels, spinning until this rank's next launch, so they time out or hand on stale rows:

- lazy loading: the first launch of a kernel loads its module, which waits for running kernels;
- ``cudaMalloc``: work issued after a device allocation does not run beside work issued before
  it (CUDA's implicit synchronisation). A rank thread's first call allocates its outputs on a
  stream the caching allocator has no blocks for yet, so the first case of a process ordered a
  skipping rank's next dispatch behind its peers' waiting combines: the waits ran their whole
  timeout (seen on H100, 2026-11-26; with cudaMallocAsync the same cases pass at once).

Separate processes, as with NVSHMEM, have separate contexts and do not meet either.

NVSHMEM itself needs one GPU per process, so this is how the kernels' logic — layouts, offsets,
masks, the order of rows and sums, the signals between hops — is tested where only one GPU is
lent; the NVSHMEM puts themselves are exercised by the GPU suite on two GPUs. Each case compares
every rank's dispatch bitwise with the one-level reference (rows, top-k, weights, source indices,
rank_prefix_matrix, receive counts), a cached dispatch with the full one, and the combine with the
two-level model (bitwise: the same float32 sums in the same order) and with the one-level
reference (within bf16 rounding).
"""
from __future__ import annotations

from loopback_cases import layout_case, low_latency_case, mixed_modes_case, normal_case, send_layout_case
from loopback_faults import (bad_counts_case, disagreement_case, ll_other_call_case, low_latency_dead_rank_case,
                             recovery_case, skip_across_buffers_case)
from loopback_common import run_ranks


TOPOLOGIES = ((2, 1), (4, 2), (4, 1), (2, 2), (6, 2))  # (ranks, ranks per node)


def layout_cases(num_ranks: int, ranks_per_node: int):
    """get_dispatch_layout's kernel on its own (:func:`layout_case`): around the block edge, holes,
    a hot rank, an empty batch, a large one."""
    return [(40, "uniform", dict(num_tokens=300)), (41, "holes", dict(num_tokens=129)), (42, "one_rank", dict(num_tokens=1)),
            (43, "skewed", dict(num_tokens=0)), (44, "holes", dict(num_tokens=5000))]


def send_layout_cases(num_ranks: int, ranks_per_node: int):
    """The send-layout kernel on its own (:func:`send_layout_case`): sizes around the block and
    channel edges, holes, a hot rank, an empty batch."""
    return [(30, "uniform", dict(num_tokens=300, num_channels=3)), (31, "holes", dict(num_tokens=129, num_channels=1)),
            (32, "one_rank", dict(num_tokens=1, num_channels=4)), (33, "skewed", dict(num_tokens=0, num_channels=2)),
            (34, "holes", dict(num_tokens=1000, num_channels=12))]


def cases(num_ranks: int, ranks_per_node: int):
    """The suite for one topology: ``(seed, scenario, keyword arguments)`` of :func:`normal_case`."""
    R = num_ranks
    plain = [(seed, scenario, dict(num_experts=4 * R))
             for seed, scenario in enumerate(("uniform", "skewed", "holes", "empty_rank"))]
    return plain + [
        (10, "uniform", dict(use_fp8=True, num_experts=4 * R, hidden=512)),
        (11, "skewed", dict(num_bias=2, num_experts=4 * R, num_channels=3)),
        (12, "holes", dict(num_worst_tokens=40 * R, num_experts=4 * R)),
        (13, "uniform", dict(with_weights=False, expert_alignment=8, num_experts=4 * R)),
        (14, "one_rank", dict(max_tokens=300, hidden=2048, num_experts=8 * R, num_topk=8)),
        # a dispatch's send split over several programs per (channel, node), each putting a slice
        (15, "uniform", dict(send_parts=3, max_tokens=120, num_experts=4 * R, num_channels=3)),
        (16, "holes", dict(send_parts=2, use_fp8=True, num_experts=4 * R, hidden=512)),
        # rows for another node stored straight into its workspace (p2p: a peer mapped here)
        (17, "uniform", dict(p2p=True, num_experts=4 * R)),
        (18, "skewed", dict(p2p=True, send_parts=3, num_bias=1, max_tokens=120, num_experts=4 * R, num_channels=3)),
        (19, "holes", dict(p2p=True, send_parts=2, use_fp8=True, num_worst_tokens=40 * R, num_experts=4 * R,
                           hidden=512)),
    ]


def low_latency_cases(num_ranks: int, ranks_per_node: int):
    """The low-latency suite for one topology: ``(seed, scenario, keyword arguments)`` of
    :func:`low_latency_case`."""
    E = 4 * num_ranks
    return [
        (20, "uniform", dict(num_experts=E)),
        (21, "skewed", dict(num_experts=E, use_fp8=True)),
        (22, "holes", dict(num_experts=2 * num_ranks, use_fp8=True, round_scale=True)),
        (23, "one_rank", dict(num_experts=E, use_fp8=True, round_scale=True, use_ue8m0=True, hidden=1024)),
        (24, "empty_rank", dict(num_experts=E, ll_ranks_per_node=1)),
        (25, "uniform", dict(num_experts=8 * num_ranks, num_topk=8, max_tokens=64, hidden=2048, use_fp8=True)),
    ]


def bad_counts_cases(num_ranks: int, ranks_per_node: int):
    """Both caller counts the send-layout kernel checks (:func:`bad_counts_case`)."""
    return [(0, "uniform", dict(argument="num_tokens_per_rank")), (0, "uniform", dict(argument="num_tokens_per_expert"))]


def dead_rank_cases(num_ranks: int, ranks_per_node: int):
    """The fault cases that run once per topology."""
    return [(0, "uniform", {})]


def dead_rank_shrink_cases(num_ranks: int, ranks_per_node: int):
    """The dead-rank case with and without enable_shrink (masked, or NaN rows)."""
    return [(0, "uniform", dict(shrink=True)), (0, "uniform", dict(shrink=False))]


def loopback_environment(environ) -> dict:
    """``environ`` with what a process of loopback ranks needs before CUDA starts (the module's
    docstring says why): eager module loading and, unless the caller chose an allocator, PyTorch's
    stream-ordered one."""
    env = dict(environ, CUDA_MODULE_LOADING="EAGER")
    env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "backend:cudaMallocAsync")
    return env


def main(argv=None) -> int:
    import argparse
    import os
    import subprocess
    import sys
    import time
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--topology", action="append", default=[], help="R,k (ranks, ranks per node); repeatable")
    parser.add_argument("--mode", choices=("normal", "low_latency", "both"), default="both")
    parser.add_argument("--only", default=None, help="run only the cases of this function (e.g. recovery_case)")
    args = parser.parse_args(argv)
    env = loopback_environment(os.environ)
    if env != dict(os.environ):  # see the module's docstring
        return subprocess.call([sys.executable, os.path.abspath(__file__)] + list(argv or sys.argv[1:]), env=env)
    topologies = [tuple(int(v) for v in t.split(",")) for t in args.topology] or TOPOLOGIES
    failed = 0
    suites = [(layout_case, layout_cases), (send_layout_case, send_layout_cases), (normal_case, cases),
              (bad_counts_case, bad_counts_cases)] if args.mode != "low_latency" else []
    suites += [(low_latency_case, low_latency_cases), (low_latency_dead_rank_case, dead_rank_shrink_cases),
               (mixed_modes_case, dead_rank_cases), (recovery_case, dead_rank_cases),
               (disagreement_case, dead_rank_cases),
               (ll_other_call_case, dead_rank_cases),
               (skip_across_buffers_case, dead_rank_cases)] if args.mode != "normal" else []
    if args.only:
        suites = [(run_case, suite) for run_case, suite in suites if run_case.__name__ == args.only]
    for num_ranks, ranks_per_node in topologies:
        for run_case, suite in suites:
            for seed, scenario, kwargs in suite(num_ranks, ranks_per_node):
                started = time.monotonic()
                try:
                    if run_case in (low_latency_dead_rank_case, mixed_modes_case, bad_counts_case, recovery_case,
                                    disagreement_case, ll_other_call_case, skip_across_buffers_case):
                        run_case(num_ranks, ranks_per_node, **kwargs)
                    else:
                        run_case(seed, num_ranks, ranks_per_node, scenario, **kwargs)
                    status = "ok"
                except (AssertionError, RuntimeError) as err:
                    failed += 1
                    status = f"FAILED: {str(err)[:2000]}"
                print(f"{run_case.__name__} R={num_ranks} k={ranks_per_node} seed={seed} {scenario} {kwargs}: "
                      f"{status} ({time.monotonic() - started:.1f} s)", flush=True)
    print(f"{failed} failed" if failed else "all passed", flush=True)
    return 1 if failed else 0


__all__ = ["run_ranks", "layout_case", "send_layout_case", "normal_case", "cases", "low_latency_case", "low_latency_cases",
           "low_latency_dead_rank_case", "mixed_modes_case", "bad_counts_case", "recovery_case", "disagreement_case",
           "ll_other_call_case", "skip_across_buffers_case", "loopback_environment", "main"]


if __name__ == "__main__":
    raise SystemExit(main())
