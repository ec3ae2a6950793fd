"""A fingerprint of every kernel specialisation the compile tests build: one line per
specialisation, the SHA-256 of its PTX for sm_90 in a canonical form. Run before and after a move
of kernel code and diff the two files: equal lines mean the same instructions (no GPU needed,
only Triton).

    python3 scripts/ptx_fingerprint.py before.txt      # (PYTHONPATH=src:tests, Triton installed)
    ... move code ...
    python3 scripts/ptx_fingerprint.py after.txt && diff before.txt after.txt

The canonical form is the same PTX for code that differs only in what cannot change behaviour: line
information and the debug labels of inlined calls; the ORDER of the kernel's parameters (each is
named by its Python name, its type kept; the loads of parameters are dropped, their registers named
after the parameter); register numbers (renamed in order of first use); and the order of the two
operands of commutative instructions (add, mul, and, or, xor, min, max, mad/fma's product,
setp.eq/ne). So a regrouping of a kernel's signature leaves every line equal;
scripts/launch_equivalence.py checks the other half, that each launch still binds the same arguments
to the same names.
"""
import hashlib
import os
import re
import sys

sys.path[:0] = [os.path.join(os.path.dirname(__file__), "..", d) for d in ("src", "tests")]

_REGISTER = re.compile(r"%[a-z]+\d+")
_COMMUTATIVE = re.compile(r"^(\s*(?:add|mul|and|or|xor|min|max|mad|fma|setp\.eq|setp\.ne)(?:\.\S+)?\s+)"
                          r"([^,]+), ([^,;]+), ([^,;]+)(.*)$")


def canonical(ptx: str, kernel: str, params) -> str:
    """``ptx`` of ``kernel`` in the canonical form above; ``params``: its runtime parameter names,
    in declaration order (Triton names them ``<kernel>_param_<i>``)."""
    code = re.split(r"\.section\s+\.debug", ptx)[0]
    # (the $L__tmp labels mark inlined calls for the debug sections: where a body moves into a
    # helper they move, the instructions do not)
    lines = [line for line in code.splitlines() if not re.match(r"\s*(\.file|\.loc\b|\$L__tmp\d+:)", line)]
    named = [re.sub(rf"{kernel}_param_(\d+)",
                    lambda m: f"P[{params[int(m.group(1))] if int(m.group(1)) < len(params) else m.group(1)}]",
                    line) for line in lines]
    declarations = sorted(line.strip().rstrip(",") for line in named if ".param" in line and "P[" in line
                          and "ld.param" not in line)
    loaded = {}
    for line in named:
        match = re.match(r"\s*ld\.param\.\S+\s+(%[a-z]+\d+), \[P\[(\w+)\]\];", line)
        if match:
            loaded[match.group(1)] = "P_" + match.group(2)
    renamed = {}

    def rename(match):
        register = match.group(0)
        if register in loaded:
            return loaded[register]
        return renamed.setdefault(register, f"%v{len(renamed)}")

    body = []
    for line in named:
        if "P[" in line and (".param" in line):  # declarations (kept above, sorted) and parameter loads
            continue
        line = _REGISTER.sub(rename, line)
        match = _COMMUTATIVE.match(line)
        if match:
            first, second = sorted((match.group(3), match.group(4)))
            line = f"{match.group(1)}{match.group(2)}, {first}, {second}{match.group(5)}"
        body.append(line)
    return "\n".join(declarations + body)


def fingerprint(ptx: str, kernel: str, params) -> str:
    return hashlib.sha256(canonical(ptx, kernel, params).encode()).hexdigest()[:16]


def main(path: str) -> int:
    from triton.backends.compiler import GPUTarget
    import test_kernels_compile as cases
    lines = []
    for spec, constexprs, num_warps in list(cases._cases()) + list(cases._multi_node_cases()):
        ptx = spec.compile(constexprs, num_warps, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
        params = [name for name, kind in spec.signature.items() if kind != "constexpr"]
        lines.append(f"{spec.name} {sorted(constexprs.items())} warps={num_warps} "
                     f"{fingerprint(ptx, spec.name, params)}")
    with open(path, "w") as out:
        out.write("\n".join(lines) + "\n")
    print(f"{len(lines)} specialisations -> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "ptx_fingerprint.txt"))
