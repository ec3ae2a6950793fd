"""NVSHMEM device functions in epcomm's Triton kernels.

PyTorch ships NVSHMEM's device library (``libnvshmem_device.bc``, found by
``torch.distributed._symmetric_memory._nvshmem_triton``) and the hook that prepares a loaded module
for it. Kernels declared with ``KernelSpec(..., library=NVSHMEM)`` get both from the launch layer
(what ``@requires_nvshmem`` does for Triton's own launcher). The device functions are declared
here by their NVSHMEM symbol names (PyTorch defines its Triton bindings only where a GPU is
present; these also compile on a CPU machine, for the compile tests):

    put_signal(dst, src, nbytes, signal, value, op, pe)   nvshmemx_putmem_signal_block: the data, then
                                                          the signal word on pe (seeing it => seeing data)
    put(dst, src, nbytes, pe)                             nvshmemx_putmem_block
    put_nbi(dst, src, nbytes, pe)                         nvshmemx_putmem_nbi_block (complete at quiet)
    signal(signal, value, op, pe)                         nvshmemx_signal_op
    fence() / quiet()                                     order / complete this PE's puts

``put_signal`` and ``put`` are block-scoped: every thread of the program calls them with the same
arguments. ``signal`` is thread-scoped, so a program's threads each issue it (idempotent for
SIGNAL_SET, which is all epcomm uses). ``dst`` and ``signal`` are this rank's addresses of
symmetric memory (NVSHMEM translates them for ``pe``); ``src`` must be symmetric memory too when
the transport is a NIC. Receivers never call ``nvshmem_signal_wait_until`` (it cannot time out):
they poll their own signal words with acquire loads, bounded like every other wait
(backends/gpu/sync.py).

The kernels call :func:`deliver`, which is either NVSHMEM's put with signal or, with ``LOOPBACK``,
the same hand-off done with plain stores into another workspace of the same process: the
loopback transport (loopback.py) runs several "ranks" on one GPU, so the multi-node kernels can be
tested where NVSHMEM cannot run (it needs one GPU per process).
"""
from __future__ import annotations

from typing import Tuple

import triton
import triton.language as tl
from triton.language import core

from ..launch import DeviceLibrary

# NVSHMEM's signal operations: the codes of NVSHMEM_SIGNAL_SET / NVSHMEM_SIGNAL_ADD in the device
# library PyTorch ships (NVSHMEM 3.x, libnvshmem_device.bc: nvshmemx_signal_op and the signal of
# nvshmemx_putmem_signal_block store the value when op == 9 and atomically ADD it for any other op).
# A wrong code is not an error there: it silently turns every SET into an ADD (epochs that sum up,
# waits that pass early, fingerprints read before they land), so the loopback transport interprets
# the codes the same way (:func:`_loopback_signal`) and its tests catch a wrong one.
SIGNAL_SET = tl.constexpr(9)
SIGNAL_ADD = tl.constexpr(10)


_I64, _U64, _I32 = core.dtype("int64"), core.dtype("uint64"), core.dtype("int32")


@core.extern
def _putmem_signal_block(dst, src, nbytes, signal, value, op, pe, _semantic=None):
    return core.extern_elementwise("", "", [dst, src, nbytes, signal, value, op, pe],
                                   {(_I64, _I64, _I64, _I64, _U64, _I32, _I32): ("nvshmemx_putmem_signal_block", _I32)},
                                   is_pure=False, _semantic=_semantic)


@core.extern
def _putmem_block(dst, src, nbytes, pe, _semantic=None):
    return core.extern_elementwise("", "", [dst, src, nbytes, pe],
                                   {(_I64, _I64, _I64, _I32): ("nvshmemx_putmem_block", _I32)},
                                   is_pure=False, _semantic=_semantic)


@core.extern
def _putmem_nbi_block(dst, src, nbytes, pe, _semantic=None):
    return core.extern_elementwise("", "", [dst, src, nbytes, pe],
                                   {(_I64, _I64, _I64, _I32): ("nvshmemx_putmem_nbi_block", _I32)},
                                   is_pure=False, _semantic=_semantic)


@core.extern
def _signal_op(signal, value, op, pe, _semantic=None):
    return core.extern_elementwise("", "", [signal, value, op, pe],
                                   {(_I64, _U64, _I32, _I32): ("nvshmemx_signal_op", _I32)},
                                   is_pure=False, _semantic=_semantic)


@core.extern
def fence(_semantic=None):
    """Puts to one PE issued before it are delivered before those issued after it."""
    return core.extern_elementwise("", "", [], {(): ("nvshmem_fence", _I32)}, is_pure=False, _semantic=_semantic)


@core.extern
def quiet(_semantic=None):
    """Every put this PE issued before it is delivered (to every PE)."""
    return core.extern_elementwise("", "", [], {(): ("nvshmem_quiet", _I32)}, is_pure=False, _semantic=_semantic)


@triton.jit
def put_signal(dst, src, nbytes, signal, value, op, pe):
    """Block-scoped put of ``nbytes`` from ``src`` to ``dst`` on ``pe``, then ``op`` (SIGNAL_SET /
    SIGNAL_ADD) of ``value`` on the int64 word ``signal`` there, after the data."""
    return _putmem_signal_block(tl.cast(dst, tl.int64), tl.cast(src, tl.int64), tl.cast(nbytes, tl.int64),
                                tl.cast(signal, tl.int64), tl.cast(value, tl.uint64), tl.cast(op, tl.int32),
                                tl.cast(pe, tl.int32))


@triton.jit
def put(dst, src, nbytes, pe):
    """Block-scoped put of ``nbytes`` from ``src`` to ``dst`` on ``pe`` (no ordering with other puts)."""
    return _putmem_block(tl.cast(dst, tl.int64), tl.cast(src, tl.int64), tl.cast(nbytes, tl.int64),
                         tl.cast(pe, tl.int32))


@triton.jit
def put_nbi(dst, src, nbytes, pe):
    """Block-scoped non-blocking put: ``src`` may be reused, and the bytes are at ``pe``, only
    after :func:`quiet`."""
    return _putmem_nbi_block(tl.cast(dst, tl.int64), tl.cast(src, tl.int64), tl.cast(nbytes, tl.int64),
                             tl.cast(pe, tl.int32))


@triton.jit
def signal(signal_word, value, op, pe):
    """``op`` of ``value`` on the int64 word ``signal_word`` on ``pe`` (after a fence: after the puts)."""
    return _signal_op(tl.cast(signal_word, tl.int64), tl.cast(value, tl.uint64), tl.cast(op, tl.int32),
                      tl.cast(pe, tl.int32))


@triton.jit
def _fence_sys():
    tl.inline_asm_elementwise("fence.acq_rel.sys; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def deliver(dst, src, nbytes, signal_word, value, pe, peer_bases_ptr, rank, LOOPBACK: tl.constexpr,
            BLOCK: tl.constexpr = 1024):
    """Block-scoped: ``nbytes`` (a multiple of 4, possibly 0) from ``src`` to ``dst`` on ``pe``, then
    the int64 ``signal_word`` there SET to ``value`` — seeing the signal means seeing the bytes.
    ``dst`` / ``signal_word`` are this rank's addresses of symmetric memory, ``src`` local memory
    (symmetric: a NIC reads it). Call after a CTA barrier that orders the program's writes of ``src``.

    NVSHMEM: each thread fences at system scope first (a NIC, unlike this block's own threads, reads
    ``src`` through memory: the block's stores must be visible there), then one put with signal
    (or the signal alone for no bytes). LOOPBACK: ``pe``'s workspace is at ``peer_bases_ptr[pe]``
    in this process; the block copies the bytes there with plain stores, runs a CTA barrier and
    thread 0 signals as the library does (:func:`_loopback_signal`: a system fence, then the op)."""
    if LOOPBACK:
        _loopback_copy(dst, src, nbytes, pe, peer_bases_ptr, rank, BLOCK)
        tl.debug_barrier()  # every thread's stores precede the release
        address = tl.cast(signal_word, tl.int64) + _loopback_shift(peer_bases_ptr, pe, rank)
        _loopback_signal(address, tl.cast(value, tl.int64), SIGNAL_SET, ONE_THREAD=True)
    else:
        _fence_sys()
        if nbytes > 0:
            put_signal(dst, src, nbytes, signal_word, value, SIGNAL_SET, pe)
        else:
            signal(signal_word, value, SIGNAL_SET, pe)


@triton.jit
def _loopback_signal(addresses, values, op: tl.constexpr, ONE_THREAD: tl.constexpr = False):
    """A signal op as NVSHMEM's device library performs it over NVLink: a system-scope fence (the
    release of what the signalling thread has seen), then the word stored when ``op`` is the
    library's SET code, atomically incremented by ``values`` for any other code (the library
    treats every other code as ADD). Lane-wise, by every thread holding a lane (``set_words``'s
    thread-scoped signals), or by thread 0 alone (``ONE_THREAD``: the signal of a block-scoped
    put). ``addresses`` are byte addresses."""
    tl.inline_asm_elementwise("fence.acq_rel.sys; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
    if op == 9:  # the library's code for SET, spelled out here: SIGNAL_SET must equal it
        if ONE_THREAD:
            tl.inline_asm_elementwise("{ .reg .pred %ep_first; .reg .b32 %ep_t; mov.u32 %ep_t, %tid.x; "
                                      "setp.eq.u32 %ep_first, %ep_t, 0; "  # thread 0 alone
                                      "@%ep_first st.relaxed.sys.global.b64 [$1], $2; } mov.u32 $0, 0;",
                                      "=r,l,l", [addresses, values], dtype=tl.int32, is_pure=False, pack=1)
        else:
            tl.inline_asm_elementwise("st.relaxed.sys.global.b64 [$1], $2; mov.u32 $0, 0;", "=r,l,l",
                                      [addresses, values], dtype=tl.int32, is_pure=False, pack=1)
    else:
        if ONE_THREAD:
            tl.inline_asm_elementwise("{ .reg .pred %ep_first; .reg .b32 %ep_t; mov.u32 %ep_t, %tid.x; "
                                      "setp.eq.u32 %ep_first, %ep_t, 0; "  # thread 0 alone
                                      "@%ep_first red.relaxed.sys.global.add.u64 [$1], $2; } mov.u32 $0, 0;",
                                      "=r,l,l", [addresses, values], dtype=tl.int32, is_pure=False, pack=1)
        else:
            tl.inline_asm_elementwise("red.relaxed.sys.global.add.u64 [$1], $2; mov.u32 $0, 0;", "=r,l,l",
                                      [addresses, values], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _loopback_shift(peer_bases_ptr, pe, rank):
    """Bytes from this rank's workspace to ``pe``'s (loopback: every workspace is in this process)."""
    return tl.load(peer_bases_ptr + pe) - tl.load(peer_bases_ptr + rank)


@triton.jit
def _loopback_copy(dst, src, nbytes, pe, peer_bases_ptr, rank, BLOCK: tl.constexpr):
    """A put done with the block's plain stores into ``pe``'s workspace (``nbytes`` % 4 == 0)."""
    src_words = tl.cast(src, tl.int64).to(tl.pointer_type(tl.int32))
    dst_words = (tl.cast(dst, tl.int64) + _loopback_shift(peer_bases_ptr, pe, rank)).to(tl.pointer_type(tl.int32))
    words = tl.cast(nbytes, tl.int64) // 4
    lanes = tl.arange(0, BLOCK)
    for first in range(0, words, BLOCK):
        i = first + lanes
        tl.store(dst_words + i, tl.load(src_words + i, mask=i < words), mask=i < words)


@triton.jit
def send_bytes(dst, src, nbytes, pe, peer_bases_ptr, rank, LOOPBACK: tl.constexpr, BLOCK: tl.constexpr = 1024):
    """Block-scoped: start moving ``nbytes`` (a multiple of 4) from ``src`` (local, symmetric) to
    ``dst`` on ``pe`` (this rank's address of symmetric memory). Complete — ``src`` reusable, the
    bytes at ``pe`` — after :func:`complete_sends`; a later signal (:func:`set_words`) then
    publishes them. Call after a CTA barrier that orders the program's writes of ``src``: each
    thread fences at system scope first (a NIC reads ``src`` through memory). LOOPBACK: the
    block's plain stores into ``pe``'s workspace (complete at once; the release of the signal
    covers them)."""
    if LOOPBACK:
        _loopback_copy(dst, src, nbytes, pe, peer_bases_ptr, rank, BLOCK)
    else:
        _fence_sys()
        put_nbi(dst, src, nbytes, pe)


@triton.jit
def complete_sends(LOOPBACK: tl.constexpr):
    """Every :func:`send_bytes` (and :func:`set_words`) this program issued has landed at its PE."""
    if not LOOPBACK:
        quiet()
    tl.debug_barrier()


@triton.jit
def set_words(words, values, pes, live, spare_word, peer_bases_ptr, rank, LOOPBACK: tl.constexpr):
    """Lane-wise: SET the int64 word ``words`` (this rank's symmetric addresses) on ``pes`` to
    ``values`` where ``live`` — after :func:`complete_sends`, a signal that publishes the bytes
    sent before it. Dead lanes SET ``spare_word`` (a scratch word of this rank's symmetric memory)
    instead: a device function call cannot be masked. Lanes are one thread each when the tensor has
    at least as many elements as the program has threads; otherwise threads repeat a SET of the
    same value (harmless for SET). LOOPBACK: the same op into ``pes``' workspace, as the library
    performs it (:func:`_loopback_signal`)."""
    if LOOPBACK:
        shift = tl.load(peer_bases_ptr + pes, mask=live, other=0) - tl.load(peer_bases_ptr + rank)
        _loopback_signal(tl.where(live, words + shift, spare_word), values.to(tl.int64), SIGNAL_SET)
    else:
        signal(tl.where(live, words, spare_word), values, SIGNAL_SET, tl.where(live, pes, rank))


class NvshmemLibrary(DeviceLibrary):
    """NVSHMEM's device bitcode, found where PyTorch's NVSHMEM wheel put it (or ``NVSHMEM_LIB_DIR``)."""

    name = "libnvshmem_device"

    def path(self) -> str:
        from torch.distributed._symmetric_memory._nvshmem_triton import NvshmemLibFinder
        return NvshmemLibFinder.find_device_library()

    def init_module(self, compiled) -> None:
        """Point the module's copy of NVSHMEM's device state at this process's (what PyTorch's
        ``@requires_nvshmem`` hook does for Triton's launcher). Only a module that holds that state
        can be initialised: a kernel linked with the library but calling none of its functions (a
        specialisation whose NVSHMEM calls compiled away, a kernel that only polls words) has none,
        and ``nvshmemx_cumodule_init`` fails on it ('named symbol not found', error 7)."""
        if not module_uses_nvshmem(compiled.asm.get("ptx", "")):
            return
        from torch._C._distributed_c10d import _nvshmemx_cumodule_init
        _nvshmemx_cumodule_init(compiled.module)


NVSHMEM = NvshmemLibrary()

# The device library's state: every NVSHMEM device function reads it, nvshmemx_cumodule_init sets it.
DEVICE_STATE_SYMBOL = "nvshmemi_device_state_d"


def module_uses_nvshmem(ptx: str) -> bool:
    """Whether a kernel's PTX holds NVSHMEM's device state (it calls into the library), i.e.
    whether its loaded module must be initialised."""
    return DEVICE_STATE_SYMBOL in ptx


def nvshmem_available() -> Tuple[bool, str]:
    """``(usable, why not)``: PyTorch built with NVSHMEM, Triton, and the device library present."""
    try:
        import torch.distributed._symmetric_memory as symm_mem
        if not symm_mem.is_nvshmem_available():
            return False, "this PyTorch has no NVSHMEM (torch.distributed._symmetric_memory.is_nvshmem_available())"
        import triton  # noqa: F401
        NVSHMEM.path()
    except Exception as exc:  # ImportError, RuntimeError (no device library), AttributeError (old torch)
        return False, f"{type(exc).__name__}: {exc}"
    return True, ""
