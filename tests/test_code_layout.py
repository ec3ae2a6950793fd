"""The package's layout rules (docs/LAYOUT.md), checked on the source so a change that breaks one
fails CI: files stay short, only ``backends/gpu/reach`` knows how a peer is reached, and the
modules' top-level imports form no circle."""
import ast
import os

import pytest

SRC = os.path.join(os.path.dirname(__file__), "..", "src", "epcomm")
GPU = os.path.join(SRC, "backends", "gpu")


def _modules():
    for folder, _, files in os.walk(SRC):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                yield os.path.relpath(path, SRC), path


def test_no_source_file_over_700_lines():
    long = {rel: n for rel, path in _modules() if (n := sum(1 for _ in open(path))) > 700}
    assert not long, f"split these files (the limit is 700 lines): {long}"


def test_only_reach_names_the_transports_in_the_gpu_layer():
    """Outside ``gpu/reach`` the shared GPU layer says what it needs (a peer on another node, a
    device library), not which transport gives it; ``gpu/__init__.py`` is the package's map."""
    named = []
    for rel, path in _modules():
        inside_gpu = rel.startswith(os.path.join("backends", "gpu") + os.sep)
        if not inside_gpu or os.sep + "reach" + os.sep in rel or rel == os.path.join("backends", "gpu", "__init__.py"):
            continue
        for number, line in enumerate(open(path), 1):
            low = line.lower()
            if "loopback" in low or ("nvshmem" in low and "backends.nvshmem.bytes_for_tokens" not in low):
                named.append(f"{rel}:{number}: {line.strip()}")
    assert not named, "name the need, not the transport (gpu/reach knows it):\n" + "\n".join(named)


def _top_level_imports(rel: str, path: str):
    """Modules of epcomm that ``rel`` imports when it loads (function-level imports are lazy: they
    run after every module has loaded, so they cannot make a circle at import)."""
    package = ["epcomm"] + rel[:-3].split(os.sep)[:-1]
    if rel.endswith("__init__.py"):
        package = ["epcomm"] + rel.split(os.sep)[:-1]
    found = set()
    for node in ast.parse(open(path).read()).body:
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1]
                target = base + (node.module.split(".") if node.module else [])
            else:
                target = (node.module or "").split(".")
            if target[0] != "epcomm":
                continue
            found.add(".".join(target))
            for alias in node.names:  # "from . import x" imports a submodule
                found.add(".".join(target + [alias.name]))
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("epcomm"))
    return found


def test_no_import_circle():
    names = {}
    for rel, path in _modules():
        parts = rel[:-3].split(os.sep)
        name = ".".join(["epcomm"] + (parts[:-1] if parts[-1] == "__init__" else parts))
        names[name] = path
    graph = {name: {m for m in _top_level_imports(os.path.relpath(path, SRC), path) if m in names and m != name}
             for name, path in names.items()}
    # a package imported by its own submodule is loaded already (its __init__ ran first): not a circle
    graph = {name: {m for m in deps if not name.startswith(m + ".")} for name, deps in graph.items()}
    state, stack = {}, []

    def visit(name):
        state[name] = "open"
        stack.append(name)
        for dep in sorted(graph[name]):
            if state.get(dep) == "open":
                pytest.fail("import circle: " + " -> ".join(stack[stack.index(dep):] + [dep]))
            if dep not in state:
                visit(dep)
        stack.pop()
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name)
