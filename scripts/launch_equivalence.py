"""Proof that a re-ordering of kernel parameters changed nothing: run it on the tree before and the
tree after, no GPU needed (no Triton either: it reads the source).

    python3 scripts/launch_equivalence.py BEFORE_ROOT AFTER_ROOT

For every kernel in SITES it checks that (1) the kernel's body is the same code (its AST, comments
aside), (2) the kernel has the same runtime parameters and the same constexprs in the same order
(they are passed by keyword), and (3) at every launch of it, each parameter NAME receives the same
argument expression before and after. Together: each launch binds the same values to the same
names of the same code, whatever the order of the signature. Exits 1 naming what differs.

A launch is found by its file, enclosing function and its place among that function's
``.launch(``/``.launch_resident(`` calls (SITES). A starred argument is expanded where its length
is known: a name the function assigns once to a tuple display (``*notify_args[3:6]`` becomes the
display's elements, as written), or a length a site states (``{"notify": 0}``: the stage launched
without the count exchange). At most one starred argument of unknown length (``*outputs``) stands
for the parameters left, as ``outputs[0]``, ``outputs[1]``, ...
"""
import ast
import os
import sys

GPU = os.path.join("src", "epcomm", "backends", "gpu")
ONE_NODE = os.path.join(GPU, "normal", "one_node")

# kernel name -> (the module that defines it, [(host module, function, index of the launch in it[,
# {starred argument: its length in this kernel's launches}])])
SITES = {
    "ep_notify_dispatch": (os.path.join(ONE_NODE, "notify.py"), [(os.path.join(ONE_NODE, "mode.py"), "dispatch", 0)]),
    "ep_dispatch_stage": (os.path.join(ONE_NODE, "stage.py"),
                          [(os.path.join(ONE_NODE, "mode.py"), "_stage", 0, {"notify": 0})]),
    "ep_dispatch_pull": (os.path.join(ONE_NODE, "dispatch.py"), [(os.path.join(ONE_NODE, "mode.py"), "dispatch", 1,
                                                                      {"outputs": 4})]),
    "ep_combine_push": (os.path.join(ONE_NODE, "combine.py"), [(os.path.join(ONE_NODE, "mode.py"), "combine", 0)]),
    "ep_combine_reduce": (os.path.join(ONE_NODE, "combine.py"), [(os.path.join(ONE_NODE, "mode.py"), "combine", 1)]),
}


def _functions(path):
    return {node.name: node for node in ast.walk(ast.parse(open(path).read())) if isinstance(node, ast.FunctionDef)}


def _params(kernel: ast.FunctionDef):
    """(runtime names in order, constexpr names in order)."""
    runtime, constexprs = [], []
    for arg in kernel.args.args:
        is_constexpr = arg.annotation is not None and "constexpr" in ast.dump(arg.annotation)
        (constexprs if is_constexpr else runtime).append(arg.arg)
    return runtime, constexprs


def _launches(function: ast.FunctionDef):
    calls = [node for node in ast.walk(function) if isinstance(node, ast.Call)
             and isinstance(node.func, ast.Attribute) and node.func.attr in ("launch", "launch_resident")]
    return sorted(calls, key=lambda node: (node.lineno, node.col_offset))


def _own_nodes(function: ast.FunctionDef):
    """The nodes of ``function``'s own scope: its body, not the bodies of functions, lambdas or
    classes defined in it."""
    pending = list(function.body)
    while pending:
        node = pending.pop()
        yield node
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            pending.extend(ast.iter_child_nodes(node))


def _tuple_displays(function: ast.FunctionDef):
    """{name: [element sources]} for each name that ``function``'s scope binds exactly once (any
    binding counts: an assignment, a loop or ``with`` target, an unpacking, ``:=``, a parameter),
    by a plain assignment of a tuple display without starred elements."""
    bindings, displays = {}, {}
    for arg in function.args.args + function.args.kwonlyargs + function.args.posonlyargs:
        bindings[arg.arg] = bindings.get(arg.arg, 0) + 1
    for node in _own_nodes(function):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            bindings[node.id] = bindings.get(node.id, 0) + 1
        elif isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name) \
                and isinstance(node.value, ast.Tuple) and not any(isinstance(e, ast.Starred) for e in node.value.elts):
            displays[node.targets[0].id] = [ast.unparse(e) for e in node.value.elts]
    return {name: elements for name, elements in displays.items() if bindings.get(name) == 1}


def _known_elements(value: ast.expr, displays: dict, lengths: dict):
    """The element sources a starred ``value`` expands to, where known statically, else None."""
    source = ast.unparse(value)
    if source in lengths:
        return [f"{source}[{j}]" for j in range(lengths[source])]
    if isinstance(value, ast.Name) and value.id in displays:
        return displays[value.id]
    if isinstance(value, ast.Subscript) and isinstance(value.value, ast.Name) and value.value.id in displays \
            and isinstance(value.slice, ast.Slice) and value.slice.step is None:
        try:
            bounds = [None if b is None else ast.literal_eval(b) for b in (value.slice.lower, value.slice.upper)]
        except ValueError:  # (a bound that is not a literal: of unknown length)
            return None
        return displays[value.value.id][bounds[0]:bounds[1]]
    return None


def _binding(call: ast.Call, names, displays=None, lengths=None):
    """{parameter name: argument source} for one launch (its first three arguments are the grid
    and the stream). ``displays``: the enclosing function's tuple displays (:func:`_tuple_displays`);
    ``lengths``: starred arguments' lengths the site states."""
    args = call.args[3:]
    known = [_known_elements(a.value, displays or {}, lengths or {}) if isinstance(a, ast.Starred) else None
             for a in args]
    unknown = [i for i, a in enumerate(args) if isinstance(a, ast.Starred) and known[i] is None]
    if len(unknown) > 1:
        raise SystemExit(f"line {call.lineno}: {len(unknown)} starred arguments of unknown length "
                         f"({', '.join(ast.unparse(args[i]) for i in unknown)}): state all but one in SITES")
    fixed = sum(1 if not isinstance(a, ast.Starred) else len(known[i]) for i, a in enumerate(args) if i not in unknown)
    expanded = []
    for i, arg in enumerate(args):
        if i in unknown:
            expanded += [f"{ast.unparse(arg.value)}[{j}]" for j in range(len(names) - fixed)]
        elif isinstance(arg, ast.Starred):
            expanded += known[i]
        else:
            expanded.append(ast.unparse(arg))
    if len(expanded) != len(names):
        raise SystemExit(f"line {call.lineno}: {len(expanded)} arguments for {len(names)} parameters {names}")
    return dict(zip(names, expanded))


def check(before_root: str, after_root: str, sites_by_kernel=None) -> list:
    problems = []
    for kernel_name, (kernel_file, sites) in (sites_by_kernel or SITES).items():
        before_kernel = _functions(os.path.join(before_root, kernel_file))[kernel_name]
        after_kernel = _functions(os.path.join(after_root, kernel_file))[kernel_name]
        if [ast.dump(s) for s in before_kernel.body] != [ast.dump(s) for s in after_kernel.body]:
            problems.append(f"{kernel_name}: the body differs")
        (before_runtime, before_constexprs), (after_runtime, after_constexprs) = \
            _params(before_kernel), _params(after_kernel)
        if sorted(before_runtime) != sorted(after_runtime) or before_constexprs != after_constexprs:
            problems.append(f"{kernel_name}: parameters differ: {before_runtime} {before_constexprs} -> "
                            f"{after_runtime} {after_constexprs}")
            continue
        for host_file, function, index, *lengths in sites:
            bindings = []
            for root, names in ((before_root, before_runtime), (after_root, after_runtime)):
                host = _functions(os.path.join(root, host_file))[function]
                bindings.append(_binding(_launches(host)[index], names, _tuple_displays(host),
                                         lengths[0] if lengths else None))
            if bindings[0] != bindings[1]:
                changed = {n: (bindings[0][n], bindings[1][n]) for n in before_runtime if bindings[0][n] != bindings[1][n]}
                problems.append(f"{kernel_name} launched in {host_file}:{function}: {changed}")
    return problems


if __name__ == "__main__":
    found = check(sys.argv[1], sys.argv[2])
    print("\n".join(found) if found else f"{len(SITES)} kernels: the same code, launched with the same arguments by name")
    sys.exit(1 if found else 0)
