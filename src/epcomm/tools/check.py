"""``epcomm check``: randomized dispatch/combine checks of the backend that would run here.

On CPU ranks (gloo) the ``torch_dist`` backend is checked against the single-process reference;
on GPUs the ``nvlink`` backend is checked against ``torch_dist`` on NCCL (normal mode) and against
the reference (low-latency mode). Exits non-zero, with the failing rank's traceback, on a mismatch.
"""
from __future__ import annotations

import time

import torch.distributed as dist


def check_rank(num_cases: int):
    """Runs on every rank; returns ``[(what, cases checked, seconds)]``."""
    from ..buffer import Buffer
    from ..testing import sweeps
    results = []
    started = time.perf_counter()
    if dist.get_backend() == "nccl":
        configs = [(scenario, 600, 4096, index % 2 == 1, index % 3 == 2)
                   for index, scenario in enumerate(sweeps.SCENARIOS * max(1, num_cases // len(sweeps.SCENARIOS)))]
        results.append(("normal mode (nvlink vs torch_dist)", sweeps.gpu_normal_against_reference(configs),
                        time.perf_counter() - started))
        R = dist.get_world_size()
        size = Buffer.get_low_latency_rdma_size_hint(128, 2048, R, 4 * R)
        started = time.perf_counter()
        results.append(("low-latency mode (vs reference)",
                        sweeps.low_latency_sweep(num_cases, 500, 2048, 8, 128, "cuda", size),
                        time.perf_counter() - started))
    else:
        results.append(("normal mode (vs reference)", sweeps.normal_mode_sweep(num_cases, 700),
                        time.perf_counter() - started))
        started = time.perf_counter()
        results.append(("low-latency mode (vs reference)", sweeps.low_latency_sweep(num_cases, 900),
                        time.perf_counter() - started))
    return results


def run_check(ranks: int = 0, num_cases: int = 24, timeout_s: float = 900) -> int:
    """Run the checks on all GPUs (or ``ranks`` CPU ranks); print a table; return the exit code."""
    from ..testing import RankFailure, default_world, run_distributed
    from .args import counted
    world, backend = default_world(ranks)
    print(f"epcomm check: {counted(num_cases, 'randomized case')} per mode on "
          f"{counted(world, 'GPU rank' if backend == 'nccl' else 'CPU rank')}", flush=True)
    try:
        results = run_distributed(check_rank, world, num_cases, backend=backend, timeout_s=timeout_s)[0]
    except RankFailure as failure:
        print(f"FAILED on rank {failure.rank}:\n{failure.remote_traceback}")
        return 1
    for what, cases, seconds in results:
        print(f"{what:<36} {counted(cases, 'case'):>10}  {seconds:6.1f} s  OK")
    return 0
