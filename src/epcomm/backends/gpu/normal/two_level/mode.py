"""Normal mode across nodes, host side: the plans per call shape and the launches of each call
(two_level/ kernels, launched in the order the wiring backend lists). A multi-node backend wires it,
as the one-node backend wires ``one_node.NormalMode``."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

import torch

from .....errors import EPError, EPInputError
from .....handle import DispatchHandle
from ....base import DispatchArgs, DispatchResult
from ... import agreement
from ...copy import COPY_WARPS, copy_block_shape, for_word_copies
from ...launch import current_stream
from ...sync import ARRIVE_NOTIFY, CALL_FAILED
from . import combine as combine_kernels
from . import dispatch as dispatch_kernels
from . import step as step_kernels
from ...call_board import unseated
from .areas import MAX_CHANNELS, CombineLayout, DispatchLayout, combine_layout, dispatch_layout, preamble
from .hierarchy import Topology
from .rows import MetaRow


def p2(n: int) -> int:
    return 1 << (max(int(n), 1) - 1).bit_length()


@dataclass
class TwoLevelState:
    """What a multi-node dispatch keeps in ``DispatchHandle.backend_state`` (for cached dispatch and combine).

    ``table`` ``[R, meta_len]`` int32: the count rows of that dispatch (rows.MetaRow, ``C`` channels);
    ``in_node_masks`` / ``node_row`` ``[T, N]`` int32 and ``node_tokens`` ``[N, T]`` int32 at home;
    ``recv_area_row`` ``[rows]`` int32 at the destination; ``area_masks`` ``[area rows]`` int32 at
    the forwarder; ``max_tokens``: the most tokens any rank sent (the capacity every area needs).
    """

    table: torch.Tensor
    in_node_masks: torch.Tensor
    node_tokens: torch.Tensor
    node_row: torch.Tensor
    recv_area_row: torch.Tensor
    area_masks: torch.Tensor
    num_channels: int
    num_experts: int
    max_tokens: int
    sequence: int


@dataclass(frozen=True)
class DispatchPlan:
    layout: DispatchLayout
    x_words: int
    num_scales: int
    num_topk: int
    num_channels: int
    send: object  # BoundKernel
    forward: object
    fingerprint: Tuple[int, int]
    send_layout: object = None  # BoundKernel (a full dispatch's)


@dataclass(frozen=True)
class CombinePlan:
    layout: CombineLayout
    num_topk: int
    num_channels: int
    push: object
    forward: object
    reduce: object
    block_t: int
    fingerprint: Tuple[int, int]


class TwoLevelMode:
    """Dispatch and combine in two hops over ``transport`` (its workspace, peers and barrier).

    Args:
        transport: where the workspaces are (gpu/reach/transport.py).
        topology: the nodes (hierarchy.Topology).
        state: the ``[16]`` int64 device state words (gpu/sync.py), shared with low-latency mode.
        mailbox: the host mailbox (gpu/mailbox.py), shared with low-latency mode.
        timeout_s: how long a wait for peers may take.
        send_parts: programs per (channel, node) of the puts between nodes.
        p2p: store straight into far peers this GPU maps, instead of putting.
        far_mode: the kernels' ``REMOTE`` (gpu/reach/modes.py).
        board: this Buffer's seat on its group's call board (gpu/call_board.py; default none).
        backend_name: the backend that wires this mode, as its errors name it to the user.
        size_hint: the function whose bytes fit a token count (named by the capacity errors).
    """

    def __init__(self, transport, topology: Topology, device: torch.device, state: torch.Tensor, mailbox,
                 timeout_s: float, send_parts: int, p2p: bool, far_mode: int, board=None, *,
                 backend_name: str, size_hint: str):
        self.backend_name, self.size_hint = backend_name, size_hint
        self.seat = board if board is not None else unseated(device, transport.num_ranks)  # gpu/call_board.py
        self.t, self.topology, self.device, self.state, self.mailbox = transport, topology, device, state, mailbox
        self.rank, self.num_ranks = transport.rank, transport.num_ranks
        self.total_bytes = transport.buffer.numel()
        self.pre = preamble(self.num_ranks, topology.ranks_per_node)
        self.base = transport.buffer.data_ptr()
        self.peer_bases = transport.peer_bases.data_ptr()
        self.far_mode = far_mode
        self.failed_word = state.data_ptr() + 8 * CALL_FAILED  # (step.py: a failed step skips the call)
        self.send_parts, self.p2p = send_parts, p2p
        # arrival counters of the send's parts, one per (channel, node); zero between calls
        self.part_counters = torch.zeros(MAX_CHANNELS * topology.num_nodes, dtype=torch.int64, device=device)
        self.timeout_s = float(timeout_s)
        self.timeout_ns = int(self.timeout_s * 1e9)
        self.epoch = 0  # calls made: every rank makes the same ones (step.py)
        self.written = False  # a call wrote its areas (over the low-latency region, which shares them)
        r_p2 = p2(self.num_ranks)
        self._steps = {kind: spec.bind(num_warps=4, REMOTE=far_mode, R_P2=r_p2)
                       for kind, spec in step_kernels.STEPS.items()}
        self._notify = dispatch_kernels.NOTIFY.bind(num_warps=4, REMOTE=far_mode, R_P2=r_p2, BLOCK_E=128)
        self._dispatch_plans = {}
        self._combine_plans = {}

    def reset(self) -> None:
        """Back to a new Buffer's counters (resync: no kernel runs on any rank)."""
        self.part_counters.zero_()
        self.epoch = 0

    def _begin(self, kind: str, fingerprint: Tuple[int, int], stream: int) -> int:
        """The call's epoch, after its step barrier (step.py; ``kind``: "dispatch" or "combine") is
        launched."""
        self.epoch += 1
        self.written = True
        self._steps[kind].launch(self.num_ranks, 1, stream, self.peer_bases, self.base, self.pre.step_rows,
                          self.pre.fingerprint, self.mailbox.address, self.failed_word, fingerprint[0], fingerprint[1], self.epoch,
                          self.timeout_ns, self.rank, self.num_ranks, self.seat.bases_address, self.seat.tag())
        return self.epoch

    @staticmethod
    def _num_channels(config) -> int:
        num_channels = config.num_sms // 2
        if num_channels > MAX_CHANNELS:
            raise EPInputError("config", f"normal mode across nodes runs at most {MAX_CHANNELS} channels "
                                         f"(num_sms <= {2 * MAX_CHANNELS}), got num_sms={config.num_sms}")
        return num_channels

    # ------------------------------------------------------------------ dispatch
    def _dispatch_plan(self, x_bytes: int, num_scales: int, num_topk: int, num_experts: int, num_channels: int,
                       cached: bool) -> DispatchPlan:
        key = (x_bytes, num_scales, num_topk, num_experts, num_channels, cached)
        plan = self._dispatch_plans.get(key)
        if plan is not None:
            return plan
        if x_bytes % 8:
            raise EPInputError("x", f"the {self.backend_name} backend needs rows of a multiple of 8 bytes "
                                    f"(got {x_bytes})")
        layout = dispatch_layout(self.total_bytes, self.num_ranks, self.topology.ranks_per_node, num_experts,
                                 num_channels, x_bytes, num_scales, num_topk)
        block_r, block_w = copy_block_shape(x_bytes // 8)
        meta = dict(HAS_SCALES=num_scales > 0, HAS_TOPK=num_topk > 0, BLOCK_R=block_r, BLOCK_W=block_w,
                    S_P2=p2(num_scales), K_P2=p2(num_topk))
        hidden = x_bytes if num_scales else x_bytes // 2
        call = agreement.CALL_CACHED if cached else agreement.CALL_DISPATCH
        fingerprint = agreement.pack(call=call, hidden=hidden, x=2 if num_scales else 1, num_topk=num_topk)
        send_layout = None if cached else dispatch_kernels.SEND_LAYOUT.bind(
            num_warps=4, HAS_TOPK=num_topk > 0, BLOCK_T=128, R_P2=p2(self.num_ranks), N_P2=p2(self.topology.num_nodes),
            BLOCK_E=256, K_P2=p2(num_topk))
        plan = DispatchPlan(layout, x_bytes // 8, num_scales, num_topk, num_channels,
                            dispatch_kernels.SEND.bind(num_warps=COPY_WARPS, REMOTE=self.far_mode, **meta),
                            dispatch_kernels.FORWARD.bind(num_warps=COPY_WARPS, **meta), fingerprint, send_layout)
        self._dispatch_plans[key] = plan
        return plan

    def _dispatch_plan_of(self, args: DispatchArgs) -> DispatchPlan:
        x = args.x[0] if args.x.__class__ is tuple else args.x
        num_scales = x.shape[1] // 128 if args.x.__class__ is tuple else 0
        if args.handle is None:
            num_topk = args.topk_idx.shape[1] if args.topk_idx is not None else 0
            return self._dispatch_plan(x.shape[1] * x.element_size(), num_scales, num_topk,
                                       args.num_tokens_per_expert.shape[0], self._num_channels(args.config), False)
        state: TwoLevelState = args.handle.backend_state
        return self._dispatch_plan(x.shape[1] * x.element_size(), num_scales, 0, state.num_experts, state.num_channels,
                                   True)

    host_epochs = True  # (its step barrier counts epochs on the host: no call of it replays in a CUDA graph)

    def refuse_capture(self, kind: str, handle=None, num_worst_tokens: int = 0) -> None:
        """A dispatch or combine inside a CUDA graph capture (GpuBackend.refuse_capture): EPError, always."""
        raise EPError(f"a {kind} of the {self.backend_name} backend's normal mode cannot be captured in a CUDA graph: "
                      "its step barrier counts epochs on the host, and its dispatch reads the counts there "
                      "(its low-latency calls can be captured)")

    def check_dispatch(self, args: DispatchArgs) -> None:
        """Row sizes, the workspace's token capacity, a handle of this backend: EPInputError."""
        if args.handle is not None and args.handle.backend_state.__class__ is not TwoLevelState:
            raise EPInputError("handle", f"was not made by the {self.backend_name} backend")
        plan = args.plan = self._dispatch_plan_of(args)
        num_tokens = (args.x[0] if args.x.__class__ is tuple else args.x).shape[0]
        most = num_tokens if args.handle is None else max(num_tokens, args.handle.backend_state.max_tokens)
        if most > plan.layout.token_cap:
            raise EPInputError("num_rdma_bytes", f"holds {plan.layout.token_cap} tokens per rank for rows of this "
                                                 f"shape, the call sends {most}; raise num_rdma_bytes "
                                                 f"({self.size_hint})")

    def dispatch(self, args: DispatchArgs) -> DispatchResult:
        """(Buffer called check_dispatch first.)"""
        R, rank, dev, topo = self.num_ranks, self.rank, self.device, self.topology
        N, k = topo.num_nodes, topo.ranks_per_node
        plan: DispatchPlan = args.plan if args.plan is not None else self._dispatch_plan_of(args)
        layout, meta, row = plan.layout, plan.layout.meta, plan.layout.row
        handle = args.handle
        is_fp8 = args.x.__class__ is tuple
        x, scales = args.x if is_fp8 else (args.x, None)
        x, _ = for_word_copies(x)
        num_tokens = x.shape[0]
        C = plan.num_channels
        stream = current_stream(dev.index)
        fp0, fp1 = plan.fingerprint
        if handle is None:
            num_experts = args.num_tokens_per_expert.shape[0]
            fp0 |= (num_experts & agreement.EXPERTS_MASK) << agreement.EXPERTS_SHIFT
            fp1 |= int(args.num_worst_tokens > 0) << agreement.WORST_SHIFT
        else:
            state: TwoLevelState = handle.backend_state
            num_experts = state.num_experts
            fp1 |= (state.sequence & agreement.HANDLE_MASK) << agreement.HANDLE_SHIFT
        num_local = num_experts // R
        epoch = self._begin("dispatch", (fp0, fp1), stream)

        if handle is None:
            # the send layout and this rank's count row (one kernel), then the count exchange. The
            # row's per-rank counts come from is_token_in_rank itself, not the caller's
            # num_tokens_per_rank: the receivers' row offsets must agree with the rows sent.
            masks = torch.empty((num_tokens, N), dtype=torch.int32, device=dev)
            lists = torch.empty((N, num_tokens), dtype=torch.int32, device=dev)
            in_rank = args.is_token_in_rank if args.is_token_in_rank.is_contiguous() else \
                args.is_token_in_rank.contiguous()
            topk_ids = args.topk_idx.data_ptr() if plan.num_topk else in_rank.data_ptr()
            plan.send_layout.launch(1, 1, stream, in_rank.data_ptr(), topk_ids, args.num_tokens_per_rank.data_ptr(),
                                    args.num_tokens_per_expert.data_ptr(), masks.data_ptr(), lists.data_ptr(),
                                    self.base + layout.count_row, num_tokens, R, k, num_experts, C, plan.num_topk,
                                    meta.per_expert, meta.per_node, meta.num_tokens, meta.gbl_prefix,
                                    meta.rdma_prefix, meta.abort)
            prefix = torch.empty((R, R), dtype=torch.int32, device=dev)
            sequence = self.mailbox.next_sequence()
            self._notify.launch(R, 1, stream, self.failed_word, self.peer_bases, self.base + layout.count_row, self.base + layout.table,
                                self.base + self.pre.notify_signals, self.base + layout.table,
                                self.state.data_ptr() + 8 * ARRIVE_NOTIFY, prefix.data_ptr(), self.mailbox.address, epoch,
                                sequence, self.timeout_ns, rank, R, meta.length, num_experts, meta.num_tokens,
                                args.expert_alignment, meta.abort)
            table = self.t.buffer[layout.table:layout.table + 4 * R * meta.length].view(torch.int32).view(
                R, meta.length).clone()
            state = TwoLevelState(table, masks, lists, torch.empty((num_tokens, N), dtype=torch.int32, device=dev),
                                 None, None, C, num_experts, -1, sequence)
        # Launch arguments are addresses, not tensors: Triton's launcher asks the driver about each
        # tensor (a cost per launch), and refuses the null address of an empty one.
        x_address = x.data_ptr()
        topk = args.topk_idx.data_ptr() if plan.num_topk else x_address
        weights = args.topk_weights.data_ptr() if plan.num_topk else x_address
        scale_strides = (scales.stride(0), scales.stride(1)) if is_fp8 else (0, 0)
        plan.send.launch(C * self.send_parts, N, stream, self.failed_word, self.peer_bases, x_address, scales.data_ptr() if is_fp8 else x_address,
                         *scale_strides, topk, weights, state.node_tokens.data_ptr(), state.in_node_masks.data_ptr(),
                         state.node_row.data_ptr(), state.table.data_ptr(), self.base + layout.send,
                         self.base + layout.recv, self.base + self.pre.dispatch_signals, epoch, rank, R, k, num_tokens,
                         plan.x_words, plan.num_scales, plan.num_topk, row.row_bytes, row.scales, row.ids, row.weights,
                         row.src, row.mask, layout.token_cap, meta.length, meta.per_node, meta.rdma_prefix, C,
                         self.send_parts, int(self.p2p), self.part_counters.data_ptr())

        if handle is None:
            # The host reads the counts even with num_worst_tokens (which then only fixes the output
            # size): combine needs the most tokens any rank sent, and this backend's epochs live on
            # the host anyway, so its calls cannot be captured in a CUDA graph.
            worst = args.num_worst_tokens
            num_received, max_tokens, per_expert = self.mailbox.wait_notify(sequence, rank, self.timeout_s)
            counts_list = per_expert[:num_local].tolist()
            num_rows = num_received
            if worst:  # rows past num_worst_tokens are not written (DeepEP's contract: it bounds the receipt)
                num_rows, num_received, counts_list = worst, min(num_received, worst), []
            state.max_tokens = max_tokens
            state.recv_area_row = torch.empty(num_rows, dtype=torch.int32, device=dev)
            state.area_masks = torch.empty(max(1, N * max_tokens), dtype=torch.int32, device=dev)
            recv_src, recv_topk, recv_weights = self._index_outputs(num_rows, plan.num_topk, padded=worst > 0)
        else:
            num_rows = handle.num_recv_rows
            recv_src = torch.empty(num_rows, dtype=torch.int32, device=dev)  # the same values again
            recv_topk = recv_weights = None
        recv_x = torch.empty((num_rows, x.shape[1]), dtype=x.dtype, device=dev)
        recv_scales = torch.empty((num_rows, plan.num_scales), dtype=torch.float32, device=dev) if is_fp8 else None
        prefix_matrix = prefix if handle is None else handle.rank_prefix_matrix
        recv_x_address = recv_x.data_ptr()
        plan.forward.launch(
            R, C, stream, self.failed_word, self.peer_bases, layout.recv, self.pre.dispatch_signals, state.table.data_ptr(),
            prefix_matrix.data_ptr(), recv_x_address, recv_scales.data_ptr() if is_fp8 else recv_x_address,
            recv_topk.data_ptr() if plan.num_topk else recv_x_address,
            recv_weights.data_ptr() if plan.num_topk else recv_x_address, recv_src.data_ptr(),
            state.recv_area_row.data_ptr(), state.area_masks.data_ptr(),
            self.mailbox.address + 8, epoch, self.timeout_ns, rank, R, k, plan.x_words, plan.num_scales, plan.num_topk,
            num_local, row.row_bytes, row.scales, row.ids, row.weights, row.src, row.mask, meta.length, meta.per_node,
            meta.gbl_prefix, meta.rdma_prefix, C, num_rows)
        recv = (recv_x, recv_scales) if is_fp8 else recv_x
        if handle is not None:
            return DispatchResult(recv, None, None, None, handle)
        out = DispatchHandle(prefix, recv_src, args.is_token_in_rank, num_received, num_rows, state, None)
        return DispatchResult(recv, recv_topk, recv_weights, counts_list, out)

    def _index_outputs(self, num_rows: int, num_topk: int, padded: bool):
        """``(recv_src_idx, recv_topk_idx, recv_topk_weights)`` for ``num_rows`` rows; ``padded``
        (num_worst_tokens): rows the forward does not write read -1 / -1 / 0."""
        dev = self.device
        if not padded:
            return (torch.empty(num_rows, dtype=torch.int32, device=dev),
                    torch.empty((num_rows, num_topk), dtype=torch.int64, device=dev) if num_topk else None,
                    torch.empty((num_rows, num_topk), dtype=torch.float32, device=dev) if num_topk else None)
        return (torch.full((num_rows,), -1, dtype=torch.int32, device=dev),
                torch.full((num_rows, num_topk), -1, dtype=torch.int64, device=dev) if num_topk else None,
                torch.zeros((num_rows, num_topk), dtype=torch.float32, device=dev) if num_topk else None)

    # ------------------------------------------------------------------ combine
    def _combine_plan(self, hidden: int, num_topk: int, num_bias: int, num_channels: int) -> CombinePlan:
        key = (hidden, num_topk, num_bias, num_channels)
        plan = self._combine_plans.get(key)
        if plan is not None:
            return plan
        if hidden % 4:
            raise EPInputError("x", f"the {self.backend_name} backend needs rows of a multiple of 8 bytes "
                                    f"(hidden={hidden})")
        layout = combine_layout(self.total_bytes, self.num_ranks, self.topology.ranks_per_node, hidden, num_topk)
        block_r, block_w = copy_block_shape(hidden // 4)
        block_c = min(p2(hidden), 1024)
        block_t = 8
        N, k = self.topology.num_nodes, self.topology.ranks_per_node
        plan = CombinePlan(
            layout, num_topk, num_channels,
            combine_kernels.PUSH.bind(num_warps=COPY_WARPS, HAS_WEIGHTS=num_topk > 0, BLOCK_R=block_r,
                                      BLOCK_W=block_w, K_P2=p2(num_topk)),
            combine_kernels.FORWARD.bind(num_warps=8, REMOTE=self.far_mode, HAS_WEIGHTS=num_topk > 0, BLOCK_R=8,
                                         BLOCK_C=block_c, K_P2=p2(num_topk), LOCAL_P2=p2(k)),
            combine_kernels.REDUCE.bind(num_warps=8, HAS_WEIGHTS=num_topk > 0, NUM_BIAS=num_bias, BLOCK_T=block_t,
                                        BLOCK_C=block_c, K_P2=p2(num_topk), SIGNALS_P2=p2(N * num_channels)),
            block_t, agreement.pack(call=agreement.CALL_COMBINE, hidden=hidden, x=1, num_topk=num_topk))
        self._combine_plans[key] = plan
        return plan

    def check_combine(self, x, handle, topk_weights, bias) -> None:
        if handle.backend_state.__class__ is not TwoLevelState:
            raise EPInputError("handle", f"was not made by the {self.backend_name} backend")
        # (an expert-major handle: Buffer folds x into rows of the same width, topk_weights is None)
        state: TwoLevelState = handle.backend_state
        plan = self._combine_plan(x.shape[1], 0 if topk_weights is None else topk_weights.shape[1], len(bias),
                                  state.num_channels)
        if state.max_tokens > plan.layout.token_cap:
            raise EPInputError("num_rdma_bytes", f"holds {plan.layout.token_cap} tokens per rank for a combine of "
                                                 f"this shape, the dispatch sent up to {state.max_tokens}; raise "
                                                 f"num_rdma_bytes ({self.size_hint})")

    def combine(self, x, handle, topk_weights, bias, config):
        """(Buffer called check_combine first.)"""
        R, rank, dev, topo = self.num_ranks, self.rank, self.device, self.topology
        N, k = topo.num_nodes, topo.ranks_per_node
        state: TwoLevelState = handle.backend_state
        num_topk = 0 if topk_weights is None else topk_weights.shape[1]
        hidden = x.shape[1]
        plan = self._combine_plan(hidden, num_topk, len(bias), state.num_channels)
        layout, crow = plan.layout, plan.layout.row
        meta = MetaRow(R, state.num_experts, N, state.num_channels)
        meta_length = meta.length
        C = state.num_channels
        num_tokens = handle.is_token_in_rank.shape[0]
        stream = current_stream(dev.index)
        fp0, fp1 = plan.fingerprint
        fp1 |= (state.sequence & agreement.HANDLE_MASK) << agreement.HANDLE_SHIFT
        epoch = self._begin("combine", (fp0, fp1), stream)
        x, _ = for_word_copies(x)
        combined = torch.empty((num_tokens, hidden), dtype=torch.bfloat16, device=dev)
        combined_w = torch.empty((num_tokens, num_topk), dtype=torch.float32, device=dev) if num_topk else None
        x_address = x.data_ptr()  # addresses, not tensors (dispatch says why)
        weights_in = topk_weights.data_ptr() if num_topk else x_address
        table, area_masks = state.table.data_ptr(), state.area_masks.data_ptr()
        plan.push.launch(R, C, stream, self.failed_word, x_address, weights_in, state.recv_area_row.data_ptr(), table,
                         handle.rank_prefix_matrix.data_ptr(), self.peer_bases, layout.slots, self.pre.push_flags, epoch, rank, R, k, hidden // 4, num_topk,
                         crow.row_bytes, crow.weights, meta_length, meta.gbl_prefix, C)
        plan.forward.launch(N * self.send_parts, C, stream, self.failed_word, self.peer_bases, area_masks, table, self.base + layout.slots,
                            self.base + self.pre.push_flags, self.base + layout.partials, self.base + layout.home,
                            self.base + self.pre.home_signals, self.mailbox.address, epoch, self.timeout_ns, rank, R, k,
                            hidden, num_topk, crow.row_bytes, crow.weights, layout.token_cap, meta_length,
                            meta.per_node, meta.rdma_prefix, C,
                            self.send_parts, int(self.p2p), self.part_counters.data_ptr())
        combined_address = combined.data_ptr()
        out_w = combined_w.data_ptr() if num_topk else combined_address
        bias0 = bias[0].data_ptr() if len(bias) >= 1 else combined_address
        bias1 = bias[1].data_ptr() if len(bias) >= 2 else combined_address
        plan.reduce.launch(max(1, min(-(-num_tokens // plan.block_t), config.num_sms)), 1, stream, self.failed_word,
                           state.in_node_masks.data_ptr(),
                           state.node_row.data_ptr(), combined_address, out_w, bias0, bias1, self.base + layout.home, self.base + self.pre.home_signals,
                           self.mailbox.address, epoch, self.timeout_ns, rank, R, k, num_tokens, hidden, num_topk,
                           crow.row_bytes, crow.weights, layout.token_cap, C)
        return combined, combined_w
