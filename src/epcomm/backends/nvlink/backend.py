"""The NVLink backend: the GPU layer (backends/gpu) on one node, every peer reached by stores.

This class only wires the parts together: a workspace, the host mailbox, the call board, NormalMode
and LowLatencyMode (backends/gpu says what each module does), and the abort. What both GPU backends
hand on the same way — the calls to the modes, the board's reports and resync — is gpu/wiring.py.

The workspace and the board are PyTorch's CUDA symmetric memory, one allocation per GPU. Where
ranks share a GPU (CUDA MPS: DeepEP's one-node shape of 8 checked on one GPU) they would be
NVSHMEM's instead, which maps every process's allocation: the same kernels store through the same
kind of pointers (``nvlink.workspace_memory``). There the ranks share the GPU's SMs too: their
grids together must leave room for a late rank's sender, or every wait runs into the timeout
(docs/GPU.md; docs/notes/multinode-log.md, finding 14): the backend caps them (GpuBackend.share_gpu,
gpu/shared_grids.py).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from ...errors import EPError, EPInputError
from ..store_agreement import StoreRendezvous
from ..gpu import agreement, call_board
from ..gpu.low_latency import LowLatencyMode
from ..gpu.normal.one_node import NormalMode
from ..gpu.mailbox import HostMailbox, check_host_mapping
from ..gpu.shared_grids import gpu_places
from ..gpu.sync import device_state
from ..gpu.wiring import GpuBackend
from ..gpu.workspace import Workspace, symmetric_memory
from . import workspace_memory

# Largest expert count per rank the mailbox reports receive counts for.
MAX_LOCAL_EXPERTS = 4096


class NVLinkBackend(GpuBackend):
    name = "nvlink"
    native_expert_major = True  # the pull writes expert-major rows, the push folds them (gpu/normal/one_node)

    def __init__(self, group: dist.ProcessGroup, device: torch.device, num_nvl_bytes: int, num_ll_bytes: int = 0,
                 timeout_s: float = 100.0, ll_receive_programs: int = 0, shrink: bool = False,
                 ll_send_messages: int = 0, ll_one_launch: Optional[bool] = None):
        """``ll_receive_programs``: at most this many programs per low-latency receive phase
        (0: no cap; ranks sharing a GPU get a cap anyway, GpuBackend.share_gpu). ``shrink``: the
        Buffer's ``enable_shrink``; ``ll_send_messages``, ``ll_one_launch``: its ``Tuning``
        (LowLatencyMode), as given: ranks sharing one GPU (the many-rank test bed) take the same
        auto default, one cooperative launch per eager call (8 ranks under CUDA MPS passed the bed's
        nvlink and nvlink-faults presets with it forced on, 9 of 9 and 36 of 36, 2026-11-28i)."""
        super().__init__(group, device)
        self.timeout_s = float(timeout_s)
        places = gpu_places(group)  # (collective)
        self.memory_kind = workspace_memory([(host, gpu) for host, gpu, _ in places])
        caps = self.share_gpu(places, "nvlink", ll_receive_programs)
        memory, self._ledger_memory = self._symmetric(Workspace.size_for(self.num_ranks, num_nvl_bytes, num_ll_bytes))
        self.ws = Workspace(group, device, num_nvl_bytes, num_ll_bytes, memory=memory)
        self.state = device_state(device)
        self.mailbox = HostMailbox(self.num_ranks, MAX_LOCAL_EXPERTS)
        check_host_mapping(self.mailbox, device)
        self.timeout_ns = int(self.timeout_s * 1e9)
        # which call each rank is in, across every Buffer of the group (a skipped call: call_board.py)
        self.seat = call_board.join(("nvlink", group.group_name), self, lambda: self._make_board(group))
        self.normal = NormalMode(self)
        self.low_latency = LowLatencyMode(self.ws, self.state, self.mailbox, self.timeout_ns, device,
                                          receive_programs=caps.ll_receive_programs, board=self.seat,
                                          send_programs=caps.ll_send_programs, shrink=shrink,
                                          messages_per_program=ll_send_messages,
                                          one_launch=ll_one_launch)

    def _symmetric(self, num_bytes: int):
        """``((buffer, bases, barrier), transport)``: ``num_bytes`` of symmetric memory on every rank
        (collective), PyTorch's CUDA symmetric memory (transport None) or, where ranks share a GPU,
        NVSHMEM's through the ledger (module docstring), whose transport releases it."""
        if self.memory_kind == "cuda":
            return symmetric_memory(self.group, self.device, num_bytes), None
        from ..gpu.reach.nvshmem import nvshmem_available
        from ..gpu.reach.transport import NvshmemTransport
        usable, why = nvshmem_available()
        if not usable:
            raise EPError(f"ranks of this group share a GPU, where the nvlink backend's memory is NVSHMEM's "
                          f"(PyTorch's CUDA symmetric memory maps one allocation per GPU), and NVSHMEM is not "
                          f"usable in this process ({why})")
        transport = NvshmemTransport(self.group, self.device, num_bytes)
        return (transport.buffer, transport.peer_bases, transport.barrier), transport

    def _make_board(self, group: dist.ProcessGroup) -> call_board.CallBoard:
        words = call_board.board_words(self.num_ranks)
        memory, _ = self._symmetric(words * 8)  # (kept for the process's life: call_board.join)
        buffer, bases, _ = memory
        buffer.zero_()
        torch.cuda.synchronize(self.device)
        rendezvous = StoreRendezvous(group, self.timeout_s)
        rendezvous("call board")  # every rank's board is zero before any rank posts
        return call_board.CallBoard(self.rank, self.num_ranks, buffer.view(torch.int64), bases, rendezvous, memory,
                                    agreement.resync_poster(bases.data_ptr(), self.rank, self.num_ranks, self.device))

    def agree(self, kind, fingerprint, error=None, rank_mask=None) -> None:
        """Calls agree through the fingerprints their kernels carry (gpu/agreement.py); here only a
        rejected input acts: the peers are told (:meth:`abort`), so every rank raises."""
        if error is not None:
            self.abort(kind, error)

    def abort(self, kind: str, error: EPInputError) -> None:
        """This rank rejected its input for a ``kind`` call its peers make: launch the abort kernel
        (the peers' waits end and they raise naming ``error.argument``); the next call resyncs."""
        agreement.launch_abort(self.ws, self.state, self.low_latency.num_experts_seen, error.argument, self.device,
                               board=(self.seat.bases_address, self.seat.tag()))
        self.mailbox.resync_needed = True

    def reset_signals(self) -> None:
        """Every flag, fingerprint row, epoch, low-latency count word and mailbox word back to zero,
        as in a new Buffer (no kernel of this Buffer runs: CallBoard.resync)."""
        self.ws.zero_signals()
        self.state.zero_()
        self.low_latency.forget_calls()
        self.mailbox.clear()

    def dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int, ranks_per_node: int):
        return self.normal.dispatch_layout(topk_idx, num_experts)  # one node (Buffer checks ranks_per_node)

    def clean_low_latency(self) -> None:
        """Collective: reset every low-latency epoch, count word and flag (LowLatencyMode.reset)."""
        self.low_latency.reset(self._barrier)

    def _barrier(self) -> None:
        torch.cuda.synchronize(self.device)
        dist.barrier(group=self.group)

    def local_buffer(self, use_rdma_buffer: bool) -> torch.Tensor:
        """The symmetric memory's normal-mode part, or with ``use_rdma_buffer`` its low-latency part."""
        if use_rdma_buffer:
            return self.ws.buffer[self.ws.ll_offset:]
        return self.ws.buffer[self.ws.normal_offset:self.ws.ll_offset]

    def destroy(self) -> None:
        """Let go of the workspace. NVSHMEM memory goes back to the ledger now, not when the last
        reference to this Buffer dies (a caller may keep one: the ledger would keep the bytes on
        every rank), as on the nvshmem backend; views a caller holds still keep it."""
        self.released = True  # (its group's call board forgets it)
        if self._ledger_memory is not None:
            self._ledger_memory.release()
        self.ws = self.normal = self.low_latency = self._ledger_memory = None
