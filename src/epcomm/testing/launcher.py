"""Run a function on N ranks (one process each), from scripts or pytest.

``run_distributed(fn, world_size, *args)`` starts the ranks, runs ``fn(*args)`` on each, and returns
the per-rank results. A :class:`WorkerPool` keeps the ranks (and their process group) alive across
many calls, which makes test suites fast. Any exception on any rank stops the pool and is raised in
the caller as :class:`RankFailure` with that rank's traceback; a call that exceeds its timeout
stops the pool and raises :class:`epcomm.EPTimeoutError` naming the ranks that had not finished.

``fn`` must be importable by name (a module-level function), since ranks are started with
``spawn``. Inside ``fn``, the default process group is initialised; ``torch.distributed.get_rank()``
tells the rank.
"""
from __future__ import annotations

import datetime
import faulthandler
import os
import queue as queue_mod
import socket
import time
import traceback
from typing import Any, Callable, List, Tuple

import torch.multiprocessing as mp

from ..errors import EPError, EPTimeoutError

# WorkerPool's backend for many ranks on one GPU: every rank on device 0, a gloo group for CPU and
# CUDA tensors; NVSHMEM needs CUDA MPS running (scripts/gpu_check.sh's shared-gpu part starts it).
SHARED_GPU = "shared-gpu"


class RankFailure(EPError):
    """A rank raised; ``rank`` and ``remote_traceback`` say where and what."""

    def __init__(self, rank: int, remote_traceback: str):
        self.rank = rank
        self.remote_traceback = remote_traceback
        super().__init__(f"rank {rank} failed:\n{remote_traceback}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker_main(rank: int, world_size: int, port: int, backend: str, jobs, results, group_timeout_s: float) -> None:
    import torch
    import torch.distributed as dist
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    # EPCOMM_STACK_DUMP_S: every rank prints its Python stack when a job runs longer (diagnosis)
    stack_dump_s = float(os.environ.get("EPCOMM_STACK_DUMP_S", "0"))
    try:
        kwargs = {}
        if backend == "nccl":
            torch.cuda.set_device(rank)
            kwargs["device_id"] = torch.device("cuda", rank)
        elif backend == SHARED_GPU:
            # Every rank on device 0 (under CUDA MPS, which the caller starts): NCCL refuses two
            # ranks on one GPU, so the group is gloo for CPU and CUDA tensors alike, and NVSHMEM
            # runs in its full multi-process-per-GPU mode.
            os.environ.setdefault("NVSHMEM_IGNORE_CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "1")
            # MPS runs every rank's kernels in one GPU context, where loading a module lazily (at
            # its first launch) waits for the running kernels — other ranks' spinning waits for
            # this rank: modules load whole at load time instead (set before CUDA starts).
            os.environ["CUDA_MODULE_LOADING"] = "EAGER"
            torch.cuda.set_device(0)
            backend = "cpu:gloo,cuda:gloo"
        dist.init_process_group(backend, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=group_timeout_s), **kwargs)
    except Exception:
        results.put((None, rank, "error", traceback.format_exc()))
        return
    results.put((None, rank, "ready", None))
    while True:
        job = jobs.get()
        if job is None:
            break
        job_id, fn, args, kwargs = job
        if stack_dump_s:  # a rank stuck in a job prints where it is (to find a hang's call)
            faulthandler.dump_traceback_later(stack_dump_s, exit=False)
        try:
            value = fn(*args, **kwargs)
            results.put((job_id, rank, "ok", value))
        except BaseException:
            results.put((job_id, rank, "error", traceback.format_exc()))
        finally:
            if stack_dump_s:
                faulthandler.cancel_dump_traceback_later()
    try:
        dist.destroy_process_group()
    except Exception:
        pass


class WorkerPool:
    """``world_size`` long-lived ranks that run functions on request.

    Args:
        world_size: number of ranks (processes).
        backend: ``"gloo"`` (CPU), ``"nccl"`` (one GPU per rank) or ``"shared-gpu"`` (every rank
            on GPU 0 over ``"cpu:gloo,cuda:gloo"``; the nvshmem backend needs CUDA MPS running).
        group_timeout_s: the process group's own timeout for a stuck collective.
    """

    def __init__(self, world_size: int, backend: str = "gloo", group_timeout_s: float = 120.0,
                 start_timeout_s: float = 180.0):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.backend = backend
        self._ctx = mp.get_context("spawn")
        for attempt in range(3):
            # The port is free when _free_port returns, but another process may take it before rank
            # 0's store listens on it (machines that run test suites back to back): a new port then.
            self._start(_free_port(), group_timeout_s)
            try:
                self._collect(None, start_timeout_s, "start")
                return
            except RankFailure as failure:
                if "EADDRINUSE" not in str(failure) or attempt == 2:
                    raise

    def _start(self, port: int, group_timeout_s: float) -> None:
        self._results = self._ctx.Queue()
        self._jobs = [self._ctx.Queue() for _ in range(self.world_size)]
        self._procs = [self._ctx.Process(target=_worker_main, daemon=True,
                                         args=(r, self.world_size, port, self.backend, self._jobs[r], self._results,
                                               group_timeout_s))
                       for r in range(self.world_size)]
        for p in self._procs:
            p.start()
        self._next_job = 0
        self._closed = False

    def _collect(self, job_id, timeout_s: float, what: str) -> List[Any]:
        values: List[Any] = [None] * self.world_size
        pending = set(range(self.world_size))
        deadline = time.monotonic() + timeout_s
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self.close(force=True)
                raise EPTimeoutError(f"{what} did not finish within {timeout_s:.0f} s", peers=pending)
            try:
                got_job, rank, status, value = self._results.get(timeout=min(remaining, 1.0))
            except queue_mod.Empty:
                dead = [r for r in pending if not self._procs[r].is_alive()]
                if dead:
                    self.close(force=True)
                    raise RankFailure(dead[0], f"process exited with code {self._procs[dead[0]].exitcode} during {what}")
                continue
            if got_job != job_id:
                continue
            if status == "error":
                self.close(force=True)
                raise RankFailure(rank, value)
            values[rank] = value
            pending.discard(rank)
        return values

    def run(self, fn: Callable, *args, timeout_s: float = 300.0, **kwargs) -> List[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; returns the list of per-rank return values."""
        if self._closed:
            raise EPError("this WorkerPool is closed (a previous call failed or close() was called)")
        job_id = self._next_job
        self._next_job += 1
        for q in self._jobs:
            q.put((job_id, fn, args, kwargs))
        return self._collect(job_id, timeout_s, getattr(fn, "__name__", "job"))

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self, force: bool = False) -> None:
        if self._closed:
            return
        self._closed = True
        if not force:
            for q in self._jobs:
                q.put(None)
            for p in self._procs:
                p.join(timeout=10)
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


def default_world(ranks: int = 0) -> Tuple[int, str]:
    """``(world size, process-group backend)`` for the tools: every visible GPU on NCCL (or ``ranks``
    of them), else ``ranks`` (default 4) CPU ranks on gloo. ``EPCOMM_DEMO_CPU=1`` forces the CPU."""
    import torch
    if torch.cuda.is_available() and torch.cuda.device_count() > 0 and os.environ.get("EPCOMM_DEMO_CPU") != "1":
        return ranks or torch.cuda.device_count(), "nccl"
    return ranks or 4, "gloo"


def run_distributed(fn: Callable, world_size: int, *args, backend: str = "gloo", timeout_s: float = 300.0,
                    **kwargs) -> List[Any]:
    """Run ``fn(*args, **kwargs)`` once on ``world_size`` fresh ranks and return their results."""
    with WorkerPool(world_size, backend=backend) as pool:
        return pool.run(fn, *args, timeout_s=timeout_s, **kwargs)
