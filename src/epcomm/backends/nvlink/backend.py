"""NVLink backend, normal mode: Triton kernels over symmetric memory on one node.

Dispatch ("stage and pull"):
  1. notify: each rank copies its counts (tokens per rank, per expert, its token count) into every
     peer's count matrix, inside a barrier — the count exchange. Skipped in cached mode.
  2. stage: each rank copies x (and scales, top-k) into its own workspace at HBM speed, and writes
     per-destination token lists; barrier.
  3. pull: each receiver reads its rows straight from the sources' workspaces into ``recv_x``, at
     prefix-sum offsets (rows grouped by source, source token order).
Combine ("push and reduce"): each rank stores every received row into the home rank's slot
``(token, own rank)``; barrier; the home sums its slots in rank order in float32.
A batch larger than the workspace runs in rounds of tokens; each round is bracketed by barriers.
Low-latency mode runs on the torch_dist reference path for now (same results; NCCL speed).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import triton

from ...errors import EPError, EPTimeoutError
from ...handle import DispatchHandle
from ...layout import align_up, local_expert_ids, rank_prefix_matrix
from ..base import Backend, DispatchArgs, DispatchResult
from ..torch_dist import TorchDistBackend
from . import kernels
from .workspace import ALIGN, Workspace, align

DEFAULT_TIMEOUT_S = 100.0


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


def _word_bytes(row_bytes: int) -> int:
    for word in (8, 4, 2):
        if row_bytes % word == 0:
            return word
    raise EPError(f"rows of {row_bytes} bytes are not supported (need a multiple of 2)")


def _block_shape(row_words: int):
    """(BLOCK_R, BLOCK_C, num_warps): about 16 KB in flight per program for wide rows."""
    if row_words >= 512:
        return 2, 1024, 16
    block_c = max(triton.next_power_of_2(row_words), 1)
    return max(4096 // block_c, 1), block_c, 4


class NVLinkBackend(Backend):
    name = "nvlink"

    def __init__(self, group: dist.ProcessGroup, device: torch.device, num_nvl_bytes: int, low_latency_mode: bool):
        super().__init__(group, device)
        self.ws = Workspace(group, device, num_nvl_bytes)
        self.sent = torch.zeros(self.num_ranks, dtype=torch.int64, device=device)
        self.errors = torch.zeros(self.num_ranks, dtype=torch.int32, device=device)
        self.timeout_ns = int(float(os.environ.get("EPCOMM_TIMEOUT_S", DEFAULT_TIMEOUT_S)) * 1e9)
        self.reference = TorchDistBackend(group, device)  # low-latency path for now
        self._dummy = torch.zeros(1, dtype=torch.int32, device=device)
        self._linear_rank = torch.zeros(1, dtype=torch.int32, device=device)

    # ------------------------------------------------------------------ synchronisation
    def _barrier(self, count_row: Optional[torch.Tensor] = None) -> None:
        R = self.num_ranks
        row_len = 0 if count_row is None else count_row.numel()
        kernels.barrier_kernel[(R,)](
            self.ws.flags_bases(), self.sent, self.errors,
            count_row if count_row is not None else self._dummy, self.ws.counts_bases(),
            row_len, self.rank, self.timeout_ns, ROW_LEN=row_len, BLOCK=1024, num_warps=4)

    def check_errors(self, errors_host: Optional[torch.Tensor] = None) -> None:
        """Raise EPTimeoutError if a wait in an earlier kernel gave up (syncs unless given host flags)."""
        flags = errors_host if errors_host is not None else self.errors.cpu()
        if bool(flags.any()):
            peers = flags.nonzero().flatten().tolist()
            raise EPTimeoutError(f"rank {self.rank}: a wait for peers exceeded {self.timeout_ns / 1e9:.0f} s", peers)

    # ------------------------------------------------------------------ row moves
    def _copy_rows(self, num_sms: int, num_rows_dev, max_rows: int, row_bytes: int, *, src_bases, dst_bases,
                   src_rank=None, src_row=None, src_stride_bytes=None, dst_rank=None, dst_row=None,
                   dst_stride_bytes=None, lo: int = 0, hi: int = 2 ** 62) -> None:
        if max_rows == 0 or row_bytes == 0:
            return
        word = _word_bytes(row_bytes)
        row_words = row_bytes // word
        block_r, block_c, warps = _block_shape(row_words)
        src_indexed, dst_indexed = src_rank is not None, dst_rank is not None
        kernels.copy_rows_kernel[(max(1, min(num_sms, triton.cdiv(max_rows, block_r))),)](
            src_bases, src_rank if src_indexed else self._linear_rank, src_row if src_indexed else self._dummy,
            (src_stride_bytes or row_bytes) // word,
            dst_bases, dst_rank if dst_indexed else self._linear_rank, dst_row if dst_indexed else self._dummy,
            (dst_stride_bytes or row_bytes) // word,
            num_rows_dev, max_rows, row_words, lo, hi,
            WORD=word, WORD_TY=_WORD_TYPES[word], SRC_INDEXED=src_indexed, DST_INDEXED=dst_indexed, BLOCK_R=block_r, BLOCK_C=block_c,
            num_warps=warps)

    @staticmethod
    def _addr(t: torch.Tensor) -> torch.Tensor:
        return torch.tensor([t.data_ptr()], dtype=torch.int64, device=t.device)

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

        if cached:
            handle = args.handle
            state: PullState = handle.backend_state
            prefix = handle.rank_prefix_matrix
            num_rows = handle.num_recv_rows
            self._barrier()  # peers are done reading the previous staging
        else:
            num_experts = args.num_tokens_per_expert.numel()
            num_local = num_experts // R
            row_len = R + num_experts + 1
            count_row = torch.cat([args.num_tokens_per_rank.to(torch.int32), args.num_tokens_per_expert.to(torch.int32),
                                   torch.full((1,), num_tokens, dtype=torch.int32, device=dev)])
            counts_view = self.ws.counts_view(row_len)
            self._barrier(count_row)  # notify: counts into every peer's matrix, then wait for all
            counts = counts_view.clone()
            prefix = rank_prefix_matrix(counts[:, :R])
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
                max_tokens = None  # unknown without a sync: the batch must fit in one round
                counts_list = []
            num_recv_dev = counts[:, rank].sum().to(torch.int32).reshape(1)
            ends = prefix[:, rank].to(torch.int64)
            rows = torch.arange(num_rows, device=dev)
            recv_src_rank = torch.searchsorted(ends, rows, right=True).clamp_max(R - 1).to(torch.int32)
            state = PullState(recv_src_rank, num_recv_dev, max_tokens if max_tokens is not None else -1)

        # ---- stage (local copies) and publish token lists
        parts = [_as_bytes(x)]
        if is_fp8:
            parts.append(_as_bytes(scales))
        if with_topk:
            parts += [_as_bytes(args.topk_idx), _as_bytes(args.topk_weights)]
        row_bytes = [p.shape[1] for p in parts]
        offsets, round_tokens = self._staging_layout(row_bytes)
        max_tokens = state.max_tokens
        if max_tokens < 0:
            if num_tokens > round_tokens:
                raise EPError(f"with num_worst_tokens the batch must fit the buffer in one round: {num_tokens} "
                              f"tokens > {round_tokens}; raise num_nvl_bytes")
            max_tokens = round_tokens
        num_rounds = max(1, -(-max_tokens // round_tokens))

        if not cached:
            if num_tokens > self.ws.list_cap:
                raise EPError(f"{num_tokens} tokens exceed the token-list capacity {self.ws.list_cap}")
            in_rank = args.is_token_in_rank
            position = in_rank.to(torch.int32).cumsum(0) - 1  # [T, R] position among tokens sent to j
            sink = R * self.ws.list_cap
            flat = torch.arange(R, device=dev, dtype=torch.int64) * self.ws.list_cap + position.to(torch.int64)
            flat = torch.where(in_rank, flat, torch.full_like(flat, sink))
            token_ids = torch.arange(num_tokens, device=dev, dtype=torch.int32).unsqueeze(1).expand(-1, R)
            self.ws.lists_view().scatter_(0, flat.flatten(), token_ids.flatten())

        recv_x = torch.empty(num_rows, hidden, dtype=x.dtype, device=dev)
        outputs = [_as_bytes(recv_x)]
        if is_fp8:
            recv_scales = torch.empty(num_rows, scales.shape[1], dtype=torch.float32, device=dev)
            outputs.append(_as_bytes(recv_scales))
        if with_topk:
            K = args.topk_idx.shape[1]
            recv_topk_global = torch.empty(num_rows, K, dtype=torch.int64, device=dev)
            recv_weights = torch.empty(num_rows, K, dtype=torch.float32, device=dev)
            outputs += [_as_bytes(recv_topk_global), _as_bytes(recv_weights)]

        if cached:
            recv_src_idx = handle.recv_src_idx
        for round_idx in range(num_rounds):
            lo, hi = round_idx * round_tokens, (round_idx + 1) * round_tokens
            if round_idx > 0:
                self._barrier()  # peers finished pulling the previous round
            for part, offset, nbytes in zip(parts, offsets, row_bytes):
                chunk = part[lo:hi]
                if chunk.shape[0]:
                    self.ws.local(offset, chunk.shape[0] * nbytes, torch.uint8, (chunk.shape[0], nbytes)).copy_(chunk)
            self._barrier()  # RELEASE staged rows + lists / ACQUIRE peers' staged rows
            if round_idx == 0 and not cached:
                # Token ids: entry (row - start of its source) of the source's list for this rank.
                starts = (prefix[:, rank] - counts[:, rank]).to(torch.int64)
                position = (torch.arange(num_rows, device=dev) - starts[state.recv_src_rank.long()]).to(torch.int32)
                recv_src_idx = torch.full((num_rows,), -1, dtype=torch.int32, device=dev)
                self._copy_rows(num_sms, state.num_recv_dev, num_rows, 4,
                                src_bases=self.ws.lists_bases_for(rank), src_rank=state.recv_src_rank, src_row=position,
                                src_stride_bytes=4, dst_bases=self._addr(recv_src_idx), lo=0, hi=2 ** 31 - 1)
            for out, offset, nbytes in zip(outputs, offsets, row_bytes):
                self._copy_rows(num_sms, state.num_recv_dev, num_rows, nbytes,
                                src_bases=self.ws.region_bases(offset), src_rank=state.recv_src_rank,
                                src_row=recv_src_idx, dst_bases=self._addr(out), lo=lo, hi=hi)

        if is_fp8:
            recv_x = (recv_x, recv_scales)
        recv_topk_idx = recv_topk_weights = None
        if with_topk:
            valid = (torch.arange(num_rows, device=dev) < state.num_recv_dev).unsqueeze(1)
            recv_topk_idx = local_expert_ids(recv_topk_global, rank, num_local)
            recv_topk_idx = torch.where(valid, recv_topk_idx, torch.full_like(recv_topk_idx, -1))
            recv_topk_weights = torch.where(recv_topk_idx >= 0, recv_weights, torch.zeros_like(recv_weights))
        if cached:
            return DispatchResult(recv_x, None, None, None, handle)
        if num_recv is None:
            num_recv = state.num_recv_dev
        handle = DispatchHandle(prefix, recv_src_idx, args.is_token_in_rank, num_recv, num_rows, state)
        return DispatchResult(recv_x, recv_topk_idx, recv_topk_weights, counts_list, handle)

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
        num_bias = len(bias)
        for round_idx in range(num_rounds):
            lo, hi = round_idx * round_tokens, (round_idx + 1) * round_tokens
            self._barrier()  # homes are done reducing the previous slots
            for (src, nbytes), slot_offset in zip(parts, slot_offsets):
                # slot (t - lo, this rank) of home rank i: base + rank·row, stride R·row
                self._copy_rows(config.num_sms, state.num_recv_dev, num_rows, nbytes,
                                src_bases=self._addr(src), dst_bases=self.ws.region_bases(slot_offset + rank * nbytes),
                                dst_rank=state.recv_src_rank, dst_row=handle.recv_src_idx,
                                dst_stride_bytes=R * nbytes, lo=lo, hi=hi)
            self._barrier()  # RELEASE pushed rows / ACQUIRE rows pushed to this rank
            token_hi = min(hi, num_tokens)
            if token_hi <= lo:
                continue
            for (src, nbytes), slot_offset, out in zip(parts, slot_offsets, outs):
                width = out.shape[1]
                slots = self.ws.local(slot_offset, round_tokens * R * nbytes, src.dtype, (-1,))
                is_x = out is combined
                kernels.reduce_slots_kernel[(max(1, min(config.num_sms * 4, token_hi - lo)),)](
                    slots, handle.is_token_in_rank, out,
                    bias[0] if is_x and num_bias >= 1 else out, bias[1] if is_x and num_bias >= 2 else out,
                    lo, token_hi, width, R, NUM_BIAS=num_bias if is_x else 0,
                    BLOCK_C=min(2048, triton.next_power_of_2(width)), num_warps=8 if width >= 1024 else 2)
        return combined, combined_w

    # ------------------------------------------------------------------ low-latency (reference path)
    def low_latency_dispatch(self, args):
        return self.reference.low_latency_dispatch(args)

    def low_latency_combine(self, args):
        return self.reference.low_latency_combine(args)

    def destroy(self) -> None:
        self.ws = None
