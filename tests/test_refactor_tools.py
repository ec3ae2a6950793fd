"""The two checks that let a kernel's parameters be regrouped without a GPU: the canonical PTX
fingerprint (scripts/ptx_fingerprint.py: the same code whatever the order of the parameters) and
the launch check (scripts/launch_equivalence.py: each launch binds the same arguments to the same
names). Each must pass a pure reordering and catch a real change."""
import ast
import importlib.util
import os
import textwrap

import pytest

SCRIPTS = os.path.join(os.path.dirname(__file__), "..", "scripts")


def _script(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(SCRIPTS, name + ".py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


KERNEL = '''
import triton
import triton.language as tl


@triton.jit
def k({params}):
    i = tl.arange(0, BLOCK)
    tl.store(out_ptr + i, tl.load(in_ptr + i, mask=i < n) * scale + {offset}, mask=i < n)
'''
ORDERED = 'in_ptr: "*i32", out_ptr: "*i32", n: "i32", scale: "i32", BLOCK: tl.constexpr'
REGROUPED = 'n: "i32", scale: "i32", out_ptr: "*i32", in_ptr: "*i32", BLOCK: tl.constexpr'
HOST = '''
def call(kernel, a, b, count, factor):
    kernel.launch(1, 1, 0, {args})
'''


def _tree(root, params, offset, args):
    os.makedirs(root)
    with open(os.path.join(root, "kern.py"), "w") as out:
        out.write(KERNEL.format(params=params, offset=offset))
    with open(os.path.join(root, "host.py"), "w") as out:
        out.write(HOST.format(args=args))
    return root


def test_launch_check_passes_a_reordering_and_names_a_swapped_argument(tmp_path):
    check = _script("launch_equivalence").check
    sites = {"k": ("kern.py", [("host.py", "call", 0)])}
    before = _tree(str(tmp_path / "a"), ORDERED, 1, "a, b, count, factor")
    same = _tree(str(tmp_path / "b"), REGROUPED, 1, "count, factor, b, a")
    swapped = _tree(str(tmp_path / "c"), REGROUPED, 1, "count, factor, a, b")
    changed = _tree(str(tmp_path / "d"), REGROUPED, 2, "count, factor, b, a")
    assert check(before, same, sites) == []
    assert "out_ptr" in " ".join(check(before, swapped, sites))
    assert "body differs" in " ".join(check(before, changed, sites))


STARRED_HOST = '''
def call(kernel, a, b, count, factor, extra):
    pair = ({first}, {second})
    kernel.launch(1, 1, 0, *pair[:1], *extra, *pair[1:], *rest)
'''


def test_launch_check_expands_tuple_displays_and_stated_lengths_and_refuses_two_unknown(tmp_path):
    """Starred arguments (the one-node launches have several): a tuple display the function assigns
    once is expanded to its elements, a site states another's length, one left is solved by count;
    two of unknown length are refused by name."""
    check = _script("launch_equivalence").check

    def tree(name, first, second, params=ORDERED):
        root = _tree(str(tmp_path / name), params, 1, "a")
        with open(os.path.join(root, "host.py"), "w") as out:
            out.write(STARRED_HOST.format(first=first, second=second))
        return root
    sites = {"k": ("kern.py", [("host.py", "call", 0, {"extra": 1})])}
    before = tree("a", "a", "b")
    assert check(before, tree("b", "a", "b"), sites) == []
    swapped, = check(before, tree("c", "b", "a"), sites)  # (pair's elements: in_ptr and n)
    assert "'in_ptr': ('a', 'b')" in swapped and "'n': ('b', 'a')" in swapped and "out_ptr" not in swapped
    with pytest.raises(SystemExit, match=r"2 starred arguments of unknown length \(\*extra, \*rest\)"):
        check(before, before, {"k": ("kern.py", [("host.py", "call", 0)])})
    # a name bound again (a loop here) is not the display; a bound that is not a literal is unknown
    module = _script("launch_equivalence")
    rebound = ast.parse("def f(a):\n    pair = (a, a)\n    for pair in []: pass\n    same = (a, 1)\n"
                        "    def inner():\n        same = ()\n").body[0]
    assert module._tuple_displays(rebound) == {"same": ["a", "1"]}
    sliced = ast.parse("pair[:n]", mode="eval").body
    assert module._known_elements(sliced, {"pair": ["a", "b"]}, {}) is None


def test_the_launch_check_reads_this_trees_launches():
    """SITES must fit the tree as it stands: the check of the tree against itself passes (it
    refused the stage's launch, with two starred arguments, from 2026-11-29 to 29f)."""
    module = _script("launch_equivalence")
    root = os.path.join(os.path.dirname(__file__), "..")
    assert module.check(root, root) == []


def test_canonical_ptx_is_the_same_for_a_reordering_and_differs_for_a_change(tmp_path):
    pytest.importorskip("triton")
    import sys
    from triton.backends.compiler import GPUTarget
    from epcomm.backends.gpu.launch import KernelSpec
    tool = _script("ptx_fingerprint")

    def fingerprint(root):
        sys.path.insert(0, root)
        try:
            module = importlib.util.spec_from_file_location("kern_" + os.path.basename(root),
                                                            os.path.join(root, "kern.py"))
            kern = importlib.util.module_from_spec(module)
            module.loader.exec_module(kern)
        finally:
            sys.path.remove(root)
        spec = KernelSpec(kern.k)
        ptx = spec.compile(dict(BLOCK=128), 4, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
        return tool.fingerprint(ptx, "k", [n for n, t in spec.signature.items() if t != "constexpr"])

    before = fingerprint(_tree(str(tmp_path / "a"), ORDERED, 1, ""))
    assert fingerprint(_tree(str(tmp_path / "b"), REGROUPED, 1, "")) == before
    assert fingerprint(_tree(str(tmp_path / "c"), REGROUPED, 2, "")) != before


def test_canonical_ptx_ignores_the_debug_labels_of_an_inlined_helper():
    """A kernel body moved into a @triton.jit helper compiles to the same instructions with
    ``$L__tmp`` labels (the debug sections' marks of inlined calls) in new places (seen when a
    kernel's body moved into a helper, 2026-11-28f). Those labels are not code."""
    tool = _script("ptx_fingerprint")
    plain = ".entry k(\n\t.param .u64 k_param_0\n)\n{\n\tld.param.u64 %rd1, [k_param_0];\n\tadd.s64 %rd2, %rd1, 8;\n\tret;\n}"
    inlined = plain.replace("\tadd.s64", "$L__tmp0:\n\tadd.s64").replace("\tret;", "$L__tmp1:\n\tret;")
    assert tool.fingerprint(inlined, "k", ["x_ptr"]) == tool.fingerprint(plain, "k", ["x_ptr"])
    assert tool.fingerprint(plain.replace("8;", "16;"), "k", ["x_ptr"]) != tool.fingerprint(plain, "k", ["x_ptr"])
