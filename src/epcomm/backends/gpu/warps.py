"""What the warps of one program agree on (device side): votes and reports.

A reduction over a small tensor does not make a value the same in every thread of a program:
Triton gives a tensor of a few lanes to every warp whole (replicated), so the reduction runs
within each warp, over that warp's own loads (shuffles only, no barrier). A value read from memory
that another GPU or program writes — a flag, GAVE_UP, the clock — can then differ between the
warps, and a branch on it splits the program:

- a warp inside a region whose cross-warp reductions use ``bar.sync`` pairs them with another
  warp's unrelated barrier (garbage reports, a false timeout, or a hang);
- Triton issues a store of a lane that every warp holds from the first warp only, so a branch that
  only other warps took stores nothing.

So every decision taken on such a value, where the region it guards has barriers or stores, goes
through a vote (:func:`cta_any`, :func:`cta_all`), and what a wait reports is stored from every
warp (:func:`store_from_every_warp`). tests/test_kernel_votes.py pins both behaviours of Triton
and checks the kernels that rely on them.

A program-wide vote is a barrier: every warp waits for the slowest, whose loads of the previous
item must land first. Where the region a decision guards holds no barrier, and every store in it
that matters comes from every warp, each warp may decide alone instead (:func:`warp_any`,
:func:`warp_all`: the warp's threads agree, and its acquires order its own later loads) and run
its items apart from the others — the overlapped pull's item loop does (one_node/dispatch.py),
where every warp holds an item's lanes whole (a few rows: its reductions are shuffles).
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def cta_any(flag):
    """1 in every thread of the program when ``flag`` (an int32 per thread) is nonzero in any
    thread, else 0: ``bar.red.or.pred``, a barrier of the whole program (every thread must reach
    it) that also orders memory like ``bar.sync`` — each thread's earlier loads (acquires included)
    precede every thread's later ones."""
    return tl.inline_asm_elementwise(
        "{ .reg .pred %p_in, %p_out; setp.ne.s32 %p_in, $1, 0; bar.red.or.pred %p_out, 0, %p_in; "
        "selp.s32 $0, 1, 0, %p_out; }", "=r,r", [flag.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def cta_all(flag):
    """1 in every thread of the program when ``flag`` (an int32 per thread) is nonzero in every
    thread, else 0 (``bar.red.and.pred``; :func:`cta_any` says what the barrier orders)."""
    return tl.inline_asm_elementwise(
        "{ .reg .pred %p_in, %p_out; setp.ne.s32 %p_in, $1, 0; bar.red.and.pred %p_out, 0, %p_in; "
        "selp.s32 $0, 1, 0, %p_out; }", "=r,r", [flag.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def warp_any(flag):
    """1 in every thread of the warp when ``flag`` (an int32 per thread) is nonzero in any of its
    threads, else 0 (``vote.sync.any``). ``bar.warp.sync`` first orders memory among the warp's
    threads: each one's earlier loads (a poll's acquires) precede every thread's later ones. No
    other warp takes part, so all the warp's threads must reach it (a warp-uniform branch)."""
    return tl.inline_asm_elementwise(
        "{ .reg .pred %p_in, %p_out; setp.ne.s32 %p_in, $1, 0; bar.warp.sync -1; "
        "vote.sync.any.pred %p_out, %p_in, -1; selp.s32 $0, 1, 0, %p_out; }", "=r,r", [flag.to(tl.int32)],
        dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def warp_all(flag):
    """1 in every thread of the warp when ``flag`` is nonzero in all of its threads, else 0
    (``vote.sync.all``; :func:`warp_any` says what it orders)."""
    return tl.inline_asm_elementwise(
        "{ .reg .pred %p_in, %p_out; setp.ne.s32 %p_in, $1, 0; bar.warp.sync -1; "
        "vote.sync.all.pred %p_out, %p_in, -1; selp.s32 $0, 1, 0, %p_out; }", "=r,r", [flag.to(tl.int32)],
        dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def vote_any(flag, WARP: tl.constexpr):
    """:func:`warp_any` with ``WARP``, else :func:`cta_any`."""
    if WARP:
        return warp_any(flag)
    else:
        return cta_any(flag)


@triton.jit
def vote_all(flag, WARP: tl.constexpr):
    """:func:`warp_all` with ``WARP``, else :func:`cta_all`."""
    if WARP:
        return warp_all(flag)
    else:
        return cta_all(flag)


@triton.jit
def store_one_from_every_warp(addresses, live, WIDE: tl.constexpr):
    """:func:`store_from_every_warp` of 1 (int64 with WIDE, else int32)."""
    store_from_every_warp(addresses, tl.zeros_like(addresses) + 1, live, WIDE)


@triton.jit
def store_from_every_warp(addresses, values, live, WIDE: tl.constexpr):
    """Store ``values`` (int64 with WIDE, else int32) at each ``live`` lane's byte address, from
    every thread that holds the lane. tl.store issues a lane that every warp holds from the first
    warp only (tests/test_kernel_votes.py), so under a branch that other warps took alone it would
    store nothing. For reports whose every writer writes the same value."""
    if WIDE:
        tl.inline_asm_elementwise(
            "{ .reg .pred %p_live; setp.ne.s32 %p_live, $3, 0; @%p_live st.global.b64 [$1], $2; } mov.u32 $0, 0;",
            "=r,l,l,r", [addresses, values.to(tl.int64), live.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.inline_asm_elementwise(
            "{ .reg .pred %p_live; setp.ne.s32 %p_live, $3, 0; @%p_live st.global.b32 [$1], $2; } mov.u32 $0, 0;",
            "=r,l,r,r", [addresses, values.to(tl.int32), live.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)
