"""Row copies and address helpers shared by the nvlink kernels: 16-byte accesses where alignment allows.

Triton moves 16 bytes per thread and access only where it can prove a pointer 16-byte aligned and
a row length a multiple of 16 bytes. It cannot prove either for what epcomm copies: peer addresses
are integers cast to pointers (the cast drops all alignment knowledge) and row lengths are runtime
scalars (a ``tl.multiple_of`` hint on a scalar argument is not carried through). Without the proof
every copy runs on 8-byte (or 2-byte bf16) accesses: twice (eight times) the memory instructions for
the same bytes. The kernels therefore take an ``ALIGNED`` constexpr: the host sets it when every
address involved is 16-byte aligned and every row length a multiple of 16 bytes (workspace offsets
always are; user tensors are checked per call), and the helpers below then state it to the compiler:

- :func:`word_ptr` / :func:`ptr_at`: an int64 byte address as a pointer, marked 16-byte aligned;
- pointer arguments: ``KernelSpec(aligned_if={"ALIGNED": [...]})`` declares them aligned in the
  ALIGNED specialisations (a ``tl.multiple_of`` on an argument inside the kernel is dropped);
- :func:`multiple`: a length rewritten as ``(n // M) * M``, the form the compiler reads as a
  multiple of ``M``.

Marking something aligned that is not makes the GPU fault, so ``ALIGNED=False`` keeps the plain
8-byte path for other inputs (same results, fewer bytes per access); an input the kernels copy in
words that is not even 8-byte aligned is copied first (:func:`for_word_copies`).
"""
from __future__ import annotations

from typing import Tuple

import triton
import triton.language as tl

from .launch import p2

# Copy tiles: remote loads take microseconds, so each program keeps many bytes in flight.
COPY_TILE_WORDS = 16384
COPY_WARPS = 16


def copy_block_shape(row_words: int) -> Tuple[int, int]:
    """(BLOCK_R, BLOCK_W) for rows of ``row_words`` 8-byte words: whole rows per step when they fit."""
    block_w = min(p2(row_words), COPY_TILE_WORDS)
    return max(COPY_TILE_WORDS // block_w, 1), block_w


def is_aligned(*tensors) -> bool:
    """Host side: every tensor's data starts on a 16-byte boundary."""
    for t in tensors:
        if t.data_ptr() & 15:
            return False
    return True


def for_word_copies(t):
    """Host side: ``(t, aligned)`` for a tensor the kernels copy in 8-byte words — ``aligned`` when
    it starts on a 16-byte boundary. A tensor not even 8-byte aligned (a view at an odd element
    offset) is copied first: word loads from it would fault. Same values either way."""
    offset = t.data_ptr() & 15
    if offset & 7:
        return t.clone(), True  # a fresh allocation: aligned
    return t, offset == 0


@triton.jit
def ptr_at(address, DTYPE: tl.constexpr, ALIGNED: tl.constexpr):
    """int64 byte address(es) → pointer(s) to ``DTYPE``; marked 16-byte aligned when ``ALIGNED``.
    (The mark must sit on an operation made here: on a value passed in, Triton drops it.)"""
    ptr = address.to(tl.pointer_type(DTYPE))
    if ALIGNED:
        ptr = tl.multiple_of(ptr, 16)
    return ptr


@triton.jit
def word_ptr(address, ALIGNED: tl.constexpr):
    """:func:`ptr_at` for 8-byte words, what the row copies move."""
    return ptr_at(address, tl.int64, ALIGNED)


@triton.jit
def multiple(n, M: tl.constexpr, ALIGNED: tl.constexpr):
    """``n``, which the host checked is a multiple of ``M`` (a power of two), in the form
    ``(n // M) * M`` that the compiler reads as one, when ``ALIGNED``."""
    if ALIGNED:
        n = (n // M) * M
    return n


@triton.jit
def copy_rows(src, dst, live, row_words, BLOCK_W: tl.constexpr):
    """Copy ``row_words`` 8-byte words of each row: ``src``/``dst`` are [BLOCK_R] int64 pointers to
    the rows' first words; rows where ``live`` is False are skipped. With 16-byte aligned row
    pointers and an even ``row_words`` (:func:`word_ptr`, :func:`multiple`) each access moves 16 bytes.
    No ordering here: the callers' arrival/wait steps (sync.py) bracket it."""
    cols = tl.arange(0, BLOCK_W)
    for start in range(0, row_words, BLOCK_W):
        c = start + cols
        m = live[:, None] & (c < row_words)[None, :]
        tl.store(dst[:, None] + c[None, :], tl.load(src[:, None] + c[None, :], mask=m), mask=m)


@triton.jit
def copy_rows_to_each(src, dst, dest_rows, live, num_topk, row_words, BLOCK_W: tl.constexpr):
    """Copy each source row to several destination rows (the expert-major layout: one per local
    expert of the token), loading it once: ``src`` [BLOCK_R] pointers to the rows; ``dst`` the
    destination, row ``i`` at ``dst + i * row_words``; ``dest_rows`` [BLOCK_R] pointers to each
    row's ``num_topk`` int32 destination rows (-1 = none), read per use (a [BLOCK_R, K] tensor of
    them would cost registers the tile needs); rows where ``live`` is False are skipped."""
    cols = tl.arange(0, BLOCK_W)
    for start in range(0, row_words, BLOCK_W):
        c = start + cols
        cm = c < row_words
        values = tl.load(src[:, None] + c[None, :], mask=live[:, None] & cm[None, :])
        for k in range(0, num_topk):
            row = tl.load(dest_rows + k, mask=live, other=-1)
            tl.store(dst + row.to(tl.int64)[:, None] * row_words + c[None, :], values,
                     mask=(row >= 0)[:, None] & cm[None, :])


# Words of NaN, for the rows a call knows are missing (DESIGN section 5: no plausible data).
NAN_BF16_WORD = tl.constexpr(0x7FC07FC07FC07FC0)  # four bf16 quiet NaNs
NAN_E4M3_WORD = tl.constexpr(0x7F7F7F7F7F7F7F7F)  # eight float8_e4m3fn NaNs


@triton.jit
def fill_rows(dst, num_rows, row_words, word, program, num_programs, BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr):
    """Store ``word`` (an int64 bit pattern, e.g. NAN_BF16_WORD) into every 8-byte word of rows
    ``[0, num_rows)`` of ``dst`` (an int64 pointer, rows of ``row_words`` words); ``program`` of
    ``num_programs`` takes blocks of rows ``program, program + num_programs, ...``."""
    cols = tl.arange(0, BLOCK_W)
    value = tl.full([BLOCK_R, BLOCK_W], word, tl.int64)
    for block in range(program, tl.cdiv(num_rows, BLOCK_R), num_programs):
        rows = (block * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
        for start in range(0, row_words, BLOCK_W):
            c = start + cols
            tl.store(dst + rows[:, None] * row_words + c[None, :], value,
                     mask=(rows < num_rows)[:, None] & (c < row_words)[None, :])


@triton.jit
def fill_nan(ptr, count, program, num_programs, BLOCK: tl.constexpr):
    """NaN into ``count`` contiguous floating-point elements at ``ptr`` (:func:`fill_value`)."""
    fill_value(ptr, count, float("nan"), program, num_programs, BLOCK)


@triton.jit
def fill_value(ptr, count, value, program, num_programs, BLOCK: tl.constexpr):
    """``value`` into ``count`` contiguous elements at ``ptr`` (its element type); ``program`` of
    ``num_programs`` takes blocks ``program, program + num_programs, ...``."""
    offs = tl.arange(0, BLOCK)
    for start in range(program * BLOCK, count, num_programs * BLOCK):
        i = (start + offs).to(tl.int64)
        tl.store(ptr + i, tl.full([BLOCK], value, ptr.dtype.element_ty), mask=i < count)
