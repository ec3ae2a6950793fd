"""The symmetric-memory workspace of the GPU layer: the only owner of its layout.

One allocation per rank, fixed for the Buffer's life, carved at the same offsets on every rank (so
a peer's region is ``bases[peer] + offset``; kernels receive ``bases`` and the offsets)::

    flags       int64 [NUM_FLAG_SETS][R]         word [s][i] is written by rank i (sync.py)
    fingerprints int64 [NUM_FP_SETS][2][R][4]   row [s][h][i] is written by rank i (agreement.py)
    block flags int64 [R][block_flag_cap]       combine: word [i][b] = the epoch of the last push whose
                                                 block b of this rank's rows rank i has stored (normal
                                                 mode only; epoch-tagged, never reset: one_node/combine.py)
    normal      two halves (barrier epoch % 2), each:
                  counts   int32 [R][row_cap]    notify: row i written by rank i
                  lists    int32 [R][list_cap]   dispatch: ascending tokens this rank sends to j
                                                 (pushed_lists: that rank j sends here; list_of)
                  payload  bytes                 dispatch staging, or combine slots [T][R]
    low-latency two halves (call parity), each (layout per call shape, :meth:`ll_layout`):
                  counts   int64 [R][E_local]    (epoch << 32) | messages, written by source i;
                           LL_COUNT_BYTES for every shape (no shape's data may lie on them)
                  recv     [E_local][R][M] messages of (header 16 B, payload, scales)
                  combine  bf16 [M][K][H]        expert outputs pushed back to their home
                  stage    what this rank puts to far peers (staging=True only, when REMOTE
                           reaches them by puts: a NIC reads symmetric memory): dispatch messages [M][K],
                           or combine rows [E_local][R*M] of 2H bytes

The normal halves are left out with ``normal=False`` (a multi-node backend's low-latency region:
its normal mode has its own workspace). Sizes are computed once here;
``Buffer.get_low_latency_rdma_size_hint`` uses :func:`low_latency_bytes`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Tuple

import torch
import torch.distributed as dist

from ...errors import EPError, EPInputError
from ...layout import align_up

ALIGN = 256
# Flag sets in the flag region: [set][R] int64, word [s][i] written by rank i (see sync.py).
FLAGS_NORMAL = 0
FLAGS_LL_COMBINE = 1
NUM_FLAG_SETS = 2
# Fingerprint sets, one per kind of signal: [set][half][R] rows of (word 0, word 1, epoch, 0) int64.
FP_NORMAL = 0
FP_LL_DISPATCH = 1
FP_LL_COMBINE = 2
NUM_FP_SETS = 3
FINGERPRINTS_OFFSET = 32 * 1024
SPARE_WORD = FINGERPRINTS_OFFSET - 64  # a scratch int64 of symmetric memory (masked-off signals to far peers)
FP_ROW_BYTES = 32
FLAGS_BYTES = 64 * 1024  # flags and fingerprints
BLOCK_FLAGS_BYTES = 1 << 20  # the combine's per-block flags (normal mode)
NOTIFY_BYTES = 256 * 1024
LISTS_BYTES = 4 << 20
LL_MAX_TOPK = 32  # the size hint reserves combine slots for up to this many experts per token
# The count words lead each low-latency half at a place and size no call shape changes: a receiver
# takes a word whose epoch field is at least its call's as "the messages are there", so the words
# must never lie where another shape's messages were (bytes left there by an earlier call with
# fewer experts read as a count: 16-rank fuzz, H100 shared GPU, 2026-11-24).
LL_MAX_EXPERTS = 2048
LL_COUNT_BYTES = LL_MAX_EXPERTS * 8
LL_HEADER_BYTES = 16


def align(n: int) -> int:
    return align_up(n, ALIGN)


@dataclass(frozen=True)
class LowLatencyLayout:
    """Byte offsets (within one low-latency half) and sizes for one call shape."""

    x_bytes: int  # payload bytes of one message (H for FP8, 2H for BF16)
    scale_words: int  # 32-bit scale words per message (H/128, H/512 with UE8M0, 0 for BF16)
    msg_bytes: int
    counts: int
    recv: int
    combine: int
    stage: int  # 0 without staging


def ll_message_bytes(hidden: int, use_fp8: bool, use_ue8m0: bool) -> Tuple[int, int, int]:
    x_bytes = hidden if use_fp8 else hidden * 2
    scale_words = 0 if not use_fp8 else (hidden // 512 if use_ue8m0 else hidden // 128)
    msg_bytes = (LL_HEADER_BYTES + x_bytes + scale_words * 4 + 15) // 16 * 16
    return x_bytes, scale_words, msg_bytes


def ll_half_bytes(num_experts: int, max_tokens: int, hidden: int, num_topk: int, msg_bytes: int,
                  staging: bool = False) -> Tuple[int, int, int]:
    """(bytes one half needs, offset of the combine slots, offset of the staging area or 0) for
    this call shape. The staging area is as large as the receive slots: it holds M*K <= E*M
    messages, or E*M rows of 2H <= msg_bytes."""
    counts = align(LL_COUNT_BYTES)
    recv = align(num_experts * max_tokens * msg_bytes)
    combine = align(max_tokens * num_topk * hidden * 2)
    stage = recv if staging else 0
    return counts + recv + combine + stage, counts + recv, counts + recv + combine if staging else 0


def low_latency_bytes(max_tokens: int, hidden: int, num_ranks: int, num_experts: int) -> int:
    """``num_rdma_bytes`` low-latency mode needs (both halves; BF16-sized messages, so FP8 fits,
    combine slots for up to LL_MAX_TOPK experts per token, and the staging area for peers on other
    nodes — unused on one node, which keeps the same hint for both)."""
    _, _, msg_bytes = ll_message_bytes(hidden, False, False)
    half, _, _ = ll_half_bytes(num_experts, max_tokens, hidden, LL_MAX_TOPK, msg_bytes, staging=True)
    return 2 * (half + ALIGN)


class Workspace:
    """The layout over one symmetric allocation per rank; collective over ``group``.

    Args:
        memory: where the bytes are: ``(buffer, bases, barrier)`` — this rank's uint8 tensor of at
            least :meth:`size_for` bytes, ``[R]`` int64 device tensor of every rank's base where
            this GPU can store to it (0 where not), and a collective host barrier. Default:
            PyTorch symmetric memory on ``group`` (NVLink).
        normal: reserve normal mode's halves (False: low-latency only).
        staging: reserve low-latency staging for puts to other nodes (a multi-node backend).
    """

    def __init__(self, group: dist.ProcessGroup, device: torch.device, num_nvl_bytes: int, num_ll_bytes: int = 0,
                 memory=None, normal: bool = True, staging: bool = False, rank: int = None, num_ranks: int = None):
        self.rank = dist.get_rank(group) if rank is None else rank
        self.num_ranks = R = dist.get_world_size(group) if num_ranks is None else num_ranks
        max_ranks = min(SPARE_WORD // (8 * NUM_FLAG_SETS),
                        (FLAGS_BYTES - FINGERPRINTS_OFFSET) // (NUM_FP_SETS * 2 * FP_ROW_BYTES))
        if R > max_ranks:
            raise EPError(f"the nvlink workspace supports at most {max_ranks} ranks")
        self.staging = staging
        # normal-mode halves
        self.row_cap = NOTIFY_BYTES // (4 * R)
        self.list_cap = LISTS_BYTES // (4 * R)
        # The combine's per-block flags: [R pushers][block_flag_cap] int64 (no halves: epoch-tagged)
        self.block_flags_offset = FLAGS_BYTES
        self.block_flag_cap = BLOCK_FLAGS_BYTES // (8 * R) if normal else 0
        # Offsets are from the workspace base, for half 0; half h adds h * normal_half_bytes.
        self.normal_offset = FLAGS_BYTES + (BLOCK_FLAGS_BYTES if normal else 0)
        self.signal_bytes = self.normal_offset  # flags, fingerprints, block flags: zero before any signal
        self.counts_offset = self.normal_offset
        self.lists_offset = self.normal_offset + NOTIFY_BYTES
        self.payload_offset = self.normal_offset + NOTIFY_BYTES + LISTS_BYTES
        self.payload_bytes = align(max(num_nvl_bytes, 0) // 2)
        self.normal_half_bytes = NOTIFY_BYTES + LISTS_BYTES + self.payload_bytes if normal else 0
        # low-latency halves
        self.ll_offset = self.normal_offset + 2 * self.normal_half_bytes
        self.ll_half = (max(num_ll_bytes, 0) // 2 - ALIGN) // ALIGN * ALIGN if num_ll_bytes >= 4 * ALIGN else 0
        self.size = self.ll_offset + 2 * self.ll_half
        self._ll_layouts: Dict[Tuple, LowLatencyLayout] = {}

        if memory is None:
            memory = symmetric_memory(group, device, self.size)
        self._memory = memory  # keeps what the allocation needs alive (a rendezvous handle)
        buffer, self.bases, barrier = memory
        self.buffer = buffer[:self.size]
        self.local_base = self.buffer.data_ptr()
        self.spare_word = self.local_base + SPARE_WORD
        # Flags, fingerprints and low-latency count words start at zero everywhere before anyone
        # signals. Zero only once every rank's GPU work so far has finished: the memory may be
        # handed out again from a Buffer destroyed after an error, whose peers' last kernels (an
        # abort launched at their next call) may still write into it.
        if self.buffer.device.type == "cuda":
            torch.cuda.synchronize(self.buffer.device)
        barrier()
        self.buffer[:self.signal_bytes].zero_()
        if self.ll_half:
            self.buffer[self.ll_offset:].zero_()
        if self.buffer.device.type == "cuda":
            torch.cuda.synchronize(self.buffer.device)
        barrier()

    @staticmethod
    def size_for(num_ranks: int, num_nvl_bytes: int, num_ll_bytes: int, normal: bool = True) -> int:
        """Bytes of the allocation a workspace of these sizes carves (what ``memory`` must hold)."""
        normal_half = NOTIFY_BYTES + LISTS_BYTES + align(max(num_nvl_bytes, 0) // 2) if normal else 0
        ll_half = (max(num_ll_bytes, 0) // 2 - ALIGN) // ALIGN * ALIGN if num_ll_bytes >= 4 * ALIGN else 0
        return FLAGS_BYTES + (BLOCK_FLAGS_BYTES if normal else 0) + 2 * normal_half + 2 * ll_half

    def fingerprint_set(self, fp_set: int) -> int:
        """Bytes from a workspace base to fingerprint set ``fp_set`` (its half 0, row 0)."""
        return FINGERPRINTS_OFFSET + fp_set * 2 * self.num_ranks * FP_ROW_BYTES

    # ------------------------------------------------------------------ normal mode
    def dispatch_round_tokens(self, row_bytes: Tuple[int, ...]) -> Tuple[Tuple[int, ...], int]:
        """Offsets (within a half) of the staged parts of a token, and tokens per round."""
        per_token = sum(row_bytes)
        tokens = (self.payload_bytes - len(row_bytes) * ALIGN) // per_token if per_token else 0
        if tokens <= 0:
            raise EPInputError("x", f"the Buffer's num_nvl_bytes leaves {self.payload_bytes} bytes per half for staging, "
                          f"less than one token of {per_token} bytes: make the Buffer with a larger num_nvl_bytes "
                          f"(Config.get_nvl_buffer_size_hint(hidden_bytes, num_ranks) gives DeepEP's size)")
        offsets, offset = [], self.payload_offset
        for nbytes in row_bytes:
            offsets.append(offset)
            offset += align(tokens * nbytes)
        return tuple(offsets), tokens

    def combine_round_tokens(self, row_bytes: Tuple[int, ...]) -> Tuple[Tuple[int, ...], int]:
        """Offsets of the combine slots ([token][R] rows of each part) and tokens per round."""
        return self.dispatch_round_tokens(tuple(self.num_ranks * b for b in row_bytes))

    def check_notify(self, num_experts: int, num_tokens: int) -> None:
        if self.num_ranks + num_experts + 1 > self.row_cap:
            raise EPInputError("num_tokens_per_expert", f"too many experts for the notify area ({num_experts} > "
                                                        f"{self.row_cap - self.num_ranks - 1})")
        if num_tokens > self.list_cap:
            raise EPInputError("x", f"{num_tokens} tokens exceed the token-list capacity {self.list_cap} per rank")

    # ------------------------------------------------------------------ low-latency mode
    def ll_layout(self, num_experts: int, max_tokens: int, hidden: int, num_topk: int, use_fp8: bool,
                  use_ue8m0: bool) -> LowLatencyLayout:
        key = (num_experts, max_tokens, hidden, num_topk, use_fp8, use_ue8m0)
        layout = self._ll_layouts.get(key)
        if layout is None:
            if num_experts > LL_MAX_EXPERTS:
                raise EPInputError("num_experts", f"low-latency mode supports at most {LL_MAX_EXPERTS} experts, "
                                                  f"got {num_experts}")
            x_bytes, scale_words, msg_bytes = ll_message_bytes(hidden, use_fp8, use_ue8m0)
            # the dispatch part is sized for BF16 messages so both formats share one layout
            _, _, bf16_msg = ll_message_bytes(hidden, False, False)
            need, combine, stage = ll_half_bytes(num_experts, max_tokens, hidden, num_topk, bf16_msg, self.staging)
            if need > self.ll_half:
                raise EPInputError("num_max_dispatch_tokens_per_rank",
                                   f"low-latency mode needs num_rdma_bytes >= {2 * (need + ALIGN)} for M={max_tokens}, "
                                   f"H={hidden}, E={num_experts}, K={num_topk} (have {2 * (self.ll_half + ALIGN)})")
            layout = LowLatencyLayout(x_bytes, scale_words, msg_bytes, 0, align(LL_COUNT_BYTES), combine, stage)
            self._ll_layouts[key] = layout
        return layout

    def ll_half_offset(self, half: int) -> int:
        return self.ll_offset + half * self.ll_half

    def zero_signals(self) -> None:
        """Zero every flag, fingerprint row and low-latency count word (no kernel may run on any rank)."""
        self.buffer[:self.signal_bytes].zero_()
        self.reset_low_latency()

    def reset_low_latency(self) -> None:
        """Zero the low-latency count words (after all ranks stopped using them)."""
        if self.ll_half:
            self.buffer[self.ll_offset:].zero_()


def symmetric_memory(group: dist.ProcessGroup, device: torch.device, size: int):
    """PyTorch symmetric memory (its default backend) on ``group``: ``(buffer, bases, barrier)``."""
    import torch.distributed._symmetric_memory as symm_mem
    buffer = symm_mem.empty(size, dtype=torch.uint8, device=device)
    handle = symm_mem.rendezvous(buffer, group.group_name)
    bases = torch.tensor(list(handle.buffer_ptrs), dtype=torch.int64, device=device)
    return buffer, bases, lambda _handle=handle: dist.barrier(group=group)
