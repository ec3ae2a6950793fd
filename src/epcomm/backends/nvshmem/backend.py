"""The multi-node backend (``nvshmem``): normal-mode dispatch and combine in two hops.

This class wires the parts together; each has its own module (gpu/normal/two_level/ unless named):

    gpu/reach/transport.py  the workspace: NVSHMEM symmetric memory (or the loopback test transport)
    areas.py       where each area lies, per call shape
    rows.py        what a count row, a dispatched row and a combine row hold
    step.py        the step barrier each call starts with (and carries the call's fingerprint)
    dispatch.py    count exchange, hop 1 (network) and hop 2 (NVLink) of a dispatch
    combine.py     the combine: push to the forwarder, reduce per node, reduce at home
    mode.py        TwoLevelMode: the plans and launches of each normal-mode call
    gpu/wiring.py  what both GPU backends hand on the same way (calls to the modes, the call board)

Launches per call (C channels of contiguous tokens, ``C = config.num_sms // 2``)::

    dispatch (full)    ml_dispatch_step ; ml_dispatch_send_layout ; ml_notify_dispatch ; ml_dispatch_send ; [host polls the mailbox] ;
                       ml_dispatch_forward
    dispatch (cached)  ml_dispatch_step ; ml_dispatch_send ; ml_dispatch_forward
    combine            ml_combine_step ; ml_combine_push ; ml_combine_forward ; ml_combine_reduce

where a full dispatch's ml_notify_dispatch follows ml_dispatch_send_layout, which computes the two-level send
layout (hierarchy.send_layout: in-node masks, channel prefix matrices), the per-node token lists
(rows.node_tokens) and this rank's count row (rows.count_row) in one program.

Low-latency mode runs the single-node kernels (gpu/low_latency/) with ``REMOTE`` set: each
message goes straight to its expert's rank — by NVLink stores within the node, staged and put by
NVSHMEM to other nodes (gpu/reach/modes.py). Its workspace (gpu/workspace.py, ``staging=True``)
is a second region of the same symmetric allocation, after the normal-mode one, so both modes
can be used on one Buffer; its epochs live on the device, so its calls can be captured in CUDA
graphs (normal-mode calls cannot: their step barrier counts epochs on the host).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from ...errors import EPError, EPInputError
from ..gpu import agreement, call_board
from ..gpu import expert_major_kernels
from ..gpu.launch import current_stream, p2
from ..gpu.low_latency import LowLatencyMode
from ..gpu.mailbox import HostMailbox, check_host_mapping
from ..gpu.normal.layout_kernel import LayoutKernel
from ..gpu.normal.two_level import step as step_kernels
from ..gpu.normal.two_level.areas import allocation_bytes, low_latency_start, preamble
from ..gpu.normal.two_level.hierarchy import Topology
from ..gpu.normal.two_level.mode import TwoLevelMode
from ..gpu.reach.modes import FAR_BY_LOOPBACK, FAR_BY_NVSHMEM
from ..gpu.reach.transport import NvshmemTransport, Transport
from ..gpu.shared_grids import GridCaps, gpu_places
from ..gpu.sync import device_state
from ..gpu.wiring import GpuBackend
from ..gpu.workspace import Workspace
from ..store_agreement import StoreRendezvous

MAX_LOCAL_EXPERTS = 4096  # experts per rank the host mailbox has receive-count words for
LOOPBACK_LL_PROGRAMS = 8  # the loopback tests' low-latency receive programs (all ranks share one GPU)


class NvshmemBackend(GpuBackend):
    """Normal mode across nodes of ``ranks_per_node`` consecutive ranks (docs/MULTINODE.md).

    Args:
        group: the ranks (None with a loopback ``transport``).
        num_rdma_bytes: bytes of the normal-mode workspace of each rank
            (:func:`workspace.bytes_for_tokens` says what a batch needs).
        num_ll_bytes: bytes of the low-latency workspace (0: no low-latency mode;
            ``Buffer.get_low_latency_rdma_size_hint`` sizes it). The modes share the allocation
            after the fixed signal words, as in DeepEP: after normal-mode calls, low-latency calls
            need :meth:`clean_low_latency` first (EPError otherwise).
        transport: where the workspaces are (default: NVSHMEM symmetric memory on ``group``, of
            :meth:`allocation_bytes`); a loopback transport's buffers must be that large too.
        ll_ranks_per_node: the nodes of low-latency mode, whose ranks reach each other by stores
            (default ``ranks_per_node``; 1 sends everything through NVSHMEM, DeepEP's
            ``allow_nvlink_for_low_latency_mode=False``).
        send_parts: programs per (channel, node) of the puts between nodes — a dispatch's send, a
            combine's forward: each moves a slice of the channel's rows (more puts in flight;
            the Buffer's ``Tuning.nvshmem_send_parts``, default 1).
        p2p: a dispatch's send and a combine's forward store their rows straight into a peer on
            another node whose workspace this GPU can load and store (NVSHMEM maps it: the nodes
            share an NVLink domain, or virtual nodes of one host) instead of staging them and
            putting them — what NVSHMEM's put would do there anyway, less one copy. Peers it cannot
            map (other hosts) always take the put. The Buffer's ``Tuning.nvshmem_p2p``, default
            True (False measures the puts between GPUs of one host).
        ll_receive_programs: at most this many programs per low-latency receive phase (default 0:
            no cap). Ranks sharing one GPU (CUDA MPS) get caps of every grid anyway
            (GpuBackend.share_gpu), this one winning where smaller.
        ll_send_messages, ll_one_launch: the low-latency kernels' settings (the Buffer's ``Tuning``;
            LowLatencyMode). ``ll_one_launch=None`` is two launches here: the one launch has not
            been measured or run across nodes.
        shrink: the Buffer's ``enable_shrink``: a late rank is masked in low-latency mode and the
            calls go on; otherwise the next call raises EPTimeoutError (LowLatencyMode).
    """

    name = "nvshmem"
    # The expert-major layout is re-laid from the plain rows after the exchange, by kernels
    # (gpu/expert_major_kernels.py), not inside the multi-node kernels.
    expand_expert_major = staticmethod(expert_major_kernels.expand)
    fold_expert_major = staticmethod(expert_major_kernels.fold)

    def __init__(self, group: Optional[dist.ProcessGroup], device: torch.device, num_rdma_bytes: int,
                 ranks_per_node: int, timeout_s: float = 100.0, transport: Optional[Transport] = None,
                 num_ll_bytes: int = 0, ll_ranks_per_node: Optional[int] = None, send_parts: int = 1,
                 p2p: bool = True, ll_receive_programs: int = 0, shrink: bool = False, ll_send_messages: int = 0,
                 ll_one_launch: Optional[bool] = None):
        if transport is None:
            if num_rdma_bytes <= 0:
                raise EPInputError("num_rdma_bytes", "the nvshmem backend needs num_rdma_bytes > 0 (its workspace; "
                                                     "epcomm.backends.nvshmem.bytes_for_tokens sizes it)")
            transport = NvshmemTransport(group, device, self.allocation_bytes(
                num_rdma_bytes, num_ll_bytes, dist.get_world_size(group), ranks_per_node))
        self.group, self.device = group, device
        self.rank, self.num_ranks = transport.rank, transport.num_ranks
        self.topology = Topology(self.num_ranks, ranks_per_node)
        self.t = transport
        self.pre = preamble(self.num_ranks, ranks_per_node)
        self.base = transport.buffer.data_ptr()
        self.peer_bases = transport.peer_bases.data_ptr()
        self.loopback = transport.loopback
        self.far_mode = FAR_BY_LOOPBACK if self.loopback else FAR_BY_NVSHMEM  # the kernels' REMOTE (gpu/reach/modes.py)
        self.state = device_state(device)
        self.mailbox = HostMailbox(self.num_ranks, MAX_LOCAL_EXPERTS)
        check_host_mapping(self.mailbox, device)
        self.layout = LayoutKernel(self.num_ranks, ranks_per_node, device, self.state, self.mailbox.address)
        if send_parts < 1:
            raise EPInputError("send_parts", f"must be >= 1, got {send_parts}")
        self.timeout_s = float(timeout_s)
        self.timeout_ns = int(self.timeout_s * 1e9)
        if self.loopback:  # (the one-GPU tests: every rank in this process; their own caps)
            caps = GridCaps(0, 0, ll_receive_programs)
        else:  # ranks sharing a GPU: grids that fit it together (collective)
            caps = self.share_gpu(gpu_places(group), "nvshmem", ll_receive_programs)
        # which call each rank is in, across every Buffer of the group (a skipped call: call_board.py)
        if self.loopback:
            self.seat = call_board.join(self.rank, self, lambda: self._make_board(group), transport.world.call_boards)
        else:
            self.seat = call_board.join(("nvshmem", group.group_name), self, lambda: self._make_board(group))
        self.normal = TwoLevelMode(transport, self.topology, device, self.state, self.mailbox, self.timeout_s,
                                   send_parts, bool(p2p), self.far_mode, board=self.seat, backend_name=self.name,
                                   size_hint="epcomm.backends.nvshmem.bytes_for_tokens")
        self.low_latency = self.ll_ws = None
        if num_ll_bytes:
            self._ll_reach = (self.far_mode, ll_ranks_per_node or ranks_per_node)
            self.ll_ws = self._ll_workspace(num_ll_bytes)
            self.low_latency = LowLatencyMode(self.ll_ws, self.state, self.mailbox, self.timeout_ns, device,
                                              *self._ll_reach, LOOPBACK_LL_PROGRAMS if self.loopback else 0,
                                              receive_programs=caps.ll_receive_programs, board=self.seat,
                                              send_programs=caps.ll_send_programs, shrink=shrink,
                                              messages_per_program=ll_send_messages,
                                              one_launch=bool(ll_one_launch))

    def _make_board(self, group: Optional[dist.ProcessGroup]) -> call_board.CallBoard:
        """The group's call board in symmetric memory (NVSHMEM, or the loopback world's)."""
        num_bytes = call_board.board_words(self.num_ranks) * 8
        if self.loopback:
            world = self.t.world.board_memory(num_bytes)
            memory, bases, rendezvous = world.transport(self.rank), world.peer_bases, lambda what: memory.barrier()
        else:
            memory = NvshmemTransport(group, self.device, num_bytes)  # zeroed on every rank before it returns
            bases, rendezvous = memory.peer_bases, StoreRendezvous(group, self.timeout_s)
        # (every peer but this rank is reached by signals: ranks_per_node 1)
        post_resync = agreement.resync_poster(bases.data_ptr(), self.rank, self.num_ranks, self.device, self.far_mode,
                                              ranks_per_node=1)
        return call_board.CallBoard(self.rank, self.num_ranks, memory.buffer.view(torch.int64), bases, rendezvous,
                                    memory, post_resync)

    # Bytes of symmetric memory per rank for both modes (two_level/areas.py).
    allocation_bytes = staticmethod(allocation_bytes)

    def _ll_workspace(self, num_ll_bytes: int) -> Workspace:
        """The low-latency workspace, right after the normal mode's fixed signal words."""
        start = low_latency_start(self.num_ranks, self.topology.ranks_per_node)
        bases = self.t.peer_bases
        ll_bases = torch.where(bases != 0, bases + start, torch.zeros_like(bases))  # 0: not mapped here
        # (loopback ranks are built one after another in one thread: no barrier among them here)
        barrier = (lambda: None) if self.loopback else self.t.barrier
        return Workspace(None, self.device, 0, num_ll_bytes, memory=(self.t.buffer[start:], ll_bases, barrier),
                         normal=False, staging=True, rank=self.rank, num_ranks=self.num_ranks)

    # ------------------------------------------------------------------ per call
    def dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int, ranks_per_node: int):
        """One kernel (gpu/normal/layout_kernel.py), the per-node counts of this backend's nodes included
        (Buffer's ``ranks_per_node`` made them); a local call."""
        return self.layout(topk_idx, num_experts)

    def local_buffer(self, use_rdma_buffer: bool) -> torch.Tensor:
        """The one symmetric allocation (both modes' memory), whichever part is asked for."""
        return self.t.buffer

    def agree(self, kind, fingerprint, error=None, rank_mask=None) -> None:
        """Calls agree through the step barrier's fingerprints; here only a rejected input acts:
        the abort kernel ends the peers' waits of this call and names the argument to them."""
        if error is None:
            return
        fp0, fp1 = agreement.abort_words(error.argument)
        board = (self.seat.bases_address, self.seat.tag())  # the aborted call, posted on the call board
        if self.low_latency is not None:  # the low-latency waits end too
            agreement.launch_abort(self.ll_ws, self.state, self.low_latency.num_experts_seen, error.argument,
                                   self.device, *self._ll_reach, board=board)
        step_kernels.ABORT.bind(num_warps=4, REMOTE=self.far_mode, R_P2=p2(self.num_ranks)).launch(
            self.num_ranks, 1, current_stream(self.device.index), self.peer_bases, self.base, self.pre.step_rows,
            self.pre.fingerprint, self.pre.notify_signals, self.pre.dispatch_signals, self.pre.push_flags,
            self.pre.home_signals, fp0, fp1, self.rank, self.num_ranks, self.topology.ranks_per_node, *board)
        self.mailbox.resync_needed = True

    def warm_abort(self) -> None:
        """Compile the abort kernels now (each compiles on first use otherwise: a rank that compiles
        one while rejecting its input holds its peers' waits up by seconds)."""
        step_kernels.ABORT.bind(num_warps=4, REMOTE=self.far_mode, R_P2=p2(self.num_ranks))
        if self.low_latency is not None:
            agreement.bind_abort(self.ll_ws.num_ranks, *self._ll_reach[:1])

    def reset_signals(self) -> None:
        """The step rows, every signal word of both modes, the epochs and the mailbox back to zero,
        as in a new Buffer (no kernel of this Buffer runs: CallBoard.resync)."""
        self.t.buffer[:self.pre.data].zero_()
        self.state.zero_()
        self.normal.reset()
        if self.low_latency is not None:
            self.ll_ws.zero_signals()
            self.low_latency.forget_calls()
            self.normal.written = False
        self.mailbox.clear()

    # ------------------------------------------------------------------ low-latency mode
    def _low_latency(self) -> LowLatencyMode:
        if self.low_latency is None:
            raise EPInputError("num_rdma_bytes", "this nvshmem backend has no low-latency workspace: make the Buffer "
                                                 "with low_latency_mode=True and num_rdma_bytes from "
                                                 "get_low_latency_rdma_size_hint")
        if self.normal.written:  # normal mode used the shared bytes (every rank makes the same calls: all raise)
            raise EPError("normal-mode calls used this Buffer's memory since the last low-latency call: call "
                          "clean_low_latency_buffer on every rank first (the modes share num_rdma_bytes, as in "
                          "DeepEP, which requires the same)")
        return self.low_latency

    def clean_low_latency(self) -> None:
        """Collective: reset every low-latency epoch, count word and flag (LowLatencyMode.reset)."""
        self.normal.written = False
        self._low_latency().reset(self.t.barrier)

    def destroy(self) -> None:
        self.released = True  # (its group's call board forgets it)
        if self.t is not None:
            self.t.release()  # back to the ledger, freed at a later agreed point (gpu/reach/symmetric_heap.py)
        self.t = self.ll_ws = self.low_latency = None
