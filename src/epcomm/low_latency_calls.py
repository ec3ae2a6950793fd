"""The low-latency (decode) calls of :class:`epcomm.Buffer`: a part of it, as :mod:`.rank_mask` is.

The calls validate their arguments (:class:`EPInputError` naming one, raised on every rank), agree
with the peers where the backend does, and hand the exchange to the backend. The buffer memory has
two halves used in turn, so at most two low-latency results may be held at once (DeepEP's rule).
With ``enable_shrink`` the calls carry the rank mask: a rank that does not arrive in time is masked
and the call goes on without it. Without it a late rank is an :class:`EPTimeoutError` on every rank
(DeepEP traps there), and a call whose wait gave up returns no plausible data: the rows it knows are
missing are NaN (the backends' ``low_latency_*`` docstrings say which).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from . import checks, nvfp4
from .backends.base import LowLatencyCombineArgs, LowLatencyDispatchArgs
from .errors import EPInputError
from .events import EventOverlap
from .handle import LowLatencyHandle


class LowLatencyCalls:
    """Low-latency mode's public calls; expects the Buffer's state (``_backend``, ``_rank_mask``,
    ``_ll_phase``, ``_ll_dispatched``, ``_ll_combine_staging``, ``group_size``, ``device``,
    ``_check_values``) and its helpers (``_check_alive``, ``_start_call``, ``_stream_scope``,
    ``_forget_calls_in_flight``, ``_stand_in_for_skipped_call``, ``_shrink_mask``)."""

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """Reset low-latency buffer state (needed after switching from normal mode on shared memory).
        Collective: every rank calls it (a host barrier)."""
        if self._rejected_layout is not None:  # the peers may still be in the call this rank skipped
            self._stand_in_for_skipped_call("clean_low_latency_buffer")
        self._check_low_latency()
        checks.check_int("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank, minimum=1)
        checks.check_int("hidden", hidden, minimum=1)
        checks.check_num_experts(num_experts, self.group_size)
        self._forget_calls_in_flight()
        self._backend.clean_low_latency()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        dist.barrier(group=self.group)

    def _next_phase(self) -> int:
        phase = self._ll_phase
        self._ll_phase ^= 1
        return phase

    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, num_max_dispatch_tokens_per_rank: int,
                             num_experts: int, cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None,
                             dispatch_wait_recv_cost_stats: Optional[torch.Tensor] = None, use_fp8: bool = True,
                             round_scale: bool = False, use_ue8m0: bool = False, async_finish: bool = False,
                             return_recv_hook: bool = False, use_nvfp4: bool = False,
                             x_global_scale: Optional[torch.Tensor] = None):
        """Low-latency dispatch: one message per (token, expert) into fixed per-(expert, source) slots.

        Args:
            x: bf16 ``[T, H]`` with ``T <= num_max_dispatch_tokens_per_rank`` (``M``).
            topk_idx: ``[T, K]`` int64 global expert ids, ``-1`` = none.
            cumulative_local_expert_recv_stats: optional int32 ``[E_local]``, incremented by the counts.
            dispatch_wait_recv_cost_stats: optional int64 ``[R]``, incremented by wait time (ns).
            use_fp8: send e4m3 with per-128-channel float32 scales; round_scale: power-of-two scales;
                use_ue8m0: pack those scales as UE8M0 bytes, 4 per int32 (needs round_scale).
            return_recv_hook: only send now; ``hook()`` receives.
            use_nvfp4, x_global_scale: NVFP4 dispatch, as DeepEP's (``use_fp8``, ``round_scale`` and
                ``use_ue8m0`` are then ignored): e2m1 values with an e4m3 scale per 16 and the float32
                global scale ``x_global_scale`` (one value); ``recv_x`` is then ``(uint8 [R*M, H/2, E_local],
                float8_e4m3fn [32, 4, ceil(R*M/128), 4, H/64, E_local])``, DeepEP's layout (:mod:`epcomm.nvfp4`).

        Returns:
            ``(recv_x, recv_count, handle, event, hook)``: ``recv_x`` is bf16 ``[E_local, R*M, H]`` or
            an FP8 pair whose scales ``[E_local, R*M, H/128]`` (int32 ``H/512`` with UE8M0) are
            column-major in the last two dims, or the NVFP4 pair above; ``recv_count [E_local]`` int32
            valid rows per expert.
            A source that did not arrive in time is masked with ``enable_shrink`` (its rows are
            left out); without it the call raises EPTimeoutError naming it (the GPU backends: at the
            next call; this call's rows from that source are then left out of ``recv_count``).

        Warning:
            The buffer has two halves, used in turn: hold at most two low-latency results at once.
            A dispatch's ``handle`` and ``recv_count`` (and its received data, until ``hook()``)
            are reused by the second dispatch after it, as in DeepEP; ``recv_x`` stays yours.
        """
        self._check_low_latency("low_latency_dispatch")
        try:
            R = self.group_size
            # Shape checks run in full once per distinct argument shape (checks.ShapeCache, as in
            # dispatch); the value checks run on every call.
            key = checks.low_latency_dispatch_key(x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                                                  (use_fp8, round_scale, use_ue8m0, use_nvfp4),
                                                  (cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats))
            try:
                checked = key in self._checked_ll_dispatches
            except TypeError:  # (an argument with an unhashable attribute: the checks reject it)
                checked = False
            if checked:
                num_tokens, hidden = x.shape
                if self._check_values:
                    checks.check_topk_values("topk_idx", topk_idx, num_experts)
            else:
                checks.check_int("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank, minimum=1)
                checks.check_num_experts(num_experts, R)
                checks.check_tensor("x", x, dtype=torch.bfloat16, ndim=2, device=self.device)
                num_tokens, hidden = x.shape
                if num_tokens > num_max_dispatch_tokens_per_rank:
                    raise EPInputError("x", f"has {num_tokens} tokens, more than num_max_dispatch_tokens_per_rank="
                                            f"{num_max_dispatch_tokens_per_rank}")
                checks.check_rows(num_tokens, "x", topk_idx=topk_idx)
                checks.check_topk_idx("topk_idx", topk_idx, num_experts, self.device, num_tokens,
                                      check_values=self._check_values)
            # DeepEP reads round_scale and use_ue8m0 only with use_fp8, and use_fp8 not with use_nvfp4
            # (SGLang passes Blackwell's round_scale / use_ue8m0 whatever it dispatches)
            if not use_fp8 or use_nvfp4:
                use_fp8 = round_scale = use_ue8m0 = False
            if not checked:
                if (use_fp8 or use_nvfp4) and hidden % 128:
                    raise EPInputError("x", f"hidden size {hidden} must be a multiple of 128 for FP8 and NVFP4")
                if use_ue8m0 and not round_scale:
                    raise EPInputError("use_ue8m0", "needs round_scale=True (with use_fp8=True)")
                if use_ue8m0 and hidden % 512:
                    raise EPInputError("x", f"hidden size {hidden} must be a multiple of 512 for UE8M0 scales")
                if cumulative_local_expert_recv_stats is not None:
                    checks.check_tensor("cumulative_local_expert_recv_stats", cumulative_local_expert_recv_stats,
                                        dtype=torch.int32, shape=(num_experts // R,), device=self.device)
                if dispatch_wait_recv_cost_stats is not None:
                    checks.check_tensor("dispatch_wait_recv_cost_stats", dispatch_wait_recv_cost_stats,
                                        dtype=torch.int64, shape=(R,), device=self.device)
                self._checked_ll_dispatches.remember(key)
            # NVFP4: quantized here (nvfp4.py) and carried as a bf16 payload by every backend
            wire = nvfp4.wire_for(x, use_nvfp4, x_global_scale, self._check_values)
            args = LowLatencyDispatchArgs(x if wire is None else wire.x, topk_idx, num_max_dispatch_tokens_per_rank,
                                          num_experts, use_fp8,
                                          round_scale, use_ue8m0, cumulative_local_expert_recv_stats,
                                          dispatch_wait_recv_cost_stats, return_recv_hook, self._rank_mask)
            self._backend.check_low_latency_dispatch(args)
        except EPInputError as err:
            self._backend.agree("low_latency_dispatch", None, err, self._shrink_mask())  # every rank raises
            raise
        if self._backend.agrees:
            self._backend.agree("low_latency_dispatch", (
                ("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank), ("hidden", hidden),
                ("num_experts", num_experts), ("num_topk", topk_idx.shape[1]), ("use_fp8", bool(use_fp8)),
                ("round_scale", bool(round_scale)), ("use_ue8m0", bool(use_ue8m0)), ("use_nvfp4", bool(use_nvfp4))),
                rank_mask=self._shrink_mask())
        phase = self._next_phase()
        if not async_finish:  # on the caller's stream: no scope to enter (events.py; as dispatch does)
            recv_x, recv_count, handle, hook = self._low_latency_dispatch_now(args, wire, phase)
            return recv_x, recv_count, handle, EventOverlap(None), hook
        with self._stream_scope(None, async_finish, (args.x, topk_idx)) as scope:
            recv_x, recv_count, handle, hook = self._low_latency_dispatch_now(args, wire, phase)
            scope.keep(recv_x, recv_count, handle.recv_src_info, handle.recv_layout_range)
        return recv_x, recv_count, handle, scope.event_overlap(), hook

    def _low_latency_dispatch_now(self, args: LowLatencyDispatchArgs, wire, phase: int):
        """The backend's low-latency dispatch of ``args`` on the current stream, as
        ``(recv_x, recv_count, handle, hook)``: DeepEP's NVFP4 layout from the bf16 payload where
        ``wire`` carried one (the handle gets the hidden size back), and the handle remembered for
        the combine's check in its half (``phase``)."""
        recv_x, recv_count, handle, hook = self._backend.low_latency_dispatch(args)
        if wire is not None:
            recv_x, handle, hook = wire.unpack(recv_x, handle, hook)
        self._ll_dispatched[phase] = (handle, args.topk_idx)
        return recv_x, recv_count, handle, hook

    def get_next_low_latency_combine_buffer(self, handle: LowLatencyHandle) -> torch.Tensor:
        """The bf16 ``[E_local, R*M, H]`` tensor the next ``low_latency_combine(zero_copy=True)`` reads.

        Write expert outputs into it directly to save the copy.
        """
        self._check_low_latency()
        checks.check_low_latency_handle(handle, self.group_size)
        shape = (handle.num_experts // self.group_size, self.group_size * handle.num_max_dispatch_tokens_per_rank,
                 handle.hidden)
        staging = self._ll_combine_staging[self._ll_phase]
        if staging is None or tuple(staging.shape) != shape:
            staging = torch.zeros(shape, dtype=torch.bfloat16, device=self.device)
            self._ll_combine_staging[self._ll_phase] = staging
        return staging

    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                            handle: LowLatencyHandle, use_logfmt: bool = False, zero_copy: bool = False,
                            async_finish: bool = False, return_recv_hook: bool = False,
                            out: Optional[torch.Tensor] = None,
                            combine_wait_recv_cost_stats: Optional[torch.Tensor] = None):
        """Low-latency combine: ``combined[t] = Σ_k topk_weights[t, k] · expert_output(t, k)`` in float32.

        The weights are applied here (unlike normal-mode :meth:`combine`, a plain sum); each
        ``(t, k)`` entry gets its own weight, also when a token lists the same expert twice.

        Args:
            x: bf16 ``[E_local, R*M, H]`` expert outputs in dispatch's layout.
            topk_idx, topk_weights: ``[T, K]`` int64 / float32, as given to the dispatch.
            handle: the dispatch's handle.
            use_logfmt: accepted for compatibility; the payload stays bf16 (no lossy compression).
            zero_copy: read the expert outputs from :meth:`get_next_low_latency_combine_buffer`.
            out: optional bf16 ``[T, H]`` to write the result into.

        Returns:
            ``(combined_x [T, H] bf16, event, hook)``. With ``enable_shrink``, masked ranks' experts
            contribute nothing; without it, a token whose contribution from some rank did not land
            (the wait for that rank gave up) is a NaN row, and the error is raised (the GPU
            backends: at the next call; the CPU backend: here, or in ``hook()``).
        """
        self._check_low_latency("low_latency_combine")
        try:
            R = self.group_size
            # The handle on every call (the rest once per shape): one this Buffer made in its last two
            # dispatches is its own, of this group's shape; any other is checked in full.
            dispatched = checks.dispatched_entry(handle, self._ll_dispatched)
            if dispatched is None:
                checks.check_low_latency_handle(handle, R)
            key = checks.low_latency_combine_key(x, topk_idx, topk_weights, out, combine_wait_recv_cost_stats, handle)
            try:
                checked = key in self._checked_ll_combines
            except TypeError:  # (an argument with an unhashable attribute: the checks reject it)
                checked = False
            if checked:
                if self._check_values:
                    checks.check_topk_values("topk_idx", topk_idx, handle.num_experts)
            else:
                slots = R * handle.num_max_dispatch_tokens_per_rank
                checks.check_tensor("x", x, dtype=torch.bfloat16, shape=(handle.num_experts // R, slots, handle.hidden),
                                    device=self.device)
                checks.check_topk_idx("topk_idx", topk_idx, handle.num_experts, self.device,
                                      check_values=self._check_values)
                if topk_idx.shape[0] > handle.num_max_dispatch_tokens_per_rank:
                    raise EPInputError("topk_idx", f"has {topk_idx.shape[0]} tokens, more than the handle's M="
                                                   f"{handle.num_max_dispatch_tokens_per_rank}")
            num_tokens = topk_idx.shape[0]
            checks.check_combine_topk_idx(topk_idx, dispatched, self._check_values)
            if not checked:
                checks.check_rows(num_tokens, "topk_idx", topk_weights=topk_weights)
                checks.check_topk_weights("topk_weights", topk_weights, tuple(topk_idx.shape), self.device)
                if out is not None:
                    checks.check_tensor("out", out, dtype=torch.bfloat16, shape=(num_tokens, handle.hidden),
                                        device=self.device)
                if combine_wait_recv_cost_stats is not None:
                    checks.check_tensor("combine_wait_recv_cost_stats", combine_wait_recv_cost_stats,
                                        dtype=torch.int64, shape=(R,), device=self.device)
                self._checked_ll_combines.remember(key)
            if zero_copy:
                x = self.get_next_low_latency_combine_buffer(handle)
            args = LowLatencyCombineArgs(x, topk_idx, topk_weights, handle, out, combine_wait_recv_cost_stats,
                                         return_recv_hook, self._rank_mask)
            self._backend.check_low_latency_combine(args)
        except EPInputError as err:
            self._backend.agree("low_latency_combine", None, err, self._shrink_mask())  # every rank raises
            raise
        if self._backend.agrees:
            self._backend.agree("low_latency_combine", (
                ("hidden", handle.hidden), ("num_experts", handle.num_experts),
                ("num_max_dispatch_tokens_per_rank", handle.num_max_dispatch_tokens_per_rank),
                ("num_topk", topk_idx.shape[1])), rank_mask=self._shrink_mask())
        self._next_phase()
        if not async_finish:  # on the caller's stream (as in low_latency_dispatch)
            combined_x, hook = self._backend.low_latency_combine(args)
            return combined_x, EventOverlap(None), hook
        with self._stream_scope(None, async_finish, (x, topk_idx, topk_weights)) as scope:
            combined_x, hook = self._backend.low_latency_combine(args)
            scope.keep(combined_x)
        return combined_x, scope.event_overlap(), hook
