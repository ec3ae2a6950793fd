"""NVLink backend: Triton kernels over symmetric memory on one node, normal and low-latency mode.

Dispatch ("stage and pull"):
  1. notify: each rank copies its counts (tokens per rank, per expert, its token count) into every
     peer's count matrix, inside a barrier — the count exchange. Skipped in cached mode.
  2. stage: each rank copies x (and scales, top-k) into its own workspace at HBM speed, and writes
     per-destination token lists; barrier.
  3. pull: each receiver reads its rows straight from the sources' workspaces into ``recv_x``, at
     prefix-sum offsets (rows grouped by source, source token order).
Combine ("push and reduce"): each rank stores every received row into the home rank's slot
``(token, own rank)``; barrier; the home sums the slots of each token in float32.
A batch larger than the workspace runs in rounds of tokens; each round is bracketed by barriers.

Low-latency mode: the sender writes one message per (token, expert) into the receiver's
``[E_local][R][M]`` slots (slot from an atomic counter, FP8 cast fused), then publishes its
per-expert counts with a release (signal); the receiver acquires them (wait), and packs rows into
``recv_x``. Combine pushes each row into the home's ``(token, k)`` slot, signals, and the home
takes the weighted top-k sum. Signal and wait are separate launches so ``return_recv_hook`` can
split them; epochs live in device memory, so the calls can be captured in CUDA graphs.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import triton

from ...errors import EPError, EPTimeoutError
from ...handle import DispatchHandle, LowLatencyHandle
from ...layout import align_up, rank_prefix_matrix
from ..base import Backend, DispatchArgs, DispatchResult
from . import kernels
from .workspace import ALIGN, Workspace, align

DEFAULT_TIMEOUT_S = 100.0


@dataclass
class LowLatencyState:
    """What the NVLink backend keeps in ``LowLatencyHandle.backend_state``."""

    push_total: torch.Tensor  # [1] int32: rows received (entries of the lists below)
    push_row: torch.Tensor  # [E_local*R*M] int32: flat row of recv_x / the combine input
    push_rank: torch.Tensor  # home rank of that row
    push_slot: torch.Tensor  # token * K + k at the home rank
    num_topk: int


@dataclass
class PullState:
    """What the NVLink backend keeps in ``DispatchHandle.backend_state``."""

    recv_src_rank: torch.Tensor  # [num_rows] int32, source rank of each received row
    num_recv_dev: torch.Tensor  # [1] int32 on device
    max_tokens: int  # max tokens over ranks (rounds are counted from it)


_WORD_TYPES = {8: triton.language.int64, 4: triton.language.int32, 2: triton.language.int16}


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A 2-D tensor's rows as uint8 ``[rows, row_bytes]`` (works for zero rows too)."""
    return t.contiguous().view(torch.uint8).view(t.shape[0], t.shape[1] * t.element_size())


def _pack_topk(topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """``[T, K]`` int64 ids and float32 weights as one byte row per token (ids first, rows padded
    to 8 bytes) so that one pull moves both."""
    parts = [_as_bytes(topk_idx), _as_bytes(topk_weights)]
    if topk_weights.shape[1] % 2:
        parts.append(torch.zeros(topk_idx.shape[0], 4, dtype=torch.uint8, device=topk_idx.device))
    return torch.cat(parts, dim=1)


def _word_bytes(row_bytes: int) -> int:
    for word in (8, 4, 2):
        if row_bytes % word == 0:
            return word
    raise EPError(f"rows of {row_bytes} bytes are not supported (need a multiple of 2)")


# Words a copy program moves per step: remote loads take microseconds, so each program keeps
# many bytes in flight (tunable for measurements: EPCOMM_COPY_TILE_WORDS, EPCOMM_COPY_WARPS).
COPY_TILE_WORDS = int(os.environ.get("EPCOMM_COPY_TILE_WORDS", 16384))
COPY_WARPS = int(os.environ.get("EPCOMM_COPY_WARPS", 16))


def _block_shape(row_words: int):
    """(BLOCK_R, BLOCK_C, num_warps) for rows of ``row_words`` words: whole rows per step when
    they fit the tile, otherwise the tile's width of one row."""
    block_c = min(triton.next_power_of_2(max(row_words, 1)), COPY_TILE_WORDS)
    block_r = max(COPY_TILE_WORDS // block_c, 1)
    warps = COPY_WARPS if block_r * block_c >= 2048 else 4
    return block_r, block_c, warps


class NVLinkBackend(Backend):
    name = "nvlink"

    def __init__(self, group: dist.ProcessGroup, device: torch.device, num_nvl_bytes: int, num_ll_bytes: int = 0):
        super().__init__(group, device)
        self.ws = Workspace(group, device, num_nvl_bytes, num_ll_bytes)
        # Per flag set (normal, LL dispatch, LL combine): signals sent to each peer so far.
        self.sent = torch.zeros(3, self.num_ranks, dtype=torch.int64, device=device)
        self.errors = torch.zeros(self.num_ranks, dtype=torch.int32, device=device)
        self.no_mask = torch.zeros(self.num_ranks, dtype=torch.int32, device=device)
        self.timeout_ns = int(float(os.environ.get("EPCOMM_TIMEOUT_S", DEFAULT_TIMEOUT_S)) * 1e9)
        self._dummy = torch.zeros(1, dtype=torch.int32, device=device)
        self._ll_calls = [0, 0]  # dispatch, combine: which half the next call uses
        self._ll_counters = {}

    # ------------------------------------------------------------------ synchronisation
    def _barrier(self, count_row: Optional[torch.Tensor] = None, *, flag_set: int = 0, count_bases=None,
                 mask: Optional[torch.Tensor] = None, signal: bool = True, wait: bool = True) -> None:
        """Barrier among the ranks (optionally publishing ``count_row`` first); ``signal``/``wait``
        split it in two launches. Low-latency sets skip masked peers and mask a peer on timeout."""
        R = self.num_ranks
        row_len = 0 if count_row is None else count_row.numel()
        kernels.barrier_kernel[(R,)](
            self.ws.flags_bases(flag_set), self.sent[flag_set], self.errors,
            mask if mask is not None else self.no_mask,
            count_row if count_row is not None else self._dummy,
            count_bases if count_bases is not None else self.ws.counts_bases(),
            row_len, self.rank, self.timeout_ns, ROW_LEN=row_len, SIGNAL=signal, WAIT=wait,
            MASK_ON_TIMEOUT=mask is not None, BLOCK=1024, num_warps=4)

    def check_errors(self, errors_host: Optional[torch.Tensor] = None) -> None:
        """Raise EPTimeoutError if a wait in an earlier kernel gave up (syncs unless given host flags)."""
        flags = errors_host if errors_host is not None else self.errors.cpu()
        if bool(flags.any()):
            peers = flags.nonzero().flatten().tolist()
            raise EPTimeoutError(f"rank {self.rank}: a wait for peers exceeded {self.timeout_ns / 1e9:.0f} s", peers)

    # ------------------------------------------------------------------ row moves
    def _copy_rows(self, num_sms: int, num_rows_dev, max_rows: int, row_bytes: int, *, src, dst,
                   src_rank=None, src_row=None, src_stride_bytes=None, dst_rank=None, dst_row=None,
                   dst_stride_bytes=None, lo: int = 0, hi: int = 2 ** 62) -> None:
        """Copy ``row_bytes``-byte rows; a side given ``*_rank``/``*_row`` is indexed through the
        address table ``src``/``dst``, the other is the tensor itself (see copy_rows_kernel)."""
        if max_rows == 0 or row_bytes == 0:
            return
        word = _word_bytes(row_bytes)
        row_words = row_bytes // word
        block_r, block_c, warps = _block_shape(row_words)
        src_indexed, dst_indexed = src_rank is not None, dst_rank is not None
        kernels.copy_rows_kernel[(max(1, min(num_sms, triton.cdiv(max_rows, block_r))),)](
            src, src_rank if src_indexed else self._dummy, src_row if src_indexed else self._dummy,
            (src_stride_bytes or row_bytes) // word,
            dst, dst_rank if dst_indexed else self._dummy, dst_row if dst_indexed else self._dummy,
            (dst_stride_bytes or row_bytes) // word,
            num_rows_dev, max_rows, row_words, lo, hi,
            WORD=word, WORD_TY=_WORD_TYPES[word], SRC_INDEXED=src_indexed, DST_INDEXED=dst_indexed,
            BLOCK_R=block_r, BLOCK_C=block_c, num_warps=warps)

    # ------------------------------------------------------------------ dispatch
    def _staging_layout(self, row_bytes_list):
        """Offsets of the staged parts of one token, and how many tokens fit per round."""
        per_token = sum(row_bytes_list)
        tokens = (self.ws.payload_bytes - len(row_bytes_list) * ALIGN) // per_token
        if tokens <= 0:
            raise EPError(f"num_nvl_bytes is too small to stage one token of {per_token} bytes")
        offsets, offset = [], self.ws.payload_offset
        for row_bytes in row_bytes_list:
            offsets.append(offset)
            offset += align(tokens * row_bytes)
        return offsets, tokens

    def dispatch(self, args: DispatchArgs) -> DispatchResult:
        R, rank, dev = self.num_ranks, self.rank, self.device
        cached = args.handle is not None
        is_fp8 = isinstance(args.x, tuple)
        x, scales = (args.x[0], args.x[1].contiguous()) if is_fp8 else (args.x, None)
        num_tokens, hidden = x.shape
        num_sms = args.config.num_sms
        with_topk = (not cached) and args.topk_idx is not None

        parts = [_as_bytes(x)]
        if is_fp8:
            parts.append(_as_bytes(scales))
        if with_topk:
            K = args.topk_idx.shape[1]
            parts.append(_pack_topk(args.topk_idx, args.topk_weights))
        row_bytes = [p.shape[1] for p in parts]
        offsets, round_tokens = self._staging_layout(row_bytes)

        if cached:
            handle = args.handle
            state: PullState = handle.backend_state
            prefix = handle.rank_prefix_matrix
            num_rows = handle.num_recv_rows
            recv_src_idx = handle.recv_src_idx
            self._barrier()  # peers are done reading the previous staging
            self._stage(parts, offsets, row_bytes, 0, round_tokens)
            self._barrier()  # RELEASE staged rows / ACQUIRE the peers' staged rows
            max_tokens = state.max_tokens
        else:
            num_experts = args.num_tokens_per_expert.numel()
            num_local = num_experts // R
            row_len = R + num_experts + 1
            count_row = torch.cat([args.num_tokens_per_rank.to(torch.int32), args.num_tokens_per_expert.to(torch.int32),
                                   torch.full((1,), num_tokens, dtype=torch.int32, device=dev)])
            counts_view = self.ws.counts_view(row_len)
            # notify: counts into every peer's matrix, then wait for all. Passing this barrier also
            # means every peer is done reading the previous staging, so staging may start.
            self._barrier(count_row)
            counts = counts_view.clone()
            prefix = rank_prefix_matrix(counts[:, :R])
            ends = prefix[:, rank].contiguous()
            self._publish_token_lists(args.is_token_in_rank)
            self._stage(parts, offsets, row_bytes, 0, round_tokens)
            self._barrier()  # RELEASE staged rows + token lists / ACQUIRE the peers' ones
            # Everything up to here, and the receive index below, is enqueued before the host
            # waits for the counts: the index arrays are sized for the most rows that can arrive.
            capacity = R * self.ws.list_cap
            index_rank = torch.empty(capacity, dtype=torch.int32, device=dev)
            index_token = torch.empty(capacity, dtype=torch.int32, device=dev)
            kernels.recv_index_kernel[(triton.cdiv(capacity, 1024),)](
                ends, self.ws.lists_bases_for(rank), index_rank, index_token, capacity, R, BLOCK=1024, num_warps=4)
            if args.num_worst_tokens == 0:
                # The one host synchronisation of a full dispatch: receive sizes (+ timeout flags).
                host = torch.cat([counts.flatten(), self.errors]).cpu()
                self.check_errors(host[R * row_len:])
                counts_host = host[:R * row_len].view(R, row_len)
                num_recv = int(counts_host[:, rank].sum())
                num_rows = num_recv
                max_tokens = int(counts_host[:, -1].max())
                per_expert = counts_host[:, R + rank * num_local:R + (rank + 1) * num_local].sum(0).tolist()
                counts_list = [align_up(int(c), args.expert_alignment) for c in per_expert]
            else:
                num_rows = args.num_worst_tokens
                num_recv = None
                max_tokens = -1
                counts_list = []
            if num_rows > capacity:
                raise EPError(f"num_worst_tokens={num_rows} exceeds the receive capacity {capacity}")
            recv_src_idx = index_token[:num_rows]
            if num_recv is None:  # padded to num_worst_tokens: rows past the device-side total are padding
                recv_src_idx = torch.where(torch.arange(num_rows, device=dev) < ends[R - 1], recv_src_idx, -1)
            state = PullState(index_rank[:num_rows], ends[R - 1:].clone(), max_tokens)
        if max_tokens < 0:  # no host sync allowed: the batch must fit one round
            if num_tokens > round_tokens:
                raise EPError(f"with num_worst_tokens the batch must fit the buffer in one round: {num_tokens} "
                              f"tokens > {round_tokens}; raise num_nvl_bytes")
            max_tokens = round_tokens
        num_rounds = max(1, -(-max_tokens // round_tokens))

        recv_x = torch.empty(num_rows, hidden, dtype=x.dtype, device=dev)
        outputs = [_as_bytes(recv_x)]
        if is_fp8:
            recv_scales = torch.empty(num_rows, scales.shape[1], dtype=torch.float32, device=dev)
            outputs.append(_as_bytes(recv_scales))
        if with_topk:
            recv_topk_packed = torch.empty(num_rows, row_bytes[-1], dtype=torch.uint8, device=dev)
            outputs.append(recv_topk_packed)

        for round_idx in range(num_rounds):
            lo, hi = round_idx * round_tokens, (round_idx + 1) * round_tokens
            if round_idx > 0:
                self._barrier()  # peers finished pulling the previous round
                self._stage(parts, offsets, row_bytes, lo, hi)
                self._barrier()  # RELEASE this round's staged rows / ACQUIRE the peers' ones
            for out, offset, nbytes in zip(outputs, offsets, row_bytes):
                self._copy_rows(num_sms, state.num_recv_dev, num_rows, nbytes,
                                src=self.ws.region_bases(offset), src_rank=state.recv_src_rank,
                                src_row=recv_src_idx, dst=out, lo=lo, hi=hi)

        if is_fp8:
            recv_x = (recv_x, recv_scales)
        if cached:
            return DispatchResult(recv_x, None, None, None, handle)
        recv_topk_idx = recv_topk_weights = None
        if with_topk:
            recv_topk_idx = torch.empty(num_rows, K, dtype=torch.int64, device=dev)
            recv_topk_weights = torch.empty(num_rows, K, dtype=torch.float32, device=dev)
            if num_rows:
                kernels.localize_topk_kernel[(triton.cdiv(num_rows * K, 1024),)](
                    recv_topk_packed, recv_topk_idx, recv_topk_weights, state.num_recv_dev, num_rows, K,
                    row_bytes[-1], rank * num_local, num_local, BLOCK=1024, num_warps=4)
        if num_recv is None:
            num_recv = state.num_recv_dev
        handle = DispatchHandle(prefix, recv_src_idx, args.is_token_in_rank, num_recv, num_rows, state)
        return DispatchResult(recv_x, recv_topk_idx, recv_topk_weights, counts_list, handle)

    def _stage(self, parts, offsets, row_bytes, lo: int, hi: int) -> None:
        """Copy tokens [lo, hi) of each part into this rank's staging area (local, HBM speed)."""
        for part, offset, nbytes in zip(parts, offsets, row_bytes):
            chunk = part[lo:hi]
            if chunk.shape[0]:
                self.ws.local(offset, chunk.shape[0] * nbytes, torch.uint8, (chunk.shape[0], nbytes)).copy_(chunk)

    def _publish_token_lists(self, is_token_in_rank: torch.Tensor) -> None:
        """Write, for each destination j, the ascending token ids sent to j into this rank's list
        area (one program per destination; no host sync)."""
        num_tokens = is_token_in_rank.shape[0]
        if num_tokens > self.ws.list_cap:
            raise EPError(f"{num_tokens} tokens exceed the token-list capacity {self.ws.list_cap}")
        if num_tokens:
            kernels.token_lists_kernel[(self.num_ranks,)](
                is_token_in_rank.view(torch.uint8), self.ws.lists_view(), num_tokens, self.num_ranks,
                self.ws.list_cap, BLOCK=1024, num_warps=4)

    # ------------------------------------------------------------------ combine
    def combine(self, x, handle, topk_weights, bias, config):
        R, rank, dev = self.num_ranks, self.rank, self.device
        state = handle.backend_state
        if not isinstance(state, PullState):
            raise EPError("this handle was not made by the nvlink backend")
        num_tokens, hidden = handle.is_token_in_rank.shape[0], x.shape[1]
        num_rows = handle.num_recv_rows
        parts = [(x, hidden * 2)]
        if topk_weights is not None:
            parts.append((topk_weights, topk_weights.shape[1] * 4))
        per_token = R * sum(nbytes for _, nbytes in parts)
        round_tokens = (self.ws.payload_bytes - 1024) // per_token
        if round_tokens <= 0:
            raise EPError("num_nvl_bytes is too small to combine one token")
        slot_offsets, offset = [], self.ws.payload_offset
        for _, nbytes in parts:
            slot_offsets.append(offset)
            offset += align(round_tokens * R * nbytes)
        max_tokens = state.max_tokens if state.max_tokens >= 0 else round_tokens
        if state.max_tokens < 0 and num_tokens > round_tokens:
            raise EPError("with num_worst_tokens the combine must fit the buffer in one round; raise num_nvl_bytes")
        num_rounds = max(1, -(-max_tokens // round_tokens))

        combined = torch.empty(num_tokens, hidden, dtype=torch.bfloat16, device=dev)
        combined_w = None if topk_weights is None else torch.empty(num_tokens, topk_weights.shape[1],
                                                                   dtype=torch.float32, device=dev)
        outs = [combined] + ([combined_w] if combined_w is not None else [])
        for round_idx in range(num_rounds):
            lo, hi = round_idx * round_tokens, (round_idx + 1) * round_tokens
            self._barrier()  # homes are done reducing the previous slots
            for (src, nbytes), slot_offset in zip(parts, slot_offsets):
                # slot (t - lo, this rank) of home rank i: base + rank·row, stride R·row
                self._copy_rows(config.num_sms, state.num_recv_dev, num_rows, nbytes,
                                src=src, dst=self.ws.region_bases(slot_offset + rank * nbytes),
                                dst_rank=state.recv_src_rank, dst_row=handle.recv_src_idx,
                                dst_stride_bytes=R * nbytes, lo=lo, hi=hi)
            self._barrier()  # RELEASE pushed rows / ACQUIRE rows pushed to this rank
            token_hi = min(hi, num_tokens)
            if token_hi <= lo:
                continue
            in_rank = handle.is_token_in_rank.view(torch.uint8)
            for (src, nbytes), slot_offset, out in zip(parts, slot_offsets, outs):
                slots = self.ws.local(slot_offset, round_tokens * R * nbytes, src.dtype, (-1,))
                is_x = out is combined
                self._reduce(config.num_sms * 4, slots, in_rank, None, out, bias if is_x else (), lo, token_hi, R)
        return combined, combined_w

    def _reduce(self, num_programs, slots, presence, weights, out, bias, lo: int, hi: int, num_slots: int,
                mask=None, num_local: int = 1) -> None:
        """Weighted (low-latency) or plain (normal) float32 sum over per-token slots; see the kernel."""
        if hi <= lo:
            return
        width = out.shape[1]
        s_p2 = triton.next_power_of_2(num_slots)
        block_c = min(triton.next_power_of_2(width), max(16384 // s_p2, 16))
        kernels.reduce_slots_kernel[(max(1, min(num_programs, hi - lo)),)](
            slots, presence, weights if weights is not None else out, mask if mask is not None else self._dummy,
            out, bias[0] if len(bias) >= 1 else out, bias[1] if len(bias) >= 2 else out,
            lo, hi, width, num_slots, num_local, NUM_BIAS=len(bias), WEIGHTED=weights is not None, S_P2=s_p2,
            BLOCK_C=block_c, num_warps=16 if s_p2 * block_c >= 8192 else 4)

    # ------------------------------------------------------------------ low-latency mode
    def _ll_layout(self, num_experts: int, max_tokens: int, hidden: int, num_topk: int, use_fp8: bool,
                   use_ue8m0: bool):
        """Byte layout of one half of the low-latency area for these call parameters."""
        R = self.num_ranks
        x_bytes = hidden if use_fp8 else hidden * 2
        scale_words = 0 if not use_fp8 else (hidden // 512 if use_ue8m0 else hidden // 128)
        msg_bytes = align_up(16 + x_bytes + scale_words * 4, 16)
        counts_bytes = align(R * num_experts * 4)
        recv_bytes = align(num_experts * max_tokens * msg_bytes)
        combine_bytes = align(max_tokens * num_topk * hidden * 2)
        need = counts_bytes + recv_bytes + combine_bytes
        if need > self.ws.ll_half_bytes:
            raise EPError(f"low-latency mode needs num_rdma_bytes >= {2 * (need + 256)} for M={max_tokens}, "
                          f"H={hidden}, E={num_experts}, K={num_topk} (have {2 * self.ws.ll_half_bytes})")
        return dict(x_bytes=x_bytes, scale_words=scale_words, msg_bytes=msg_bytes, counts=0,
                    recv=counts_bytes, combine=counts_bytes + recv_bytes)

    def _ll_half(self, which: int) -> int:
        half = self._ll_calls[which] % 2
        self._ll_calls[which] += 1
        return half

    def low_latency_dispatch(self, args):
        R, rank, dev = self.num_ranks, self.rank, self.device
        if args.dispatch_wait_recv_cost_stats is not None:
            raise EPError("dispatch_wait_recv_cost_stats is not supported by the nvlink backend yet")
        x, topk = args.x, args.topk_idx
        num_tokens, hidden = x.shape
        if hidden % 128:
            raise EPError(f"the nvlink low-latency kernels need hidden % 128 == 0, got {hidden}")
        E, M, K = args.num_experts, args.num_max_dispatch_tokens_per_rank, topk.shape[1]
        num_local = E // R
        layout = self._ll_layout(E, M, hidden, K, args.use_fp8, args.use_ue8m0)
        half = self._ll_half(0)
        base = self.ws.ll_offset + half * self.ws.ll_half_bytes
        key = (half, E)
        counters = self._ll_counters.get(key)
        if counters is None:
            counters = torch.zeros(E, dtype=torch.int32, device=dev)
            self._ll_counters[key] = counters
        mask = args.rank_mask
        if num_tokens:
            kernels.ll_send_kernel[(num_tokens, K)](
                x, topk, counters, mask, self.ws.region_bases(base + layout["recv"]),
                hidden, K, num_local, M, R, rank, layout["msg_bytes"], layout["x_bytes"],
                USE_FP8=args.use_fp8, ROUND_SCALE=args.round_scale, UE8M0=args.use_ue8m0,
                BLOCK_H=triton.next_power_of_2(hidden), num_warps=8)
        # RELEASE: the messages above, then this rank's per-expert counts, to every peer.
        self._barrier(counters, flag_set=1, count_bases=self.ws.region_bases(base + layout["counts"]), mask=mask,
                      wait=False)

        slots = R * M
        x_dtype = torch.float8_e4m3fn if args.use_fp8 else torch.bfloat16
        recv_x = torch.empty(num_local, slots, hidden, dtype=x_dtype, device=dev)
        scale_words = layout["scale_words"]
        scales_store = torch.empty(num_local, max(scale_words, 1), slots, device=dev,
                                   dtype=torch.int32 if args.use_ue8m0 else torch.float32)
        recv_src_info = torch.empty(num_local, slots, dtype=torch.int32, device=dev)
        push_total = torch.zeros(1, dtype=torch.int32, device=dev)
        push_row, push_rank, push_slot = torch.empty(3, num_local * slots, dtype=torch.int32, device=dev)
        recv_layout = torch.empty(num_local, R, dtype=torch.int64, device=dev)
        recv_count = torch.empty(num_local, dtype=torch.int32, device=dev)
        stats = args.cumulative_local_expert_recv_stats
        region = self.ws.local(base + layout["recv"], 1, torch.uint8, (-1,))

        def receive() -> None:
            # ACQUIRE: every live peer's counts and messages for this call.
            self._barrier(flag_set=1, mask=mask, signal=False)
            kernels.ll_pack_kernel[(num_local, R)](
                self.ws.local(base + layout["counts"], R * E * 4, torch.int32, (R, E)), counters, mask, region,
                recv_x.view(torch.uint8), scales_store.view(torch.int32), recv_src_info,
                push_total, push_row, push_rank, push_slot, recv_layout, recv_count, stats if stats is not None else recv_count,
                E, num_local, R, rank, M, K, layout["msg_bytes"], layout["x_bytes"], scale_words,
                HAS_STATS=stats is not None, BLOCK_X=1024, BLOCK_S=triton.next_power_of_2(max(scale_words, 1)),
                num_warps=4)

        if args.use_fp8:
            recv = (recv_x, scales_store[:, :scale_words].transpose(1, 2))
        else:
            recv = recv_x
        handle = LowLatencyHandle(recv_src_info, recv_layout, M, hidden, E,
                                  LowLatencyState(push_total, push_row, push_rank, push_slot, K))
        if args.return_recv_hook:
            return recv, recv_count, handle, receive
        receive()
        return recv, recv_count, handle, None

    def low_latency_combine(self, args):
        dev = self.device
        if args.combine_wait_recv_cost_stats is not None:
            raise EPError("combine_wait_recv_cost_stats is not supported by the nvlink backend yet")
        handle = args.handle
        state = handle.backend_state
        if not isinstance(state, LowLatencyState):
            raise EPError("this handle was not made by the nvlink backend")
        x = args.x
        num_local, slots, hidden = x.shape
        K, M = state.num_topk, handle.num_max_dispatch_tokens_per_rank
        if args.topk_idx.shape[1] != K:
            raise EPError(f"topk_idx has {args.topk_idx.shape[1]} columns, the dispatch had {K}")
        layout = self._ll_layout(handle.num_experts, M, hidden, K, False, False)
        half = self._ll_half(1)
        base = self.ws.ll_offset + half * self.ws.ll_half_bytes
        mask = args.rank_mask
        # Expert side: every received row goes to its home rank's slot (token, k).
        self._copy_rows(132, state.push_total, num_local * slots, hidden * 2,
                        src=torch.full((1,), x.data_ptr(), dtype=torch.int64, device=dev),
                        src_rank=self._zeros(num_local * slots), src_row=state.push_row,
                        dst=self.ws.region_bases(base + layout["combine"]), dst_rank=state.push_rank,
                        dst_row=state.push_slot)
        self._barrier(flag_set=2, mask=mask, wait=False)  # RELEASE the pushed rows
        num_tokens = args.topk_idx.shape[0]
        out = args.out if args.out is not None else torch.empty(num_tokens, hidden, dtype=torch.bfloat16, device=dev)
        combine_slots = self.ws.local(base + layout["combine"], M * K * hidden * 2, torch.bfloat16, (-1,))

        def receive() -> None:
            self._barrier(flag_set=2, mask=mask, signal=False)  # ACQUIRE the rows pushed to this rank
            self._reduce(132, combine_slots, args.topk_idx, args.topk_weights, out, (), 0, num_tokens, K,
                         mask=mask, num_local=num_local)

        if args.return_recv_hook:
            return out, receive
        receive()
        return out, None

    def clean_low_latency(self) -> None:
        """Zero the send counters (normally the pack kernel does, but a hook may never have run)."""
        for key, counters in self._ll_counters.items():
            if isinstance(key[0], int):
                counters.zero_()

    def _zeros(self, n: int) -> torch.Tensor:
        """A cached int32 zero vector (rank 0 of a one-entry address table)."""
        zeros = self._ll_counters.get(("zeros", n))
        if zeros is None:
            zeros = torch.zeros(n, dtype=torch.int32, device=self.device)
            self._ll_counters[("zeros", n)] = zeros
        return zeros

    def destroy(self) -> None:
        self.ws = None
