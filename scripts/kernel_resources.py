"""Registers, warps and programs per SM of each kernel the compile tests build, for sm_90, without a
GPU (Triton's ptxas and cuobjdump on the cubins). One line per kernel: its first specialisation in
tests/test_kernels_compile.py.

    python3 scripts/kernel_resources.py        # (PYTHONPATH=src:tests, Triton installed)

Why: a kernel that waits for its peers holds its SMs while it waits. Where ranks share one GPU
(the CUDA MPS bed) every rank's waiting programs together must leave an SM to a late sender
(docs/notes/multinode-log.md, finding 14); on real machines the same numbers bound how many warps an SM
has to hide a remote load's latency.
"""
import os
import re
import subprocess
import sys
import tempfile

sys.path[:0] = [os.path.join(os.path.dirname(__file__), "..", d) for d in ("src", "tests")]

REGISTERS_PER_SM = 65536  # sm_90
THREADS_PER_SM = 2048
SHARED_PER_SM = 228 * 1024


def programs_per_sm(registers: int, warps: int, shared_bytes: int) -> int:
    """How many programs of ``warps`` warps at ``registers`` per thread fit one sm_90 SM at once
    (registers are given out per warp in blocks of 256, rounded from each thread's count up to 8)."""
    per_warp = -(-max(registers, 1) * 32 // 256) * 256
    by_registers = REGISTERS_PER_SM // (per_warp * warps)
    by_threads = THREADS_PER_SM // (32 * warps)
    by_shared = SHARED_PER_SM // shared_bytes if shared_bytes else by_threads
    return max(0, min(by_registers, by_threads, by_shared, 32))


def resources(cubin: bytes, cuobjdump: str) -> dict:
    """``{"registers": n, "shared": bytes}`` of the one kernel in ``cubin``."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        out = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True,
                             check=True).stdout
    finally:
        os.unlink(f.name)
    match = re.search(r"REG:(\d+).*?SHARED:(\d+)", out)
    return {"registers": int(match.group(1)), "shared": int(match.group(2))}


def main() -> None:
    import triton
    from triton.backends.compiler import GPUTarget
    import test_kernels_compile as cases
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    seen = set()
    print(f"{'kernel':34} {'warps':>5} {'registers':>9} {'shared B':>8} {'per SM':>6}")
    for spec, constexprs, warps in cases._cases():
        if spec.name in seen:
            continue
        seen.add(spec.name)
        compiled = spec.compile(constexprs, warps, target=GPUTarget("cuda", 90, 32))
        used = resources(compiled.asm["cubin"], cuobjdump)
        shared = max(used["shared"], compiled.metadata.shared)
        print(f"{spec.name:34} {warps:>5} {used['registers']:>9} {shared:>8} "
              f"{programs_per_sm(used['registers'], warps, shared):>6}")


if __name__ == "__main__":
    main()
