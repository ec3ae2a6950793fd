"""Where each rank's multi-node workspace lives and how the kernels reach the others'.

Two transports give the backend the same things — this rank's workspace (``buffer``, bytes),
every rank's workspace address where this GPU can load and store it (``peer_bases``, ``[R]``
int64 on the device; 0 where it cannot: other hosts), and a host barrier:

- :class:`NvshmemTransport`: PyTorch symmetric memory on its NVSHMEM backend, one process per GPU.
  The kernels move bytes between nodes with NVSHMEM puts (reach/nvshmem.py) and within a node with
  stores through ``peer_bases``.
- :class:`LoopbackWorld`: every rank in one process on one GPU, each in its own thread and
  stream; the kernels' ``deliver`` becomes plain stores into the other workspace (reach/nvshmem.py,
  ``LOOPBACK``). It runs the multi-node kernels where NVSHMEM cannot (one GPU: NVSHMEM needs a GPU
  per process) — a test transport, not a fast path.
"""
from __future__ import annotations

import threading
from typing import List

import torch
import torch.distributed as dist

from ....errors import EPError
from .symmetric_heap import process_heap


class Transport:
    """One rank's view: ``rank``, ``num_ranks``, ``buffer`` (uint8, this rank's workspace),
    ``peer_bases`` (``[R]`` int64 device tensor), ``loopback`` (the kernels' LOOPBACK flag)."""

    rank: int
    num_ranks: int
    buffer: torch.Tensor
    peer_bases: torch.Tensor
    loopback: bool = False

    def barrier(self) -> None:
        """Every rank's host arrives, with its GPU work so far finished."""
        raise NotImplementedError

    def release(self) -> None:
        """The Buffer is destroyed; its workspace may go (only where every rank let go of it)."""


class NvshmemTransport(Transport):
    """``num_bytes`` of NVSHMEM symmetric memory on every rank of ``group`` (collective)."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device, num_bytes: int):
        import os

        import torch.distributed._symmetric_memory as symm_mem
        # NVSHMEM reserves its symmetric heap when it starts (at the first allocation), 1 GiB unless
        # NVSHMEM_SYMMETRIC_SIZE says otherwise: make room for this workspace unless an operator chose.
        os.environ.setdefault("NVSHMEM_SYMMETRIC_SIZE", str(max(1 << 30, num_bytes + (256 << 20))))
        self.group = group
        self.rank = dist.get_rank(group)
        self.num_ranks = dist.get_world_size(group)
        self.group_ranks = dist.get_process_group_ranks(group)
        try:  # through the ledger: PyTorch frees NVSHMEM memory collectively, so only at agreed points
            self.buffer = process_heap().take(self.group_ranks, device, num_bytes, self, self._all_gather,
                                              whole_world=self.num_ranks == dist.get_world_size())
            handle = symm_mem.rendezvous(self.buffer, group.group_name)
        except Exception as exc:  # RuntimeError from NVSHMEM's bootstrap, allocation or rendezvous
            raise EPError(f"the nvshmem backend could not set up {num_bytes} bytes of NVSHMEM symmetric memory "
                          f"({type(exc).__name__}: {exc}); EPCOMM_BACKEND=torch_dist runs without it") from exc
        self.handle = handle
        self.peer_bases = torch.tensor([int(p or 0) for p in handle.buffer_ptrs], dtype=torch.int64, device=device)
        # The heap hands freed memory out again: a Buffer made after another may get the bytes a
        # peer's last kernels of the old one still write into. Zero only once every rank's GPU
        # work so far has finished, and start once every rank has zeroed.
        self.barrier()
        self.buffer.zero_()
        self.barrier()

    def barrier(self) -> None:
        torch.cuda.synchronize(self.buffer.device)
        dist.barrier(group=self.group)

    def _all_gather(self, obj):
        gathered = [None] * self.num_ranks
        dist.all_gather_object(gathered, obj, group=self.group)
        return gathered

    def release(self) -> None:
        """The Buffer is destroyed: its bytes go back to the ledger (not freed here: see symmetric_heap)."""
        process_heap().release(self.group_ranks, self.buffer)
        self.buffer = self.handle = self.peer_bases = None


LOOPBACK_BARRIER_TIMEOUT_S = 60.0


class LoopbackWorld:
    """``num_ranks`` workspaces of ``num_bytes`` on one GPU, for ranks run as threads of this
    process (``transport(rank)`` gives each its view). Each thread must use its own CUDA stream:
    the ranks' kernels wait for each other, so they must run concurrently — keep grids small
    (few channels), or the GPU cannot hold every rank's waiting programs at once and the waits
    time out."""

    def __init__(self, num_ranks: int, device: torch.device, num_bytes: int):
        self.num_ranks = num_ranks
        self.buffers: List[torch.Tensor] = [torch.zeros(num_bytes, dtype=torch.uint8, device=device)
                                            for _ in range(num_ranks)]
        self.peer_bases = torch.tensor([b.data_ptr() for b in self.buffers], dtype=torch.int64, device=device)
        self._barrier = threading.Barrier(num_ranks)
        self.call_boards = {}  # rank -> its call board (gpu/call_board.py), kept as long as the world
        self._board_world = None
        torch.cuda.synchronize(device)

    def board_memory(self, num_bytes: int) -> "LoopbackWorld":
        """A second, small world for the ranks' call boards (made by the first rank that asks)."""
        if self._board_world is None:
            self._board_world = LoopbackWorld(self.num_ranks, self.buffers[0].device, num_bytes)
        return self._board_world

    def transport(self, rank: int) -> "LoopbackTransport":
        return LoopbackTransport(self, rank)


class LoopbackTransport(Transport):
    loopback = True

    def __init__(self, world: LoopbackWorld, rank: int):
        self.world = world
        self.rank = rank
        self.num_ranks = world.num_ranks
        self.buffer = world.buffers[rank]
        self.peer_bases = world.peer_bases

    def barrier(self) -> None:
        torch.cuda.synchronize(self.buffer.device)
        try:  # bounded: a rank thread that died (an exception) never arrives
            self.world._barrier.wait(timeout=LOOPBACK_BARRIER_TIMEOUT_S)
        except threading.BrokenBarrierError:
            raise EPError(f"loopback rank {self.rank}: a rank did not reach the barrier within "
                          f"{LOOPBACK_BARRIER_TIMEOUT_S:g} s (another rank's thread failed?)") from None
