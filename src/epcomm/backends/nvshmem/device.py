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
    signal(signal, value, op, pe)                         nvshmemx_signal_op
    fence() / quiet()                                     order / complete this PE's puts

All are block-scoped: every thread of the program calls them with the same arguments. ``dst`` and
``signal`` are this rank's addresses of symmetric memory (NVSHMEM translates them for ``pe``);
``src`` must be symmetric memory too when the transport is a NIC. Receivers never call
``nvshmem_signal_wait_until`` (it cannot time out): they poll their own signal words with acquire
loads, bounded like every other wait (backends/nvlink/sync.py).
"""
from __future__ import annotations

from typing import Tuple

import triton
import triton.language as tl
from triton.language import core

from ..nvlink.launch import DeviceLibrary

# NVSHMEM's signal operations and comparisons (nvshmem.h; the experimental _extern_triton library
# numbers them differently — not those).
SIGNAL_SET = 0
SIGNAL_ADD = 5
CMP_GE = 3


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
def signal(signal_word, value, op, pe):
    """``op`` of ``value`` on the int64 word ``signal_word`` on ``pe`` (after a fence: after the puts)."""
    return _signal_op(tl.cast(signal_word, tl.int64), tl.cast(value, tl.uint64), tl.cast(op, tl.int32),
                      tl.cast(pe, tl.int32))


class NvshmemLibrary(DeviceLibrary):
    """NVSHMEM's device bitcode, found where PyTorch's NVSHMEM wheel put it (or ``NVSHMEM_LIB_DIR``)."""

    name = "libnvshmem_device"

    def path(self) -> str:
        from torch.distributed._symmetric_memory._nvshmem_triton import NvshmemLibFinder
        return NvshmemLibFinder.find_device_library()

    def init_module(self, compiled) -> None:
        from torch._C._distributed_c10d import _nvshmemx_cumodule_init
        _nvshmemx_cumodule_init(compiled.module)


NVSHMEM = NvshmemLibrary()


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
