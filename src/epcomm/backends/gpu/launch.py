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

Kernels that call a device library (one that reaches peers on other nodes: gpu/reach) name it
with ``KernelSpec(library=...)``: its bitcode is linked at compile time and each loaded module is
initialised by the library (:class:`DeviceLibrary`).

If the Triton in use lacks the internals this relies on (it was written against Triton 3.4–3.6),
launches fall back to ``kernel[grid](...)``: the same compiled code, only slower to launch;
:func:`launch_mode` reports which path runs.
"""
from __future__ import annotations

import threading
from typing import Dict, Iterable, List, Optional, Tuple

import torch
import triton

from ...errors import EPError
from .compile_lock import compile_lock


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def p2(n: int) -> int:
    """Next power of two >= n (>= 1). Not triton.next_power_of_2: that one costs ~3 µs per call."""
    return 1 << (max(int(n), 1) - 1).bit_length()


class DeviceLibrary:
    """A device library some kernels call (LLVM bitcode linked into them) and what each loaded
    module needs before its first launch. Subclasses say where the bitcode is and how to set a
    module up; both are asked only when a kernel is compiled, never at import."""

    name: str = "?"

    def path(self) -> str:
        """Path of the library's ``.bc`` file."""
        raise NotImplementedError

    def init_module(self, compiled) -> None:
        """Prepare a loaded module (``compiled.module``, a CUmodule handle) for launches."""


class KernelSpec:
    """A Triton kernel and the types of its runtime parameters.

    Args:
        fn: the ``@triton.jit`` function. Its constexpr parameters must come after all others.
        types: Triton type string of each runtime parameter, in order (``"*i8"``, ``"*i32"``,
            ``"i32"``, ``"i64"``, ...). Default: each parameter's annotation, where the kernel
            declares it next to the parameter (``x_ptr: "*bf16"``, ``num_tokens: "i32"``).
        aligned: names of pointer parameters that are always 16-byte aligned (lets the compiler
            move 16 bytes per access through them; see copy.py).
        aligned_if: ``{constexpr: names}``: pointer parameters declared 16-byte aligned only in
            specialisations where that constexpr is True (e.g. user tensors the host checked).
        library: a :class:`DeviceLibrary` the kernel calls into (linked, and each module set up).
        library_if: ``(constexpr, value)``: the library is called only in specialisations where the
            constexpr has that value (``gpu/reach/modes.FAR_LIBRARY`` says which value links which
            library; the other transports link none).
        fp_fusion: let the compiler fuse a float multiply and add into one FMA (one rounding
            instead of two). False where results must equal torch's separate operations bit for bit.
    """

    def __init__(self, fn, types: Optional[Iterable[str]] = None, aligned: Iterable[str] = (),
                 aligned_if: Dict[str, Iterable[str]] = None, library: Optional[DeviceLibrary] = None,
                 library_if: Optional[Tuple[str, object]] = None,
                 fp_fusion: bool = True):
        self.fn = fn
        self.fp_fusion = fp_fusion
        self.library = library
        self.library_if = library_if
        self.name = fn.__name__
        params = getattr(fn, "params", None)
        if params is None:  # Triton's interpreter (TRITON_INTERPRET=1, CPU tests): read the function itself
            params = triton.runtime.jit.JITFunction(fn.fn).params
        runtime = [p.name for p in params if not p.is_constexpr]
        self.constexpr_names = [p.name for p in params if p.is_constexpr]
        if [p.name for p in params[:len(runtime)]] != runtime:
            raise EPError(f"{self.name}: constexpr parameters must come after all runtime parameters")
        if types is None:
            # (with ``from __future__ import annotations`` an annotation is its source text, quotes included)
            types = [p.annotation.strip("'\"") for p in params[:len(runtime)]]
            missing = [name for name, ty in zip(runtime, types) if not ty]
            if missing:
                raise EPError(f"{self.name}: no type given for {missing} (annotate them, e.g. x_ptr: \"*i8\")")
        types = list(types)
        if len(types) != len(runtime):
            raise EPError(f"{self.name}: {len(types)} types given for {len(runtime)} runtime parameters {runtime}")
        self.signature = dict(zip(runtime, types))
        self.signature.update({name: "constexpr" for name in self.constexpr_names})
        self.aligned = tuple(aligned)
        self.aligned_if = {flag: tuple(names) for flag, names in (aligned_if or {}).items()}
        unknown = (set(self.aligned).union(*self.aligned_if.values()) - set(runtime)) | \
            (set(self.aligned_if) - set(self.constexpr_names))
        if library_if and library_if[0] not in self.constexpr_names:
            unknown.add(library_if[0])
        if unknown:
            raise EPError(f"{self.name}: no parameters named {sorted(unknown)}")
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

    def library_of(self, constexprs: Dict) -> Optional[DeviceLibrary]:
        """The device library one specialisation calls (None: none)."""
        if self.library_if is not None and constexprs.get(self.library_if[0]) != self.library_if[1]:
            return None
        return self.library

    def compile(self, constexprs: Dict, num_warps: int, target=None, ptx_options: Optional[str] = None):
        """``triton.compile`` of one specialisation (``target`` defaults to the current GPU).
        ``ptx_options``: extra ptxas flags (tests pass ``--compile-only`` to check kernels whose device
        library is absent: calls into it stay unresolved)."""
        from triton.compiler import ASTSource
        missing = set(self.constexpr_names) - set(constexprs)
        if missing:
            raise EPError(f"{self.name}: constexpr values missing for {sorted(missing)}")
        names = list(self.signature)
        aligned = list(self.aligned)
        for flag, params in self.aligned_if.items():
            if constexprs[flag]:
                aligned += params
        attrs = {(names.index(name),): [["tt.divisibility", 16]] for name in aligned}
        source = ASTSource(self.fn, dict(self.signature), constexprs=dict(constexprs), attrs=attrs)
        if target is None:
            target = triton.runtime.driver.active.get_current_target()
        options = {"num_warps": num_warps}
        if not self.fp_fusion:
            options["enable_fp_fusion"] = False
        library = self.library_of(constexprs)
        if ptx_options:
            options["ptx_options"] = ptx_options
        elif library is not None:
            options["extern_libs"] = {library.name: library.path()}
        with compile_lock(f"{self.name}:{sorted(constexprs.items())}:{num_warps}:{target}"):
            return triton.compile(source, target=target, options=options)


# Every specialisation this process has compiled, in order ("name{constexprs}"): a test that times
# a wait reads it to tell a slow wait from a compile inside the timed window.
compiled_specialisations: List[str] = []


class BoundKernel:
    """One compiled specialisation; ``launch(grid_x, grid_y, stream, *args)`` starts it.

    ``args`` are the runtime parameters in declaration order (tensors or int addresses for
    pointers); ``stream`` is a raw CUDA stream handle (:func:`current_stream`).
    """

    __slots__ = ("name", "_run", "_function", "_metadata", "_coop", "_pdl", "_constexprs", "_fallback",
                 "num_warps", "n_regs", "shared", "_max_resident")

    def __init__(self, spec: KernelSpec, constexprs: Dict, num_warps: int):
        self.name = spec.name
        self._constexprs = tuple(constexprs[name] for name in spec.constexpr_names)
        self._fallback = None
        self._max_resident = None
        self.num_warps = num_warps
        compiled = spec.compile(constexprs, num_warps)
        compiled_specialisations.append(f"{spec.name}{sorted(constexprs.items())}")
        library = spec.library_of(constexprs)
        self.n_regs = getattr(compiled, "n_regs", 255) or 255
        self.shared = int(getattr(compiled.metadata, "shared", 0) or 0)
        try:
            compiled._init_handles()
            if library is not None:
                library.init_module(compiled)
            launcher = compiled.run
            self._run = launcher.launch
            self._function = compiled.function
            self._metadata = compiled.packed_metadata
            self._coop = launcher.launch_cooperative_grid
            self._pdl = launcher.launch_pdl
            scratch = (launcher.global_scratch_size, launcher.profile_scratch_size)
        except AttributeError:
            if library is not None:  # kernel[grid](...) would not link the library
                raise EPError(f"{self.name} calls {library.name}, which needs Triton's launcher internals "
                              f"(Triton 3.4-3.6); this Triton lacks them")
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

    # ------------------------------------------------------------------ all programs at once
    def resident_grid(self, items: int) -> int:
        """A 1-D grid for ``items`` work items whose programs can all run at once (one launch
        whose programs wait on each other): at most what the GPU's SMs hold of this kernel."""
        if self._max_resident is None:
            props = torch.cuda.get_device_properties(torch.cuda.current_device())
            per_sm = 1 if self._fallback is not None else programs_per_sm(
                self.num_warps, self.n_regs, self.shared, props.max_threads_per_multi_processor,
                getattr(props, "regs_per_multiprocessor", 65536), props.shared_memory_per_multiprocessor)
            self._max_resident = props.multi_processor_count * per_sm
        return max(1, min(items, self._max_resident))

    def launch_resident(self, grid_x: int, stream: int, *args) -> None:
        """Launch ``grid_x`` (from :meth:`resident_grid`) programs that must all be resident: a
        cooperative launch, so a grid the GPU cannot hold at once is refused instead of hanging.
        Refused (another kernel's resources counted, an estimate off), the grid shrinks and the
        launch is retried: the kernels take their items in turn, so any grid size is correct."""
        if self._fallback is not None:
            self.launch(grid_x, 1, stream, *args)
            return
        while True:
            try:
                self._run(grid_x, 1, 1, stream, self._function, 1, self._pdl, None, None,
                          self._metadata, None, None, None, *args, *self._constexprs)
                return
            except RuntimeError as err:
                if "COOPERATIVE" not in str(err).upper() or grid_x <= 1:
                    raise
                grid_x = max(1, grid_x // 2)
                self._max_resident = grid_x


class Specialisations(dict):
    """The launchers of one kernel that differ only in a few flag constexprs, each compiled on first
    use: ``kernels[flags]`` (a tuple, or one value for one flag) is a plain dict lookup once bound.

    Args:
        spec: the kernel.
        flags: names of the constexprs the key supplies, in key order.
        num_warps, fixed: the rest of the specialisation, the same for every key.
    """

    def __init__(self, spec: KernelSpec, flags: Iterable[str], num_warps: int, **fixed):
        super().__init__()
        self.spec, self.flags, self.num_warps, self.fixed = spec, tuple(flags), num_warps, fixed

    def __missing__(self, key) -> "BoundKernel":
        values = key if isinstance(key, tuple) else (key,)
        bound = self.spec.bind(num_warps=self.num_warps, **self.fixed, **dict(zip(self.flags, values)))
        self[key] = bound
        return bound


def programs_per_sm(num_warps: int, n_regs: int, shared: int, max_threads: int, regs: int, shared_per_sm: int) -> int:
    """Programs of one kernel an SM holds at once, limited by threads, registers (allocated per
    warp in units of 256) and shared memory (1 KB reserved per program); at least 1."""
    warp_regs = -(-max(n_regs, 1) // 8) * 8 * 32
    by_threads = max_threads // (num_warps * 32)
    by_regs = regs // (warp_regs * num_warps)
    by_shared = shared_per_sm // (shared + 1024)
    return max(1, min(by_threads, by_regs, by_shared, 32))


def current_stream(device_index: int) -> int:
    """The raw handle of the current CUDA stream of ``device_index`` (cheap: no Stream object)."""
    return torch._C._cuda_getCurrentRawStream(device_index)


def stream_capturing() -> bool:
    """Whether the current CUDA stream is being captured into a graph (cheap: one runtime query,
    no Stream object)."""
    return torch._C._cuda_isCurrentStreamCapturing()


def launch_mode() -> str:
    """``"bound"`` when kernels launch through their C launchers directly, else ``"jit"``."""
    try:
        from triton.compiler.compiler import CompiledKernel  # noqa: F401
        from triton.backends.nvidia.driver import CudaLauncher  # noqa: F401
        return "bound"
    except ImportError:
        return "jit"
