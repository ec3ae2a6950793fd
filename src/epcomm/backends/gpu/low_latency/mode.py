"""Low-latency mode's host side: plans per shape, the buffer halves, the launches of each call."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ....errors import EPInputError
from ....handle import LowLatencyHandle
from .. import agreement, sync
from ..call_board import unseated
from ..copy import for_word_copies
from ..launch import Specialisations, current_stream, launch_mode, p2, stream_capturing
from ..reach.modes import PEERS_BY_STORES
from ..workspace import FP_LL_COMBINE, FP_LL_DISPATCH, FP_ROW_BYTES
from .combine import COMBINE
from .dispatch import DISPATCH, LL_PULL_MESSAGES


@dataclass
class LowLatencyState:
    """What a GPU backend keeps in ``LowLatencyHandle.backend_state``."""

    slot_info: torch.Tensor  # [E_local, R*M] int32: home slot token * K + k of each packed row
    num_topk: int
    sequence: int = 0  # the dispatch's call number: the same on every rank (fingerprints)
    addresses: tuple = ()  # of the handle's recv_layout_range and of slot_info (the combine's launch arguments)
    owner: object = None  # the token of the LowLatencyMode that made it (its slots are in that workspace)


# ====================================================================== host side
@dataclass(frozen=True)
class DispatchPlan:
    layout: object  # workspace.LowLatencyLayout
    kernels: Specialisations  # (SEND, RECEIVE, HAS_STATS, HAS_WAIT_STATS, ALIGNED) -> ep_ll_dispatch
    send_groups: int  # message groups (send items) per token
    counters: torch.Tensor  # [E] int32 slot counters, zero between calls
    counters_address: int
    fingerprint: tuple  # agreement.py: the call's two words
    # Per buffer half: a _DispatchHalf, made on first use. A result lives until the second
    # dispatch after it (the two halves), as DeepEP documents; reusing its index tensors spares
    # four allocations per call. recv_x is fresh every call.
    per_half: list


@dataclass(frozen=True)
class _DispatchHalf:
    handle: LowLatencyHandle  # its recv_src_info / recv_layout_range / slot_info are this half's
    recv_count: torch.Tensor  # [E_local] int32
    indices: tuple  # addresses of src_info, slot_info, recv_layout, recv_count
    sizes: tuple  # the kernel's arguments from hidden on: fixed for the plan and half


@dataclass(frozen=True)
class CombinePlan:
    layout: object
    kernels: Specialisations  # (SEND, RECEIVE, HAS_WAIT_STATS, ALIGNED) -> ep_ll_combine
    fingerprint: tuple  # agreement.py: the call's two words (the handle's dispatch number added)
    # Per buffer half: (this rank's flags and combine slots, mailbox) and the arguments from hidden
    # to the fingerprint set: fixed for the plan and half.
    per_half: tuple


class LowLatencyMode:
    """Host orchestration of low-latency mode: per call, two bound launches (send phase, receive
    phase; or one, see ``one_launch``) and the outputs; everything shape-dependent is computed once
    per shape (plans).

    Args:
        ws: the workspace (workspace.py; ``staging=True`` when ``remote`` is not PEERS_BY_STORES).
        state: the backend's device state words (sync.py); mailbox: its host mailbox.
        remote: how peers of other nodes are reached (PEERS_BY_STORES: there are none).
        ranks_per_node: nodes are blocks of this many consecutive ranks (with ``remote``).
        num_sms: programs of the combine's receive phase (default: the GPU's SMs; tests with many
            ranks on one GPU keep it small so that every rank's programs fit at once).
        receive_programs: at most this many programs in each receive phase (0: no cap — one
            per (local expert, source) in a dispatch, ``num_sms`` in a combine), and in a one-launch
            call's grid. Receive programs spin until their messages land, so where several ranks
            share one GPU (CUDA MPS) their receivers together must leave SMs for the senders
            (shared_grids.py). The loops stride over their items, so any cap gives the same results.
        send_programs: at most this many programs in each send phase (0: no cap — one per token
            in a dispatch, per (local expert, source) in a combine): ranks sharing a GPU.
        board: this Buffer's seat on its group's call board (gpu/call_board.py; default: none,
            nothing posted or checked).
        shrink: the Buffer's ``enable_shrink``: a peer that does not answer within the timeout is
            masked and the call completes without it. Without it the peer is masked too (this call
            chain neither waits for it nor sends to it again) and reported: the host raises
            EPTimeoutError naming it at the next call, and the combine rows it did not deliver are
            NaN (its dispatch rows are left out of ``recv_count``: their number never arrived).
        messages_per_program: messages of one token a send item carries (0: all its top-k, one
            FP8 cast per token).
        one_launch: how a call without a hook runs its two phases. None (auto): in one cooperative
            launch, except while the current stream is captured into a CUDA graph, where they are
            two launches. True: always one; False: always two (a call with a hook always takes two).
            (The Buffer's ``Tuning``: ``ll_send_messages``, ``ll_one_launch``.)
    """

    def __init__(self, ws, state: torch.Tensor, mailbox, timeout_ns: int, device: torch.device,
                 remote: int = PEERS_BY_STORES, ranks_per_node: int = 0, num_sms: int = 0,
                 receive_programs: int = 0, board=None, send_programs: int = 0, shrink: bool = False,
                 messages_per_program: int = 0, one_launch: Optional[bool] = None):
        self.ws = ws
        self.board = board if board is not None else unseated(device, ws.num_ranks)
        # what this mode's handles carry to name it (not the mode itself: a handle kept in a plan
        # would then keep the workspace alive through a reference cycle)
        self.token = object()
        self.mailbox_address = mailbox.address
        self.timeout_ns = timeout_ns
        self.remote = remote
        self.R = self.ws.num_ranks
        self.rank = self.ws.rank
        self.R_P2 = p2(self.R)
        self.dev_index = device.index
        self.device = device
        # The one-launch kernels keep every program resident: at most one per SM.
        self.num_sms = num_sms or torch.cuda.get_device_properties(device).multi_processor_count
        self.receive_cap = receive_programs or (1 << 30)
        self.send_cap = send_programs or (1 << 30)
        self.shrink = int(bool(shrink))  # the kernels' runtime flag
        self.reach = (ranks_per_node or self.R, ws.spare_word)  # the kernels' ranks_per_node, spare_word
        self.bases = self.ws.bases.data_ptr()
        self.state_words = state
        self.state = state.data_ptr()
        self.flags = self.ws.local_base + sync.FLAGS_LL_COMBINE * self.R * 8
        self.fingerprints = (self.ws.fingerprint_set(FP_LL_DISPATCH), self.ws.fingerprint_set(FP_LL_COMBINE))
        self._calls = [0, 0]  # dispatch, combine: which half the next call uses
        self._dispatch_plans = {}
        self._combine_plans = {}
        self._counters = {}  # num_experts -> [E] int32 slot counters (zero between calls)
        # Messages per send item: all K of a token by default (0: one cast per token).
        self.messages_per_program = messages_per_program
        # Why auto. Eager decode is host-bound: the GPU waits for the host's launches, and one
        # launch less per call is ~5 us less host time (2026-11-28g: eager round trip 111 against
        # 134-155 us at 2 ranks, 124 against 148-171 at 4). A graph replays without the host: there
        # the two launches are as fast or faster (73.5 against 75.5 us at 2 ranks), because the
        # one launch's receive phase spins on SMs while other programs still send.
        self.one_launch = None if one_launch is None else bool(one_launch)
        # Auto's one launch needs a cooperative launch (all programs resident, or refused): Triton's
        # own launcher (launch.py's fallback) has none, so auto takes two launches there.
        self._cooperative = launch_mode() == "bound"

    def _two_launches(self, hook: bool, capturing: bool) -> bool:
        """Whether this call runs its phases as two launches (see ``one_launch``). Auto asks whether
        the current device's stream is being captured (``capturing``: stream_capturing(), asked
        once per call): a capture on this Buffer's device entered from another current device would
        take the one launch, which replays correctly too (only slower)."""
        if hook:
            return True
        if self.one_launch is None:
            return not self._cooperative or capturing
        return not self.one_launch

    def check_dispatch(self, args) -> None:
        """This backend's limits (hidden % 128, the buffer's size for this shape): EPInputError."""
        args.plan = self._dispatch_plan_of(args)

    def _dispatch_plan_of(self, args) -> DispatchPlan:
        key = (args.num_experts, args.num_max_dispatch_tokens_per_rank, args.x.shape[1], args.topk_idx.shape[1],
               args.use_fp8, args.round_scale, args.use_ue8m0)
        plan = self._dispatch_plans.get(key)
        if plan is None:
            plan = self._dispatch_plans[key] = self._dispatch_plan(*key)
        return plan

    def _dispatch_plan(self, E: int, M: int, hidden: int, K: int, use_fp8: bool, round_scale: bool,
                       use_ue8m0: bool) -> DispatchPlan:
        if hidden % 128:
            raise EPInputError("x", f"the low-latency kernels need hidden % 128 == 0, got {hidden}")
        layout = self._layout(E, M, hidden, K, use_fp8, use_ue8m0)
        counters = self._counters.get(E)
        if counters is None:
            counters = self._counters[E] = torch.zeros(E, dtype=torch.int32, device=self.device)
        msgs = min(self.messages_per_program or p2(K), p2(K))
        kernels = Specialisations(DISPATCH, ["SEND", "RECEIVE", "HAS_STATS", "HAS_WAIT_STATS", "ALIGNED"], 8,
                                  USE_FP8=use_fp8, ROUND_SCALE=round_scale, UE8M0=use_ue8m0, BLOCK_H=p2(hidden),
                                  MSGS=msgs, BLOCK_E=min(1024, p2(E)), BLOCK_X=1024, BLOCK_S=p2(layout.scale_words),
                                  BLOCK_M=LL_PULL_MESSAGES, R_P2=self.R_P2, REMOTE=self.remote)
        words = agreement.pack(call=agreement.CALL_LL_DISPATCH, hidden=hidden, x=1, num_topk=K, num_experts=E,
                               num_max_dispatch_tokens_per_rank=M, use_fp8=use_fp8, round_scale=round_scale,
                               use_ue8m0=use_ue8m0)
        return DispatchPlan(layout, kernels, -(-K // msgs), counters, counters.data_ptr(), words, [None, None])

    def _layout(self, E: int, M: int, hidden: int, K: int, use_fp8: bool, use_ue8m0: bool):
        """The workspace's layout for a call shape; EPInputError naming ``num_rdma_bytes`` (the
        Buffer's, which sized the workspace) when the shape does not fit it."""
        try:
            return self.ws.ll_layout(E, M, hidden, K, use_fp8, use_ue8m0)
        except EPInputError as err:
            if err.argument != "num_max_dispatch_tokens_per_rank":
                raise
            raise EPInputError("num_rdma_bytes", str(err).split(": ", 1)[-1]) from None

    def _dispatch_half(self, plan: DispatchPlan, half: int, E: int, M: int, hidden: int, K: int) -> "_DispatchHalf":
        """One buffer half's index tensors, handle and the launch arguments that never change."""
        R, dev, layout = self.R, self.device, plan.layout
        num_local, slots = E // R, R * M
        src_info = torch.empty((num_local, slots), dtype=torch.int32, device=dev)
        slot_info = torch.empty((num_local, slots), dtype=torch.int32, device=dev)
        recv_layout = torch.empty((num_local, R), dtype=torch.int64, device=dev)
        recv_count = torch.empty(num_local, dtype=torch.int32, device=dev)
        # Pointers go to the launcher as addresses: it would ask the driver about every tensor, twice a call.
        indices = (src_info.data_ptr(), slot_info.data_ptr(), recv_layout.data_ptr(), recv_count.data_ptr())
        handle = LowLatencyHandle(src_info, recv_layout, M, hidden, E,
                                  LowLatencyState(slot_info, K, addresses=(indices[2], indices[1]), owner=self.token))
        sizes = (hidden, K, E, num_local, M, R, self.rank, layout.msg_bytes, layout.x_bytes, layout.scale_words,
                 self.ws.ll_offset + half * self.ws.ll_half, layout.counts, layout.recv, half, self.timeout_ns,
                 self.shrink, layout.stage, *self.reach, self.fingerprints[0], *plan.fingerprint)
        return _DispatchHalf(handle, recv_count, indices, sizes)

    def dispatch(self, args):
        x, topk = args.x, args.topk_idx
        num_tokens, hidden = x.shape
        plan = args.plan if args.plan is not None else self._dispatch_plan_of(args)
        layout = plan.layout
        sequence = self._calls[0]
        half = sequence & 1
        self._calls[0] += 1
        per_half = plan.per_half[half]
        if per_half is None:
            per_half = plan.per_half[half] = self._dispatch_half(plan, half, args.num_experts,
                                                                 args.num_max_dispatch_tokens_per_rank, hidden,
                                                                 topk.shape[1])
        handle = per_half.handle
        handle.backend_state.sequence = sequence
        num_local, slots = args.num_experts // self.R, self.R * args.num_max_dispatch_tokens_per_rank  # (the half's)
        stats = args.cumulative_local_expert_recv_stats
        wait_stats = args.dispatch_wait_recv_cost_stats
        x_address = x.data_ptr()
        src_info, slot_info, recv_layout, recv_count = per_half.indices
        capturing = stream_capturing()  # (asked once: the call board's tag and the launches depend on it)
        head = (x_address, topk.data_ptr(), plan.counters_address, args.rank_mask.data_ptr(), self.bases, self.state,
                self.mailbox_address)
        tail = (src_info, slot_info, recv_layout, recv_count, recv_count if stats is None else stats.data_ptr(),
                recv_layout if wait_stats is None else wait_stats.data_ptr(), num_tokens) + per_half.sizes + \
            (self.board.bases_address, self.board.tag(capturing))
        send_items = num_tokens * plan.send_groups
        stream = current_stream(self.dev_index)
        two_launches = self._two_launches(args.return_recv_hook, capturing)
        if two_launches:
            # The send phase writes only into the receivers' workspaces, not into recv_x: it is
            # launched before the outputs are allocated, so the GPU starts while the host allocates
            # (in a synced call the kernels start that much sooner). Its out pointers are
            # placeholders (src_info: mapped, aligned, never read by the send phase).
            plan.kernels[True, False, False, False, x_address & 15 == 0].launch(
                max(min(send_items, self.send_cap), 1), 1, stream, *head, src_info, src_info, *tail)
        recv_x, scales = self._dispatch_outputs(num_local, slots, hidden, layout.scale_words, args)
        launch_args = head + (recv_x.data_ptr(), scales.data_ptr()) + tail
        packed = (recv_x, scales) if args.use_fp8 else recv_x
        if two_launches:
            receive_kernel = plan.kernels[False, True, stats is not None, wait_stats is not None, False]
            receive_programs = min(num_local * self.R, self.receive_cap)
            if not args.return_recv_hook:
                receive_kernel.launch(receive_programs, 1, stream, *launch_args)
                return packed, per_half.recv_count, handle, None

            # The launch arguments are addresses: the hook holds the tensors they point into.
            def receive(_keep=(recv_x, scales, stats, wait_stats)) -> None:
                receive_kernel.launch(receive_programs, 1, current_stream(self.dev_index), *launch_args)
            return packed, per_half.recv_count, handle, receive
        key = (True, True, stats is not None, wait_stats is not None, x_address & 15 == 0)
        if key not in plan.kernels and self.one_launch is None:
            # the two launches a captured call of this kind takes: compiled now, not inside a capture
            plan.kernels[True, False, False, False, key[4]], plan.kernels[False, True, key[2], key[3], False]
        kernel = plan.kernels[key]
        grid = min(kernel.resident_grid(max(send_items, num_local * self.R)), self.receive_cap)  # (all spin)
        kernel.launch_resident(grid, stream, *launch_args)
        return packed, per_half.recv_count, handle, None

    def _dispatch_outputs(self, num_local: int, slots: int, hidden: int, scale_words: int, args):
        """``(recv_x, scales)``: recv_x ``[E_local, R*M, H]`` (e4m3 or bf16) and, with FP8, the scales
        ``[E_local, R*M, S]`` column-major in the last two dims, as DeepEP returns them (else
        ``recv_x`` again)."""
        # (new_empty: x's device, no device argument to parse; about 1 µs less each on a GPU host)
        recv_x = args.x.new_empty((num_local, slots, hidden), dtype=torch.float8_e4m3fn if args.use_fp8 else torch.bfloat16)
        if not args.use_fp8:
            return recv_x, recv_x
        scales = args.x.new_empty_strided((num_local, slots, scale_words), (scale_words * slots, 1, slots),
                                          dtype=torch.int32 if args.use_ue8m0 else torch.float32)
        return recv_x, scales

    def _combine_plan(self, E: int, M: int, hidden: int, K: int) -> CombinePlan:
        layout = self._layout(E, M, hidden, K, False, False)
        kernels = Specialisations(COMBINE, ["SEND", "RECEIVE", "HAS_WAIT_STATS", "ALIGNED"], 8,
                                  BLOCK_W=min(4096, p2(hidden // 4)), K_P2=p2(K),
                                  # (BLOCK_C: K rows of it in flight per token, as the [K, BLOCK_C] tile had)
                                  BLOCK_C=min(p2(hidden), max(8192 // p2(K), 16)), R_P2=self.R_P2,
                                  REMOTE=self.remote)
        per_half = []
        for half in (0, 1):
            half_offset = self.ws.ll_offset + half * self.ws.ll_half
            per_half.append(((self.flags, self.ws.local_base + half_offset + layout.combine, self.mailbox_address),
                             (hidden, K, E // self.R, self.R, self.rank, M, hidden // 4, half_offset, layout.combine,
                              half, self.timeout_ns, self.shrink, layout.stage, *self.reach, self.fingerprints[1])))
        return CombinePlan(layout, kernels, agreement.pack(call=agreement.CALL_LL_COMBINE, hidden=hidden, x=1, num_topk=K,
                                                           num_experts=E, num_max_dispatch_tokens_per_rank=M),
                           tuple(per_half))

    def check_combine(self, args) -> None:
        """The handle is this backend's, topk_idx as wide as the dispatch's: EPInputError."""
        state = args.handle.backend_state
        if state.__class__ is not LowLatencyState or state.owner is not self.token:
            raise EPInputError("handle", "was not made by this Buffer's low_latency_dispatch")
        if args.topk_idx.shape[1] != state.num_topk:
            raise EPInputError("topk_idx", f"has {args.topk_idx.shape[1]} columns, the dispatch had {state.num_topk}")
        args.plan = self._combine_plan_of(args)

    def _combine_plan_of(self, args) -> CombinePlan:
        handle = args.handle
        key = (handle.num_experts, handle.num_max_dispatch_tokens_per_rank, args.x.shape[2], args.topk_idx.shape[1])
        plan = self._combine_plans.get(key)
        if plan is None:
            plan = self._combine_plans[key] = self._combine_plan(*key)
        return plan

    def combine(self, args):
        """(Buffer called check_combine first.)"""
        handle = args.handle
        state = handle.backend_state
        x, x_aligned = for_word_copies(args.x)  # rows are copied in 8-byte words
        plan = args.plan if args.plan is not None else self._combine_plan_of(args)
        half = self._calls[1] & 1
        self._calls[1] += 1
        topk = args.topk_idx
        num_tokens = topk.shape[0]
        wait_stats = args.combine_wait_recv_cost_stats
        fp0, fp1 = plan.fingerprint
        fp1 |= (state.sequence & agreement.HANDLE_MASK) << agreement.HANDLE_SHIFT
        areas, sizes = plan.per_half[half]
        # Pointers as addresses (see _dispatch_half).
        head = (x.data_ptr(), *state.addresses, topk.data_ptr(), args.topk_weights.data_ptr(), args.rank_mask.data_ptr(),
                self.bases, self.state)
        capturing = stream_capturing()  # (asked once, as in dispatch)
        tail = (self.state if wait_stats is None else wait_stats.data_ptr(), *areas, num_tokens, *sizes, fp0, fp1,
                self.board.bases_address, self.board.tag(capturing))
        pairs = x.shape[0] * self.R
        stream = current_stream(self.dev_index)
        two_launches = self._two_launches(args.return_recv_hook, capturing)
        if two_launches:
            # The send phase pushes rows into the homes' workspaces, not into out: it is launched
            # before out is allocated (dispatch says why; its out pointer is a placeholder: the
            # state words, mapped and aligned, never read by the send phase).
            plan.kernels[True, False, False, x_aligned].launch(min(pairs, self.send_cap), 1, stream, *head, self.state,
                                                               *tail)
        out = args.out if args.out is not None else x.new_empty((num_tokens, x.shape[2]), dtype=torch.bfloat16)
        out_address = out.data_ptr()
        aligned = x_aligned and out_address & 15 == 0
        launch_args = head + (out_address,) + tail
        if two_launches:
            receive_kernel = plan.kernels[False, True, wait_stats is not None, aligned]
            receive_programs = max(1, min(num_tokens, self.num_sms, self.receive_cap))
            if not args.return_recv_hook:
                receive_kernel.launch(receive_programs, 1, stream, *launch_args)
                return out, None

            # The launch arguments are addresses: the hook holds the tensors they point into.
            def receive(_keep=(x, out, topk, args.topk_weights, wait_stats)) -> None:
                receive_kernel.launch(receive_programs, 1, current_stream(self.dev_index), *launch_args)
            return out, receive
        key = (True, True, wait_stats is not None, aligned)
        send_key = (True, False, False, x_aligned)  # (aligned also counts out's address: not in key alone)
        if self.one_launch is None and (key not in plan.kernels or send_key not in plan.kernels):  # (as in dispatch)
            plan.kernels[send_key], plan.kernels[False, True, key[2], aligned]
        kernel = plan.kernels[key]
        kernel.launch_resident(min(kernel.resident_grid(max(pairs, num_tokens)), self.receive_cap), stream,
                               *launch_args)
        return out, None

    @property
    def num_experts_seen(self):
        """The expert counts of the low-latency calls made so far (the abort kernel's count words)."""
        return tuple(self._counters)

    def reset(self, barrier) -> None:
        """Collective (``barrier()``: every rank's host, its GPU work finished): reset every
        low-latency epoch, count word, flag, half and slot counter, once no rank has a low-latency
        call in flight (also re-synchronises after ranks were masked and unmasked)."""
        barrier()
        self.ws.reset_low_latency()
        self.forget_calls()
        flags = self.ws.buffer[:sync.NUM_FLAG_SETS * self.R * 8].view(torch.int64).view(sync.NUM_FLAG_SETS, -1)
        flags[sync.FLAGS_LL_COMBINE].zero_()
        for fp_set in (FP_LL_DISPATCH, FP_LL_COMBINE):  # both halves' rows (the two-level normal
            start = self.ws.fingerprint_set(fp_set)     # mode may have written over them)
            self.ws.buffer[start:start + 2 * self.R * FP_ROW_BYTES].zero_()
        for word in (sync.EPOCH_LL_DISPATCH, sync.EPOCH_LL_COMBINE, sync.LL_DISPATCH_HALF_EPOCH,
                     sync.LL_DISPATCH_HALF_EPOCH + 1, sync.LL_COMBINE_HALF_EPOCH, sync.LL_COMBINE_HALF_EPOCH + 1):
            self.state_words[word] = 0
        barrier()

    def forget_calls(self) -> None:
        """Start counting calls again: both halves' call counters and the per-shape slot counters
        (the caller zeroes the words they index; no kernel may run)."""
        self._calls = [0, 0]
        for counters in self._counters.values():
            counters.zero_()
