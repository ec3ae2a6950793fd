"""The one-node dispatch's device functions for the expert-major layout (expert_major.py): the
stage's place of each top-k entry among the rows its expert receives, the pull's rows stored once
per local entry, and the groups' padding zeroed (dispatch.py calls them)."""
from __future__ import annotations

import triton
import triton.language as tl

from ...copy import copy_rows_to_each

POSITION_TOKENS = 32  # tokens per program of the expert-major positions (expert_positions)
POSITION_HIST_ENTRIES = tl.constexpr(4096)  # top-k entries per histogram step of expert_positions
POSITION_ELEMENTS = 16384  # the positions' [SUB, K, E] one-hot tile: SUB = this // (K * E), at least 1

@triton.jit
def expert_positions(topk_ptr, pos_address, pos_row_bytes, first, last, token_lo, num_topk, num_experts,
                      HIST_T: tl.constexpr, SUB: tl.constexpr, K_P2: tl.constexpr, E_P2: tl.constexpr):
    """For the entries (t, k) of tokens [first, last): the number of entries with the same expert
    before it in (token, k) order over this rank's batch — its place among the rows this rank sends
    that expert (the receiver adds the rows of lower ranks and the groups before: expert-major
    layout). Stored as int32 ``[K]`` at ``pos_address + (t - token_lo) * pos_row_bytes``.

        running[e] = entries of e in tokens [0, first)            (histograms, HIST_T tokens a step)
        for each SUB tokens:  hit[t, k, e] = (id[t, k] == e)
            before[t, e] = running[e] + entries of e in earlier tokens of the step   (cumsum over t)
            pos[t, k]    = before[t, id[t, k]] + #{k' < k : id[t, k'] == id[t, k]}
    """
    ks = tl.arange(0, K_P2)
    experts = tl.arange(0, E_P2)
    running = tl.zeros([E_P2], tl.int32)
    for start in range(0, first, HIST_T):
        t = start + tl.arange(0, HIST_T)
        ids = tl.load(topk_ptr + t[:, None].to(tl.int64) * num_topk + ks[None, :],
                      mask=(t < first)[:, None] & (ks < num_topk)[None, :], other=-1)
        valid = (ids >= 0) & (ids < num_experts)
        running += tl.histogram(tl.reshape(tl.where(valid, ids, 0).to(tl.int32), [HIST_T * K_P2]), E_P2,
                                mask=tl.reshape(valid, [HIST_T * K_P2]))
    for start in range(first, last, SUB):
        t = start + tl.arange(0, SUB)
        live = (t < last)[:, None] & (ks < num_topk)[None, :]
        ids = tl.load(topk_ptr + t[:, None].to(tl.int64) * num_topk + ks[None, :], mask=live, other=-1)
        ids = tl.where((ids >= 0) & (ids < num_experts), ids, -1).to(tl.int32)
        hit = ids[:, :, None] == experts[None, None, :]  # [SUB, K_P2, E_P2]
        per_token = tl.sum(hit.to(tl.int32), axis=1)  # [SUB, E_P2]
        before = running[None, :] + tl.cumsum(per_token, axis=0) - per_token
        pos = tl.sum(tl.where(hit, before[:, None, :], 0), axis=2)  # [SUB, K_P2]
        same = (ids[:, :, None] == ids[:, None, :]) & (ks[None, None, :] < ks[None, :, None])
        pos += tl.sum(same.to(tl.int32), axis=2)
        running += tl.sum(per_token, axis=0)
        rows = pos_address + (t - token_lo).to(tl.int64) * pos_row_bytes
        tl.store(rows.to(tl.pointer_type(tl.int32))[:, None] + ks[None, :], pos, mask=live & (ids >= 0))


@triton.jit
def staged_topk(staged, srow, move, topk_offset, topk_row_bytes, num_topk, K_P2: tl.constexpr):
    """``(columns, mask, ids, weights)``: the int64 expert ids (-1 masked) and float32 weights (0
    masked) of staged rows ``srow`` (where ``move``) — a staged top-k row is [K int64 ids][K float32
    weights], and in the expert-major layout [K int32 positions] after them (the pull of either
    layout reads it here)."""
    k = tl.arange(0, K_P2)
    mask = move[:, None] & (k < num_topk)[None, :]
    trow = staged + topk_offset + srow * topk_row_bytes
    ids = tl.load(trow.to(tl.pointer_type(tl.int64))[:, None] + k[None, :], mask=mask, other=-1)
    weights = tl.load((trow + num_topk * 8).to(tl.pointer_type(tl.float32))[:, None] + k[None, :], mask=mask,
                      other=0.0)
    return k, mask, ids, weights


@triton.jit
def pull_expert_major(staged, srow, src, rows64, move, sx, recv_x_ptr, recv_scales_ptr, row_experts_ptr,
                       row_weights_ptr, table_ptr, dest_ptr, x_words, num_scales, num_topk, scales_offset, topk_offset,
                       topk_row_bytes, expert_lo, num_local, num_em_rows, HAS_SCALES: tl.constexpr,
                       HAS_TOPK: tl.constexpr, BLOCK_W: tl.constexpr, S_P2: tl.constexpr, K_P2: tl.constexpr):
    """ep_dispatch_pull's rows in the expert-major layout: each row read once from its source and
    stored to the row of each of its local entries."""
    if HAS_TOPK:  # this dispatch's rows: the source's position plus this rank's group table
        k, entries, ids, weights = staged_topk(staged, srow, move, topk_offset, topk_row_bytes, num_topk, K_P2)
        trow = staged + topk_offset + srow * topk_row_bytes
        position = tl.load((trow + num_topk * 12).to(tl.pointer_type(tl.int32))[:, None] + k[None, :], mask=entries,
                           other=0)
        local = ids - expert_lo
        mine = entries & (ids >= 0) & (local >= 0) & (local < num_local)
        dest = tl.load(table_ptr + src * num_local + local, mask=mine, other=0) + position
        mine = mine & (dest >= 0) & (dest < num_em_rows)  # (the counts behind the table were checked on device)
        tl.store(dest_ptr + rows64[:, None] * num_topk + k[None, :], tl.where(mine, dest, -1), mask=entries)
        tl.store(row_experts_ptr + dest, local.to(tl.int64), mask=mine)
        tl.store(row_weights_ptr + dest, weights, mask=mine)
        tl.debug_barrier()  # the copies below read these rows back (CTA-wide visibility)
    # (a cached dispatch: the rows its handle's dispatch computed)
    dest_rows = dest_ptr + rows64 * num_topk
    copy_rows_to_each(sx, recv_x_ptr.to(tl.pointer_type(tl.int64), bitcast=True), dest_rows, move, num_topk, x_words,
                      BLOCK_W)
    if HAS_SCALES:
        ss = (staged + scales_offset).to(tl.pointer_type(tl.float32)) + srow * num_scales
        copy_rows_to_each(ss, recv_scales_ptr, dest_rows, move, num_topk, num_scales, S_P2)


@triton.jit
def zero_padding_rows(table_ptr, recv_x_ptr, recv_scales_ptr, row_experts_ptr, row_weights_ptr, num_ranks, num_local,
                  num_em_rows, x_words, num_scales, HAS_SCALES: tl.constexpr, HAS_TOPK: tl.constexpr,
                  BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr, S_P2: tl.constexpr):
    """Zero the padding rows of the expert-major groups this program owns (expert e: rows
    table[R][e] .. table[R + 1][e]); with HAS_TOPK their expert is -1 and weight 0."""
    pid = tl.program_id(0)
    x_rows = recv_x_ptr.to(tl.pointer_type(tl.int64), bitcast=True)
    cols = tl.arange(0, BLOCK_W)
    for expert in range(pid, num_local, tl.num_programs(0)):
        first = tl.maximum(tl.load(table_ptr + num_ranks * num_local + expert), 0)
        end = tl.minimum(tl.load(table_ptr + (num_ranks + 1) * num_local + expert), num_em_rows)
        for block in range(first, end, BLOCK_R):
            rows = block + tl.arange(0, BLOCK_R)
            live = rows < end
            rows64 = rows.to(tl.int64)
            for start in range(0, x_words, BLOCK_W):
                c = start + cols
                tl.store(x_rows + rows64[:, None] * x_words + c[None, :], tl.zeros([BLOCK_R, BLOCK_W], tl.int64),
                         mask=live[:, None] & (c < x_words)[None, :])
            if HAS_SCALES:
                s = tl.arange(0, S_P2)
                tl.store(recv_scales_ptr + rows64[:, None] * num_scales + s[None, :],
                         tl.zeros([BLOCK_R, S_P2], tl.float32), mask=live[:, None] & (s < num_scales)[None, :])
            if HAS_TOPK:
                tl.store(row_experts_ptr + rows64, tl.full([BLOCK_R], -1, tl.int64), mask=live)
                tl.store(row_weights_ptr + rows64, tl.zeros([BLOCK_R], tl.float32), mask=live)
