"""Normal mode's host side: plans per shape, the launches of each call and their outputs (the
kernels of each phase are in the sibling modules; the package docstring lists them per call)."""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from .....errors import EPError, EPInputError
from .....handle import DeviceCount, DispatchHandle
from .....expert_major import ExpertMajor
from ....base import DispatchArgs, DispatchResult
from ... import agreement
from ...copy import COPY_WARPS, copy_block_shape, for_word_copies, is_aligned
from ...launch import Specialisations, cdiv, current_stream, p2
from ...workspace import FP_NORMAL
from .choices import WAITING_PROGRAMS_PER_SM, KernelChoices
from .combine import PUSH, PUSH_REDUCE, REDUCE
from .dispatch import PULL, STAGE_PULL
from .expert_major_rows import POSITION_ELEMENTS, POSITION_TOKENS
from .stage import STAGE
from ..layout_kernel import LayoutKernel
from .notify import NOTIFY_BLOCK, NOTIFY_BOUND, NOTIFY_STAGE
from .outputs import dispatch_outputs
from .plans import CombinePlan, DispatchPlan, PullState

# The expert-major pull and fold store (read) each row once per local entry of its token — about
# K * L / E times the plain layout's local bytes — so they run on this many times Config.num_sms
# programs (bounded by the device's SMs): with num_sms programs alone the local stores, not NVLink,
# would set their speed.
EXPERT_MAJOR_SM_FACTOR = 6
EXPERT_MAJOR_BLOCK_W = 1024  # words per row chunk of the expert-major pull (2048 spills registers)


# ====================================================================== host side
class NormalMode(KernelChoices):
    """Host orchestration of normal mode for one backend: per call, argument-derived scalars and
    2–3 bound launches; everything shape-dependent is computed once per shape (plans). Its kernel
    choices (every_peer, pull_programs_per_sm, ...) are KernelChoices' (choices.py)."""

    def __init__(self, backend):
        self.b = backend
        ws = backend.ws
        self.ws = ws
        self.R = ws.num_ranks
        self.rank = ws.rank
        self.R_P2 = p2(self.R)
        self.dev_index = backend.device.index
        self.device = backend.device
        # The expert-major pull and push run up to this many programs: the device's SMs, or the cap
        # of ranks sharing a GPU (gpu/shared_grids.py; its arithmetic counts num_sms programs each)
        self.expert_major_programs = getattr(backend, "max_num_sms", 0) or \
            torch.cuda.get_device_properties(backend.device).multi_processor_count
        # persistent tensors go to the launcher as plain addresses
        self.bases = ws.bases.data_ptr()
        self.state = backend.state.data_ptr()
        self.fingerprints = ws.fingerprint_set(FP_NORMAL)
        self.seat = backend.seat  # the group's call board (gpu/call_board.py)
        self.layout = LayoutKernel(self.R, self.R, backend.device, backend.state, backend.mailbox.address)
        self._dispatch_plans = {}
        self._combine_plans = {}
        self._default_choices()
        self.trace_address = self.bases  # the trace buffer's address for the pull and push (any when not tracing)

    # ------------------------------------------------------------------ layout
    def dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int):
        return self.layout(topk_idx, num_experts)

    # ------------------------------------------------------------------ dispatch
    def _dispatch_plan(self, x_bytes: int, num_scales: int, num_topk: int, expert_major_topk: int) -> DispatchPlan:
        """``num_topk``: top-k width staged (0 in a cached dispatch); ``expert_major_topk``: the
        width of the expert-major entries (0 = plain layout)."""
        if x_bytes % 8:
            raise EPInputError("x", f"the {self.b.name} backend needs rows of a multiple of 8 bytes (got {x_bytes})")
        expert_major = expert_major_topk > 0
        # staged top-k row: [K] int64 ids, [K] float32 weights, expert-major [K] int32 positions
        topk_row_bytes = (num_topk * (16 if expert_major else 12) + 15) // 16 * 16
        row_bytes = (x_bytes,) + ((num_scales * 4,) if num_scales else ()) + ((topk_row_bytes,) if num_topk else ())
        offsets, round_tokens = self.ws.dispatch_round_tokens(row_bytes)
        offsets = (offsets[0], offsets[1] if num_scales else 0, offsets[-1] if num_topk else 0)
        block_r, block_w = copy_block_shape(x_bytes // 8)
        if expert_major:
            block_w = min(block_w, EXPERT_MAJOR_BLOCK_W)
        # (rows of one chunk only; two tiles of half the rows in the registers of one: no spills on sm_90)
        pipeline = self.pipelined_pull and not expert_major and x_bytes // 8 <= block_w
        if pipeline:
            block_r = max(1, block_r // 2)
        meta = dict(HAS_SCALES=num_scales > 0, HAS_TOPK=num_topk > 0, BLOCK_R=block_r, BLOCK_W=block_w,
                    S_P2=p2(num_scales), K_P2=p2(max(num_topk, expert_major_topk)), R_P2=self.R_P2)
        pushed, no_lists = dict(PUSHED_LISTS=self.pushed_lists), dict(PUSHED_LISTS=False)  # (with lists, without)
        schedule = dict(EVERY_PEER=self.every_peer, TRACE=self.trace is not None, PIPELINE=pipeline,
                        SIDE_FIRST=self.side_loads_first, GATHER_INDEX=self.gathered_index)
        overlapped = dict(EVERY_PEER=self.every_peer, TRACE=self.trace is not None, SIDE_FIRST=self.side_loads_first)
        positions = dict(EXPERT_MAJOR=expert_major and num_topk > 0, POSITION_TOKENS=POSITION_TOKENS)
        rows_aligned = x_bytes % 16 == 0  # 16-byte accesses (copy.py) where x itself is aligned too
        words = dict(hidden=x_bytes if num_scales else x_bytes // 2, x=2 if num_scales else 1, num_topk=num_topk,
                     expert_major=int(expert_major))
        return DispatchPlan(x_bytes // 8, num_scales, num_topk, max(num_topk, expert_major_topk), topk_row_bytes,
                            offsets, round_tokens, block_r, rows_aligned, expert_major,
                            Specialisations(STAGE, ["ALIGNED", "L_P2", "E_P2", "POSITION_SUB"], COPY_WARPS,
                                            WRITE_LISTS=True, LIST_BLOCK=1024, **meta, **positions, **pushed),
                            Specialisations(STAGE, ["ALIGNED", "E_P2", "POSITION_SUB"], COPY_WARPS, WRITE_LISTS=False,
                                            LIST_BLOCK=1024, L_P2=1, **meta, **positions, **no_lists),
                            Specialisations(NOTIFY_STAGE, ["ALIGNED", "L_P2", "E_P2", "POSITION_SUB"], COPY_WARPS,
                                            WRITE_LISTS=True, LIST_BLOCK=1024, BLOCK=NOTIFY_BLOCK, **meta,
                                            **positions, **pushed),
                            PULL.bind(num_warps=COPY_WARPS, INDEX=True, ALIGNED=rows_aligned, EXPERT_MAJOR=expert_major,
                                      **meta, **schedule, **pushed),
                            PULL.bind(num_warps=COPY_WARPS, INDEX=False, ALIGNED=rows_aligned,
                                      EXPERT_MAJOR=expert_major, **meta, **no_lists,
                                      **dict(schedule, GATHER_INDEX=False)),  # (no index to gather)
                            None if expert_major or pipeline else Specialisations(
                                STAGE_PULL, ["ALIGNED", "L_P2", "DOORBELL", "NOTIFY"], COPY_WARPS, INDEX=True,
                                WRITE_LISTS=True, LIST_BLOCK=1024, OUT_ALIGNED=rows_aligned, NOTIFY_BLOCK=NOTIFY_BLOCK,
                                **meta, **overlapped, **pushed),
                            None if expert_major or pipeline else Specialisations(
                                STAGE_PULL, ["ALIGNED"], COPY_WARPS, INDEX=False, WRITE_LISTS=False, LIST_BLOCK=1024,
                                L_P2=1, OUT_ALIGNED=rows_aligned, DOORBELL=False, NOTIFY=False,
                                NOTIFY_BLOCK=NOTIFY_BLOCK, **meta, **overlapped, **no_lists),
                            # (pushed_lists: ranks that disagree read lists where none were written, so
                            # the full dispatch's fingerprint carries it and they raise instead)
                            agreement.pack(call=agreement.CALL_DISPATCH, pushed_lists=int(self.pushed_lists), **words),
                            agreement.pack(call=agreement.CALL_CACHED, **dict(words, num_topk=0)),
                            **self._fixed_arguments(offsets, topk_row_bytes))

    def _fixed_arguments(self, offsets: Tuple[int, int, int], topk_row_bytes: int) -> dict:
        """DispatchPlan's ``stage_fixed``, ``pull_fixed`` and ``overlapped_fixed``: the workspace
        (_workspace_words, the lists' offset and capacity, the staging offsets, the top-k row's
        size), then the stage's fingerprint set; the
        pull's host words (the mailbox, the timeout) and fingerprint set; or ep_dispatch's block
        flags (offset, capacity), the count rows' offset (NOTIFY) and host words (the mailbox, the
        timeout, the doorbell)."""
        ws, mailbox = self.ws, self.b.mailbox
        workspace = self._workspace_words() + (ws.lists_offset, ws.list_cap, *offsets, topk_row_bytes)
        return dict(stage_fixed=workspace + (self.fingerprints,),
                    pull_fixed=workspace + (mailbox.address, self.b.timeout_ns, self.fingerprints),
                    overlapped_fixed=workspace + (ws.block_flags_offset, ws.block_flag_cap, ws.counts_offset,
                                                  mailbox.address, self.b.timeout_ns, mailbox.doorbell_address))

    def _dispatch_plan_of(self, args: DispatchArgs) -> DispatchPlan:
        x = args.x[0] if args.x.__class__ is tuple else args.x
        hidden = x.shape[1]
        handle = args.handle
        num_topk = args.topk_idx.shape[1] if handle is None and args.topk_idx is not None else 0
        expert_major_topk = 0 if not args.expert_major else num_topk if handle is None else \
            handle.expert_major.dest.shape[1]
        key = (hidden * x.element_size(), hidden // 128 if args.x.__class__ is tuple else 0, num_topk,
               expert_major_topk)
        plan = self._dispatch_plans.get(key)
        if plan is None:
            plan = self._dispatch_plans[key] = self._dispatch_plan(*key)
        return plan

    host_epochs = False  # (its epochs live on the device: its combine and a dispatch without a host wait replay)
    # notify_stage_fits' bound on the single launch's waiting programs, per num_sms (a bed test raises
    # it on its Buffer so that 8 ranks sharing one GPU take that launch with a small batch)
    waiting_programs_per_sm = WAITING_PROGRAMS_PER_SM

    def refuse_capture(self, kind: str, handle, num_worst_tokens: int) -> None:
        """A call inside a CUDA graph capture (GpuBackend.refuse_capture): EPError for a full dispatch
        without num_worst_tokens, which waits on the host for the receive counts."""
        if kind == "dispatch" and handle is None and not num_worst_tokens:
            raise EPError("a full dispatch (no handle) waits on the host for the receive counts, so it cannot be "
                          "captured in a CUDA graph: pass num_worst_tokens (outputs padded to it, no host wait), "
                          "or capture a cached dispatch (handle=...)")

    def check_dispatch(self, args: DispatchArgs) -> None:
        """This backend's limits (row sizes, buffer capacity, a handle of this backend): EPInputError."""
        plan = args.plan = self._dispatch_plan_of(args)
        if args.handle is not None:
            if args.handle.backend_state.__class__ is not PullState:
                raise EPInputError("handle", f"was not made by the {self.b.name} backend")
            return
        num_tokens = (args.x[0] if args.x.__class__ is tuple else args.x).shape[0]
        self.ws.check_notify(args.num_tokens_per_expert.shape[0], num_tokens)
        if args.num_worst_tokens and num_tokens > plan.round_tokens:
            raise EPInputError("num_worst_tokens", f"needs the batch to fit the buffer in one round: {num_tokens} "
                                                   f"tokens > {plan.round_tokens}; raise num_nvl_bytes")

    def dispatch(self, args: DispatchArgs) -> DispatchResult:
        """(Buffer called check_dispatch first.)"""
        b, ws, R, rank, dev = self.b, self.ws, self.R, self.rank, self.device
        handle = args.handle
        cached = handle is not None
        x = args.x
        is_fp8 = x.__class__ is tuple
        x, scales = x if is_fp8 else (x, x)
        x, x_aligned = for_word_copies(x)
        num_tokens = x.shape[0]
        plan = args.plan if args.plan is not None else self._dispatch_plan_of(args)
        num_topk = plan.num_topk
        mapping = handle.expert_major if cached else None
        stream = current_stream(self.dev_index)
        round_tokens = plan.round_tokens
        num_local = 0 if cached else args.num_tokens_per_expert.shape[0] // R
        board, tag = self.seat.bases_address, self.seat.tag(args.capturing)  # this call on the group's call board
        expert_major = plan.expert_major
        num_sms = args.config.num_sms
        if expert_major:
            num_sms = min(num_sms * EXPERT_MAJOR_SM_FACTOR, max(self.expert_major_programs, num_sms))
        received = None  # the outputs, where the doorbell needed them before the launches below
        pulling = False  # the doorbell's launch pulls already (it got the outputs' addresses)
        notify_inside = False  # the one launch runs the count exchange too (num_worst_tokens)
        one_launch_grid = None  # its (stage, pull) programs where already counted (num_worst_tokens)
        one_launch_pulls = num_sms  # pull programs of a one-launch dispatch (full_one_launch: x pull_programs_per_sm)

        if cached:
            state: PullState = handle.backend_state
            num_rows, max_tokens = handle.num_recv_rows, state.max_tokens
            counts_list = None
            fp0, fp1 = plan.fingerprint_cached
            fp1 |= (state.sequence & agreement.HANDLE_MASK) << agreement.HANDLE_SHIFT
            overlapped = self._one_launch(plan, max_tokens)
            if not overlapped:
                # Round 0 is staged before the outputs are allocated: the GPU copies while the host
                # allocates (in a synced call the kernels start that much sooner).
                self._stage(plan, args, x, x_aligned, scales, 0, round_tokens, False, stream, fp0, fp1, tag)
        else:
            num_experts = num_local * R
            worst = args.num_worst_tokens > 0
            # The notify's outputs and the handle's int32 words in one allocation (new_empty: no
            # device argument to parse; the counts are int32 on this device, Buffer checked them):
            # each allocation costs 2-4 µs of host time on the GPU hosts, where this path sets a
            # small batch's pace, a view 1.3-1.5. index_words: list_index ([T, R]), recv_info ([2]),
            # then from 16-byte boundaries rank_prefix_matrix ([R, R]) and, where its size is
            # known now (num_worst_tokens), recv_src_idx.
            prefix_at = (num_tokens * R + 2 + 3) & ~3
            src_idx_at = prefix_at + ((R * R + 3) & ~3)
            index_words = args.num_tokens_per_rank.new_empty(src_idx_at + (args.num_worst_tokens if worst else 0))
            prefix = index_words.as_strided((R, R), (R, 1), prefix_at)
            list_index = index_words.data_ptr()
            recv_info = list_index + 4 * num_tokens * R
            table = torch.empty((R + 2, num_local), dtype=torch.int32, device=dev) if expert_major else prefix
            prefix_address, in_rank = prefix.data_ptr(), args.is_token_in_rank.data_ptr()
            mailbox = b.mailbox
            sequence = mailbox.next_sequence()
            fp0, fp1 = plan.fingerprint_full
            fp0 |= (num_experts & agreement.EXPERTS_MASK) << agreement.EXPERTS_SHIFT
            fp1 |= int(worst) << agreement.WORST_SHIFT
            notify_args = (prefix_address, recv_info, table.data_ptr(), num_experts, args.expert_alignment,
                           int(expert_major), ws.counts_offset, mailbox.address, sequence, b.timeout_ns)
            # Round 0 is staged during the host's count wait: in turn (the pull launched after the
            # wait), or (doorbell_dispatch, where this rank's batch allows: the group's is known only
            # after the wait) in one launch with the pull, whose programs wait for the doorbell the
            # host rings after the wait with the outputs' addresses — or with a cancel, when the
            # group needs rounds (mailbox.py, ring). num_worst_tokens: every size is known now, so no
            # wait: one launch as a cached dispatch's, with the count exchange in it (below) or after it.
            may_overlap = self.overlapped_dispatch and plan.overlapped_full is not None
            overlapped = worst and may_overlap and self._one_launch(plan, -1)
            # num_worst_tokens: that one launch takes the count exchange too (ep_dispatch with NOTIFY:
            # the whole dispatch one launch) where all its programs, which all wait, fit as
            # notify_stage_fits counts them
            if overlapped:  # (its programs as launched below: num_rows is num_worst_tokens)
                one_launch_grid = (self._overlapped_stage_programs(args, num_tokens, plan),
                                   self._overlapped_pull_programs(plan, one_launch_pulls, args.num_worst_tokens))
                notify_inside = self.notify_stage_fits(sum(one_launch_grid), args.config.num_sms)
            doorbell = self.doorbell_dispatch and not worst and may_overlap and self._one_launch(plan, num_tokens)
            # full_one_launch: nothing staged before the wait, one launch after it where the group's
            # batches fit one. With one_launch_tokens, a batch above the bound stages now as by
            # default, and the group takes one launch only where its largest batch (max_tokens) is
            # within the bound: then every rank's is, none staged, and all launch alike; otherwise
            # all pull in turn, the ranks that did not stage yet staging after the wait.
            bound = self.one_launch_tokens
            after_wait = self.full_one_launch and not worst and not doorbell and may_overlap and \
                (not bound or num_tokens <= bound)
            # The stage in turn goes with the count exchange in one launch (notify.py, ep_dispatch_notify_stage:
            # one launch less on this path) where _stage finds it fits; else the notify goes alone. (With
            # num_worst_tokens too: a CUDA graph may capture that dispatch, and the launch's waits are on
            # device epochs, which a replay advances as the first run did.) notify_inside: below.
            if not notify_inside and (doorbell or overlapped or after_wait or not self._stage(
                    plan, args, x, x_aligned, scales, 0, round_tokens, True, stream, fp0, fp1, tag, list_index,
                    notify_args)):
                NOTIFY_BOUND[self.R_P2].launch(
                    R, 1, stream,
                    args.num_tokens_per_rank.data_ptr(), args.num_tokens_per_expert.data_ptr(), *notify_args[:3],
                    num_tokens, *notify_args[3:6], rank, R, self.bases, self.bases, self.state, ws.normal_half_bytes,
                    *notify_args[6:], self.fingerprints, fp0, fp1, board, tag)
                if doorbell:
                    self._dispatch_overlapped(plan, args, x, x_aligned, scales,
                                              (prefix_address, 0, 0, in_rank, list_index), (prefix_address,) * 4, 0,
                                              stream, fp0, fp1, tag,
                                              (self._overlapped_stage_programs(args, num_tokens, plan), num_sms),
                                              sequence, doorbell=True)
                elif not overlapped and not after_wait:
                    self._stage(plan, args, x, x_aligned, scales, 0, round_tokens, True, stream, fp0, fp1, tag,
                                list_index)
            rung = not doorbell
            try:
                if worst:
                    num_rows, max_tokens, counts = args.num_worst_tokens, -1, None
                else:
                    num_rows, max_tokens, counts = mailbox.wait_notify(sequence, rank, b.timeout_s)
                src_idx = index_words.as_strided((num_rows,), (1,), src_idx_at) if worst else \
                    index_words.new_empty(num_rows)
                if doorbell and self._one_launch(plan, max_tokens):  # go: the GPU pulls from here on
                    received = dispatch_outputs(plan, x, scales if is_fp8 else None, num_rows, None)
                    rung = overlapped = pulling = True  # (ring writes the tag before it may raise: no cancel after it)
                    mailbox.ring(sequence, rank, b.timeout_s, num_rows, received[4] + (src_idx.data_ptr(),))
            finally:
                if not rung:  # the launch's pull programs stand down: the host pulls in turn below, or raised
                    mailbox.ring(sequence, rank, b.timeout_s)
            if after_wait:  # one launch where the group's batches fit one round (max_tokens: the same on every rank)
                one_launch_pulls = num_sms * self.pull_programs_per_sm
                overlapped = self._one_launch(plan, max_tokens) and (not bound or max_tokens <= bound)
                if not overlapped:  # rounds, or above one_launch_tokens: round 0 staged now, pulled in turn below
                    self._stage(plan, args, x, x_aligned, scales, 0, round_tokens, True, stream, fp0, fp1, tag,
                                list_index)
            counts_list = [] if counts is None else counts[:num_local].tolist()
            state = PullState(index_words, max_tokens, sequence, table if expert_major else None)
            if expert_major:
                mapping = ExpertMajor(torch.empty((num_rows, num_topk), dtype=torch.int32, device=dev),
                                      torch.empty(sum(counts_list), dtype=torch.int64, device=dev),
                                      torch.empty(sum(counts_list), dtype=torch.float32, device=dev),
                                      sum(counts_list), counts_list)
            state.addresses = (prefix_address, recv_info, src_idx.data_ptr(), table.data_ptr(),
                               (mapping.dest if expert_major else prefix).data_ptr(), in_rank, list_index)
        num_rounds = 1 if max_tokens <= round_tokens else cdiv(max_tokens, round_tokens)

        if received is None:
            received = dispatch_outputs(plan, x, scales if is_fp8 else None, num_rows, mapping)
        if overlapped and not pulling:
            prefix_address, recv_info, src_idx_address, _, _, in_rank, list_index = state.addresses
            self._dispatch_overlapped(plan, args, x, x_aligned, scales,
                                      (prefix_address, recv_info, src_idx_address, in_rank, list_index),
                                      received[4], num_rows, stream, fp0, fp1, tag,
                                      one_launch_grid or (self._overlapped_stage_programs(args, num_tokens, plan),
                                                          self._overlapped_pull_programs(plan, one_launch_pulls,
                                                                                         num_rows)),
                                      sequence if notify_inside else 0, notify=notify_inside)
        recv_x, recv_scales, recv_topk, recv_weights, outputs = received
        if overlapped:
            num_rounds = 0
        prefix_address, _, src_idx_address, table_address, dest_address, _, _ = state.addresses
        out_rows = recv_x.shape[0]
        num_local_rows = len(mapping.group_sizes) if expert_major else num_local
        pull_programs = max(1, min(num_sms * (1 if expert_major else self.pull_programs_per_sm),
                                   cdiv(num_rows, plan.block_r)))  # (expert-major: num_sms is scaled above)
        for round_idx in range(num_rounds):
            lo, hi = round_idx * round_tokens, (round_idx + 1) * round_tokens
            if round_idx > 0:  # (round 0 was staged above, in both kinds of dispatch)
                self._stage(plan, args, x, x_aligned, scales, lo, hi, False, stream, fp0, fp1, tag)
            # Launched even with no rows: its wait is what makes the next call's writes safe (sync.py).
            (plan.pull_index if not cached and round_idx == 0 else plan.pull).launch(
                pull_programs, 1, stream,
                prefix_address, src_idx_address, *outputs,  # tensors
                table_address, dest_address,
                num_rows, lo, hi, plan.x_words, plan.num_scales, plan.entry_topk,  # sizes
                rank * num_local, num_local_rows, out_rows, int(round_idx == 0),
                *plan.pull_fixed,  # workspace, host, fingerprint set
                fp0, fp1, board, tag,  # identity
                self.trace_address)

        recv = (recv_x, recv_scales) if is_fp8 else recv_x
        if cached:
            return DispatchResult(recv, None, None, None, handle)
        # (num_worst_tokens: recv_info's first word, a 0-dim view made when the handle's field is read)
        num_recv_tokens = num_rows if max_tokens >= 0 else DeviceCount(index_words, num_tokens * R)
        handle = DispatchHandle(prefix, src_idx, args.is_token_in_rank, num_recv_tokens, num_rows, state, mapping)
        return DispatchResult(recv, recv_topk, recv_weights, counts_list, handle)

    def _one_launch(self, plan: DispatchPlan, max_tokens: int) -> bool:
        """Whether a dispatch runs as one launch (ep_dispatch): overlapped, one round (``max_tokens``,
        the group's most tokens, or -1: a num_worst_tokens dispatch, whose batches fit one round),
        and each source's blocks of staged rows within the block flags (the last word of a source's
        row is its list's). The same on every rank: max_tokens is the group's."""
        if not self.overlapped_dispatch or plan.overlapped_cached is None:
            return False
        bound = plan.round_tokens if max_tokens < 0 else max_tokens
        return bound <= plan.round_tokens and cdiv(bound, plan.block_r) <= self.ws.block_flag_cap - 1

    def _dispatch_overlapped(self, plan: DispatchPlan, args: DispatchArgs, x, x_aligned: bool, scales, handle: tuple,
                             outputs: tuple, num_rows: int, stream: int, fp0: int, fp1: int, tag: int,
                             grid: Tuple[int, int], sequence: int = 0, doorbell: bool = False,
                             notify: bool = False) -> None:
        """The dispatch in one launch (dispatch.py, ep_dispatch): with ``notify`` the count exchange's
        R programs first (a num_worst_tokens dispatch); ``grid``: the stage's programs (in a full
        dispatch R list programs; then up to ``num_sms`` copy programs: _overlapped_stage_programs)
        and the pull programs after them (at most 4 x num_sms: full_one_launch's
        pull_programs_per_sm), which start on each block of rows as it is staged. Every program waits: with ``notify`` the host took the launch where
        notify_stage_fits counts them all; else it counts the pull's (at most 4 x num_sms, as
        shared_grids.py does).
        ``handle``: the addresses of rank_prefix_matrix, recv_info (the notify's, or 0),
        recv_src_idx, is_token_in_rank and the list index; ``outputs``: recv_x, recv_scales,
        recv_topk, recv_weights. ``sequence``: a full dispatch's notify number, the mailbox's with
        ``notify``; with ``doorbell`` the launch goes before the count wait, with ``num_rows``,
        ``outputs`` and recv_src_idx placeholders that the doorbell of ``sequence`` supplies
        (mailbox.py, ring)."""
        num_tokens = x.shape[0]
        x_address, scales_address, topk, weights = _input_addresses(plan, args, x, scales)
        aligned = plan.rows_aligned and x_aligned
        cached = args.handle is not None
        num_local = 0 if cached else args.num_tokens_per_expert.shape[0] // self.R
        num_stage, pull_programs = grid
        prefix, recv_info, src_idx, in_rank, list_index = handle
        if cached:
            kernel = plan.overlapped_cached[aligned]
            per_rank = per_expert = in_rank
        else:
            kernel = plan.overlapped_full[aligned, p2(num_local), doorbell, notify]
            per_rank, per_expert = args.num_tokens_per_rank.data_ptr(), args.num_tokens_per_expert.data_ptr()
        kernel.launch(
            (self.R if notify else 0) + num_stage + pull_programs, 1, stream,
            x_address, scales_address, topk, weights, in_rank, list_index,
            per_rank, per_expert, prefix, recv_info or prefix, src_idx or prefix, *outputs,  # tensors
            num_tokens, plan.x_words, plan.num_scales,  # sizes
            scales.stride(0) if plan.num_scales else 0, scales.stride(1) if plan.num_scales else 0,
            plan.num_topk, num_local, num_rows, num_stage, args.expert_alignment,
            *plan.overlapped_fixed, sequence,  # workspace, block flags, count rows, host
            self.fingerprints, fp0, fp1, self.seat.bases_address, tag,  # identity
            self.trace_address)

    @staticmethod
    def _overlapped_pull_programs(plan: DispatchPlan, most: int, num_rows: int) -> int:
        """ep_dispatch's pull programs: one per block of rows received, at most ``most``."""
        return max(1, min(most, cdiv(num_rows, plan.block_r)))

    def _overlapped_stage_programs(self, args: DispatchArgs, num_tokens: int, plan: DispatchPlan) -> int:
        """ep_dispatch's stage programs: a copy program per block of rows, at most num_sms, and in
        a full dispatch first R list programs."""
        copies = max(1, min(args.config.num_sms, cdiv(num_tokens, plan.block_r)))
        return copies if args.handle is not None else copies + self.R

    def notify_stage_fits(self, stage_programs: int, num_sms: int) -> bool:
        """Whether a full dispatch's count exchange goes in one launch with its round-0 stage of
        ``stage_programs`` programs (copy, position and list programs; in a num_worst_tokens
        dispatch's whole launch, dispatch.py's ep_dispatch with NOTIFY, the stage's and the pull's)
        on ``num_sms``: where ``notify_with_stage`` is set and its R notify programs and the
        others, which all wait (the others for the notify, the notify's for the peers), are at most
        WAITING_PROGRAMS_PER_SM (4) x num_sms. That is the most waiting programs shared_grids.py counts per rank where ranks share a GPU. On a GPU of
        its own it keeps the wait's spinning programs within what the one-node kernels' waiting
        grids use (the pull in turn 3 x num_sms, the combine 4 x num_sms), so a compute stream
        beside the call keeps the rest of the SMs. An expert-major batch's position programs
        (one per 32 tokens) take it past that at T=4096, and then the notify goes apart, as before
        2026-11-29."""
        return self.notify_with_stage and self.R + stage_programs <= self.waiting_programs_per_sm * num_sms

    def _stage(self, plan: DispatchPlan, args: DispatchArgs, x, x_aligned: bool, scales, lo: int, hi: int,
               write_lists: bool, stream: int, fp0: int, fp1: int, tag: int, list_index: int = 0,
               notify: tuple = ()) -> bool:
        """Launch the stage of tokens [lo, hi); ``write_lists``: a full dispatch's round 0, which also
        writes the token lists and ``list_index`` (the address of the handle's [T, R] int32).
        ``notify``: ep_dispatch_notify_stage's own arguments (after the stage's, from prefix_ptr on): launch
        the count exchange with it (notify.py) where :meth:`notify_stage_fits`, else launch nothing.
        Returns whether it launched."""
        num_tokens = x.shape[0]
        rows = max(0, min(hi, num_tokens) - lo)
        programs = max(1, min(args.config.num_sms * self.stage_programs_per_sm, cdiv(rows, plan.block_r)))
        x_address, scales_address, topk, weights = _input_addresses(plan, args, x, scales)
        aligned = plan.rows_aligned and x_aligned
        num_local = 0 if args.handle is not None else args.num_tokens_per_expert.shape[0] // self.R
        e_p2, sub, num_position_programs = 1, 1, 0
        if plan.expert_major and plan.num_topk:  # positions of the entries (expert-major layout)
            e_p2 = p2(num_local * self.R)
            sub = max(1, POSITION_ELEMENTS // (p2(plan.num_topk) * e_p2))
            num_position_programs = cdiv(rows, POSITION_TOKENS)
            programs += num_position_programs
        if write_lists:  # a full dispatch: the token lists and the count checks
            in_rank, per_rank, per_expert, programs = args.is_token_in_rank.data_ptr(), \
                args.num_tokens_per_rank.data_ptr(), args.num_tokens_per_expert.data_ptr(), programs + self.R
            if notify:
                if not self.notify_stage_fits(programs, args.config.num_sms):
                    return False
                kernel, programs = plan.notify_stage[aligned, p2(num_local), e_p2, sub], programs + self.R
            else:
                kernel = plan.stage_lists[aligned, p2(num_local), e_p2, sub]
        else:
            kernel = plan.stage[aligned, e_p2, sub]
            in_rank = per_rank = per_expert = args.handle.backend_state.addresses[5] if args.handle is not None \
                else args.is_token_in_rank.data_ptr()
        kernel.launch(
            programs, 1, stream,
            x_address, scales_address, topk, weights, in_rank, list_index or x_address, per_rank, per_expert,  # tensors
            num_tokens, lo, hi, plan.x_words, plan.num_scales,  # sizes and strides
            scales.stride(0) if plan.num_scales else 0, scales.stride(1) if plan.num_scales else 0,
            plan.num_topk, num_local, num_position_programs,
            *plan.stage_fixed,  # workspace, fingerprint set
            fp0, fp1, self.seat.bases_address, tag,  # identity
            *notify)  # (ep_dispatch_notify_stage: its counts' outputs, sizes, workspace offset and host words)
        return True

    # ------------------------------------------------------------------ combine
    def _combine_plan(self, hidden: int, num_topk: int, num_bias: int, expert_major_topk: int) -> CombinePlan:
        x_bytes = hidden * 2
        if x_bytes % 8:
            raise EPInputError("x", f"the {self.b.name} backend needs rows of a multiple of 8 bytes (hidden={hidden})")
        (slots_x, *rest), round_tokens = self.ws.combine_round_tokens((x_bytes,) + ((num_topk * 4,) if num_topk else ()))
        block_r, block_w = copy_block_shape(x_bytes // 8)
        # A token's columns per step of the reduce: the tile holds [R_P2, BLOCK_C]; the rank loop
        # holds [BLOCK_C] and R_P2 rows in flight, so it keeps a whole 7168 row to one step at 8 ranks
        # (2048 made four steps in turn per token, the reduce then trailed the push: performance-log)
        block_c = min(p2(hidden), max(16384 // (min(self.R_P2, 2) if self.rank_loop_reduce else self.R_P2), 16))
        rows_aligned = hidden % 8 == 0  # 16-byte accesses (copy.py) where x / the biases are aligned too
        push = Specialisations(PUSH, ["ALIGNED"], COPY_WARPS, HAS_WEIGHTS=num_topk > 0, BLOCK_R=block_r,
                               BLOCK_W=block_w, K_P2=p2(max(num_topk, expert_major_topk)), R_P2=self.R_P2,
                               EXPERT_MAJOR=expert_major_topk > 0, EVERY_PEER=self.every_peer,
                               TRACE=self.trace is not None)
        reduce = Specialisations(REDUCE, ["ALIGNED"], 16 if self.R_P2 * block_c >= 8192 else 4, NUM_BIAS=num_bias,
                                 HAS_WEIGHTS=num_topk > 0, R_P2=self.R_P2, BLOCK_C=block_c, K_P2=p2(num_topk),
                                 RANK_LOOP=self.rank_loop_reduce)
        overlapped = None if expert_major_topk else Specialisations(
            PUSH_REDUCE, ["ALIGNED", "OUT_ALIGNED"], COPY_WARPS, HAS_WEIGHTS=num_topk > 0, BLOCK_R=block_r,
            BLOCK_W=block_w, K_P2=p2(num_topk), R_P2=self.R_P2, EXPERT_MAJOR=False, EVERY_PEER=self.every_peer,
            TRACE=self.trace is not None, NUM_BIAS=num_bias, BLOCK_C=block_c, RANK_LOOP=self.rank_loop_reduce,
            WARPS_APART=self.reduce_warps_apart)
        return CombinePlan(slots_x, rest[0] if num_topk else 0, round_tokens, block_r, rows_aligned,
                           expert_major_topk > 0, push, reduce, overlapped,
                           agreement.pack(call=agreement.CALL_COMBINE, hidden=hidden, x=1, num_topk=num_topk,
                                          expert_major=int(expert_major_topk > 0)),
                           self._combine_fixed_arguments(slots_x, rest[0] if num_topk else 0))

    def _combine_fixed_arguments(self, slots_x: int, slots_w: int) -> tuple:
        """CombinePlan's ``overlapped_fixed``: the workspace words, the slots' offsets (rows,
        weights), the block flags (offset, capacity), the host words (the mailbox, the timeout) and
        the fingerprint set."""
        ws = self.ws
        return self._workspace_words() + (slots_x, slots_w, ws.block_flags_offset, ws.block_flag_cap,
                                          self.b.mailbox.address, self.b.timeout_ns, self.fingerprints)

    def _workspace_words(self) -> tuple:
        """The arguments every one-node kernel takes first of the workspace, in their order: rank,
        group size, the bases twice (rows and flags), the state words, a half's size."""
        return self.rank, self.R, self.bases, self.bases, self.state, self.ws.normal_half_bytes

    def _combine_plan_of(self, x: torch.Tensor, handle: DispatchHandle, topk_weights: Optional[torch.Tensor],
                         bias: Tuple[torch.Tensor, ...]) -> CombinePlan:
        mapping = handle.expert_major
        key = (x.shape[1], 0 if topk_weights is None else topk_weights.shape[1], len(bias),
               0 if mapping is None else mapping.dest.shape[1])
        plan = self._combine_plans.get(key)
        if plan is None:
            plan = self._combine_plans[key] = self._combine_plan(*key)
        return plan

    def check_combine(self, x: torch.Tensor, handle: DispatchHandle, topk_weights: Optional[torch.Tensor],
                      bias: Tuple[torch.Tensor, ...]) -> None:
        """This backend's limits (row sizes, buffer capacity, a handle of this backend): EPInputError."""
        if handle.backend_state.__class__ is not PullState:
            raise EPInputError("handle", f"was not made by the {self.b.name} backend")
        plan = self._combine_plan_of(x, handle, topk_weights, bias)
        if handle.backend_state.max_tokens < 0 and handle.is_token_in_rank.shape[0] > plan.round_tokens:
            raise EPInputError("handle", "comes from a num_worst_tokens dispatch: its combine must fit the buffer "
                                         "in one round; raise num_nvl_bytes")

    def combine(self, x: torch.Tensor, handle: DispatchHandle, topk_weights: Optional[torch.Tensor],
                bias: Tuple[torch.Tensor, ...], config) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(Buffer called check_combine first.)"""
        b, R, rank = self.b, self.R, self.rank
        state = handle.backend_state
        num_tokens, hidden = handle.is_token_in_rank.shape[0], x.shape[1]
        num_rows = handle.num_recv_rows
        num_topk = topk_weights.shape[1] if topk_weights is not None else 0
        mapping = handle.expert_major  # x: the expert-major rows, folded by the push
        plan = self._combine_plan_of(x, handle, topk_weights, bias)
        round_tokens = plan.round_tokens
        max_tokens = state.max_tokens if state.max_tokens >= 0 else round_tokens
        num_rounds = 1 if max_tokens <= round_tokens else cdiv(max_tokens, round_tokens)
        stream = current_stream(self.dev_index)
        # addresses, not tensors (PullState.addresses says why)
        prefix_address, _, src_idx_address, _, dest_address, in_rank_address, list_index_address = state.addresses
        dest = src_idx_address if mapping is None else dest_address
        num_sms = config.num_sms
        # In one launch where it can (one round; a home's rows at a pusher, at most max_tokens, in
        # blocks the flag area holds): the same on every rank, since max_tokens is the group's.
        if self.overlapped_combine and num_rounds == 1 and plan.overlapped is not None and \
                cdiv(max_tokens, plan.block_r) <= self.ws.block_flag_cap - 1:  # (the last word: a dispatch list's)
            return self._combine_overlapped(x, state, topk_weights, bias, config, plan, num_tokens, num_rows,
                                            num_topk, prefix_address, src_idx_address, in_rank_address,
                                            list_index_address)
        if mapping is not None:
            num_sms = min(num_sms * EXPERT_MAJOR_SM_FACTOR, max(self.expert_major_programs, num_sms))
        push_programs = max(1, min(num_sms, cdiv(num_rows, plan.block_r)))
        half_bytes = self.ws.normal_half_bytes
        x, x_aligned = for_word_copies(x)
        x_address = x.data_ptr()
        w_in = topk_weights.data_ptr() if num_topk else x_address if mapping is None else mapping.row_weights.data_ptr()
        push = plan.push[plan.rows_aligned and x_aligned]
        reduce = plan.reduce[plan.rows_aligned and is_aligned(*bias)]
        fp0, fp1 = plan.fingerprint
        fp1 |= (state.sequence & agreement.HANDLE_MASK) << agreement.HANDLE_SHIFT
        board, tag = self.seat.bases_address, self.seat.tag()  # this call on the group's call board
        combined = combined_w = None
        for round_idx in range(num_rounds):
            lo, hi = round_idx * round_tokens, (round_idx + 1) * round_tokens
            push.launch(push_programs, 1, stream,
                        x_address, w_in, prefix_address, src_idx_address, dest,  # tensors
                        num_rows, lo, hi, hidden // 4, num_topk if mapping is None else mapping.dest.shape[1],  # sizes
                        rank, R, self.bases, self.bases, self.state,  # workspace
                        half_bytes, plan.slots_x, plan.slots_w,
                        self.fingerprints, fp0, fp1, board, tag,  # identity
                        self.trace_address)
            if combined is None:  # after the first push is launched: the GPU pushes while the host allocates
                combined = x.new_empty((num_tokens, hidden))  # (x: bf16; new_empty: dispatch says why)
                combined_w = x.new_empty((num_tokens, num_topk), dtype=torch.float32) if num_topk else None
                combined_address = combined.data_ptr()
                bias0 = bias[0].data_ptr() if len(bias) >= 1 else combined_address
                bias1 = bias[1].data_ptr() if len(bias) >= 2 else combined_address
                w_out = combined_w.data_ptr() if num_topk else combined_address
            reduce.launch(max(1, min(4 * config.num_sms, min(hi, num_tokens) - lo)), 1, stream,
                          in_rank_address, combined_address, w_out, bias0, bias1,  # tensors
                          num_tokens, lo, hi, hidden, num_topk,  # sizes
                          rank, R, self.bases, self.bases, self.state,  # workspace
                          half_bytes, plan.slots_x, plan.slots_w,
                          b.mailbox.address, b.timeout_ns,  # host
                          self.fingerprints, fp0, fp1, board, tag)  # identity
        return combined, combined_w

    def _combine_overlapped(self, x: torch.Tensor, state: PullState, topk_weights: Optional[torch.Tensor],
                            bias: Tuple[torch.Tensor, ...], config, plan: CombinePlan, num_tokens: int, num_rows: int,
                            num_topk: int, prefix_address: int, src_idx_address: int, in_rank_address: int,
                            list_index_address: int) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The combine in one launch (combine.py, ep_combine): ``combine_split[0] * num_sms`` push
        programs, then reduce programs (``combine_split[1] * num_sms`` at most) that sum
        each chunk of tokens as its blocks land. Together at most 4 x num_sms programs, as many as
        the push and the reduce in turn wait in (shared_grids.py counts them)."""
        hidden = x.shape[1]
        combined = x.new_empty((num_tokens, hidden))  # (x: bf16; new_empty: dispatch says why)
        combined_w = x.new_empty((num_tokens, num_topk), dtype=torch.float32) if num_topk else None
        combined_address = combined.data_ptr()
        x, x_aligned = for_word_copies(x)
        x_address = x.data_ptr()
        fp0, fp1 = plan.fingerprint
        fp1 |= (state.sequence & agreement.HANDLE_MASK) << agreement.HANDLE_SHIFT
        push_per_sm, reduce_per_sm = self.combine_split
        num_push = max(1, min(push_per_sm * config.num_sms, cdiv(num_rows, plan.block_r)))
        num_reduce = max(1, min(reduce_per_sm * config.num_sms, cdiv(num_tokens, plan.block_r)))
        kernel = plan.overlapped[plan.rows_aligned and x_aligned, plan.rows_aligned and is_aligned(*bias)]
        kernel.launch(
            num_push + num_reduce, 1, current_stream(self.dev_index),
            x_address, topk_weights.data_ptr() if num_topk else x_address, prefix_address, src_idx_address,
            src_idx_address, in_rank_address, list_index_address, combined_address,  # tensors
            combined_w.data_ptr() if num_topk else combined_address,
            bias[0].data_ptr() if len(bias) >= 1 else combined_address,
            bias[1].data_ptr() if len(bias) >= 2 else combined_address,
            num_rows, plan.round_tokens, num_tokens, hidden // 4, hidden, num_topk, num_push,  # sizes
            *plan.overlapped_fixed,  # workspace, block flags, host, fingerprint set
            fp0, fp1, self.seat.bases_address, self.seat.tag(),  # identity
            self.trace_address)
        return combined, combined_w


def _input_addresses(plan: DispatchPlan, args: DispatchArgs, x: torch.Tensor, scales) -> Tuple[int, int, int, int]:
    """The stage's inputs as launch arguments: the addresses of x, its scales, top-k ids and weights
    (x's where the plan stages none). Addresses, not tensors: PullState.addresses says why."""
    x_address = x.data_ptr()
    topk, weights = (args.topk_idx.data_ptr(), args.topk_weights.data_ptr()) if plan.num_topk else (x_address, x_address)
    return x_address, scales.data_ptr() if plan.num_scales else x_address, topk, weights
