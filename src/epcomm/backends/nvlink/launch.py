"""The launch layer: Triton kernels compiled once per specialisation and launched without Triton's
per-call binder.

``kernel[grid](...)`` costs ~14 µs of host time per call on the GPU image: Triton inspects every
argument to pick a specialisation (types, alignment, value 1), hashes it, and looks the kernel up.
epcomm's hot paths launch 2–3 kernels per call, so that alone would exceed the per-call budget.
Here each kernel declares the types of its runtime parameters once (:class:`KernelSpec`); a
specialisation (the constexpr values and ``num_warps``) is compiled on first use with
``triton.compile`` and its C launcher is kept (:class:`BoundKernel`). A launch is then one call
into that C function: a few µs.

Declaring types up front also makes the compiled code independent of argument values: a scalar is
``i32`` or ``i64`` because the spec says so, never because of the value of the first call, and no
pointer is assumed 16-byte aligned unless the spec says so (``aligned``).

Pointer arguments may be tensors or plain ``int`` addresses (peer memory, host-mapped memory):
the launcher passes an int straight through. Constexpr parameters come last in every kernel.

If the Triton in use lacks the internals this relies on (it was written against Triton 3.4–3.6),
launches fall back to ``kernel[grid](...)``: the same compiled code, only slower to launch;
:func:`launch_mode` reports which path runs.
"""
from __future__ import annotations

import threading
from typing import Dict, Iterable, Tuple

import torch
import triton

from ...errors import EPError


class KernelSpec:
    """A Triton kernel and the types of its runtime parameters.

    Args:
        fn: the ``@triton.jit`` function. Its constexpr parameters must come after all others.
        types: Triton type string of each runtime parameter, in order (``"*i8"``, ``"*i32"``,
            ``"i32"``, ``"i64"``, ...).
        aligned: names of pointer parameters that are always 16-byte aligned (lets the compiler
            vectorise accesses through them).
    """

    def __init__(self, fn, types: Iterable[str], aligned: Iterable[str] = ()):
        self.fn = fn
        self.name = fn.__name__
        params = fn.params
        runtime = [p.name for p in params if not p.is_constexpr]
        self.constexpr_names = [p.name for p in params if p.is_constexpr]
        if [p.name for p in params[:len(runtime)]] != runtime:
            raise EPError(f"{self.name}: constexpr parameters must come after all runtime parameters")
        types = list(types)
        if len(types) != len(runtime):
            raise EPError(f"{self.name}: {len(types)} types given for {len(runtime)} runtime parameters {runtime}")
        self.signature = dict(zip(runtime, types))
        self.signature.update({name: "constexpr" for name in self.constexpr_names})
        self.aligned = tuple(aligned)
        self._bound: Dict[Tuple, "BoundKernel"] = {}
        self._lock = threading.Lock()

    def bind(self, num_warps: int = 4, **constexprs) -> "BoundKernel":
        """The launcher of one specialisation (compiled on first use, then cached)."""
        key = (num_warps,) + tuple(constexprs[name] for name in self.constexpr_names)
        bound = self._bound.get(key)
        if bound is None:
            with self._lock:
                bound = self._bound.get(key)
                if bound is None:
                    bound = BoundKernel(self, constexprs, num_warps)
                    self._bound[key] = bound
        return bound

    def compile(self, constexprs: Dict, num_warps: int, target=None):
        """``triton.compile`` of one specialisation (``target`` defaults to the current GPU)."""
        from triton.compiler import ASTSource
        missing = set(self.constexpr_names) - set(constexprs)
        if missing:
            raise EPError(f"{self.name}: constexpr values missing for {sorted(missing)}")
        names = list(self.signature)
        attrs = {(names.index(name),): [["tt.divisibility", 16]] for name in self.aligned}
        source = ASTSource(self.fn, dict(self.signature), constexprs=dict(constexprs), attrs=attrs)
        if target is None:
            target = triton.runtime.driver.active.get_current_target()
        return triton.compile(source, target=target, options={"num_warps": num_warps})


class BoundKernel:
    """One compiled specialisation; ``launch(grid_x, grid_y, stream, *args)`` starts it.

    ``args`` are the runtime parameters in declaration order (tensors or int addresses for
    pointers); ``stream`` is a raw CUDA stream handle (:func:`current_stream`).
    """

    __slots__ = ("name", "_run", "_function", "_metadata", "_coop", "_pdl", "_constexprs", "_fallback")

    def __init__(self, spec: KernelSpec, constexprs: Dict, num_warps: int):
        self.name = spec.name
        self._constexprs = tuple(constexprs[name] for name in spec.constexpr_names)
        self._fallback = None
        compiled = spec.compile(constexprs, num_warps)
        try:
            compiled._init_handles()
            launcher = compiled.run
            self._run = launcher.launch
            self._function = compiled.function
            self._metadata = compiled.packed_metadata
            self._coop = launcher.launch_cooperative_grid
            self._pdl = launcher.launch_pdl
            scratch = (launcher.global_scratch_size, launcher.profile_scratch_size)
        except AttributeError:
            self._fallback = (spec.fn, dict(constexprs), num_warps)
            return
        if any(scratch):
            raise EPError(f"{self.name} needs Triton scratch memory {scratch}; epcomm kernels must not")

    def launch(self, grid_x: int, grid_y: int, stream: int, *args) -> None:
        if self._fallback is None:
            self._run(grid_x, grid_y, 1, stream, self._function, self._coop, self._pdl, None, None,
                      self._metadata, None, None, None, *args, *self._constexprs)
        else:
            fn, constexprs, num_warps = self._fallback
            fn[(grid_x, grid_y, 1)](*args, num_warps=num_warps, **constexprs)


def current_stream(device_index: int) -> int:
    """The raw handle of the current CUDA stream of ``device_index`` (cheap: no Stream object)."""
    return torch._C._cuda_getCurrentRawStream(device_index)


def launch_mode() -> str:
    """``"bound"`` when kernels launch through their C launchers directly, else ``"jit"``."""
    try:
        from triton.compiler.compiler import CompiledKernel  # noqa: F401
        from triton.backends.nvidia.driver import CudaLauncher  # noqa: F401
        return "bound"
    except ImportError:
        return "jit"
