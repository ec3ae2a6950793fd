"""The public, DeepEP V1-compatible ``Buffer``.

The buffer validates every argument (raising :class:`EPInputError` before any communication),
computes routing layouts, runs the work on its communication stream, and hands the byte moving to
a backend (see :mod:`epcomm.backends`).
"""
from __future__ import annotations

import dataclasses
import os
from typing import Callable, List, Optional, Tuple

import torch
import torch.distributed as dist

from . import checks, config as config_mod, fp8
from . import expert_major as expert_major_layout
from .backends import BACKENDS, create_backend, default_backend_name, group_device, ranks_per_host
from .backends.base import DispatchArgs
from .config import Config, Tuning
from .errors import EPError, EPInputError
from .events import EventOverlap, StreamScope, capture_event
from .handle import DispatchHandle, LowLatencyHandle
from .low_latency_calls import LowLatencyCalls
from .rank_mask import RankMasking
from .types import Payload

DEFAULT_TIMEOUT_S = 100.0
# Operators' switches of Tuning, read where a Buffer is built and by no module below this one
# (tests/test_configuration.py): the variable wins over the argument, as EPCOMM_BACKEND does.
TUNING_VARIABLES = {"ll_send_messages": "EPCOMM_LL_SEND_MESSAGES", "ll_one_launch": "EPCOMM_LL_ONE_LAUNCH",
                    "ll_receive_programs": "EPCOMM_LL_RECEIVE_PROGRAMS",
                    "nvshmem_send_parts": "EPCOMM_NVSHMEM_SEND_PARTS", "nvshmem_p2p": "EPCOMM_NVSHMEM_P2P"}
SWITCHES = ("ll_one_launch", "nvshmem_p2p")  # the Tuning fields whose variables read 0 or 1
_INLINE_SCOPE = StreamScope(None, None, False)  # a synchronous call without previous_event (events.py)


class Buffer(RankMasking, LowLatencyCalls):
    """Communication buffer for expert-parallel dispatch and combine (DeepEP V1 ``Buffer`` API).

    Args:
        group: the process group of the expert-parallel ranks (gloo → CPU tensors, NCCL → CUDA;
            ``device`` below changes that).
        num_nvl_bytes: bytes of intra-node communication memory, fixed for the buffer's life.
        num_rdma_bytes: bytes of inter-node (or low-latency) communication memory.
        low_latency_mode: enable the low-latency (decode) kernels.
        num_qps_per_rank: RDMA queue pairs per peer (inter-node only; accepted for compatibility).
        allow_nvlink_for_low_latency_mode: low-latency traffic within a node uses NVLink (nvshmem;
            False: every message to another rank goes through NVSHMEM).
        allow_mnnvl: allow multi-node NVLink (accepted for compatibility).
        use_fabric: fabric-handle memory for multi-node NVLink in DeepEP; PyTorch picks the handle
            type of epcomm's symmetric memory itself: accepted, recorded, no effect.
        explicitly_destroy: if True, :meth:`destroy` must be called to free resources.
        enable_shrink: enable the low-latency rank-mask calls (``low_latency_update_mask_buffer``,
            ``low_latency_query_mask_buffer``, ``low_latency_clean_mask_buffer``), as in DeepEP: a
            rank that times out in low-latency mode is masked and the calls go on without it.
            Without it a late rank is an EPTimeoutError on every rank, never a smaller sum.
        backend: ``"torch_dist"``, ``"nvlink"`` or ``"nvshmem"``; default: chosen from the group
            (``nvlink`` on one node, ``nvshmem`` across hosts or when ``ranks_per_node`` splits
            the group, else ``torch_dist``).
        ranks_per_node: group the ranks into nodes of this many consecutive ranks (on one host:
            virtual nodes, which reach each other only the way separate nodes would — on nvshmem,
            through NVSHMEM puts; ``EPCOMM_RANKS_PER_NODE`` overrides it). Default: the ranks per
            host on the nvshmem backend, one node otherwise. With several nodes,
            :meth:`get_dispatch_layout` returns ``num_tokens_per_rdma_rank`` (tokens per node), as
            DeepEP does across nodes; torch_dist and nvshmem run several nodes, nvlink one.
        timeout: seconds a wait for peers may take before it raises :class:`EPTimeoutError` naming
            them (or, in low-latency mode with ``enable_shrink``, masks them); ``EPCOMM_TIMEOUT_S``
            overrides the default.
        check_values: validate tensor contents (e.g. ``topk_idx`` ranges) on CUDA too, which costs a
            host synchronisation per call; ``EPCOMM_CHECK_VALUES=1`` turns it on. Always on for CPU.
        tuning: the GPU kernels' settings (:class:`epcomm.Tuning`; default: the measured choices),
            each overridden by its ``EPCOMM_*`` variable (``TUNING_VARIABLES``); ``buffer.tuning``
            holds what the backend got.
        device: where the Buffer's tensors live. Default: from the group — CUDA (the current
            device) for a group with CUDA collectives (``nccl``, ``"cpu:gloo,cuda:nccl"``), the CPU
            for a ``gloo`` group (the reference backend). ``device="cuda"`` with a gloo group on
            CUDA ranks (as vLLM passes one) runs the GPU backends on the current device, the group
            carrying only host-side exchanges, as in DeepEP (``deep_ep.Buffer`` does this by
            default); ``device="cpu"`` asks for the CPU reference backend.

    Everything before ``timeout`` is DeepEP V1's constructor, keyword for keyword and in order. The
    backend is chosen from the group (``torch_dist`` for gloo, ``nvlink`` for CUDA on one node,
    ``nvshmem`` across nodes) unless ``backend`` names one; ``EPCOMM_BACKEND`` overrides both;
    ``buffer.backend_name`` tells which. On ``nvshmem``, ``num_rdma_bytes`` sizes each rank's
    symmetric workspace (0: ``num_nvl_bytes``, or 1 GiB if that is 0 too — code written for one
    node runs as it is): ``epcomm.backends.nvshmem.bytes_for_tokens`` gives what a batch
    needs in normal mode, :meth:`get_low_latency_rdma_size_hint` in low-latency mode; the modes
    share those bytes as in DeepEP: after normal-mode calls, call :meth:`clean_low_latency_buffer`
    on every rank before the next low-latency call (an EPError says so otherwise).
    """

    num_sms: int = 20

    def __init__(self, group: dist.ProcessGroup, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0,
                 low_latency_mode: bool = False, num_qps_per_rank: int = 24,
                 allow_nvlink_for_low_latency_mode: bool = True, allow_mnnvl: bool = False,
                 use_fabric: bool = False, explicitly_destroy: bool = False, enable_shrink: bool = False, *,
                 timeout: Optional[float] = None, check_values: Optional[bool] = None,
                 backend: Optional[str] = None, ranks_per_node: Optional[int] = None, device=None,
                 tuning: Optional[Tuning] = None):
        if group is None or not isinstance(group, dist.ProcessGroup):
            raise EPInputError("group", f"must be a torch.distributed.ProcessGroup, got {type(group).__name__}")
        checks.check_int("num_nvl_bytes", num_nvl_bytes, minimum=0)
        checks.check_int("num_rdma_bytes", num_rdma_bytes, minimum=0)
        checks.check_int("num_qps_per_rank", num_qps_per_rank, minimum=1)
        if timeout is None:
            timeout = float(os.environ.get("EPCOMM_TIMEOUT_S", DEFAULT_TIMEOUT_S))
        if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not timeout > 0:
            raise EPInputError("timeout", f"must be a positive number of seconds, got {timeout!r}")
        self.group = group
        self.rank = dist.get_rank(group)
        self.group_size = dist.get_world_size(group)
        if os.environ.get("EPCOMM_RANKS_PER_NODE"):
            ranks_per_node = int(os.environ["EPCOMM_RANKS_PER_NODE"])
        if ranks_per_node is not None:
            checks.check_int("ranks_per_node", ranks_per_node, minimum=1)
            if self.group_size % ranks_per_node:
                raise EPInputError("ranks_per_node", f"{ranks_per_node} does not divide the group size "
                                                     f"{self.group_size}")
        self.num_nvl_bytes = num_nvl_bytes
        self.num_rdma_bytes = num_rdma_bytes
        self.low_latency_mode = bool(low_latency_mode)
        self.num_qps_per_rank = num_qps_per_rank
        self.allow_nvlink_for_low_latency_mode = allow_nvlink_for_low_latency_mode
        self.allow_mnnvl = allow_mnnvl
        self.use_fabric = bool(use_fabric)
        self.explicitly_destroy = explicitly_destroy
        self.enable_shrink = bool(enable_shrink)
        self.timeout = float(timeout)
        try:
            self.device = group_device(group, device)
        except EPError as err:
            raise EPInputError("device", str(err)) from None
        if backend is not None and backend not in BACKENDS:
            raise EPInputError("backend", f"must be one of {BACKENDS}, got {backend!r}")
        if tuning is not None and not isinstance(tuning, Tuning):
            raise EPInputError("tuning", f"must be an epcomm.Tuning, got {type(tuning).__name__}")
        self.tuning = tuning_from_environment(tuning or Tuning())
        override = os.environ.get("EPCOMM_BACKEND")  # (an operator's switch: wins over the argument)
        self.backend_name = default_backend_name(group, override or backend, ranks_per_node, self.device,
                                                 "EPCOMM_BACKEND" if override else "backend")
        if ranks_per_node is None:  # one node, except on nvshmem: its hosts' blocks of ranks
            ranks_per_node = ranks_per_host(group) if self.backend_name == "nvshmem" else self.group_size
        self.ranks_per_node = ranks_per_node
        self.num_nodes = self.group_size // ranks_per_node
        if self.num_nodes > 1 and self.backend_name == "nvlink":
            raise EPError(f"ranks_per_node={ranks_per_node} makes {self.num_nodes} nodes; the nvlink backend runs "
                          f"on one node (multi-node: backend='nvshmem', or 'torch_dist')")
        # Value checks read tensors (a host sync on CUDA): always on CPU and for the reference
        # backend, opt-in (check_values / EPCOMM_CHECK_VALUES=1) on the GPU fast path.
        if check_values is None:
            check_values = checks.value_checks_enabled(self.device) or self.backend_name == "torch_dist" \
                or os.environ.get("EPCOMM_CHECK_VALUES", "0") == "1"
        self._check_values = bool(check_values)
        self._backend = create_backend(self.backend_name, group, self.device, num_nvl_bytes, num_rdma_bytes,
                                       self.low_latency_mode, self.timeout, ranks_per_node,
                                       allow_nvlink_for_low_latency_mode, self.enable_shrink, self.tuning)
        self._capped_configs = {}  # Config -> the same with num_sms capped (ranks sharing a GPU)
        # argument shapes that passed their checks (checks.ShapeCache): a call of a known shape skips them
        self._checked_dispatches, self._checked_layouts = checks.ShapeCache(), checks.ShapeCache()
        self._checked_ll_dispatches, self._checked_ll_combines = checks.ShapeCache(), checks.ShapeCache()
        self._comm_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        # Low-latency state: rank mask, and the two buffer halves used alternately.
        self._rank_mask = torch.zeros(self.group_size, dtype=torch.int32, device=self.device)
        self._ll_phase = 0
        self._resyncs_seen = self._backend.resync_generation  # (a resync of the group restarts the halves)
        self._ll_combine_staging: List[Optional[torch.Tensor]] = [None, None]
        # (handle, topk_idx) of the last two low-latency dispatches: combine checks its topk_idx against them
        self._ll_dispatched: List[Optional[Tuple[LowLatencyHandle, torch.Tensor]]] = [None, None]
        self._destroyed = False
        self._spare_bytes = {}  # get_local_buffer_tensor's memory where the backend has none
        # A get_dispatch_layout that rejected its input (a local call): the next call that exchanges
        # anything takes part as an abort, so no peer pairs its current call with this rank's next one.
        self._rejected_layout: Optional[EPInputError] = None

    # ------------------------------------------------------------------ static helpers
    @staticmethod
    def is_sm90_compiled() -> bool:  # True: the FP8 paths need no compiled extension here
        return True

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """Set the SM count used by default configs (must be even)."""
        config_mod.set_default_num_sms(new_num_sms)
        Buffer.num_sms = new_num_sms

    @staticmethod
    def capture() -> EventOverlap:
        """An event on the current CUDA stream, to pass as ``previous_event`` (done event on CPU)."""
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        return capture_event(device)

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        """Tuned dispatch :class:`Config` for ``num_ranks`` ranks."""
        return config_mod.dispatch_config(num_ranks)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        """Tuned combine :class:`Config` for ``num_ranks`` ranks."""
        return config_mod.combine_config(num_ranks)

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int,
                                       num_ranks: int, num_experts: int) -> int:
        """Bytes of ``num_rdma_bytes`` low-latency mode needs: two halves, each holding the count
        matrix ``[R, E]``, the receive slots ``[E_local][R][M]`` of one message per (token, expert)
        (BF16-sized, so FP8 fits too), the combine slots ``[M][K]`` for up to 32 experts per token,
        and (used across nodes, on nvshmem) a staging area as large as the receive slots."""
        for name, value in (("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank),
                            ("hidden", hidden), ("num_ranks", num_ranks), ("num_experts", num_experts)):
            checks.check_int(name, value, minimum=1)
        from .backends.gpu.workspace import low_latency_bytes
        return low_latency_bytes(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts)

    # ------------------------------------------------------------------ state
    def _check_alive(self) -> None:
        if self._destroyed:
            raise EPError("this Buffer was destroyed")
        if self._backend.needs_resync:
            self._resync()
        if self._backend.resync_generation != self._resyncs_seen:  # another Buffer of the group resynced all
            self._forget_calls_in_flight()
        self._backend.raise_pending()

    def _start_call(self, kind: str) -> None:
        """:meth:`_check_alive` for a call that exchanges anything: an EPInputError kernels reported
        for an earlier call (the GPU backends report at the next call when the failing one did not
        wait on the host) makes this call take part as an abort, so the peers raise in it too and
        every rank resyncs at its next call; after a rejected layout, the stand-in comes first
        (:meth:`_stand_in_for_skipped_call`)."""
        try:
            self._check_alive()
        except EPInputError as err:
            self._backend.agree(kind, None, err, self._shrink_mask(kind))
            raise
        if self._rejected_layout is not None:
            self._stand_in_for_skipped_call(kind)

    def _resync(self) -> None:
        """After this rank raised EPInputError on a GPU backend: re-pair with the peers (collective
        over the group, bounded: every rank that raised comes here at its next call)."""
        self._backend.resync()
        self._forget_calls_in_flight()

    def _forget_calls_in_flight(self) -> None:
        """After a resync of this Buffer's group: the low-latency halves start again, and a call a
        rejected layout skipped is over (its peers raised)."""
        self._resyncs_seen = self._backend.resync_generation
        self._rejected_layout = None
        self._ll_phase = 0
        self._ll_combine_staging = [None, None]
        self._ll_dispatched = [None, None]

    def _shrink_mask(self, kind: str = "low_latency") -> Optional[torch.Tensor]:
        """The rank mask a ``kind`` call agrees under: low-latency calls with ``enable_shrink`` only
        (a late rank is masked there); otherwise None (a late rank is an error on every rank)."""
        return self._rank_mask if self.enable_shrink and kind.startswith("low_latency") else None

    def _check_low_latency(self, kind: Optional[str] = None) -> None:
        self._check_alive() if kind is None else self._start_call(kind)
        if not self.low_latency_mode:
            raise EPError("low-latency calls need a Buffer constructed with low_latency_mode=True")

    def _stand_in_for_skipped_call(self, kind: str) -> None:
        """If this rank's last get_dispatch_layout rejected its input (a local call), this rank
        skipped the call that layout was for, which its peers are making. The first call that
        exchanges anything afterwards first stands in for it, as an abort: the peers raise
        EPInputError there, naming this rank and the argument, and this call then pairs with their
        next one: without the stand-in, this call would pair with the peers' call the layout was
        for. (On the GPU backends this rank then resyncs with the peers, which raised.)"""
        rejected, self._rejected_layout = self._rejected_layout, None
        if rejected is None:
            return
        reason = str(rejected).split(": ", 1)[-1]
        error = EPInputError(rejected.argument, f"get_dispatch_layout rejected it on rank {self.rank} ({reason}), "
                                                f"which skipped the call that layout was for")
        try:
            self._backend.stand_in(kind, error, self._shrink_mask(kind))
        except EPInputError:
            pass  # this rank's own abort, expected: its peers raised in the call it skipped
        if self._backend.needs_resync:  # GPU backends: the abort left the signals out of step
            self._resync()

    def get_comm_stream(self) -> Optional[torch.cuda.Stream]:
        """The stream communication runs on (``None`` on CPU)."""
        return self._comm_stream

    def get_local_buffer_tensor(self, dtype: torch.dtype, size: Optional[torch.Size] = None, offset: int = 0,
                                use_rdma_buffer: bool = False) -> torch.Tensor:
        """This rank's communication memory as a tensor of ``dtype`` (DeepEP's raw-buffer view).

        Args:
            dtype: the element type of the view.
            size: view the first ``size.numel()`` elements with this shape (default: all of them, 1-D).
            offset: bytes from the start of the memory (a multiple of the element size).
            use_rdma_buffer: the inter-node / low-latency memory instead of the intra-node one.

        On nvlink the two are the normal-mode and the low-latency parts of the symmetric memory; on
        nvshmem both are its one symmetric allocation; torch_dist moves data with collectives and
        has none, so it returns a zeroed byte buffer of ``num_nvl_bytes`` / ``num_rdma_bytes`` that
        no call reads. Warning: the kernels own the memory during calls; write it only between calls.
        """
        self._check_alive()
        memory = self._backend.local_buffer(bool(use_rdma_buffer))
        if memory is None:  # (torch_dist) one byte buffer per kind, made on first use
            kind = bool(use_rdma_buffer)
            if kind not in self._spare_bytes:
                nbytes = self.num_rdma_bytes if kind else self.num_nvl_bytes
                self._spare_bytes[kind] = torch.zeros(nbytes, dtype=torch.uint8, device=self.device)
            memory = self._spare_bytes[kind]
        return checks.view_of_bytes(memory, dtype, size, offset)

    def destroy(self) -> None:
        """Free the buffer's resources; required when constructed with ``explicitly_destroy=True``.

        Not collective. On nvshmem the symmetric memory goes back to a per-process ledger and is
        reused or freed at the next Buffer construction on the group, once every rank has let go
        of it (NVSHMEM frees are barriers over every process; on a subgroup it is kept: see
        backends/gpu/reach/symmetric_heap.py).
        Views of the memory (``get_local_buffer_tensor``, a zero-copy combine buffer) must not be
        used afterwards; while one is alive, the memory is kept."""
        if self._destroyed:
            return
        self._backend.destroy()
        self._destroyed = True

    def __del__(self):
        try:
            if not self.explicitly_destroy:
                self.destroy()
        except Exception:
            pass

    def _stream_scope(self, previous_event, async_finish, inputs=()) -> StreamScope:
        if previous_event is None and not async_finish:
            return _INLINE_SCOPE  # runs on the caller's stream; keeps no state, so one object serves every call
        if previous_event is not None and not isinstance(previous_event, EventOverlap):
            raise EPInputError("previous_event", f"must be an EventOverlap, got {type(previous_event).__name__}")
        return StreamScope(self._comm_stream, previous_event, bool(async_finish), inputs)

    def _resolve_config(self, config, default: Callable[[int], Config]) -> Config:
        """``config`` or the default, its ``num_sms`` capped at the backend's ``max_num_sms`` (ranks
        sharing a GPU: every rank's grids must fit at once, GpuBackend.share_gpu); smaller wins."""
        if config is None:
            config = default(self.group_size)
        elif not isinstance(config, Config):
            raise EPInputError("config", f"must be an epcomm.Config, got {type(config).__name__}")
        cap = self._backend.max_num_sms
        if cap and config.num_sms > cap:
            capped = self._capped_configs.get(config)
            if capped is None:
                capped = self._capped_configs[config] = dataclasses.replace(config, num_sms=cap)
            return capped
        return config

    # ------------------------------------------------------------------ normal mode
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int,
                            previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                            allocate_on_comm_stream: bool = False):
        """Count tokens per rank and per expert from the router's choice.

        Args:
            topk_idx: ``[T, K]`` int64 expert ids, ``-1`` = no expert.
            num_experts: global expert count ``E`` (a multiple of the group size).

        Returns:
            ``(num_tokens_per_rank [R] int32, num_tokens_per_rdma_rank [N] int32 | None,
            num_tokens_per_expert [E] int32, is_token_in_rank [T, R] bool, event)``.

        A local call, as in DeepEP. If it rejects its input (:class:`EPInputError`), skip the call
        it was for (as code does when the layout raised): the next call that exchanges anything
        first stands in for the skipped one as an abort — the peers, making that call, raise
        EPInputError naming this rank and the argument — and then pairs with the peers' next call.
        """
        self._check_alive()
        try:
            key = checks.layout_key(topk_idx, num_experts)
            try:
                checked = key in self._checked_layouts  # the shape checks in full once per shape (checks.ShapeCache)
            except TypeError:
                checked = False
            if not checked:
                checks.check_num_experts(num_experts, self.group_size)
                checks.check_topk_idx("topk_idx", topk_idx, num_experts, self.device, check_values=self._check_values)
                self._checked_layouts.remember(key)
            elif self._check_values:
                checks.check_topk_values("topk_idx", topk_idx, num_experts)
        except EPInputError as err:
            self._rejected_layout = err  # the next collective call stands in for the skipped one
            self._backend.pass_given_up_calls()  # (so that the stand-in meets that call, not an older one)
            raise
        if previous_event is None and not async_finish:  # on the caller's stream: no scope to enter (events.py)
            per_rank, per_rdma_rank, per_expert, in_rank = self._backend.dispatch_layout(topk_idx, num_experts,
                                                                                         self.ranks_per_node)
            return per_rank, per_rdma_rank, per_expert, in_rank, EventOverlap(None)
        with self._stream_scope(previous_event, async_finish, (topk_idx,)) as scope:
            per_rank, per_rdma_rank, per_expert, in_rank = self._backend.dispatch_layout(topk_idx, num_experts,
                                                                                         self.ranks_per_node)
            scope.keep(per_rank, per_rdma_rank, per_expert, in_rank)
        return per_rank, per_rdma_rank, per_expert, in_rank, scope.event_overlap()

    def dispatch(self, x: Payload, handle: Optional[DispatchHandle] = None,
                 num_tokens_per_rank: Optional[torch.Tensor] = None,
                 num_tokens_per_rdma_rank: Optional[torch.Tensor] = None,
                 is_token_in_rank: Optional[torch.Tensor] = None,
                 num_tokens_per_expert: Optional[torch.Tensor] = None,
                 topk_idx: Optional[torch.Tensor] = None, topk_weights: Optional[torch.Tensor] = None,
                 expert_alignment: int = 1, num_worst_tokens: int = 0, config: Optional[Config] = None,
                 previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False, *, expert_major: bool = False):
        """Send each token once to every rank that hosts at least one of its experts.

        Args:
            x: bf16 ``[T, H]``, or FP8 ``(e4m3 [T, H], scales [T, S])``: float32 or int32 scales of any
                width ``S`` and strides (e.g. DeepGEMM's UE8M0 ``[T, H/512]`` int32, column-major and
                TMA-aligned), received in their dtype and width, row-major (:class:`epcomm.fp8.DispatchPayload`).
            handle: a handle from an earlier dispatch: cached mode (no top-k arguments, no count
                exchange, no host synchronisation).
            num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank, num_tokens_per_expert:
                the outputs of :meth:`get_dispatch_layout`.
            topk_idx: ``[T, K]`` int64 global expert ids (``-1`` = none); topk_weights: ``[T, K]`` float32.
            expert_alignment: round each per-expert receive count up to a multiple of this.
            num_worst_tokens: if > 0, pad outputs to exactly this many rows and skip the host sync.
            expert_major: return the rows grouped by local expert for a grouped GEMM (epcomm's
                extension; :mod:`epcomm.expert_major`): one row per (token, local expert) entry,
                groups padded to ``expert_alignment`` whose sizes are the returned list;
                ``recv_topk_idx`` / ``recv_topk_weights`` become ``[rows]`` (each row's local expert
                and weight; -1 / 0 on padding). :meth:`combine` then applies these weights itself
                (the handle keeps the returned tensor: do not modify it in place before combine). A
                cached dispatch with such a handle returns the same layout. Needs top-k arguments
                and ``num_worst_tokens == 0``. (The NVLink backend builds it in its kernels; its
                pull and fold then run on up to 6× ``config.num_sms`` programs, since every row is
                stored once per local expert.)

        Returns:
            ``(recv_x, recv_topk_idx [Trecv, K] | None, recv_topk_weights [Trecv, K] | None,
            num_recv_tokens_per_expert_list, handle, event)``. Rows are grouped by source rank in rank
            order, each source's tokens in its own order. ``handle`` holds DeepEP's fields at DeepEP's
            positions (:mod:`epcomm.handle`: ``handle[0]`` is ``rank_prefix_matrix`` on one node).
            ``recv_topk_idx`` holds local expert ids (``-1`` elsewhere; weights 0 there).
            In cached mode the top-k outputs and the list are ``None``.
        """
        capturing = None if self._destroyed else self._backend.refuse_capture("dispatch", handle, num_worst_tokens)
        self._start_call("dispatch")
        try:
            # Shape checks run in full once per distinct argument shape (checks.ShapeCache); the
            # handle's checks and the value checks run on every call.
            payload = None
            pair = isinstance(x, (tuple, list))  # FP8: scales of any 4-byte dtype, width and strides, as float32 words
            pair_key = checks.fp8_pair_key(x) if pair else None
            key = checks.dispatch_key(handle is not None, pair_key if pair else x,
                                      num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
                                      num_tokens_per_expert, topk_idx, topk_weights, expert_alignment, num_worst_tokens)
            try:
                checked = key in self._checked_dispatches
            except TypeError:  # (an argument with an unhashable attribute: the checks reject it)
                checked = False
            if pair:  # (the pair's checks once per shape; the wire made on every call, except a plain pair's)
                if checked and fp8.plain_pair(pair_key):  # (its wire is the pair itself: no payload to make)
                    x = x if x.__class__ is tuple else tuple(x)
                    (num_tokens, hidden), is_fp8 = x[0].shape, True
                else:
                    num_tokens, hidden, is_fp8, payload = fp8.dispatch_payload("x", x, self.device, checked)
            elif checked:  # a bf16 tensor: the payload is x itself
                num_tokens, hidden = x.shape
                is_fp8 = False
            else:
                num_tokens, hidden, is_fp8, payload = fp8.dispatch_payload("x", x, self.device)
            # The handle's DeepEP channel fields follow the Config the caller asked for (DeepEP's
            # channels), not the one capped where ranks share a GPU (the grids that run).
            asked = config if config is not None else Buffer.get_dispatch_config(self.group_size)
            config = self._resolve_config(asked, Buffer.get_dispatch_config)
            if not checked:  # (with the value checks in their place: the first failing check names the argument)
                self._check_dispatch_arguments(num_tokens, handle is None, num_tokens_per_rank, num_tokens_per_rdma_rank,
                                               is_token_in_rank, num_tokens_per_expert, topk_idx, topk_weights,
                                               expert_alignment, num_worst_tokens)
                self._checked_dispatches.remember(key)
            elif handle is None and self._check_values:
                self._check_dispatch_values(num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
                                            num_tokens_per_expert, topk_idx)
            if handle is not None:
                self._check_cached_dispatch(handle, num_tokens, num_tokens_per_rank, num_tokens_per_rdma_rank,
                                            is_token_in_rank, num_tokens_per_expert, topk_idx, topk_weights, expert_major)
            elif expert_major and (topk_idx is None or num_worst_tokens):
                raise EPInputError("expert_major", "needs topk_idx/topk_weights and num_worst_tokens=0")
            args = DispatchArgs(x if payload is None else payload.x, handle, num_tokens_per_rank, is_token_in_rank,
                                num_tokens_per_expert, topk_idx, topk_weights, expert_alignment, num_worst_tokens, config,
                                expert_major or (handle is not None and handle.expert_major is not None),
                                capturing=capturing)
            self._backend.check_dispatch(args)
        except EPInputError as err:
            self._backend.agree("dispatch", None, err)  # every rank raises, not only this one
            raise
        if self._backend.agrees:
            self._backend.agree("dispatch", (("x", "fp8" if is_fp8 else "bf16"), ("hidden", hidden),
                                             ("handle", handle is not None), ("topk_idx", topk_idx is not None),
                                             ("num_topk", None if topk_idx is None else topk_idx.shape[1]),
                                             ("num_tokens_per_expert",
                                              None if handle is not None else num_tokens_per_expert.numel()),
                                             ("num_worst_tokens", num_worst_tokens > 0)))
        if previous_event is None and not async_finish:  # on the caller's stream: no scope to enter (events.py)
            return self._dispatch_outputs(self._backend.dispatch(args), payload, handle, expert_major, asked) + \
                (EventOverlap(None),)
        inputs = payload.tensors if payload is not None else x if pair else (x,)  # (a plain pair: x is its tuple)
        with self._stream_scope(previous_event, async_finish, inputs + (topk_idx, topk_weights, is_token_in_rank)) \
                as scope:
            outputs = self._dispatch_outputs(self._backend.dispatch(args), payload, handle, expert_major, asked)
            scope.keep(*outputs[:3])
        return outputs + (scope.event_overlap(),)

    def _dispatch_outputs(self, result, payload, handle: Optional[DispatchHandle], expert_major,
                          asked_config: Config) -> tuple:
        """The backend's DispatchResult as :meth:`dispatch` returns it, less the event: FP8 scales in
        the caller's format, the handle laid out as DeepEP's, the expert-major rows where the backend
        does not build them."""
        recv_x, recv_topk_idx, recv_topk_weights = result.recv_x, result.recv_topk_idx, result.recv_topk_weights
        if payload is not None:
            recv_x = payload.restore(recv_x)  # the caller's scale dtype and width, row-major
        counts = result.num_recv_tokens_per_expert_list
        # DeepEP's fields, on the channels of the Config the caller asked for
        out_handle = result.handle.laid_out(self.rank, self.ranks_per_node, asked_config.num_sms // 2)
        if not self._backend.native_expert_major:  # re-laid here from the plain rows
            if expert_major:
                mapping = expert_major_layout.plan(recv_topk_idx, recv_topk_weights, counts)
                recv_x = self._backend.expand_expert_major(recv_x, mapping)
                recv_topk_idx, recv_topk_weights = mapping.row_experts, mapping.row_weights
                out_handle = out_handle._replace(expert_major=mapping)
            elif handle is not None and handle.expert_major is not None:
                recv_x = self._backend.expand_expert_major(recv_x, handle.expert_major)
        return recv_x, recv_topk_idx, recv_topk_weights, counts, out_handle

    def _check_dispatch_arguments(self, num_tokens: int, full: bool, num_tokens_per_rank, num_tokens_per_rdma_rank,
                                  is_token_in_rank, num_tokens_per_expert, topk_idx, topk_weights, expert_alignment,
                                  num_worst_tokens) -> None:
        """:meth:`dispatch`'s argument checks in full, in the order that decides which argument an
        invalid call names (``x`` is checked already; a cached dispatch's handle apart): the shape
        checks, which a key of the arguments' metadata covers (checks.dispatch_key), and with
        ``check_values`` the value checks in their place."""
        checks.check_int("expert_alignment", expert_alignment, minimum=1)
        checks.check_int("num_worst_tokens", num_worst_tokens, minimum=0)
        if not full:
            return
        R = self.group_size
        for name, value in (("num_tokens_per_rank", num_tokens_per_rank), ("is_token_in_rank", is_token_in_rank),
                            ("num_tokens_per_expert", num_tokens_per_expert)):
            if value is None:
                raise EPInputError(name, "is required unless a handle is given (use get_dispatch_layout)")
        checks.check_rows(num_tokens, "x", topk_idx=topk_idx, topk_weights=topk_weights,
                          is_token_in_rank=is_token_in_rank)
        checks.check_tensor("num_tokens_per_rank", num_tokens_per_rank, dtype=torch.int32, shape=(R,), device=self.device)
        checks.check_tensor("is_token_in_rank", is_token_in_rank, dtype=torch.bool, shape=(num_tokens, R),
                            device=self.device)
        checks.check_tensor("num_tokens_per_expert", num_tokens_per_expert, dtype=torch.int32, ndim=1, device=self.device)
        if num_tokens_per_rdma_rank is not None:
            checks.check_tensor("num_tokens_per_rdma_rank", num_tokens_per_rdma_rank, dtype=torch.int32,
                                shape=(self.num_nodes,), device=self.device)
        num_experts = num_tokens_per_expert.numel()
        if num_experts == 0 or num_experts % R:
            raise EPInputError("num_tokens_per_expert", f"length {num_experts} is not a positive multiple of the group size {R}")
        if (topk_idx is None) != (topk_weights is None):
            raise EPInputError("topk_weights" if topk_weights is None else "topk_idx",
                               "topk_idx and topk_weights must be given together")
        if topk_idx is not None:
            checks.check_topk_idx("topk_idx", topk_idx, num_experts, self.device, num_tokens,
                                  check_values=self._check_values)
            checks.check_topk_weights("topk_weights", topk_weights, (num_tokens, topk_idx.shape[1]), self.device)
        if self._check_values:
            checks.check_routing_counts(num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert, topk_idx, R,
                                        num_tokens_per_rdma_rank, self.ranks_per_node)

    def _check_dispatch_values(self, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
                               num_tokens_per_expert, topk_idx) -> None:
        """``check_values``: the value checks of a full dispatch whose shapes passed before (they read
        the tensors: a host synchronisation on CUDA)."""
        if topk_idx is not None:
            checks.check_topk_values("topk_idx", topk_idx, num_tokens_per_expert.shape[0])
        checks.check_routing_counts(num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert, topk_idx,
                                    self.group_size, num_tokens_per_rdma_rank, self.ranks_per_node)

    def _check_cached_dispatch(self, handle, num_tokens: int, num_tokens_per_rank, num_tokens_per_rdma_rank,
                               is_token_in_rank, num_tokens_per_expert, topk_idx, topk_weights, expert_major) -> None:
        """A cached dispatch's checks of its handle (on every call: they read the handle)."""
        checks.check_dispatch_handle(handle, self.group_size)
        if not (num_tokens_per_rank is None and num_tokens_per_rdma_rank is None and is_token_in_rank is None
                and num_tokens_per_expert is None and topk_idx is None and topk_weights is None):
            for name, value in (("num_tokens_per_rank", num_tokens_per_rank),
                                ("num_tokens_per_rdma_rank", num_tokens_per_rdma_rank),
                                ("is_token_in_rank", is_token_in_rank),
                                ("num_tokens_per_expert", num_tokens_per_expert), ("topk_idx", topk_idx),
                                ("topk_weights", topk_weights)):
                if value is not None:
                    raise EPInputError(name, "must be None in cached mode (a handle was given)")
        if expert_major and handle.expert_major is None:
            raise EPInputError("expert_major", "this handle comes from a plain dispatch; a cached dispatch "
                                               "returns the layout of the dispatch that made the handle")
        if handle.is_token_in_rank.shape[0] != num_tokens:
            raise EPInputError("x", f"has {num_tokens} tokens but the handle was made for {handle.is_token_in_rank.shape[0]}")

    def combine(self, x: torch.Tensor, handle: DispatchHandle, topk_weights: Optional[torch.Tensor] = None,
                bias=None, config: Optional[Config] = None, previous_event: Optional[EventOverlap] = None,
                async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """Send rows back to their home ranks and sum them there (plain sum, float32 accumulation).

        No top-k weights are applied: scale each row by its weight in your expert code first (unlike
        :meth:`low_latency_combine`, which takes the weighted sum itself).

        Args:
            x: bf16 ``[Trecv, H]``, rows in the order dispatch returned them (with an expert-major
                handle: the unweighted expert outputs in that layout; the weights are applied here).
            handle: the handle of that dispatch.
            topk_weights: optional float32 ``[Trecv, K]``, summed the same way.
            bias: ``None``, a bf16 ``[T, H]`` tensor, or a pair of them, added to the result.

        Returns:
            ``(combined_x [T, H] bf16, combined_topk_weights [T, K] float32 | None, event)``.
        """
        if not self._destroyed:
            self._backend.refuse_capture("combine")
        self._start_call("combine")
        try:
            checks.check_dispatch_handle(handle, self.group_size)
            mapping = handle.expert_major
            num_rows = handle.num_recv_rows if mapping is None else mapping.num_rows
            checks.check_tensor("x", x, dtype=torch.bfloat16, shape=(num_rows, None), device=self.device)
            if mapping is not None and topk_weights is not None:
                raise EPInputError("topk_weights", "must be None with an expert-major handle (combine applies the "
                                                   "weights of its entries)")
            if topk_weights is not None:
                checks.check_tensor("topk_weights", topk_weights, dtype=torch.float32, shape=(num_rows, None), device=self.device)
            num_tokens = handle.is_token_in_rank.shape[0]
            if bias is None:
                biases: Tuple[torch.Tensor, ...] = ()
            elif isinstance(bias, torch.Tensor):
                biases = (bias,)
            elif isinstance(bias, (tuple, list)) and len(bias) <= 2:
                biases = tuple(b for b in bias if b is not None)
            else:
                raise EPInputError("bias", "must be None, a tensor, or a pair of tensors")
            for i, b in enumerate(biases):
                checks.check_tensor(f"bias[{i}]", b, dtype=torch.bfloat16, shape=(num_tokens, x.shape[1]), device=self.device)
            config = self._resolve_config(config, Buffer.get_combine_config)
            self._backend.check_combine(x, handle, topk_weights, biases)
        except EPInputError as err:
            self._backend.agree("combine", None, err)  # every rank raises, not only this one
            raise
        if self._backend.agrees:
            self._backend.agree("combine", (("hidden", x.shape[1]),
                                            ("topk_weights", None if topk_weights is None else topk_weights.shape[1])))
        with self._stream_scope(previous_event, async_finish, (x, topk_weights) + biases) as scope:
            if mapping is not None and not self._backend.native_expert_major:
                x = self._backend.fold_expert_major(x, mapping)  # weighted fold back onto the plain rows
            combined_x, combined_weights = self._backend.combine(x, handle, topk_weights, biases, config)
            scope.keep(combined_x, combined_weights)
        return combined_x, combined_weights, scope.event_overlap()


def tuning_from_environment(tuning: Tuning) -> Tuning:
    """``tuning`` with each field whose ``EPCOMM_*`` variable (``TUNING_VARIABLES``) is set taken
    from it: a whole number, or 0 / 1 for the switches. EPInputError names a bad variable."""
    changes = {}
    for field, variable in TUNING_VARIABLES.items():
        text = os.environ.get(variable, "").strip()
        if not text:
            continue
        switch = field in SWITCHES
        if (switch and text not in ("0", "1")) or not text.isdigit():
            raise EPInputError(variable, f"must be {'0 or 1' if switch else 'a whole number'}, got {text!r}")
        changes[field] = bool(int(text)) if switch else int(text)
    return dataclasses.replace(tuning, **changes) if changes else tuning
