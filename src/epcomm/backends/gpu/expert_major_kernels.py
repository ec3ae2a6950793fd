"""The expert-major layout (:mod:`epcomm.expert_major`) in two kernels, for GPU backends that
receive plain rows and re-lay them after the exchange (two-level normal mode; the one-node kernels
build the layout inside their pull and push instead).

The torch re-layout (``expert_major.expand`` / ``fold``) moves each row through index_put and
boolean-mask gathers: on 2 × H200 at T=4096 (virtual nodes, measured 2026-11-23) the expansion took
~1.6 ms and the fold ~5.7 ms, against ~0.6 ms and ~1.7 ms for the plain cached dispatch and
combine they follow. Here each plain row is read once and written to its expert rows, and each
plain row is folded from its expert rows in one pass — the same bytes and the same float32 sums
as the torch functions (bit for bit: the fold is compiled without FMA fusion, so every product
and sum is rounded as torch rounds them)::

    expand (grid: copy programs, then zero programs)     fold (grid: plain rows / BLOCK_R)
      program p < P:  rows r of block p                    rows r of block p
        for k: if dest[r, k] >= 0:                           acc = 0 (float32)
                 out[dest[r, k]] = x[r]                      for k ascending: d = dest[r, k]
      program p >= P: output rows m of block p - P             if d >= 0: acc += float(y[d]) * w[d]
        if row_experts[m] < 0: out[m] = 0 (padding)         out[r] = bf16(acc)

No ordering with other kernels: both run on the caller's stream after the dispatch (before the
combine) that produced (consumes) the rows.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ... import expert_major as torch_layout
from ...expert_major import ExpertMajor
from .copy import copy_block_shape, copy_rows_to_each, for_word_copies
from .launch import KernelSpec, cdiv, current_stream, p2

# Plain rows per fold program and its warps: one row of 2 warps read 582 MB in 242 µs on H100
# (8161 rows, H=7168, top-8), against 276-1138 µs for 2-16 rows of 2-8 warps (a sweep on one H100, 2026-11-24).
FOLD_BLOCK_R = 1
FOLD_WARPS = 2
FOLD_COLUMNS = tl.constexpr(512)  # bf16 columns per chunk of the fold (fold_expert_major_rows)


@triton.jit
def fold_expert_major_rows(y_ptr, row_weights_ptr, dest_ptr, rows64, move, dst, hidden, num_topk, K_P2: tl.constexpr):
    """dst[r] = Σ_k row_weights[d] · y[d] over d = dest[r, k] >= 0, in float32, k ascending, rounded
    to bf16 (``dst`` [BLOCK_R] bf16 row pointers; rows where ``move`` is False are skipped). The k
    loop is unrolled so that the K loads of a chunk are in flight together (narrow chunks keep
    them in registers)."""
    cols = tl.arange(0, FOLD_COLUMNS)
    for start in range(0, hidden, FOLD_COLUMNS):
        c = start + cols
        cm = c < hidden
        acc = tl.zeros([rows64.shape[0], FOLD_COLUMNS], tl.float32)
        for k in tl.static_range(K_P2):
            row = tl.load(dest_ptr + rows64 * num_topk + k, mask=move & (k < num_topk), other=-1)
            weight = tl.load(row_weights_ptr + row, mask=row >= 0, other=0.0)
            values = tl.load(y_ptr + row.to(tl.int64)[:, None] * hidden + c[None, :],
                             mask=(row >= 0)[:, None] & cm[None, :], other=0.0)
            acc += values.to(tl.float32) * weight[:, None]
        tl.store(dst[:, None] + c[None, :], acc.to(tl.bfloat16), mask=move[:, None] & cm[None, :])


@triton.jit
def ep_dispatch_expert_major_expand(src_ptr: "*i8",  # [N, row_words] words of the plain rows (WORD_BYTES each)
                                    dest_ptr: "*i32",  # [N, K] int32: expert-major row of entry (r, k), -1 = none
                                    row_experts_ptr: "*i64",  # [M] int64: each output row's local expert, -1 on padding
                                    out_ptr: "*i8",  # out [M, row_words] words
                                    num_plain: "i32", num_topk: "i32", row_words: "i32", num_out_rows: "i32",
                                    num_copy_programs: "i32",
                                    WORD_BYTES: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr):
    pid = tl.program_id(0)
    if WORD_BYTES == 8:
        src = src_ptr.to(tl.pointer_type(tl.int64), bitcast=True)
        out = out_ptr.to(tl.pointer_type(tl.int64), bitcast=True)
    else:
        src = src_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
        out = out_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    if pid < num_copy_programs:  # each plain row, loaded once, stored to every row of its entries
        rows = (pid * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
        live = rows < num_plain
        copy_rows_to_each(src + rows * row_words, out, dest_ptr + rows * num_topk, live, num_topk, row_words,
                          BLOCK_W)
    else:  # padding rows (no entry points at them) are zero
        rows = ((pid - num_copy_programs) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
        pad = tl.load(row_experts_ptr + rows, mask=rows < num_out_rows, other=0) < 0
        cols = tl.arange(0, BLOCK_W)
        zeros = tl.zeros([BLOCK_R, BLOCK_W], out.dtype.element_ty)
        for start in range(0, row_words, BLOCK_W):
            c = start + cols
            tl.store(out + rows[:, None] * row_words + c[None, :], zeros, mask=pad[:, None] & (c < row_words)[None, :])


EXPAND = KernelSpec(ep_dispatch_expert_major_expand)


@triton.jit
def ep_combine_expert_major_fold(y_ptr: "*bf16",  # [M, H] bf16 expert outputs, expert-major rows
                                 row_weights_ptr: "*fp32",  # [M] float32: each row's top-k weight
                                 dest_ptr: "*i32",  # [N, K] int32: expert-major row of entry (r, k), -1 = none
                                 out_ptr: "*bf16",  # out [N, H] bf16 plain rows
                                 num_plain: "i32", hidden: "i32", num_topk: "i32",
                                 BLOCK_R: tl.constexpr, K_P2: tl.constexpr):
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    move = rows < num_plain
    fold_expert_major_rows(y_ptr, row_weights_ptr, dest_ptr, rows, move, out_ptr + rows * hidden, hidden, num_topk,
                       K_P2)


FOLD = KernelSpec(ep_combine_expert_major_fold, fp_fusion=False)


def _expand_rows(rows: torch.Tensor, mapping: ExpertMajor) -> torch.Tensor:
    """One 2-D tensor's rows laid out as ``mapping`` says (``rows`` contiguous ``[N, C]``, rows of
    a multiple of 4 bytes, moved in 8-byte words where the row length allows)."""
    out = torch.empty((mapping.num_rows, rows.shape[1]), dtype=rows.dtype, device=rows.device)
    rows, _ = for_word_copies(rows)  # (a view at an odd offset is copied: word loads would fault)
    row_bytes = rows.shape[1] * rows.element_size()
    word_bytes = 8 if row_bytes % 8 == 0 else 4
    row_words = row_bytes // word_bytes
    num_plain, num_topk = mapping.dest.shape
    block_r, block_w = copy_block_shape(max(cdiv(row_bytes, 8), 1))
    copy_programs = cdiv(num_plain, block_r)
    programs = copy_programs + cdiv(mapping.num_rows, block_r)
    if programs and row_words:
        kernel = EXPAND.bind(num_warps=8, WORD_BYTES=word_bytes, BLOCK_R=block_r, BLOCK_W=block_w)
        kernel.launch(programs, 1, current_stream(rows.device.index), rows.data_ptr(), mapping.dest.data_ptr(),
                      mapping.row_experts.data_ptr(), out.data_ptr(), num_plain, num_topk, row_words,
                      mapping.num_rows, copy_programs)
    return out


def expand(recv_x, mapping: ExpertMajor):
    """:func:`epcomm.expert_major.expand` on the GPU: plain rows → expert-major rows, padding rows
    zero. ``recv_x``: bf16 ``[N, H]`` or an FP8 pair ``(values [N, H], scales [N, S])``; returns
    the same kind with ``mapping.num_rows`` rows."""
    parts = recv_x if isinstance(recv_x, tuple) else (recv_x,)
    if any(part.dim() != 2 or part.shape[1] * part.element_size() % 4 for part in parts):
        return torch_layout.expand(recv_x, mapping)  # rows the word copies cannot move (same result)
    expanded = tuple(_expand_rows(part.contiguous(), mapping) for part in parts)
    return expanded if isinstance(recv_x, tuple) else expanded[0]


def fold(y: torch.Tensor, mapping: ExpertMajor) -> torch.Tensor:
    """:func:`epcomm.expert_major.fold` on the GPU: expert-major outputs ``y`` bf16 ``[M, H]`` →
    plain rows bf16 ``[N, H]``, ``row[r] = Σ_k w · y[dest[r, k]]`` in float32, k ascending."""
    y = y.contiguous()
    num_plain, num_topk = mapping.dest.shape
    hidden = y.shape[1]
    out = torch.empty((num_plain, hidden), dtype=torch.bfloat16, device=y.device)
    if num_plain and hidden:
        kernel = FOLD.bind(num_warps=FOLD_WARPS, BLOCK_R=FOLD_BLOCK_R, K_P2=p2(num_topk))
        kernel.launch(cdiv(num_plain, FOLD_BLOCK_R), 1, current_stream(y.device.index), y.data_ptr(),
                      mapping.row_weights.data_ptr(), mapping.dest.data_ptr(), out.data_ptr(), num_plain, hidden,
                      num_topk)
    return out
