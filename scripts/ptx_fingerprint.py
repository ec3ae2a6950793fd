"""A fingerprint of every kernel specialisation the compile tests build: one line per
specialisation, the SHA-256 of its PTX for sm_90 without line information. Run before and after a
move of kernel code and diff the two files: equal lines mean the same instructions (no GPU needed,
only Triton).

    python3 scripts/ptx_fingerprint.py before.txt      # (PYTHONPATH=src:tests, Triton installed)
    ... move code ...
    python3 scripts/ptx_fingerprint.py after.txt && diff before.txt after.txt
"""
import hashlib
import os
import re
import sys

sys.path[:0] = [os.path.join(os.path.dirname(__file__), "..", d) for d in ("src", "tests")]


def fingerprint(ptx: str) -> str:
    """The PTX up to its debug sections, without ``.file``/``.loc`` lines (they move with the code)."""
    code = re.split(r"\.section\s+\.debug", ptx)[0]
    code = "\n".join(line for line in code.splitlines() if not re.match(r"\s*(\.file|\.loc)\b", line))
    return hashlib.sha256(code.encode()).hexdigest()[:16]


def main(path: str) -> int:
    from triton.backends.compiler import GPUTarget
    import test_kernels_compile as cases
    lines = []
    for spec, constexprs, num_warps in list(cases._cases()) + list(cases._multi_node_cases()):
        ptx = spec.compile(constexprs, num_warps, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
        lines.append(f"{spec.name} {sorted(constexprs.items())} warps={num_warps} {fingerprint(ptx)}")
    with open(path, "w") as out:
        out.write("\n".join(lines) + "\n")
    print(f"{len(lines)} specialisations -> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "ptx_fingerprint.txt"))
