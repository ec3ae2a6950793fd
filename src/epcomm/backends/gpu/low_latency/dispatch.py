"""``ep_ll_dispatch``: the send phase (one message per (token, expert) into the receiver's fixed
slots, then the per-expert counts released) and the receive phase (acquire the counts, pack the
received messages per local expert); the package docstring has the protocol."""
from __future__ import annotations

import triton
import triton.language as tl

from .. import sync
from ..agreement import abort_covers, check_rows
from ..copy import multiple, word_ptr
from ..launch import KernelSpec
from ..reach.modes import (FAR_LIBRARY, far_complete, far_send_bytes, post_call_any, post_fingerprint_any,
                          release_words, same_node)
from ..sync import (FP_ROW, arrive, fingerprint_half, fingerprints_settled, mailbox_words, poll_epochs_or_other_call,
                    record_elsewhere, report_dropped, report_late)
from ..walk import peer_after

# Messages the dispatch's receive phase packs per step.
LL_PULL_MESSAGES = 4


# ====================================================================== dispatch
@triton.jit
def expert_after(walk, rank, num_local, num_ranks):
    """The expert at place ``walk`` of ``rank``'s walk over all experts: the experts of the rank
    after it first (:func:`peer_after`), each rank's in ascending order. A bijection of the
    experts, so a loop over ``walk`` still takes each expert once."""
    return peer_after(walk // num_local, rank, num_ranks) * num_local + walk % num_local


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
                far_send_bytes(my_base + tl.sum(tl.where(lanes == i, slot_at, 0), axis=0),
                           tl.sum(tl.where(lanes == i, msg, 0), axis=0), msg_bytes, pe, bases_ptr, rank,
                           REMOTE)


@triton.jit
def _publish_counts(epoch, counter_ptr, mask_ptr, bases_ptr, state_ptr, num_experts, num_local, rank, half_offset,
                    counts_offset, half, ranks_per_node, spare_word, BLOCK_E: tl.constexpr, REMOTE: tl.constexpr):
    """Run by the program arriving last, so every message of this call, and the fingerprint, has
    been stored (acquired through the arrivals; puts completed before each arrival): RELEASE each
    expert's count, tagged with the epoch, to the expert's rank; reset the counters. Experts go
    BLOCK_E at a time, from the first expert of the rank after this one (:func:`expert_after`): with
    more experts than BLOCK_E the ranks' last arrivers release to different ranks first, instead of
    all to rank 0 (whose receivers would start while rank R - 1's still wait)."""
    tl.store(state_ptr + sync.EPOCH_LL_DISPATCH, epoch)
    tl.store(state_ptr + sync.LL_DISPATCH_HALF_EPOCH + half, epoch)
    for start in range(0, num_experts, BLOCK_E):
        walk = start + tl.arange(0, BLOCK_E)  # place in this rank's walk; e: the expert there
        in_e = walk < num_experts
        e = expert_after(walk, rank, num_local, num_experts // num_local)
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
                   timeout_ns, shrink, fp_offset, half, fp0, fp1, board_address, call_tag,
                   HAS_STATS: tl.constexpr, HAS_WAIT_STATS: tl.constexpr, BLOCK_X: tl.constexpr,
                   BLOCK_S: tl.constexpr, BLOCK_M: tl.constexpr, R_P2: tl.constexpr):
    """ACQUIRE the count words of local expert l from every live source (a word carrying this
    call's epoch means all its messages are stored here), then pack source s's messages for
    expert l — BLOCK_M at a time — into rows [offset, offset + n) of expert l, offset = messages
    of lower sources. A source that stays silent past the timeout is masked (its rows are left
    out); without ``shrink`` (the Buffer's enable_shrink) it is also reported, and the host raises
    EPTimeoutError naming it at the next call. One whose call differs (its fingerprint), that the
    call board shows in another call, or whose count word is an abort's stamp covering this call
    (it rejected its input: agreement.ep_abort), sends nothing here, and the host raises
    (agreement.py)."""
    sources = tl.arange(0, R_P2)
    live = (sources < num_ranks) & (tl.load(mask_ptr + sources, mask=sources < num_ranks, other=1) == 0)
    my_base = tl.load(bases_ptr + rank)
    my_half = my_base + half_offset
    count_words = (my_half + counts_offset).to(tl.pointer_type(tl.int64)) + sources * num_local + l
    fp_rows = fingerprint_half(fp_offset, half, num_ranks)  # this call's fingerprint rows
    settled = fingerprints_settled(my_base + fp_rows, sources, live, fp0, fp1, epoch)
    # ACQUIRE; a source in another call ends its wait by its fingerprint row (another expert
    # count: its count words lie elsewhere) or by the call board (another Buffer's call, or a
    # call this rank skipped) instead of the timeout
    sender_rows = (my_base + fp_rows).to(tl.pointer_type(tl.int64)) + sources * (FP_ROW // 8)
    words, waited, late, elsewhere = poll_epochs_or_other_call(count_words, live, epoch, timeout_ns, sender_rows,
                                                               sender_rows, fp0, fp1, board_address, call_tag,
                                                               EPOCH_SHIFT=32, CHECK_ROWS=True, CHECK_BOARD=True)
    timeouts, _, agreement, _ = mailbox_words(mailbox_address, num_ranks)
    # Masked either way, so this call's combine neither pushes to nor waits for it (without shrink
    # its home then times out too, and its combine rows for this rank's experts are NaN there).
    report_late(late, sources, mask_ptr, mask_ptr, MASK_ON_TIMEOUT=True)
    if shrink == 0:  # no enable_shrink: a late rank is an error, not a smaller call
        report_late(late, sources, mask_ptr, timeouts, MASK_ON_TIMEOUT=False)
    if HAS_WAIT_STATS:
        if l == 0:
            tl.atomic_add(wait_stats_ptr + s, tl.sum(tl.where(sources == s, waited, 0), axis=0), sem="relaxed")
    # Late sources too: one whose call differs may have sent its counts elsewhere (another E). A
    # source's count word that an abort stamped (the ACQUIRE above read it) covers this call only
    # if the source never sent it: one that sent it and aborted its next call delivered this one.
    stamped = live & abort_covers(words >> 32, epoch)
    differ = check_rows(my_base + fp_offset, half, sources, live, settled, stamped, fp0, fp1, epoch, agreement,
                        num_ranks)
    differ |= elsewhere
    record_elsewhere(board_address, sources, elsewhere, call_tag, fp0, agreement, num_ranks)
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


# ep_ll_dispatch: one launch (SEND and RECEIVE, a cooperative grid), or two (a hook: SEND now,
# RECEIVE when the hook runs). Grid: programs striding over the items of each phase.
#
#   SEND   epoch = EPOCH_LL_DISPATCH + 1
#          program 0: post the call's fingerprint and board word on every live peer
#          for each (token t, group of MSGS top-k entries):                      (_send_messages)
#              cast x[t] once (FP8 per 128 channels, or BF16)
#              slot = atomic counter[e]++;  store message [t, k | x | scales] into
#              dst(e).half.recv[e_local, rank, slot]     (a peer store; another node: staged, then put)
#          (REMOTE: this program's puts complete before it arrives)
#          last to arrive:                                                       (_publish_counts)
#              RELEASE dst(e).half.counts[rank, e_local] = (epoch << 32) | counter[e];  counter[e] = 0
#   RECEIVE  (a hook's launch: the epoch its half was sent with)
#          for each (local expert l, source s):                                  (_pack_received)
#              ACQUIRE every live source's count word for l carrying epoch — or its fingerprint row
#              or board word shows another call (recorded, nothing packed), or the timeout (masked;
#              without shrink also reported: the host raises EPTimeoutError at the next call); a
#              word an abort stamped covering this call counts as a differing call (agreement.py)
#              recv_x[l, offset(s) + i] <- message i of s for l, i < count(s);  offset(s) = Σ_{s'<s} count
#              layout[l, s] = (offset << 32) | count;  recv_count[l] = Σ_s count   (by the last s)
@triton.jit
def ep_ll_dispatch(
                   # the call's tensors, the rank mask, the workspaces, this rank's state and mailbox
                   x_ptr: "*bf16",  # [T, H] bf16
                   topk_ptr: "*i64",  # [T, K] int64 global expert ids (-1 = none)
                   counter_ptr: "*i32",  # [E] int32 local, zero on entry: messages per expert (slot allocator)
                   mask_ptr: "*i32",  # [R] int32: masked ranks receive nothing / are not waited for
                   bases_ptr: "*i64",  # [R] int64: each rank's workspace
                   state_ptr: "*i64",  # [16] int64 local (sync.py)
                   mailbox_address: "i64",  # host mailbox (sync.py)
                   # the outputs: recv_x, its scales, the handle's arrays, the statistics
                   out_x_ptr: "*i8",  # [E_local, R*M, x_bytes] bytes of recv_x
                   out_scales_ptr: "*i32",  # [E_local, scale_words, R*M] 32-bit words (column-major scales)
                   src_info_ptr: "*i32", slot_info_ptr: "*i32",  # [E_local, R*M] int32: source token; home slot t*K+k
                   layout_ptr: "*i64",  # [E_local, R] int64: (offset << 32) | count
                   recv_count_ptr: "*i32",  # [E_local] int32
                   stats_ptr: "*i32",  # [E_local] int32 cumulative receive counts (HAS_STATS)
                   wait_stats_ptr: "*i64",  # [R] int64 cumulative wait ns per source (HAS_WAIT_STATS)
                   # sizes: of the call and of one message
                   num_tokens: "i32", hidden: "i32", num_topk: "i32", num_experts: "i32", num_local: "i32",
                   max_tokens: "i32", num_ranks: "i32", rank: "i32",
                   msg_bytes: "i32", x_bytes: "i32", scale_words: "i32",
                   # this call's half of the workspace, and the timeout of a wait
                   half_offset: "i64", counts_offset: "i64", recv_offset: "i64", half: "i32", timeout_ns: "i64",
                   shrink: "i32",  # 1: a late rank is masked (enable_shrink); 0: masked and reported
                   # peers on other nodes (REMOTE only: gpu/reach)
                   stage_offset: "i64", ranks_per_node: "i32", spare_word: "i64",
                   # the call's identity: its fingerprint, and its word on the call board (gpu/call_board.py)
                   fp_offset: "i64", fp0: "i64", fp1: "i64",
                   board_bases_ptr: "*i64",  # [R] int64: each rank's call board
                   call_tag: "i64",  # this call's number and Buffer on the board (0: not posted, not checked)
                   # meta-parameters
                   SEND: tl.constexpr, RECEIVE: tl.constexpr, USE_FP8: tl.constexpr, ROUND_SCALE: tl.constexpr,
                   UE8M0: tl.constexpr, BLOCK_H: tl.constexpr, MSGS: tl.constexpr, BLOCK_E: tl.constexpr,
                   HAS_STATS: tl.constexpr, HAS_WAIT_STATS: tl.constexpr, BLOCK_X: tl.constexpr,
                   BLOCK_S: tl.constexpr, BLOCK_M: tl.constexpr, R_P2: tl.constexpr, ALIGNED: tl.constexpr,
                   REMOTE: tl.constexpr):
    # One launch holds both phases only as a cooperative grid the GPU holds at once: every program
    # is resident, so the receivers' spin cannot starve the senders they wait for.
    # hidden % 128 == 0 (host-checked) and messages are 16-byte aligned, so copies move 16 bytes
    # (copy.py); ALIGNED: x is 16-byte aligned too.
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    hidden = multiple(hidden, 128, True)
    fp_rows = fingerprint_half(fp_offset, half, num_ranks)  # this call's fingerprint rows
    # -- SEND: messages to their experts' ranks, then the counts released by the last arrival
    if SEND:
        # Read before this program arrives, so before the last arriver stores epoch + 1.
        epoch = tl.load(state_ptr + sync.EPOCH_LL_DISPATCH) + 1
        if pid == 0:
            post_fingerprint_any(bases_ptr, fp_rows, rank, num_ranks, mask_ptr, fp0, fp1, epoch, ranks_per_node,
                                 spare_word, R_P2, REMOTE)
            post_call_any(board_bases_ptr, rank, num_ranks, call_tag, fp0, ranks_per_node, R_P2, REMOTE)
        groups = tl.cdiv(num_topk, MSGS)
        for item in range(pid, num_tokens * groups, num_programs):
            _send_messages(item // groups, item % groups, x_ptr, topk_ptr, counter_ptr, mask_ptr, bases_ptr,
                           mailbox_address, hidden, num_topk, num_experts, num_local, max_tokens, num_ranks, rank,
                           msg_bytes, multiple(x_bytes // 8, 2, True), half_offset, recv_offset, stage_offset,
                           ranks_per_node, USE_FP8, ROUND_SCALE, UE8M0, BLOCK_H, MSGS, REMOTE)
        if REMOTE:
            far_complete(REMOTE)  # this program's puts land before it arrives
        if arrive(state_ptr + sync.ARRIVE_LL_SEND, num_programs):
            _publish_counts(epoch, counter_ptr, mask_ptr, bases_ptr, state_ptr, num_experts, num_local, rank,
                            half_offset, counts_offset, half, ranks_per_node, spare_word, BLOCK_E, REMOTE)
    else:
        # A hook's receive launch: the epoch its half was sent with (another dispatch may have
        # used the other half since).
        epoch = tl.load(state_ptr + sync.LL_DISPATCH_HALF_EPOCH + half)
    # -- RECEIVE: acquire each local expert's counts, pack its messages source by source
    if RECEIVE:
        for item in range(pid, num_local * num_ranks, num_programs):
            _pack_received(item // num_ranks, item % num_ranks, epoch, mask_ptr, out_x_ptr, out_scales_ptr,
                           src_info_ptr, slot_info_ptr, layout_ptr, recv_count_ptr, stats_ptr, wait_stats_ptr,
                           bases_ptr, mailbox_address, half_offset, counts_offset, recv_offset, num_local, num_ranks,
                           rank, max_tokens, num_topk, msg_bytes, x_bytes, scale_words, timeout_ns, shrink, fp_offset,
                           half, fp0, fp1,
                           tl.load(board_bases_ptr + rank), call_tag, HAS_STATS, HAS_WAIT_STATS, BLOCK_X, BLOCK_S,
                           BLOCK_M, R_P2)


DISPATCH = KernelSpec(ep_ll_dispatch, aligned=["out_x_ptr"], aligned_if={"ALIGNED": ["x_ptr"]}, **FAR_LIBRARY)
