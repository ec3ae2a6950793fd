"""Low-latency mode (decode) on NVLink: two launches per call (or one), kernels beside their launches.

    low_latency_dispatch   ep_ll_dispatch   send messages + counts  ->  wait + pack
    low_latency_combine    ep_ll_combine    push rows + signal      ->  wait + reduce

Each call launches the send phase, then the receive phase (``return_recv_hook=True`` returns
after the first; ``hook()`` issues the second). With ``EPCOMM_LL_ONE_LAUNCH=1`` a call without a
hook runs both phases in one cooperative launch no larger than the GPU holds at once (launch.py):
all programs are resident, so the receive phase's spin cannot starve the send phase it waits for.

Dispatch: the programs take the tokens in turn; each casts its token (FP8 fused) and stores one
message per top-k expert (no dedup) into the receiver's fixed ``[E_local][R][M]`` slots — slot
from a per-expert atomic counter. The program arriving last publishes, for every expert,
``(epoch << 32) | messages`` into the count word of the expert's rank with a release; no separate
signal. The receive phase acquires the count words of its experts (a word carrying this call's
epoch means "all messages are there") and packs the rows of each (expert, source) into ``recv_x``
in source order.

Combine: the programs take the (local expert l, source s) pairs in turn and store the rows of l
that came from s into slot ``token * K + k`` of s's combine area; the last program releases the
epoch into every live peer's flag. The home acquires the flags and takes ``Σ_k w_k · slot(t, k)``
in float32.

Halves alternate per call kind (dispatch, combine), so at most two results may be held at once;
epochs live in device memory, so captured CUDA graphs replay correctly. A peer that does not
answer within the timeout is masked (``low_latency_query_mask_buffer`` shows it) and the call
completes without it. Ordering: see :mod:`.sync`.

Peers on other nodes (``REMOTE``, the nvshmem backend: nodes of ``ranks_per_node`` consecutive
ranks). A rank's stores reach only its own node; everything for a rank of another node is built
in this rank's staging area (workspace.py) and moved there by an NVSHMEM put
(nvshmem/device.py: ``send_bytes``). Each sending program completes its puts (``quiet``) before
it arrives, so the program arriving last has every put of the call delivered when it SETs the
count words / flags of the far peers with NVSHMEM signals — the same release step, over the
network. The receive phases read only their own memory and are unchanged.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ...errors import EPInputError
from ...handle import LowLatencyHandle
from . import agreement, sync
from .copy import for_word_copies, multiple, ptr_at, word_ptr
from .launch import KernelSpec, Specialisations, current_stream
from .workspace import FP_LL_COMBINE, FP_LL_DISPATCH, FP_ROW_BYTES
from .normal import p2
from ..nvshmem.device import NVSHMEM, complete_sends, send_bytes
from .reach import (FAR_BY_NVSHMEM, LOOPBACK_MODE, PEERS_BY_STORES, post_fingerprint_any, release_words,
                    same_node)
from .sync import (FP_ROW, arrive, check_fingerprints, fingerprint_half, fingerprints_settled, live_peers,
                   mailbox_words, poll_epochs_or_other_call, report_dropped, report_late, wait_peers)

# Messages the dispatch's receive phase packs per step.
LL_PULL_MESSAGES = 4

@dataclass
class LowLatencyState:
    """What the nvlink backend keeps in ``LowLatencyHandle.backend_state``."""

    slot_info: torch.Tensor  # [E_local, R*M] int32: home slot token * K + k of each packed row
    num_topk: int
    sequence: int = 0  # the dispatch's call number: the same on every rank (fingerprints)
    addresses: tuple = ()  # of the handle's recv_layout_range and of slot_info (the combine's launch arguments)
    owner: object = None  # the token of the LowLatencyMode that made it (its slots are in that workspace)


# ====================================================================== dispatch
@triton.jit
def _pack_words(values, N: tl.constexpr, PER_WORD: tl.constexpr):
    """[N] int8 (PER_WORD=8) or int16 (PER_WORD=4) → [N / PER_WORD] int64, little-endian: peer
    addresses come from a table, so byte-wide remote stores would cost 8x the instructions."""
    bits = 64 // PER_WORD
    lanes = tl.reshape(values.to(tl.int64) & ((1 << bits) - 1), (N // PER_WORD, PER_WORD))
    shifts = (tl.arange(0, PER_WORD) * bits).to(tl.int64)
    return tl.sum(lanes << shifts[None, :], axis=1)


@triton.jit
def _send_messages(t, j, x_ptr, topk_ptr, counter_ptr, mask_ptr, bases_ptr, mailbox_address,
                   hidden, num_topk, num_experts, num_local, max_tokens, num_ranks, rank, msg_bytes, x_words,
                   half_offset, recv_offset, stage_offset, ranks_per_node,
                   USE_FP8: tl.constexpr, ROUND_SCALE: tl.constexpr, UE8M0: tl.constexpr, BLOCK_H: tl.constexpr,
                   MSGS: tl.constexpr, REMOTE: tl.constexpr):
    """Cast token t once (FP8 per 128 channels, or BF16) and store the messages of its top-k
    entries [j * MSGS, (j + 1) * MSGS) — [t int32, k int32, 8 pad][e4m3 H bytes | bf16 2H][H/128 f32
    | H/512 UE8M0 int32 scales] — into slot (local expert, this rank, slot) of each expert's rank,
    as one tile of plain peer stores. The slot comes from the expert's counter. A message for
    another node (REMOTE) is stored into this rank's staging slot (t, k) instead and put to its
    slot there, one block-scoped put per message."""
    t64 = t.to(tl.int64)
    ks = j * MSGS + tl.arange(0, MSGS)
    in_k = ks < num_topk
    expert = tl.load(topk_ptr + t64 * num_topk + ks, mask=in_k, other=-1)
    dropped = tl.sum((in_k & ((expert < -1) | (expert >= num_experts))).to(tl.int32), axis=0)
    if dropped > 0:  # reported to the host; the entries are skipped
        report_dropped(mailbox_address, num_ranks, dropped)
    send = in_k & (expert >= 0) & (expert < num_experts)
    dst = tl.where(send, expert // num_local, 0)
    send &= tl.load(mask_ptr + dst, mask=send, other=1) == 0
    slot = tl.atomic_add(counter_ptr + expert, tl.zeros_like(ks) + 1, mask=send, sem="relaxed")
    slot = tl.minimum(slot, max_tokens - 1)  # distinct experts per token keep slot < M
    # bytes from a workspace base to each message's slot at its receiver
    slot_at = half_offset + recv_offset + (((expert % num_local) * num_ranks + rank) * max_tokens +
                                           slot).to(tl.int64) * msg_bytes
    near = same_node(dst, rank, ranks_per_node, REMOTE)
    msg = tl.load(bases_ptr + dst, mask=send & near, other=0) + slot_at
    if REMOTE:
        my_base = tl.load(bases_ptr + rank)
        msg = tl.where(near, msg, my_base + half_offset + stage_offset + (t64 * num_topk + ks) * msg_bytes)
    two = tl.arange(0, 2)
    tl.store(msg.to(tl.pointer_type(tl.int32))[:, None] + two[None, :],
             tl.where(two[None, :] == 0, t, ks[:, None]), mask=send[:, None])
    payload = word_ptr(msg + 16, True)
    cols = tl.arange(0, BLOCK_H)
    x = tl.load(x_ptr + t64 * hidden + cols, mask=cols < hidden, other=0.0).to(tl.float32)
    if USE_FP8:
        groups = tl.reshape(x, (BLOCK_H // 128, 128))
        amax = tl.maximum(tl.max(tl.abs(groups), axis=1), 1e-4)
        scale = tl.math.div_rn(amax, 448.0)
        if ROUND_SCALE:  # next power of two
            bits = scale.to(tl.int32, bitcast=True)
            exponent = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
            scale = (exponent << 23).to(tl.float32, bitcast=True)
        q = tl.math.div_rn(groups, scale[:, None])
        q = tl.reshape(tl.minimum(tl.maximum(q, -448.0), 448.0).to(tl.float8e4nv), (BLOCK_H,))
        words = tl.arange(0, BLOCK_H // 8)
        packed = _pack_words(q.to(tl.int8, bitcast=True), BLOCK_H, 8)
        tl.store(payload[:, None] + words[None, :], tl.broadcast_to(packed[None, :], (MSGS, BLOCK_H // 8)),
                 mask=send[:, None] & (words < x_words)[None, :])
        scale_words = (payload + x_words).to(tl.pointer_type(tl.int32), bitcast=True)
        if UE8M0:
            exps = tl.reshape((scale.to(tl.int32, bitcast=True) >> 23) & 0xFF, (BLOCK_H // 512, 4))
            packed_scales = tl.sum(exps << (tl.arange(0, 4) * 8)[None, :], axis=1)
            ids = tl.arange(0, BLOCK_H // 512)
            tl.store(scale_words[:, None] + ids[None, :],
                     tl.broadcast_to(packed_scales[None, :], (MSGS, BLOCK_H // 512)),
                     mask=send[:, None] & (ids < hidden // 512)[None, :])
        else:
            ids = tl.arange(0, BLOCK_H // 128)
            tl.store(scale_words.to(tl.pointer_type(tl.float32), bitcast=True)[:, None] + ids[None, :],
                     tl.broadcast_to(scale[None, :], (MSGS, BLOCK_H // 128)),
                     mask=send[:, None] & (ids < hidden // 128)[None, :])
    else:
        words = tl.arange(0, BLOCK_H // 4)
        packed = _pack_words(x.to(tl.bfloat16).to(tl.int16, bitcast=True), BLOCK_H, 4)
        tl.store(payload[:, None] + words[None, :], tl.broadcast_to(packed[None, :], (MSGS, BLOCK_H // 4)),
                 mask=send[:, None] & (words < x_words)[None, :])
    if REMOTE:
        tl.debug_barrier()  # every thread's staged stores precede the puts
        far = send & (near == 0)
        lanes = tl.arange(0, MSGS)
        for i in range(0, MSGS):
            if tl.sum((far & (lanes == i)).to(tl.int32), axis=0) > 0:
                pe = tl.sum(tl.where(lanes == i, dst, 0), axis=0)
                send_bytes(my_base + tl.sum(tl.where(lanes == i, slot_at, 0), axis=0),
                           tl.sum(tl.where(lanes == i, msg, 0), axis=0), msg_bytes, pe, bases_ptr, rank,
                           REMOTE == LOOPBACK_MODE)


@triton.jit
def _publish_counts(epoch, counter_ptr, mask_ptr, bases_ptr, state_ptr, num_experts, num_local, rank, half_offset,
                    counts_offset, half, ranks_per_node, spare_word, BLOCK_E: tl.constexpr, REMOTE: tl.constexpr):
    """Run by the program arriving last, so every message of this call, and the fingerprint, has
    been stored (acquired through the arrivals; puts completed before each arrival): RELEASE each
    expert's count, tagged with the epoch, to the expert's rank; reset the counters."""
    tl.store(state_ptr + sync.EPOCH_LL_DISPATCH, epoch)
    tl.store(state_ptr + sync.LL_DISPATCH_HALF_EPOCH + half, epoch)
    for start in range(0, num_experts, BLOCK_E):
        e = start + tl.arange(0, BLOCK_E)
        in_e = e < num_experts
        n = tl.load(counter_ptr + e, mask=in_e, other=0)
        # Small E leaves each element replicated over several threads: all of them must have
        # read the count before any resets it.
        tl.debug_barrier()
        tl.store(counter_ptr + e, tl.zeros_like(n), mask=in_e)
        dst = e // num_local
        live = in_e & (tl.load(mask_ptr + dst, mask=in_e, other=1) == 0)
        offsets = half_offset + counts_offset + ((rank * num_local + e % num_local) * 8).to(tl.int64)
        release_words(bases_ptr, offsets, dst, (epoch << 32) | n.to(tl.int64), live,
                      (state_ptr + sync.SPARE).to(tl.int64), rank, ranks_per_node, spare_word, REMOTE)


@triton.jit
def _pack_received(l, s, epoch, mask_ptr, out_x_ptr, out_scales_ptr, src_info_ptr, slot_info_ptr, layout_ptr,
                   recv_count_ptr, stats_ptr, wait_stats_ptr, bases_ptr, mailbox_address, half_offset, counts_offset,
                   recv_offset, num_local, num_ranks, rank, max_tokens, num_topk, msg_bytes, x_bytes, scale_words,
                   timeout_ns, fp_rows, fp0, fp1,
                   HAS_STATS: tl.constexpr, HAS_WAIT_STATS: tl.constexpr, BLOCK_X: tl.constexpr,
                   BLOCK_S: tl.constexpr, BLOCK_M: tl.constexpr, R_P2: tl.constexpr):
    """ACQUIRE the count words of local expert l from every live source (a word carrying this
    call's epoch means all its messages are stored here), then pack source s's messages for
    expert l — BLOCK_M at a time — into rows [offset, offset + n) of expert l, offset = messages
    of lower sources. A source that stays silent past the timeout is masked; one whose call
    differs (its fingerprint) sends nothing here, and the host raises (agreement.py)."""
    sources = tl.arange(0, R_P2)
    live = (sources < num_ranks) & (tl.load(mask_ptr + sources, mask=sources < num_ranks, other=1) == 0)
    my_base = tl.load(bases_ptr + rank)
    my_half = my_base + half_offset
    count_words = (my_half + counts_offset).to(tl.pointer_type(tl.int64)) + sources * num_local + l
    settled = fingerprints_settled(my_base + fp_rows, sources, live, fp0, fp1, epoch)
    # ACQUIRE; a source in another call (another expert count: its count words lie elsewhere)
    # ends its wait by its fingerprint row instead of the timeout
    sender_rows = (my_base + fp_rows).to(tl.pointer_type(tl.int64)) + sources * (FP_ROW // 8)
    words, waited, late = poll_epochs_or_other_call(count_words, live, epoch, timeout_ns, sender_rows, fp0, fp1,
                                                    EPOCH_SHIFT=32, CHECK_ROWS=True)
    report_late(late, sources, mask_ptr, mask_ptr, MASK_ON_TIMEOUT=True)
    if HAS_WAIT_STATS:
        if l == 0:
            tl.atomic_add(wait_stats_ptr + s, tl.sum(tl.where(sources == s, waited, 0), axis=0), sem="relaxed")
    _, _, agreement, _ = mailbox_words(mailbox_address, num_ranks)
    # Late sources too: one whose call differs may have sent its counts elsewhere (another E).
    differ = check_fingerprints(my_base + fp_rows, sources, live, settled, fp0, fp1, epoch, agreement, num_ranks)
    # At most M per source: duplicate experts in a token's top-k share the last slot (_send_messages).
    counts = tl.where(live & (late == 0) & (differ == 0), tl.minimum(words & 0xFFFFFFFF, max_tokens), 0).to(tl.int32)
    offset = tl.sum(tl.where(sources < s, counts, 0), axis=0)
    n = tl.sum(tl.where(sources == s, counts, 0), axis=0)
    tl.store(layout_ptr + l * num_ranks + s, (offset.to(tl.int64) << 32) | n.to(tl.int64))
    if s == num_ranks - 1:
        tl.store(recv_count_ptr + l, offset + n)
        if HAS_STATS:
            tl.atomic_add(stats_ptr + l, offset + n, sem="relaxed")
    slots_total = num_ranks * max_tokens
    first_msg = my_half + recv_offset + ((l * num_ranks + s) * max_tokens).to(tl.int64) * msg_bytes
    xcols = tl.arange(0, BLOCK_X)
    scols = tl.arange(0, BLOCK_S)
    two = tl.arange(0, 2)
    x_words = multiple(x_bytes // 8, 2, True)  # messages and recv_x rows are 16-byte aligned (copy.py)
    for i0 in range(0, n, BLOCK_M):
        i = i0 + tl.arange(0, BLOCK_M)
        has = i < n
        msg = first_msg + i.to(tl.int64) * msg_bytes
        rows = (l * slots_total + offset + i).to(tl.int64)
        header = tl.load(msg.to(tl.pointer_type(tl.int32))[:, None] + two[None, :], mask=has[:, None], other=0)
        token = tl.sum(tl.where(two[None, :] == 0, header, 0), axis=1)
        k = tl.sum(tl.where(two[None, :] == 1, header, 0), axis=1)
        tl.store(src_info_ptr + rows, token, mask=has)
        tl.store(slot_info_ptr + rows, token * num_topk + k, mask=has)
        words_in = word_ptr(msg + 16, True)
        words_out = out_x_ptr.to(tl.pointer_type(tl.int64), bitcast=True) + rows * x_words
        for c0 in range(0, x_words, BLOCK_X):
            c = c0 + xcols
            m = has[:, None] & (c < x_words)[None, :]
            tl.store(words_out[:, None] + c[None, :], tl.load(words_in[:, None] + c[None, :], mask=m), mask=m)
        if scale_words > 0:
            m = has[:, None] & (scols < scale_words)[None, :]
            scales = tl.load((msg + 16 + x_bytes).to(tl.pointer_type(tl.int32))[:, None] + scols[None, :], mask=m)
            dst = out_scales_ptr + (l * scale_words).to(tl.int64) * slots_total + \
                scols[None, :].to(tl.int64) * slots_total + (offset + i)[:, None]
            tl.store(dst, scales, mask=m)


@triton.jit
def ep_ll_dispatch(x_ptr,  # [T, H] bf16
                   topk_ptr,  # [T, K] int64 global expert ids (-1 = none)
                   counter_ptr,  # [E] int32 local, zero on entry: messages per expert (slot allocator)
                   mask_ptr,  # [R] int32: masked ranks receive nothing / are not waited for
                   bases_ptr,  # [R] int64: each rank's workspace
                   state_ptr,  # [16] int64 local (sync.py)
                   mailbox_address,  # host mailbox (sync.py)
                   out_x_ptr,  # [E_local, R*M, x_bytes] bytes of recv_x
                   out_scales_ptr,  # [E_local, scale_words, R*M] 32-bit words (column-major scales)
                   src_info_ptr, slot_info_ptr,  # [E_local, R*M] int32: source token; home slot t*K+k
                   layout_ptr,  # [E_local, R] int64: (offset << 32) | count
                   recv_count_ptr,  # [E_local] int32
                   stats_ptr,  # [E_local] int32 cumulative receive counts (HAS_STATS)
                   wait_stats_ptr,  # [R] int64 cumulative wait ns per source (HAS_WAIT_STATS)
                   num_tokens, hidden, num_topk, num_experts, num_local, max_tokens, num_ranks, rank,
                   msg_bytes, x_bytes, scale_words, half_offset, counts_offset, recv_offset, half, timeout_ns,
                   stage_offset, ranks_per_node, spare_word,  # (REMOTE only)
                   fp_offset, fp0, fp1,
                   SEND: tl.constexpr, RECEIVE: tl.constexpr, USE_FP8: tl.constexpr, ROUND_SCALE: tl.constexpr,
                   UE8M0: tl.constexpr, BLOCK_H: tl.constexpr, MSGS: tl.constexpr, BLOCK_E: tl.constexpr,
                   HAS_STATS: tl.constexpr, HAS_WAIT_STATS: tl.constexpr, BLOCK_X: tl.constexpr,
                   BLOCK_S: tl.constexpr, BLOCK_M: tl.constexpr, R_P2: tl.constexpr, ALIGNED: tl.constexpr,
                   REMOTE: tl.constexpr):
    # SEND: programs take the (token, message group) items in turn (_send_messages); the program
    # arriving last RELEASES the counts (_publish_counts). RECEIVE: programs take the (local
    # expert, source) pairs in turn and ACQUIRE before packing (_pack_received). Both in one
    # launch when no hook splits them: a cooperative grid the GPU holds at once, so every program
    # is resident and the receivers' spin cannot starve the senders they wait for.
    # hidden % 128 == 0 (host-checked) and messages are 16-byte aligned, so copies move 16 bytes
    # (copy.py); ALIGNED: x is 16-byte aligned too.
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    hidden = multiple(hidden, 128, True)
    fp_rows = fingerprint_half(fp_offset, half, num_ranks)  # this call's fingerprint rows
    if SEND:
        # Read before this program arrives, so before the last arriver stores epoch + 1.
        epoch = tl.load(state_ptr + sync.EPOCH_LL_DISPATCH) + 1
        if pid == 0:
            post_fingerprint_any(bases_ptr, fp_rows, rank, num_ranks, mask_ptr, fp0, fp1, epoch, ranks_per_node,
                                 spare_word, R_P2, REMOTE)
        groups = tl.cdiv(num_topk, MSGS)
        for item in range(pid, num_tokens * groups, num_programs):
            _send_messages(item // groups, item % groups, x_ptr, topk_ptr, counter_ptr, mask_ptr, bases_ptr,
                           mailbox_address, hidden, num_topk, num_experts, num_local, max_tokens, num_ranks, rank,
                           msg_bytes, multiple(x_bytes // 8, 2, True), half_offset, recv_offset, stage_offset,
                           ranks_per_node, USE_FP8, ROUND_SCALE, UE8M0, BLOCK_H, MSGS, REMOTE)
        if REMOTE:
            complete_sends(REMOTE == LOOPBACK_MODE)  # this program's puts land before it arrives
        if arrive(state_ptr + sync.ARRIVE_LL_SEND, num_programs):
            _publish_counts(epoch, counter_ptr, mask_ptr, bases_ptr, state_ptr, num_experts, num_local, rank,
                            half_offset, counts_offset, half, ranks_per_node, spare_word, BLOCK_E, REMOTE)
    else:
        # A hook's receive launch: the epoch its half was sent with (another dispatch may have
        # used the other half since).
        epoch = tl.load(state_ptr + sync.LL_DISPATCH_HALF_EPOCH + half)
    if RECEIVE:
        for item in range(pid, num_local * num_ranks, num_programs):
            _pack_received(item // num_ranks, item % num_ranks, epoch, mask_ptr, out_x_ptr, out_scales_ptr,
                           src_info_ptr, slot_info_ptr, layout_ptr, recv_count_ptr, stats_ptr, wait_stats_ptr,
                           bases_ptr, mailbox_address, half_offset, counts_offset, recv_offset, num_local, num_ranks,
                           rank, max_tokens, num_topk, msg_bytes, x_bytes, scale_words, timeout_ns, fp_rows, fp0, fp1,
                           HAS_STATS, HAS_WAIT_STATS, BLOCK_X, BLOCK_S, BLOCK_M, R_P2)


DISPATCH = KernelSpec(ep_ll_dispatch, ["*bf16", "*i64", "*i32", "*i32", "*i64", "*i64", "i64",
                                       "*i8", "*i32", "*i32", "*i32", "*i64", "*i32", "*i32", "*i64",
                                       "i32", "i32", "i32", "i32", "i32", "i32", "i32", "i32",
                                       "i32", "i32", "i32", "i64", "i64", "i64", "i32", "i64",
                                       "i64", "i32", "i64", "i64", "i64", "i64"],
                      aligned=["out_x_ptr"], aligned_if={"ALIGNED": ["x_ptr"]}, library=NVSHMEM,
                      library_if=("REMOTE", FAR_BY_NVSHMEM))


# ====================================================================== combine
@triton.jit
def _push_rows(l, s, x_ptr, layout_ptr, slot_info_ptr, mask_ptr, bases_ptr, num_ranks, rank, max_tokens, x_words,
               half_offset, combine_offset, stage_offset, ranks_per_node, BLOCK_W: tl.constexpr,
               REMOTE: tl.constexpr):
    """Store the rows of local expert l that came from source s into their slots in s's combine
    area (plain peer stores). The slots are free: s read them two combines ago (sync.py). For s
    on another node (REMOTE): copy the rows to this rank's staging rows, then one put per row."""
    if tl.load(mask_ptr + s) == 0:
        packed = tl.load(layout_ptr + l * num_ranks + s)
        offset = (packed >> 32).to(tl.int32)
        n = (packed & 0xFFFFFFFF).to(tl.int32)
        near = same_node(s, rank, ranks_per_node, REMOTE)
        row_bytes = (x_words * 8).to(tl.int64)
        first_row = (l * num_ranks * max_tokens + offset).to(tl.int64)
        my_base = tl.load(bases_ptr + rank)
        stage = my_base + half_offset + stage_offset + first_row * row_bytes  # (far s) rows staged in order
        home = tl.where(near, tl.load(bases_ptr + s) + half_offset + combine_offset, 0)
        cols = tl.arange(0, BLOCK_W)
        for i in range(0, n):
            row = first_row + i
            slot = tl.load(slot_info_ptr + row).to(tl.int64)
            src = x_ptr.to(tl.pointer_type(tl.int64), bitcast=True) + row * x_words
            dst = word_ptr(tl.where(near, home + slot * row_bytes, stage + i * row_bytes), True)
            for c0 in range(0, x_words, BLOCK_W):
                c = c0 + cols
                tl.store(dst + c, tl.load(src + c, mask=c < x_words), mask=c < x_words)
        if REMOTE:
            if near == 0:
                tl.debug_barrier()  # every thread's staged rows precede the puts
                for i in range(0, n):
                    slot = tl.load(slot_info_ptr + first_row + i).to(tl.int64)
                    send_bytes(my_base + half_offset + combine_offset + slot * row_bytes, stage + i * row_bytes,
                               row_bytes, s, bases_ptr, rank, REMOTE == LOOPBACK_MODE)


@triton.jit
def _reduce_tokens(pid, num_programs, topk_ptr, weights_ptr, mask_ptr, out_ptr, slots_address, num_tokens, hidden,
                   num_topk, num_local, num_ranks, K_P2: tl.constexpr, BLOCK_C: tl.constexpr):
    """out[t] = Σ_k w[t, k] · slot(t, k) in float32 over entries whose expert id is valid and
    whose rank is not masked, for this program's tokens."""
    slots = ptr_at(slots_address, tl.bfloat16, True)  # slots are 16-byte aligned, hidden % 128 == 0
    ks = tl.arange(0, K_P2)
    cols = tl.arange(0, BLOCK_C)
    num_experts = num_local * num_ranks
    for token in range(pid, num_tokens, num_programs):
        t64 = token.to(tl.int64)
        expert = tl.load(topk_ptr + t64 * num_topk + ks, mask=ks < num_topk, other=-1)
        present = (expert >= 0) & (expert < num_experts)
        present &= tl.load(mask_ptr + expert // num_local, mask=present, other=1) == 0
        weight = tl.load(weights_ptr + t64 * num_topk + ks, mask=present, other=0.0)
        slot = t64 * num_topk + ks
        for c0 in range(0, hidden, BLOCK_C):
            c = c0 + cols
            cm = c < hidden
            rows = tl.load(slots + slot[:, None] * hidden + c[None, :], mask=present[:, None] & cm[None, :], other=0.0)
            acc = tl.sum(rows.to(tl.float32) * weight[:, None], axis=0)
            tl.store(out_ptr + t64 * hidden + c, acc.to(tl.bfloat16), mask=cm)


@triton.jit
def ep_ll_combine(x_ptr,  # [E_local, R*M, H] bf16 expert outputs, dispatch's layout
                  layout_ptr,  # [E_local, R] int64 (offset << 32) | count
                  slot_info_ptr,  # [E_local, R*M] int32 home slot t*K+k
                  topk_ptr, weights_ptr,  # [T, K] int64 / float32, as given to dispatch
                  mask_ptr, bases_ptr, state_ptr,
                  out_ptr,  # [T, H] bf16
                  wait_stats_ptr,  # [R] int64 (HAS_WAIT_STATS)
                  my_flags_address,  # this rank's LL-combine flag set
                  slots_address,  # this rank's combine slots of this half: bf16 [M][K][H]
                  mailbox_address,  # host mailbox (sync.py)
                  num_tokens, hidden, num_topk, num_local, num_ranks, rank, max_tokens, x_words, half_offset,
                  combine_offset, half, timeout_ns,
                  stage_offset, ranks_per_node, spare_word,  # (REMOTE only)
                  fp_offset, fp0, fp1,
                  SEND: tl.constexpr, RECEIVE: tl.constexpr, HAS_WAIT_STATS: tl.constexpr, BLOCK_W: tl.constexpr,
                  K_P2: tl.constexpr, BLOCK_C: tl.constexpr, R_P2: tl.constexpr, ALIGNED: tl.constexpr,
                  REMOTE: tl.constexpr):
    # SEND: program 0 posts the call's fingerprint; programs take the (local expert, source) pairs
    # in turn (_push_rows); the program arriving last RELEASES the epoch into every live peer's
    # flag. RECEIVE: ACQUIRE every live peer's flag for this call, check the fingerprints (a
    # difference is recorded: the host raises), then reduce this program's tokens
    # (_reduce_tokens). One launch when no hook splits them (a cooperative grid, all resident:
    # see ep_ll_dispatch).
    # Rows are a multiple of 16 bytes (hidden % 128 == 0); ALIGNED: x and out are 16-byte aligned.
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    hidden = multiple(hidden, 128, True)
    fp_rows = fingerprint_half(fp_offset, half, num_ranks)  # this call's fingerprint rows
    if SEND:
        epoch = tl.load(state_ptr + sync.EPOCH_LL_COMBINE) + 1  # read before arriving (see ep_ll_dispatch)
        if pid == 0:
            post_fingerprint_any(bases_ptr, fp_rows, rank, num_ranks, mask_ptr, fp0, fp1, epoch, ranks_per_node,
                                 spare_word, R_P2, REMOTE)
        for item in range(pid, num_local * num_ranks, num_programs):
            _push_rows(item // num_ranks, item % num_ranks, x_ptr, layout_ptr, slot_info_ptr, mask_ptr, bases_ptr,
                       num_ranks, rank, max_tokens, multiple(x_words, 2, True), half_offset, combine_offset,
                       stage_offset, ranks_per_node, BLOCK_W, REMOTE)
        if REMOTE:
            complete_sends(REMOTE == LOOPBACK_MODE)  # this program's puts land before it arrives
        if arrive(state_ptr + sync.ARRIVE_LL_PUSH, num_programs):
            tl.store(state_ptr + sync.EPOCH_LL_COMBINE, epoch)
            tl.store(state_ptr + sync.LL_COMBINE_HALF_EPOCH + half, epoch)
            peers, live = live_peers(mask_ptr, num_ranks, HAS_MASK=True, R_P2=R_P2)
            release_words(bases_ptr, (sync.FLAGS_LL_COMBINE * num_ranks + rank) * 8 + tl.zeros([R_P2], tl.int64),
                          peers, tl.zeros([R_P2], tl.int64) + epoch, live, (state_ptr + sync.SPARE).to(tl.int64), rank,
                          ranks_per_node, spare_word, REMOTE)  # RELEASE: rows, fingerprint -> homes
    else:
        epoch = tl.load(state_ptr + sync.LL_COMBINE_HALF_EPOCH + half)  # a hook's receive launch
    if RECEIVE:
        peers, live = live_peers(mask_ptr, num_ranks, HAS_MASK=True, R_P2=R_P2)
        my_rows = tl.load(bases_ptr + rank) + fp_rows
        settled = fingerprints_settled(my_rows, peers, live, fp0, fp1, epoch)
        waited = wait_peers(my_flags_address.to(tl.pointer_type(tl.int64)), num_ranks, epoch, mask_ptr, mask_ptr,
                            timeout_ns, HAS_MASK=True, MASK_ON_TIMEOUT=True, R_P2=R_P2)  # ACQUIRE
        _, _, agreement, _ = mailbox_words(mailbox_address, num_ranks)
        # Recorded only: the reduction reads this rank's own slots, in bounds whatever a differing
        # peer pushed, and the host raises; skipping would cost a reduction on the critical path.
        check_fingerprints(my_rows, peers, live, settled, fp0, fp1, epoch, agreement, num_ranks)
        if HAS_WAIT_STATS:
            if pid == 0:
                peers = tl.arange(0, R_P2)
                tl.atomic_add(wait_stats_ptr + peers, waited, mask=peers < num_ranks, sem="relaxed")
        _reduce_tokens(pid, num_programs, topk_ptr, weights_ptr, mask_ptr, out_ptr, slots_address, num_tokens,
                       hidden, num_topk, num_local, num_ranks, K_P2, BLOCK_C)


COMBINE = KernelSpec(ep_ll_combine, ["*i8", "*i64", "*i32", "*i64", "*fp32", "*i32", "*i64", "*i64", "*bf16", "*i64",
                                     "i64", "i64", "i64", "i32", "i32", "i32", "i32", "i32", "i32", "i32", "i32",
                                     "i64", "i64", "i32", "i64", "i64", "i32", "i64", "i64", "i64", "i64"],
                     aligned_if={"ALIGNED": ["x_ptr", "out_ptr"]}, library=NVSHMEM,
                     library_if=("REMOTE", FAR_BY_NVSHMEM))


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
        num_sms: programs of the combine's receive phase (default: the GPU's SMs; the loopback
            tests keep it small so that every rank's programs fit on one GPU at once).
    """

    def __init__(self, ws, state: torch.Tensor, mailbox, timeout_ns: int, device: torch.device,
                 remote: int = PEERS_BY_STORES, ranks_per_node: int = 0, num_sms: int = 0):
        self.ws = ws
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
        # Messages per send item: all K of a token by default (one cast per token);
        # EPCOMM_LL_SEND_MESSAGES overrides it for measurements.
        self.messages_per_program = int(os.environ.get("EPCOMM_LL_SEND_MESSAGES", 0))
        # Calls without a hook run the two phases as two launches by default: measured on 2 x H200,
        # the round trip in a CUDA graph took 74-75 us that way against 79-80 us with both phases in
        # one cooperative launch (whose receive phase spins while other programs still send).
        # EPCOMM_LL_ONE_LAUNCH=1 picks the one launch (one launch less of host time per call).
        self.one_launch = os.environ.get("EPCOMM_LL_ONE_LAUNCH", "0") == "1"

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
        layout = self.ws.ll_layout(E, M, hidden, K, use_fp8, use_ue8m0)
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
                 layout.stage, *self.reach, self.fingerprints[0], *plan.fingerprint)
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
        num_local, slots, scale_words = handle.recv_src_info.shape[0], handle.recv_src_info.shape[1], layout.scale_words
        dev = self.device
        recv_x = torch.empty((num_local, slots, hidden), dtype=torch.float8_e4m3fn if args.use_fp8 else torch.bfloat16,
                             device=dev)
        # FP8 scales [E_local, R*M, S], column-major in the last two dims, as DeepEP returns them
        scales = torch.empty_strided((num_local, slots, scale_words), (scale_words * slots, 1, slots), device=dev,
                                     dtype=torch.int32 if args.use_ue8m0 else torch.float32) if args.use_fp8 else recv_x
        stats = args.cumulative_local_expert_recv_stats
        wait_stats = args.dispatch_wait_recv_cost_stats
        x_address = x.data_ptr()
        src_info, slot_info, recv_layout, recv_count = per_half.indices
        launch_args = (x_address, topk.data_ptr(), plan.counters_address, args.rank_mask.data_ptr(), self.bases,
                       self.state, self.mailbox_address, recv_x.data_ptr(), scales.data_ptr(), src_info, slot_info,
                       recv_layout, recv_count, recv_count if stats is None else stats.data_ptr(),
                       recv_layout if wait_stats is None else wait_stats.data_ptr(), num_tokens) + per_half.sizes
        send_items = num_tokens * plan.send_groups
        packed = (recv_x, scales) if args.use_fp8 else recv_x
        stream = current_stream(self.dev_index)
        if args.return_recv_hook or not self.one_launch:
            plan.kernels[True, False, False, False, x_address & 15 == 0].launch(max(send_items, 1), 1, stream,
                                                                                *launch_args)
            receive_kernel = plan.kernels[False, True, stats is not None, wait_stats is not None, False]
            if not args.return_recv_hook:
                receive_kernel.launch(num_local * self.R, 1, stream, *launch_args)
                return packed, per_half.recv_count, handle, None

            # The launch arguments are addresses: the hook holds the tensors they point into.
            def receive(_keep=(recv_x, scales, stats, wait_stats)) -> None:
                receive_kernel.launch(num_local * self.R, 1, current_stream(self.dev_index), *launch_args)
            return packed, per_half.recv_count, handle, receive
        kernel = plan.kernels[True, True, stats is not None, wait_stats is not None, x_address & 15 == 0]
        kernel.launch_resident(kernel.resident_grid(max(send_items, num_local * self.R)), stream, *launch_args)
        return packed, per_half.recv_count, handle, None

    def _combine_plan(self, E: int, M: int, hidden: int, K: int) -> CombinePlan:
        layout = self.ws.ll_layout(E, M, hidden, K, False, False)
        kernels = Specialisations(COMBINE, ["SEND", "RECEIVE", "HAS_WAIT_STATS", "ALIGNED"], 8,
                                  BLOCK_W=min(4096, p2(hidden // 4)), K_P2=p2(K),
                                  BLOCK_C=min(p2(hidden), max(8192 // p2(K), 16)), R_P2=self.R_P2,
                                  REMOTE=self.remote)
        per_half = []
        for half in (0, 1):
            half_offset = self.ws.ll_offset + half * self.ws.ll_half
            per_half.append(((self.flags, self.ws.local_base + half_offset + layout.combine, self.mailbox_address),
                             (hidden, K, E // self.R, self.R, self.rank, M, hidden // 4, half_offset, layout.combine,
                              half, self.timeout_ns, layout.stage, *self.reach, self.fingerprints[1])))
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
        out = args.out if args.out is not None else torch.empty((num_tokens, x.shape[2]), dtype=torch.bfloat16,
                                                                device=self.device)
        out_address = out.data_ptr()
        wait_stats = args.combine_wait_recv_cost_stats
        aligned = x_aligned and out_address & 15 == 0
        fp0, fp1 = plan.fingerprint
        fp1 |= (state.sequence & agreement.HANDLE_MASK) << agreement.HANDLE_SHIFT
        areas, sizes = plan.per_half[half]
        # Pointers as addresses (see _dispatch_half).
        launch_args = (x.data_ptr(), *state.addresses, topk.data_ptr(), args.topk_weights.data_ptr(),
                       args.rank_mask.data_ptr(), self.bases, self.state, out_address,
                       self.state if wait_stats is None else wait_stats.data_ptr(), *areas, num_tokens, *sizes, fp0,
                       fp1)
        pairs = x.shape[0] * self.R
        stream = current_stream(self.dev_index)
        if args.return_recv_hook or not self.one_launch:
            plan.kernels[True, False, False, aligned].launch(pairs, 1, stream, *launch_args)
            receive_kernel = plan.kernels[False, True, wait_stats is not None, aligned]
            receive_programs = max(1, min(num_tokens, self.num_sms))
            if not args.return_recv_hook:
                receive_kernel.launch(receive_programs, 1, stream, *launch_args)
                return out, None

            # The launch arguments are addresses: the hook holds the tensors they point into.
            def receive(_keep=(x, out, topk, args.topk_weights, wait_stats)) -> None:
                receive_kernel.launch(receive_programs, 1, current_stream(self.dev_index), *launch_args)
            return out, receive
        kernel = plan.kernels[True, True, wait_stats is not None, aligned]
        kernel.launch_resident(kernel.resident_grid(max(pairs, num_tokens)), stream, *launch_args)
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
        for fp_set in (FP_LL_DISPATCH, FP_LL_COMBINE):  # both halves' rows (the nvshmem backend's normal
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
