"""NVSHMEM symmetric memory that is freed only where every rank frees it.

Why: NVSHMEM's ``nvshmem_malloc`` and ``nvshmem_free`` are collective — each ends (malloc) or
starts (free) with a barrier over every process — and PyTorch frees its NVSHMEM tensors when the
last reference dies. Python drops a Buffer whenever its reference count or the cycle collector
says so, which differs between ranks (a Buffer in a reference cycle waits for the next collection,
and collections start at per-process allocation counts). A rank freeing then enters a barrier its
peers do not: the job hangs, or the barrier pairs with a peer's later allocation and the heap's
offsets stop being symmetric (one rank's bytes land in another allocation).

So this process keeps every allocation it made (the ``SymmetricHeap`` ledger) until a collective
point: a new workspace on a group of every process (a subgroup keeps its memory: see ``take``). There the ranks of its group agree which allocations every one of them
has let go of — its user released or gone, and no view of its bytes left outside the ledger — and
then reuse one of the same size, or free them all in the same order on every rank (their
barriers pair) and allocate. An allocation that one rank still uses is kept on every rank.

Timeline of two ranks, rank 1's old Buffer in a reference cycle::

    rank 0:  Buffer A ... del A (freed to the ledger)      Buffer B: agree {A: r0 only} -> keep A, malloc B
    rank 1:  Buffer A ... del A (in a cycle, not yet)      Buffer B: agree {A: r0 only} -> keep A, malloc B
                                gc (later) frees A to the ledger; no barrier anywhere
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch


def storage_users(tensor: torch.Tensor) -> int:
    """How many tensors (and storage objects) share ``tensor``'s bytes; -1 where PyTorch cannot say."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    if use_count is None:
        return -1
    return int(use_count(tensor.untyped_storage()._cdata))


@dataclass
class Allocation:
    """One symmetric allocation: its ledger id (the same on every rank of its group: allocations
    are collective and ordered), bytes, the tensor, and who uses it now."""
    id: int
    num_bytes: int
    tensor: torch.Tensor
    users_alone: int  # storage_users() when the ledger's tensor is the only one
    owner: Optional[weakref.ref] = None

    def let_go(self) -> bool:
        """True when nothing on this rank needs the bytes: no owner, no view outside the ledger."""
        if self.owner is not None and self.owner() is not None:
            return False
        return self.users_alone < 0 or storage_users(self.tensor) <= self.users_alone


class SymmetricHeap:
    """The allocations of one process, per group (the tuple of its global ranks) and device.

    ``allocate(num_bytes, device)`` makes a new symmetric tensor (collective); ``all_gather(obj)`` returns
    every group rank's ``obj``. Both are arguments so that the bookkeeping runs without NVSHMEM
    (tests give a fake allocator and exchange)."""

    def __init__(self, allocate: Callable[[int, torch.device], torch.Tensor]):
        self._allocate = allocate
        self._by_group: Dict[tuple, List[Allocation]] = {}
        self._next_id: Dict[tuple, int] = {}

    def take(self, group_ranks: Sequence[int], device: torch.device, num_bytes: int, owner: object,
             all_gather: Callable[[object], List[object]], whole_world: bool = True) -> torch.Tensor:
        """Collective over the group: a symmetric tensor of ``num_bytes`` for ``owner`` (held until
        ``owner`` is released or gone). Reuses an allocation of this size that every rank let go
        of; otherwise frees those every rank let go of (same order everywhere) and allocates.

        ``whole_world=False`` (the group is not every process): NVSHMEM's allocations and frees
        are barriers over every process, and ranks of other groups decide on their own garbage —
        a reuse here while another group allocates would leave that group's barrier unpaired. So
        a subgroup allocates at every call, as every group does, and never frees or reuses: its
        memory stays until the process ends."""
        key = (tuple(group_ranks), str(device))
        held = self._by_group.setdefault(key, [])
        chosen = self._reclaim(held, num_bytes, all_gather) if whole_world else None
        if chosen is None:
            tensor = self._allocate(num_bytes, device)
            allocation_id = self._next_id.get(key, 0)
            self._next_id[key] = allocation_id + 1
            chosen = Allocation(allocation_id, num_bytes, tensor, storage_users(tensor))
            held.append(chosen)
        chosen.owner = weakref.ref(owner)
        return chosen.tensor

    @staticmethod
    def _reclaim(held: List[Allocation], num_bytes: int, all_gather) -> Optional[Allocation]:
        """Agree which of ``held`` every rank let go of; return one of ``num_bytes`` to reuse, or
        free them all (same order on every rank) and return None."""
        free_here = [a.id for a in held if a.let_go()]
        everywhere = set(free_here)
        for theirs in all_gather(free_here):
            everywhere &= set(theirs)
        free_everywhere = [a for a in held if a.id in everywhere]  # ledger order: ascending id
        reuse = next((a for a in free_everywhere if a.num_bytes == num_bytes), None)
        if reuse is None:
            held[:] = [a for a in held if a.id not in everywhere]
            while free_everywhere:  # the last reference: PyTorch frees it now (a barrier), in this order on every rank
                free_everywhere.pop(0)
        return reuse

    def release(self, group_ranks: Sequence[int], tensor: torch.Tensor) -> None:
        """``tensor``'s owner is done with it (an explicit destroy); the bytes go back at the next
        collective ``take`` once no view of them is left on any rank."""
        for allocation in self._by_group.get((tuple(group_ranks), str(tensor.device)), []):
            if allocation.tensor.data_ptr() == tensor.data_ptr():
                allocation.owner = None

    def allocations(self, group_ranks: Sequence[int], device: torch.device) -> List[Allocation]:
        """The group's allocations this process holds, in id order: for tests and diagnosis."""
        return list(self._by_group.get((tuple(group_ranks), str(device)), []))

    def held(self, group_ranks: Sequence[int], device: torch.device) -> List[Tuple[int, int, bool]]:
        """(id, bytes, let go of here) per allocation of the group: for tests and diagnosis."""
        return [(a.id, a.num_bytes, a.let_go()) for a in self.allocations(group_ranks, device)]


_PROCESS_HEAP: Optional[SymmetricHeap] = None


def process_heap() -> SymmetricHeap:
    """This process's ledger of NVSHMEM allocations through PyTorch's symmetric memory."""
    global _PROCESS_HEAP
    if _PROCESS_HEAP is None:
        def allocate(num_bytes: int, device: torch.device) -> torch.Tensor:
            import torch.distributed._symmetric_memory as symm_mem
            symm_mem.set_backend("NVSHMEM")
            return symm_mem.empty(num_bytes, dtype=torch.uint8, device=device)
        _PROCESS_HEAP = SymmetricHeap(allocate)
    return _PROCESS_HEAP
