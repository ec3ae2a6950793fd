"""Reference backend: torch.distributed collectives only (gloo on CPU, NCCL on GPU).

It is the oracle every other backend is tested against, so it favours obvious correctness over
speed: one count exchange (``all_gather``), one payload ``all_to_all_single`` of packed byte rows,
and deterministic float32 reductions in rank order. Split sizes of the collectives must be
Python ints, so this backend synchronises with the host even when ``num_worst_tokens`` is set.
"""
from __future__ import annotations

import datetime
import time
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from .. import fp8
from ..errors import EPError, EPInputError, EPTimeoutError
from ..handle import DispatchHandle, LowLatencyHandle
from ..layout import aligned_counts, local_expert_ids, rank_prefix_matrix
from .store_agreement import StoreAgreement
from .base import Backend, DispatchArgs, DispatchResult, LowLatencyCombineArgs, LowLatencyDispatchArgs
from .packed_rows import pack_rows, spec_of, unpack_rows


def _exclusive_cumsum(counts: torch.Tensor) -> torch.Tensor:
    return counts.cumsum(0) - counts


def _mark_missing(rows: torch.Tensor) -> None:
    """Rows that did not arrive: NaN (bf16, e4m3, float32 scales), or all bits set (UE8M0 int32
    scales: exponent byte 255, UE8M0's NaN)."""
    if rows.dtype.is_floating_point:
        rows.fill_(float("nan"))
    else:
        rows.fill_(-1)


class TorchDistBackend(Backend):
    """The reference backend. Every exchanging call first agrees with the peers through the
    store (store_agreement.py: fingerprints, aborts, who is missing); gloo collectives are then waited
    for with the timeout too, and a failed one raises EPError instead of a raw gloo error."""

    name = "torch_dist"
    agrees = True

    def __init__(self, group: dist.ProcessGroup, device: torch.device, timeout_s: float = 100.0,
                 num_rdma_bytes: int = 0):
        """``num_rdma_bytes``: the Buffer's; this backend moves data with collectives and needs no
        memory of its own, but a low-latency call it would not fit raises as on the GPU backends
        (0: not given, nothing checked)."""
        super().__init__(group, device)
        self.timeout_s = timeout_s
        self.num_rdma_bytes = num_rdma_bytes
        self.agreement = StoreAgreement(group, timeout_s)
        self._bounded = dist.get_backend(group) == "gloo"  # NCCL has its own watchdog
        # Low-latency exchanges whose hook has not run yet: kept (not dropped with the hook) so
        # that clean_low_latency can finish them and the peers' halves complete.
        self._unfinished: List[list] = []

    def agree(self, kind, fingerprint, error=None, rank_mask=None) -> None:
        self.agreement.agree(kind, fingerprint, error, rank_mask)

    def stand_in(self, kind, error, rank_mask=None) -> None:
        self.agreement.agree(kind, None, error, rank_mask, stand_in=True)

    def pass_given_up_calls(self) -> None:
        self.agreement.pass_given_up()

    # ---------------------------------------------------------------- collectives
    def _finish(self, work, what: str, timeout_s: Optional[float] = None) -> None:
        """Wait for a gloo collective, bounded by ``timeout_s`` (default: the timeout); name the
        failure. (NCCL: its own watchdog.)"""
        if not self._bounded:
            work.wait()
            return
        try:
            seconds = self.timeout_s if timeout_s is None else max(timeout_s, 0.001)
            if not work.wait(timeout=datetime.timedelta(seconds=seconds)):
                raise RuntimeError("timed out")
        except RuntimeError as err:
            text = str(err).splitlines()[0][:200]
            if "timed out" in text.lower() or "timeout" in text.lower():
                raise EPTimeoutError(f"rank {self.rank}: {what} did not finish within {self.timeout_s:g} s "
                                     f"({text})") from None
            raise EPError(f"rank {self.rank}: {what} failed — a peer exited or its connection broke ({text})") from None

    def _exchange_live(self, send: torch.Tensor, send_counts: List[int], recv_counts: List[int],
                       rank_mask: torch.Tensor, async_op: bool = False, phase: int = 1):
        """All-to-all of rows among the live ranks only, point to point: a masked (possibly dead)
        rank is never contacted, so low-latency calls complete without it. Rows for and from masked
        ranks must be empty. With ``async_op`` the caller finishes the returned works.

        Messages are tagged with the call's agreement number (and ``phase``: 0 counts, 1 rows), so a
        message can only meet the same call's receive on the peer: gloo pairs untagged messages by
        order, which would hand one call's rows to another after a desync."""
        tag = (2 * self.agreement.calls + phase) % (1 << 30)
        recv = torch.empty(sum(recv_counts), *send.shape[1:], dtype=send.dtype, device=send.device)
        send_parts = send.contiguous().split(send_counts)
        recv_parts = recv.split(recv_counts)
        masked = rank_mask.tolist()
        works = []  # (peer whose rows the work receives, or -1 for a send; work)
        for peer in range(self.num_ranks):
            if peer == self.rank:
                recv_parts[peer].copy_(send_parts[peer])
            elif not masked[peer] and not masked[self.rank]:  # a masked rank takes no part at all
                global_peer = dist.get_global_rank(self.group, peer)
                works.append((-1, dist.isend(send_parts[peer], global_peer, group=self.group, tag=tag)))
                works.append((peer, dist.irecv(recv_parts[peer], global_peer, group=self.group, tag=tag)))
        if async_op:
            return recv, works
        failed, error = self._wait_works(works)
        if error is not None:
            raise error
        return recv, []

    def _wait_works(self, works: list) -> Tuple[List[int], Optional[EPError]]:
        """Wait for a low-latency exchange's ``(peer, work)`` pairs, all within one timeout; returns
        ``(the peers whose rows did not arrive, the error to raise or None)``: the caller marks
        those rows missing (NaN) before it raises. A collective (NCCL) counts as every peer."""
        if works in self._unfinished:
            self._unfinished.remove(works)
        deadline = time.monotonic() + self.timeout_s
        failed, error = [], None
        for peer, work in works:
            try:
                self._finish(work, "the low-latency exchange", deadline - time.monotonic())
            except EPError as err:
                error = error or err
                if peer >= 0:
                    failed.append(peer)
        if failed and isinstance(error, EPTimeoutError):
            error = EPTimeoutError(f"rank {self.rank}: the low-latency exchange: ranks {failed} did not send within "
                                   f"{self.timeout_s:g} s; the rows this call expected from them are NaN", failed)
        return failed, error

    def clean_low_latency(self) -> None:
        """Collective: finish the exchanges of hooks that were never called, and bring the ranks'
        call numbers together again (a rank masked by its peers made fewer calls than they did)."""
        while self._unfinished:
            _, error = self._wait_works(self._unfinished[0])
            if error is not None:
                raise error
        calls = torch.tensor([self.agreement.calls], dtype=torch.int64, device=self.device)
        work = dist.all_reduce(calls, op=dist.ReduceOp.MAX, group=self.group, async_op=self._bounded)
        if work is not None:
            self._finish(work, "clean_low_latency_buffer")
        self.agreement.calls = int(calls.item())

    def check_low_latency_dispatch(self, args: LowLatencyDispatchArgs) -> None:
        """``num_rdma_bytes`` (when given) must hold the call, as on the GPU backends."""
        if self.num_rdma_bytes:
            from .gpu.workspace import low_latency_bytes
            need = low_latency_bytes(args.num_max_dispatch_tokens_per_rank, args.x.shape[1], self.num_ranks,
                                     args.num_experts)
            if self.num_rdma_bytes < need:
                raise EPInputError("num_rdma_bytes", f"{self.num_rdma_bytes} bytes are less than this call needs: "
                                                     f"{need} for M={args.num_max_dispatch_tokens_per_rank}, "
                                                     f"H={args.x.shape[1]}, E={args.num_experts} "
                                                     f"(Buffer.get_low_latency_rdma_size_hint)")

    def _ll_rows(self, send, send_counts, recv_counts, rank_mask, async_op: bool):
        """Low-latency row exchange: point to point among live ranks on gloo (masking works), one
        collective on NCCL. Returns ``(recv, works to finish)``."""
        if self._bounded:
            recv, works = self._exchange_live(send, send_counts, recv_counts, rank_mask, async_op)
        else:
            recv, work = self._all_to_all_rows(send, send_counts, recv_counts, async_op)
            works = [(-1, work)] if work is not None else []
        if works:
            self._unfinished.append(works)
        return recv, works

    def _all_gather(self, values: torch.Tensor) -> torch.Tensor:
        """``[n]`` int64 per rank → ``[R, n]``."""
        gathered = [torch.empty_like(values) for _ in range(self.num_ranks)]
        work = dist.all_gather(gathered, values, group=self.group, async_op=self._bounded)
        if work is not None:
            self._finish(work, "the count exchange")
        return torch.stack(gathered)

    def _all_to_all_rows(self, send: torch.Tensor, send_counts: List[int], recv_counts: List[int],
                         async_op: bool = False):
        """Rows to every rank. With ``async_op`` the caller finishes the returned work
        (:meth:`_finish`); otherwise it is finished here."""
        recv = torch.empty(sum(recv_counts), *send.shape[1:], dtype=send.dtype, device=send.device)
        work = dist.all_to_all_single(recv, send.contiguous(), recv_counts, send_counts,
                                      group=self.group, async_op=async_op or self._bounded)
        if work is not None and not async_op:
            self._finish(work, "the row exchange")
            work = None
        return recv, work

    # ---------------------------------------------------------------- normal mode
    def dispatch(self, args: DispatchArgs) -> DispatchResult:
        R, rank = self.num_ranks, self.rank
        cached = args.handle is not None
        is_fp8 = isinstance(args.x, tuple)
        x, scales = (args.x[0], args.x[1].contiguous()) if is_fp8 else (args.x, None)

        if cached:
            handle = args.handle
            is_token_in_rank = handle.is_token_in_rank
            prefix = handle.rank_prefix_matrix
        else:
            is_token_in_rank = args.is_token_in_rank
            # Count exchange: every rank learns the whole [src, dst] token matrix (for the prefix
            # matrix) and the per-expert counts of all ranks (to count its own experts).
            local = torch.cat([args.num_tokens_per_rank.to(torch.int64),
                               args.num_tokens_per_expert.to(torch.int64)])
            gathered = self._all_gather(local).cpu()  # NCCL gathers on the device; the splits are host ints
            prefix = rank_prefix_matrix(gathered[:, :R]).to(self.device)
            num_local_experts = args.num_tokens_per_expert.numel() // R
            per_expert = gathered[:, R + rank * num_local_experts: R + (rank + 1) * num_local_experts].sum(0)

        column = prefix[:, rank].to(torch.int64).cpu()
        recv_counts = (column - torch.cat([column.new_zeros(1), column[:-1]])).tolist()
        # Send order: grouped by destination rank, tokens in ascending order within a destination.
        dst_rank, src_token = is_token_in_rank.t().nonzero(as_tuple=True)
        send_counts = torch.bincount(dst_rank, minlength=R).tolist()

        parts = [x.index_select(0, src_token)]
        if is_fp8:
            parts.append(scales.index_select(0, src_token))
        with_topk = (not cached) and args.topk_idx is not None
        if with_topk:
            parts += [args.topk_idx.index_select(0, src_token), args.topk_weights.index_select(0, src_token)]
        parts.append(src_token.to(torch.int32))
        specs = [spec_of(p) for p in parts]
        recv_packed, _ = self._all_to_all_rows(pack_rows(parts), send_counts, recv_counts)
        received = unpack_rows(recv_packed, specs)

        num_recv = sum(recv_counts)
        num_rows = args.num_worst_tokens if args.num_worst_tokens > 0 else num_recv
        if cached:
            num_rows = handle.num_recv_rows
        if num_recv > num_rows:
            raise EPError(f"rank {rank} received {num_recv} tokens, more than num_worst_tokens={num_rows}")

        def padded(t: torch.Tensor, fill) -> torch.Tensor:
            if num_rows == num_recv:
                return t
            out = torch.full((num_rows, *t.shape[1:]), fill, dtype=t.dtype, device=t.device) if fill is not None \
                else torch.zeros((num_rows, *t.shape[1:]), dtype=t.dtype, device=t.device)
            out[:num_recv] = t
            return out

        recv_x = padded(received[0], None)
        if is_fp8:
            recv_x = (recv_x, padded(received[1], None))
        recv_src_idx = padded(received[-1], -1)

        recv_topk_idx = recv_topk_weights = None
        if with_topk:
            num_local_experts = args.num_tokens_per_expert.numel() // R
            recv_topk_idx = local_expert_ids(received[-3], rank, num_local_experts)
            recv_topk_weights = torch.where(recv_topk_idx >= 0, received[-2], torch.zeros_like(received[-2]))
            recv_topk_idx, recv_topk_weights = padded(recv_topk_idx, -1), padded(recv_topk_weights, None)

        if cached:
            return DispatchResult(recv_x, None, None, None, handle)
        counts_list: Optional[List[int]] = None
        if args.num_worst_tokens == 0:
            counts_list = aligned_counts(per_expert.tolist(), args.expert_alignment)
        else:
            counts_list = []
        handle = DispatchHandle(prefix, recv_src_idx, is_token_in_rank, num_recv, num_rows, None)
        return DispatchResult(recv_x, recv_topk_idx, recv_topk_weights, counts_list, handle)

    def combine(self, x, handle, topk_weights, bias, config):
        R, rank = self.num_ranks, self.rank
        num_recv = handle.num_recv_tokens
        column = handle.rank_prefix_matrix[:, rank].to(torch.int64).cpu()
        # Rows go back to where they came from: the sizes of dispatch, with send and recv swapped.
        back_counts = (column - torch.cat([column.new_zeros(1), column[:-1]])).tolist()
        dst_rank, home_token = handle.is_token_in_rank.t().nonzero(as_tuple=True)
        home_counts = torch.bincount(dst_rank, minlength=R).tolist()

        parts = [x[:num_recv]]
        if topk_weights is not None:
            parts.append(topk_weights[:num_recv])
        specs = [spec_of(p) for p in parts]
        recv_packed, _ = self._all_to_all_rows(pack_rows(parts), back_counts, home_counts)
        received = unpack_rows(recv_packed, specs)

        num_tokens, hidden = handle.is_token_in_rank.shape[0], x.shape[1]
        # float32 sum; rows arrive in rank order, so on CPU the order of additions is fixed.
        combined = torch.zeros(num_tokens, hidden, dtype=torch.float32, device=x.device)
        combined.index_add_(0, home_token, received[0].float())
        for b in bias:
            combined += b.float()
        combined_weights = None
        if topk_weights is not None:
            combined_weights = torch.zeros(num_tokens, topk_weights.shape[1], dtype=torch.float32, device=x.device)
            combined_weights.index_add_(0, home_token, received[1].float())
        return combined.to(torch.bfloat16), combined_weights

    # ---------------------------------------------------------------- low-latency mode
    def _ll_messages(self, topk_idx: torch.Tensor, num_experts: int, rank_mask: torch.Tensor):
        """The (token, expert) messages this rank sends, ordered by (expert, token, k): one per
        top-k entry, so a token listing an expert twice sends it twice.

        Messages to masked ranks, and all messages of a masked rank, are dropped. Returns
        ``(token, expert, k)`` index tensors.
        """
        num_tokens, num_topk = topk_idx.shape
        experts = topk_idx.reshape(-1)
        num_local_experts = num_experts // self.num_ranks
        keep = experts >= 0
        mask = rank_mask.to(experts.device)
        keep &= mask[experts.clamp_min(0) // num_local_experts] == 0
        if bool(mask[self.rank]):
            keep &= False  # a masked rank takes no part: it sends nothing and is sent nothing
        flat = keep.nonzero(as_tuple=True)[0]
        order = torch.sort(experts[flat], stable=True).indices
        flat = flat[order]
        return flat // num_topk, experts[flat], flat % num_topk

    def low_latency_dispatch(self, args: LowLatencyDispatchArgs):
        R = self.num_ranks
        x = args.x
        num_tokens, hidden = x.shape
        M = args.num_max_dispatch_tokens_per_rank
        num_local_experts = args.num_experts // R
        token, expert, _ = self._ll_messages(args.topk_idx, args.num_experts, args.rank_mask)

        # Count exchange (the reference has no fixed slots, so it needs the sizes up front).
        pair_counts = torch.bincount(expert, minlength=args.num_experts).view(R, num_local_experts)
        if self._bounded:  # gloo: point to point among the live ranks (a dead one is never waited for)
            mask = args.rank_mask.tolist()
            members = [p for p in range(R) if p == self.rank or not (mask[p] or mask[self.rank])]
            one_each = [1 if p in members else 0 for p in range(R)]
            got, _ = self._exchange_live(pair_counts[members], one_each, one_each, args.rank_mask, phase=0)
            recv_pair_counts = torch.zeros_like(pair_counts)
            recv_pair_counts[members] = got
        else:
            recv_pair_counts = torch.empty_like(pair_counts)
            dist.all_to_all_single(recv_pair_counts, pair_counts, group=self.group)
        # Messages from masked ranks are ignored by the receiver.
        recv_pair_counts_host = recv_pair_counts.cpu()
        send_counts = pair_counts.sum(1).tolist()
        recv_counts = recv_pair_counts_host.sum(1).tolist()

        if args.use_fp8:
            x_fp8, scales = fp8.per_token_cast_to_fp8(x, round_scale=args.round_scale)
            parts = [x_fp8.index_select(0, token), scales.index_select(0, token)]
        else:
            parts = [x.index_select(0, token)]
        parts.append(token.to(torch.int32))
        specs = [spec_of(p) for p in parts]
        started = time.perf_counter_ns()
        recv_packed, work = self._ll_rows(pack_rows(parts), send_counts, recv_counts, args.rank_mask,
                                          args.return_recv_hook)

        # Outputs have fixed shapes, so they can be handed out before the data lands (hook mode).
        dev = x.device
        slots = R * M
        recv_count = torch.where(args.rank_mask.cpu() == 0, recv_pair_counts_host.t(),
                                 torch.zeros_like(recv_pair_counts_host.t())).sum(1).to(torch.int32).to(dev)
        if args.use_fp8:
            recv_x_data = torch.empty(num_local_experts, slots, hidden, dtype=fp8.FP8_DTYPE, device=dev)
            groups = hidden // fp8.GROUP // (4 if args.use_ue8m0 else 1)
            scale_dtype = torch.int32 if args.use_ue8m0 else torch.float32
            # Column-major in the last two dims, as DeepEP returns them.
            recv_scales = torch.empty(num_local_experts, groups, slots, dtype=scale_dtype, device=dev).transpose(1, 2)
            recv_x = (recv_x_data, recv_scales)
        else:
            recv_x_data = torch.empty(num_local_experts, slots, hidden, dtype=torch.bfloat16, device=dev)
            recv_x = recv_x_data
        recv_src_info = torch.full((num_local_experts, slots), -1, dtype=torch.int32, device=dev)

        # Where each (source, local expert) block lands: sources in rank order within an expert.
        live = (args.rank_mask.cpu() == 0).to(torch.int64).unsqueeze(1)
        block_counts = recv_pair_counts_host * live  # [src, local expert]
        block_offsets = block_counts.cumsum(0) - block_counts
        recv_layout_range = ((block_offsets << 32) | block_counts).t().contiguous().to(dev)

        def receive() -> None:
            failed, error = self._wait_works(work)
            if args.dispatch_wait_recv_cost_stats is not None:
                args.dispatch_wait_recv_cost_stats += time.perf_counter_ns() - started
            received = unpack_rows(recv_packed, specs)
            # Received rows come ordered by (source, local expert, token).
            flat_counts = recv_pair_counts_host.reshape(-1)
            block_ids = torch.repeat_interleave(torch.arange(flat_counts.numel(), device=flat_counts.device), flat_counts)
            keep = live.squeeze(1).repeat_interleave(num_local_experts)[block_ids] > 0
            position = torch.arange(block_ids.numel(), device=block_ids.device) - torch.repeat_interleave(_exclusive_cumsum(flat_counts), flat_counts)
            src, local_expert = block_ids // num_local_experts, block_ids % num_local_experts
            row = block_offsets[src, local_expert] + position
            local_expert, row = local_expert[keep].to(dev), row[keep].to(dev)
            keep_dev = keep.to(dev)
            recv_x_data[local_expert, row] = received[0][keep_dev]
            if args.use_fp8:
                scales_rows = received[1][keep_dev]
                if args.use_ue8m0:
                    scales_rows = fp8.pack_ue8m0(scales_rows)
                recv_scales[local_expert, row] = scales_rows
            recv_src_info[local_expert, row] = received[-1][keep_dev]
            if error is not None:  # no plausible rows: those of the sources that did not arrive are NaN
                for src in failed:
                    for e in range(num_local_experts):
                        start, count = int(block_offsets[src, e]), int(block_counts[src, e])
                        _mark_missing(recv_x_data[e, start:start + count])
                        if args.use_fp8:
                            _mark_missing(recv_scales[e, start:start + count])
                raise error

        if args.cumulative_local_expert_recv_stats is not None:
            args.cumulative_local_expert_recv_stats += recv_count
        handle = LowLatencyHandle(recv_src_info, recv_layout_range, M, hidden, args.num_experts)
        if args.return_recv_hook:
            return recv_x, recv_count, handle, receive
        receive()
        return recv_x, recv_count, handle, None

    def low_latency_combine(self, args: LowLatencyCombineArgs):
        R = self.num_ranks
        x, handle = args.x, args.handle
        num_local_experts = x.shape[0]
        dev = x.device
        # Expert side: send each packed row back to its source, blocks ordered (source, expert).
        layout = handle.recv_layout_range.cpu()
        block_offsets, block_counts = (layout >> 32).t(), (layout & 0xFFFFFFFF).t()  # [src, local expert]
        flat_counts = block_counts.reshape(-1)
        block_ids = torch.repeat_interleave(torch.arange(flat_counts.numel(), device=flat_counts.device), flat_counts)
        position = torch.arange(block_ids.numel(), device=block_ids.device) - torch.repeat_interleave(_exclusive_cumsum(flat_counts), flat_counts)
        local_expert = block_ids % num_local_experts
        row = block_offsets.reshape(-1)[block_ids] + position
        send = x[local_expert.to(dev), row.to(dev)]
        send_counts = block_counts.sum(1).tolist()

        # Home side: rows come back in the order this rank sent them in dispatch.
        token, expert, k_of = self._ll_messages(args.topk_idx, handle.num_experts, args.rank_mask)
        recv_counts = torch.bincount(expert // num_local_experts, minlength=R).tolist()
        started = time.perf_counter_ns()
        recv, work = self._ll_rows(send, send_counts, recv_counts, args.rank_mask, args.return_recv_hook)

        num_tokens = args.topk_idx.shape[0]
        out = args.out if args.out is not None else torch.empty(num_tokens, handle.hidden, dtype=torch.bfloat16, device=dev)
        weights = args.topk_weights[token, k_of].float()  # each message's own (token, k) weight

        def receive() -> None:
            failed, error = self._wait_works(work)
            if args.combine_wait_recv_cost_stats is not None:
                args.combine_wait_recv_cost_stats += time.perf_counter_ns() - started
            combined = torch.zeros(num_tokens, handle.hidden, dtype=torch.float32, device=dev)
            combined.index_add_(0, token, recv.float() * weights.unsqueeze(1))
            if error is not None:  # a token whose contribution from a failed rank did not land is NaN
                lost = torch.isin(expert // num_local_experts, torch.tensor(failed, dtype=expert.dtype))
                combined[token[lost.to(token.device)]] = float("nan")
                out.copy_(combined)
                raise error
            out.copy_(combined)

        if args.return_recv_hook:
            return out, receive
        receive()
        return out, None
