"""Triton kernels of the NVLink backend.

Three kernels, each parametrised rather than copied per use:

- ``barrier_kernel``: a bounded, graph-safe barrier among the ranks (optionally first copying a
  small row of counts into every peer — the "notify" step).
- ``copy_rows_kernel``: moves rows between local memory and peers' symmetric memory. Either side
  may be "indexed" (address = a per-rank base from a table + row index · stride) or "linear" (row
  ``r`` of a local tensor). Dispatch pulls (indexed source, linear destination); combine pushes
  (linear source, indexed destination).
- ``recv_index_kernel``: for each received row, its source rank and source token (dispatch).
- ``reduce_slots_kernel``: the home rank's float32 sum over the per-rank slots of each token.

Addresses of peers' memory are plain int64 byte addresses (``buffer_ptrs`` of symmetric memory)
turned into typed pointers inside the kernels.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _now_ns():
    # %globaltimer: a nanosecond clock shared by all SMs, used only to bound waits.
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def barrier_kernel(flag_bases_ptr,  # [R] int64: address of each rank's int64 flag array [R]
                   sent_ptr,  # [R] int64, local: barriers this rank has signalled to each peer
                   error_ptr,  # [R] int32, local: set to 1 when a wait for that peer timed out
                   mask_ptr,  # [R] int32, local: masked peers are skipped; a timeout masks the peer
                   count_row_ptr,  # [row_len] int32, local: counts to publish (notify), if ROW_LEN > 0
                   count_bases_ptr,  # [R] int64: address of each rank's count matrix [R, row_len]
                   row_len, rank, timeout_ns,
                   ROW_LEN: tl.constexpr, SIGNAL: tl.constexpr, WAIT: tl.constexpr,
                   MASK_ON_TIMEOUT: tl.constexpr, BLOCK: tl.constexpr):
    # One program per peer p. SIGNAL: optionally write this rank's count row into p's count matrix
    # at row `rank`, then release-store the epoch into p's flag[rank]. WAIT: acquire-poll own
    # flag[p] until p has signalled the same epoch. A barrier is SIGNAL+WAIT; low-latency hooks
    # split them across two launches (the epoch counter is only advanced by SIGNAL).
    peer = tl.program_id(0)
    if tl.load(mask_ptr + peer) != 0:
        return
    if SIGNAL:
        if ROW_LEN > 0:
            dst = tl.load(count_bases_ptr + peer).to(tl.pointer_type(tl.int32)) + rank * row_len
            for start in range(0, row_len, BLOCK):
                offs = start + tl.arange(0, BLOCK)
                tl.store(dst + offs, tl.load(count_row_ptr + offs, mask=offs < row_len), mask=offs < row_len)
            # All threads' row stores happen-before the single-thread release below (CTA barrier,
            # then the release is cumulative).
            tl.debug_barrier()
        # Epoch = barriers so far, counted per peer in device memory (graph-replay safe).
        epoch = tl.load(sent_ptr + peer) + 1
        tl.store(sent_ptr + peer, epoch)
        # RELEASE (sys scope): the count row above, and every store of earlier kernels on this
        # stream (staged payload, pushed rows), become visible to peer p before it sees the epoch.
        peer_flags = tl.load(flag_bases_ptr + peer).to(tl.pointer_type(tl.int64))
        tl.atomic_xchg(peer_flags + rank, epoch, sem="release", scope="sys")
    if WAIT:
        epoch = tl.load(sent_ptr + peer)
        # ACQUIRE (sys scope), pairs with peer p's release: afterwards p's writes are visible.
        my_flags = tl.load(flag_bases_ptr + rank).to(tl.pointer_type(tl.int64))
        deadline = _now_ns() + timeout_ns
        # A peer may already be one barrier ahead, hence >= rather than ==.
        seen = tl.atomic_add(my_flags + peer, 0, sem="acquire", scope="sys")
        while (seen < epoch) & (_now_ns() < deadline):
            seen = tl.atomic_add(my_flags + peer, 0, sem="acquire", scope="sys")
        if seen < epoch:
            tl.store(error_ptr + peer, 1)
            if MASK_ON_TIMEOUT:
                tl.store(mask_ptr + peer, 1)


@triton.jit
def copy_rows_kernel(src_ptr, src_rank_ptr, src_row_ptr, src_stride,
                     dst_ptr, dst_rank_ptr, dst_row_ptr, dst_stride,
                     num_rows_ptr, max_rows, row_words, filter_lo, filter_hi,
                     WORD: tl.constexpr, WORD_TY: tl.constexpr, SRC_INDEXED: tl.constexpr,
                     DST_INDEXED: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    # Row r (r < *num_rows) moves from src to dst. An indexed side's ``ptr`` is a table of int64
    # byte addresses, one per rank: row r lives at table[rank[r]] + (row[r] - filter_lo) * stride,
    # and only rows with row[r] in [filter_lo, filter_hi) move (one round of a batch larger than
    # the buffer). A linear side's ``ptr`` is the tensor itself and row r lives at r * stride.
    # Strides and row_words count WORD-byte words; WORD_TY is the integer type of that size.
    # No ordering is done here: the caller's barriers bracket the kernel.
    num_rows = tl.load(num_rows_ptr)
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_C)
    # The loop stops at the device-side row count: no work for rows that cannot exist.
    for block in range(pid, tl.cdiv(tl.minimum(num_rows, max_rows), BLOCK_R), num_programs):
        rows = block * BLOCK_R + tl.arange(0, BLOCK_R)
        live = rows < num_rows
        if SRC_INDEXED:
            src_row = tl.load(src_row_ptr + rows, mask=live, other=-1).to(tl.int64)
            live &= (src_row >= filter_lo) & (src_row < filter_hi)
            src_base = tl.load(src_ptr + tl.load(src_rank_ptr + rows, mask=live, other=0), mask=live, other=0)
            src = (src_base + (src_row - filter_lo) * src_stride * WORD).to(tl.pointer_type(WORD_TY))
        else:
            src = src_ptr.to(tl.pointer_type(WORD_TY)) + rows.to(tl.int64) * src_stride
        if DST_INDEXED:
            dst_row = tl.load(dst_row_ptr + rows, mask=live, other=-1).to(tl.int64)
            live &= (dst_row >= filter_lo) & (dst_row < filter_hi)
            dst_base = tl.load(dst_ptr + tl.load(dst_rank_ptr + rows, mask=live, other=0), mask=live, other=0)
            dst = (dst_base + (dst_row - filter_lo) * dst_stride * WORD).to(tl.pointer_type(WORD_TY))
        else:
            dst = dst_ptr.to(tl.pointer_type(WORD_TY)) + rows.to(tl.int64) * dst_stride
        for start in range(0, row_words, BLOCK_C):
            c = start + cols
            mask = live[:, None] & (c < row_words)[None, :]
            values = tl.load(src[:, None] + c[None, :], mask=mask)
            tl.store(dst[:, None] + c[None, :], values, mask=mask)


@triton.jit
def recv_index_kernel(ends_ptr,  # [R] int32: end row of each source's rows in recv_x
                      list_bases_ptr,  # [R] int64: address of each source's token list for this rank
                      src_rank_out, src_idx_out,  # [max_rows] int32 each
                      max_rows, num_ranks, BLOCK: tl.constexpr):
    # For each received row: its source rank (rows are grouped by source in rank order) and the
    # token index on that source, read from the source's token list (remote load; the staging
    # barrier before this kernel acquired the list). Rows past the total get -1.
    total = tl.load(ends_ptr + num_ranks - 1)
    if tl.program_id(0) * BLOCK >= total:
        return  # the grid covers the capacity; only the first `total` rows exist
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_range = rows < max_rows
    src = tl.zeros([BLOCK], dtype=tl.int32)
    for i in range(0, num_ranks):
        src += (tl.load(ends_ptr + i) <= rows).to(tl.int32)
    live = rows < total
    src = tl.minimum(src, num_ranks - 1)
    start = tl.load(ends_ptr + src - 1, mask=live & (src > 0), other=0)
    base = tl.load(list_bases_ptr + src, mask=live, other=0)
    token = tl.load((base + (rows - start).to(tl.int64) * 4).to(tl.pointer_type(tl.int32)), mask=live, other=-1)
    tl.store(src_rank_out + rows, src, mask=in_range)
    tl.store(src_idx_out + rows, token, mask=in_range)


@triton.jit
def reduce_slots_kernel(slots_ptr,  # [chunk tokens, S, width]: slot rows written by the peers
                        presence_ptr,  # [T, S] uint8 (normal mode) or [T, S] int64 expert ids (WEIGHTED)
                        weights_ptr, mask_ptr,  # WEIGHTED only: [T, S] float32 weights, [R] int32 rank mask
                        out_ptr,  # [T, width]
                        bias0_ptr, bias1_ptr,  # [T, width] or unused
                        token_lo, token_hi, width, num_slots, num_local_experts,
                        NUM_BIAS: tl.constexpr, WEIGHTED: tl.constexpr, S_P2: tl.constexpr,
                        BLOCK_C: tl.constexpr):
    # out[t] = Σ_s w[t, s] · slots[t, s] in float32 (+ biases), over the slots that hold data.
    # Normal mode: slot s = rank s, present where is_token_in_rank, w = 1. Low-latency mode
    # (WEIGHTED): slot s = top-k entry s, present where its expert id >= 0 and the expert's rank is
    # not masked, w = topk_weights. All S slot rows of a column block load at once. Reads only
    # local memory; the barrier before this kernel acquired the pushers' stores.
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_C)
    slot_ids = tl.arange(0, S_P2)
    in_slots = slot_ids < num_slots
    for token in range(token_lo + pid, token_hi, num_programs):
        t64 = token.to(tl.int64)
        if WEIGHTED:
            expert = tl.load(presence_ptr + t64 * num_slots + slot_ids, mask=in_slots, other=-1)
            present = expert >= 0
            masked = tl.load(mask_ptr + expert // num_local_experts, mask=present, other=1) != 0
            present = present & (masked == 0)
            weight = tl.load(weights_ptr + t64 * num_slots + slot_ids, mask=present, other=0.0)
        else:
            present = tl.load(presence_ptr + t64 * num_slots + slot_ids, mask=in_slots, other=0) != 0
        slot_rows = (t64 - token_lo) * num_slots + slot_ids
        for start in range(0, width, BLOCK_C):
            c = start + cols
            cmask = c < width
            values = tl.load(slots_ptr + slot_rows[:, None] * width + c[None, :],
                             mask=present[:, None] & cmask[None, :], other=0.0).to(tl.float32)
            if WEIGHTED:
                values = values * weight[:, None]
            acc = tl.sum(values, axis=0)
            if NUM_BIAS >= 1:
                acc += tl.load(bias0_ptr + t64 * width + c, mask=cmask, other=0.0).to(tl.float32)
            if NUM_BIAS >= 2:
                acc += tl.load(bias1_ptr + t64 * width + c, mask=cmask, other=0.0).to(tl.float32)
            tl.store(out_ptr + t64 * width + c, acc.to(out_ptr.dtype.element_ty), mask=cmask)


@triton.jit
def token_lists_kernel(in_rank_ptr,  # [T, R] uint8: token t goes to rank j
                       lists_ptr,  # [R, list_cap] int32, local: ascending tokens sent to each rank
                       num_tokens, num_ranks, list_cap, BLOCK: tl.constexpr):
    # Program j writes the ascending list of tokens sent to rank j (a running prefix sum over
    # token blocks). Local writes only; the staging barrier publishes them to the peers.
    dest = tl.program_id(0)
    running = 0
    for start in range(0, num_tokens, BLOCK):
        tokens = start + tl.arange(0, BLOCK)
        member = tl.load(in_rank_ptr + tokens.to(tl.int64) * num_ranks + dest, mask=tokens < num_tokens, other=0) != 0
        member_i = member.to(tl.int32)
        position = running + tl.cumsum(member_i, axis=0) - 1
        tl.store(lists_ptr + dest.to(tl.int64) * list_cap + position, tokens, mask=member)
        running += tl.sum(member_i, axis=0)


@triton.jit
def localize_topk_kernel(packed_ptr,  # [N, row_bytes] uint8: K int64 global ids, then K float32 weights
                         topk_out, weights_out,  # [N, K] int64 / float32
                         num_rows_ptr, max_rows, num_topk, row_bytes, expert_lo, num_local, BLOCK: tl.constexpr):
    # Ids of experts on this rank become local ids; all others, and padding rows, become -1 with
    # weight 0. Local memory only.
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_range = offs < max_rows * num_topk
    live = offs < tl.load(num_rows_ptr) * num_topk
    row = (offs // num_topk).to(tl.int64)
    k = offs % num_topk
    id_ptr = (packed_ptr + row * row_bytes + k * 8).to(tl.pointer_type(tl.int64), bitcast=True)
    weight_ptr = (packed_ptr + row * row_bytes + num_topk * 8 + k * 4).to(tl.pointer_type(tl.float32), bitcast=True)
    expert = tl.load(id_ptr, mask=in_range & live, other=-1)
    local = expert - expert_lo
    mine = live & (expert >= 0) & (local >= 0) & (local < num_local)
    tl.store(topk_out + offs, tl.where(mine, local, -1), mask=in_range)
    weight = tl.load(weight_ptr, mask=in_range & mine, other=0.0)
    tl.store(weights_out + offs, tl.where(mine, weight, 0.0), mask=in_range)


# ---------------------------------------------------------------------- low-latency mode
@triton.jit
def _pack_words(values, N: tl.constexpr, PER_WORD: tl.constexpr):
    """[N] int8 (PER_WORD=8) or int16 (PER_WORD=4) → [N / PER_WORD] int64, little-endian."""
    bits = 64 // PER_WORD
    lanes = tl.reshape(values.to(tl.int64) & ((1 << bits) - 1), (N // PER_WORD, PER_WORD))
    shifts = (tl.arange(0, PER_WORD) * bits).to(tl.int64)
    return tl.sum(lanes << shifts[None, :], axis=1)


@triton.jit
def ll_send_kernel(x_ptr,  # [T, H] bf16
                   topk_ptr,  # [T, K] int64 global expert ids
                   counter_ptr,  # [E] int32, local, zero on entry: messages sent per expert (slot allocator)
                   mask_ptr,  # [R] int32: masked ranks are not sent to
                   recv_bases_ptr,  # [R] int64: each rank's receive area of this half, [E_local][R][M] messages
                   hidden, num_topk, num_local, max_tokens, num_ranks, rank, msg_bytes, x_bytes,
                   USE_FP8: tl.constexpr, ROUND_SCALE: tl.constexpr, UE8M0: tl.constexpr,
                   BLOCK_H: tl.constexpr):
    # Program (t, k) sends token t to its k-th expert (no dedup); each program casts the row to FP8
    # itself (cheap arithmetic on an L2-resident row) so all T*K messages go out in parallel.
    # Message: [t int32, k int32, 8 pad][payload: e4m3 H bytes or bf16 2H][scales: H/128 f32 or
    # H/512 packed UE8M0 int32]. Slot = atomic counter per expert, so the receiver's region for
    # (expert, this rank) fills densely. Only plain stores to peers here: the signal kernel that
    # follows on the stream publishes the counts with a release.
    t = tl.program_id(0)
    k = tl.program_id(1)
    t64 = t.to(tl.int64)
    expert = tl.load(topk_ptr + t64 * num_topk + k)
    if expert < 0:
        return
    dst = (expert // num_local).to(tl.int32)
    if tl.load(mask_ptr + dst) != 0:
        return
    cols = tl.arange(0, BLOCK_H)
    in_h = cols < hidden
    x = tl.load(x_ptr + t64 * hidden + cols, mask=in_h, other=0.0).to(tl.float32)
    if USE_FP8:
        groups = tl.reshape(x, (BLOCK_H // 128, 128))
        amax = tl.maximum(tl.max(tl.abs(groups), axis=1), 1e-4)
        scale = tl.math.div_rn(amax, 448.0)
        if ROUND_SCALE:
            bits = scale.to(tl.int32, bitcast=True)
            exponent = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
            scale = (exponent << 23).to(tl.float32, bitcast=True)
        q = tl.math.div_rn(groups, scale[:, None])
        q = tl.minimum(tl.maximum(q, -448.0), 448.0).to(tl.float8e4nv)
        q = tl.reshape(q, (BLOCK_H,))
        group_ids = tl.arange(0, BLOCK_H // 128)
        if UE8M0:
            exps = tl.reshape((scale.to(tl.int32, bitcast=True) >> 23) & 0xFF, (BLOCK_H // 512, 4))
            shifts = tl.arange(0, 4) * 8
            packed = tl.sum(exps << shifts[None, :], axis=1)
            packed_ids = tl.arange(0, BLOCK_H // 512)
    slot = tl.atomic_add(counter_ptr + expert, 1, sem="relaxed")
    # (slot < M always holds for distinct experts per token; the guard keeps a malformed routing
    # from writing past the region)
    slot = tl.minimum(slot, max_tokens - 1)
    local = expert % num_local
    msg = tl.load(recv_bases_ptr + dst) + ((local * num_ranks + rank) * max_tokens + slot) * msg_bytes
    header = tl.where(tl.arange(0, 2) == 0, t, k)
    tl.store(msg.to(tl.pointer_type(tl.int32)) + tl.arange(0, 2), header)
    payload = msg + 16
    # Payload leaves as 8-byte words: the peer address comes from a table, so the compiler cannot
    # prove wider alignment, and byte-wide remote stores would cost 8x the instructions.
    words = tl.arange(0, BLOCK_H // 8)
    if USE_FP8:
        tl.store(payload.to(tl.pointer_type(tl.int64)) + words, _pack_words(q.to(tl.int8, bitcast=True), BLOCK_H, 8),
                 mask=words < x_bytes // 8)
        if UE8M0:
            tl.store((payload + x_bytes).to(tl.pointer_type(tl.int32)) + packed_ids, packed,
                     mask=packed_ids < hidden // 512)
        else:
            tl.store((payload + x_bytes).to(tl.pointer_type(tl.float32)) + group_ids, scale,
                     mask=group_ids < hidden // 128)
    else:
        halves = x.to(tl.bfloat16).to(tl.int16, bitcast=True)
        words4 = tl.arange(0, BLOCK_H // 4)
        tl.store(payload.to(tl.pointer_type(tl.int64)) + words4, _pack_words(halves, BLOCK_H, 4),
                 mask=words4 < x_bytes // 8)


@triton.jit
def ll_pack_kernel(counts_ptr,  # [R, E] int32, local: row s = messages source s sent to each expert
                   counter_ptr,  # [E] int32, local: this rank's send counters, zeroed here for the next call
                   mask_ptr,  # [R] int32
                   region_ptr,  # uint8*, local receive area of this half: [E_local][R][M] messages
                   out_x_ptr,  # [E_local, R*M, x_bytes] uint8 view of recv_x
                   out_scales_ptr,  # [E_local, scale_words, R*M] 32-bit words (column-major scales)
                   src_info_ptr,  # [E_local, R*M] int32: source token of each packed row
                   push_total_ptr,  # [1] int32, zero on entry: rows listed for the combine's pushes
                   push_row_ptr, push_rank_ptr, push_slot_ptr,  # [E_local*R*M] int32: flat row, home, token*K+k
                   layout_ptr,  # [E_local, R] int64
                   recv_count_ptr,  # [E_local] int32
                   stats_ptr,  # [E_local] int32 cumulative counts, if HAS_STATS
                   num_experts, num_local, num_ranks, rank, max_tokens, num_topk, msg_bytes, x_bytes,
                   scale_words, HAS_STATS: tl.constexpr, BLOCK_X: tl.constexpr, BLOCK_S: tl.constexpr):
    # Program (l, s) packs the messages source s sent to local expert l into rows
    # [offset, offset + n) of expert l, offset = messages of sources < s. The counts were acquired
    # by the wait before this kernel (sources' releases), so reading them and the messages is safe.
    l = tl.program_id(0)
    s = tl.program_id(1)
    expert = rank * num_local + l
    offset = 0
    for src in range(0, num_ranks):
        n_src = tl.where(tl.load(mask_ptr + src) != 0, 0, tl.load(counts_ptr + src * num_experts + expert))
        offset += tl.where(src < s, n_src, 0)
    n = tl.where(tl.load(mask_ptr + s) != 0, 0, tl.load(counts_ptr + s * num_experts + expert))
    row0 = offset
    # The signal kernel already published this rank's send counters: reset one entry per program
    # (the (l, s) grid covers all E) for the next call on this half.
    tl.store(counter_ptr + s * num_local + l, 0)
    tl.store(layout_ptr + l * num_ranks + s, (row0.to(tl.int64) << 32) | n.to(tl.int64))
    if s == num_ranks - 1:
        total = offset + n
        tl.store(recv_count_ptr + l, total)
        if HAS_STATS:
            tl.atomic_add(stats_ptr + l, total, sem="relaxed")
    slots_total = num_ranks * max_tokens
    # Reserve n entries of the compact list the combine walks (only rows that exist).
    listed = tl.atomic_add(push_total_ptr, n, sem="relaxed")
    xcols = tl.arange(0, BLOCK_X)
    scols = tl.arange(0, BLOCK_S)
    for i in range(0, n):
        msg = region_ptr + ((l * num_ranks + s) * max_tokens + i).to(tl.int64) * msg_bytes
        row = (l * slots_total + row0 + i).to(tl.int64)
        header = tl.load(msg.to(tl.pointer_type(tl.int32), bitcast=True) + tl.arange(0, 2))
        token = tl.sum(tl.where(tl.arange(0, 2) == 0, header, 0), axis=0)
        k = tl.sum(tl.where(tl.arange(0, 2) == 1, header, 0), axis=0)
        tl.store(src_info_ptr + row, token)
        tl.store(push_row_ptr + listed + i, row.to(tl.int32))
        tl.store(push_rank_ptr + listed + i, s)
        tl.store(push_slot_ptr + listed + i, token * num_topk + k)
        words = (msg + 16).to(tl.pointer_type(tl.int64), bitcast=True)
        out_words = (out_x_ptr + row * x_bytes).to(tl.pointer_type(tl.int64), bitcast=True)
        for start in range(0, x_bytes // 8, BLOCK_X):
            c = start + xcols
            tl.store(out_words + c, tl.load(words + c, mask=c < x_bytes // 8), mask=c < x_bytes // 8)
        if scale_words > 0:
            scales = tl.load((msg + 16 + x_bytes).to(tl.pointer_type(tl.int32), bitcast=True) + scols,
                             mask=scols < scale_words)
            dst = out_scales_ptr + (l * scale_words).to(tl.int64) * slots_total + scols.to(tl.int64) * slots_total \
                + row0 + i
            tl.store(dst, scales, mask=scols < scale_words)
