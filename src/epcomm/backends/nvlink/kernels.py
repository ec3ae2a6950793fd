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
                   count_row_ptr,  # [ROW] int32, local: counts to publish (notify), unused if ROW_LEN == 0
                   count_bases_ptr,  # [R] int64: address of each rank's count matrix [R, row_len]
                   row_len, rank, timeout_ns,
                   ROW_LEN: tl.constexpr, BLOCK: tl.constexpr):
    # One program per peer. Program p: (1) optionally writes this rank's count row into peer p's
    # count matrix at row `rank`; (2) release-stores the barrier epoch into peer p's flag[rank];
    # (3) acquire-polls its own flag[p] until peer p has arrived at the same epoch.
    peer = tl.program_id(0)
    if ROW_LEN > 0:
        dst = tl.load(count_bases_ptr + peer).to(tl.pointer_type(tl.int32)) + rank * row_len
        for start in range(0, row_len, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            tl.store(dst + offs, tl.load(count_row_ptr + offs, mask=offs < row_len), mask=offs < row_len)
        # All threads' row stores happen-before the single-thread release below (CTA barrier,
        # then the release is cumulative).
        tl.debug_barrier()
    # Epoch = number of barriers so far, counted per peer in device memory (graph-replay safe).
    epoch = tl.load(sent_ptr + peer) + 1
    tl.store(sent_ptr + peer, epoch)
    # RELEASE (sys scope): the count row above, and every store of earlier kernels on this stream
    # (staged payload, pushed rows), become visible to peer p before it sees the epoch.
    peer_flags = tl.load(flag_bases_ptr + peer).to(tl.pointer_type(tl.int64))
    tl.atomic_xchg(peer_flags + rank, epoch, sem="release", scope="sys")
    # ACQUIRE (sys scope), pairs with peer p's release above: after this, p's writes are visible.
    my_flags = tl.load(flag_bases_ptr + rank).to(tl.pointer_type(tl.int64))
    deadline = _now_ns() + timeout_ns
    # A peer may already be one barrier ahead, hence >= rather than ==.
    seen = tl.atomic_add(my_flags + peer, 0, sem="acquire", scope="sys")
    while (seen < epoch) & (_now_ns() < deadline):
        seen = tl.atomic_add(my_flags + peer, 0, sem="acquire", scope="sys")
    if seen < epoch:
        tl.store(error_ptr + peer, 1)


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
    for block in range(pid, tl.cdiv(max_rows, BLOCK_R), num_programs):
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
def reduce_slots_kernel(slots_ptr,  # [chunk tokens, R, width] slot rows written by the ranks
                        in_rank_ptr,  # [T, R] bool: which slots hold data
                        out_ptr,  # [T, width]
                        bias0_ptr, bias1_ptr,  # [T, width] bf16 or unused
                        token_lo, token_hi, width, num_ranks,
                        NUM_BIAS: tl.constexpr, R_P2: tl.constexpr, BLOCK_C: tl.constexpr):
    # out[t] = Σ_j slots[t, j] over the ranks j holding token t, in float32 (+ biases). All R slot
    # rows of a column block load at once to keep many bytes in flight. Reads only local memory;
    # the barrier before this kernel acquired the pushers' stores.
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_C)
    ranks = tl.arange(0, R_P2)
    for token in range(token_lo + pid, token_hi, num_programs):
        t64 = token.to(tl.int64)
        present = tl.load(in_rank_ptr + t64 * num_ranks + ranks, mask=ranks < num_ranks, other=0) != 0
        slot_rows = (t64 - token_lo) * num_ranks + ranks
        for start in range(0, width, BLOCK_C):
            c = start + cols
            cmask = c < width
            values = tl.load(slots_ptr + slot_rows[:, None] * width + c[None, :],
                             mask=present[:, None] & cmask[None, :], other=0.0)
            acc = tl.sum(values.to(tl.float32), axis=0)
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
