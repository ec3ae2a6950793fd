"""Every ``from .x import name`` inside epcomm, and every ``from epcomm.x import name`` in the
package, its tests and scripts, names a module that exists and a name it defines.

The GPU modules import Triton, which the CPU CI does not install, so their imports never run
there (nor the tests' imports of them): a renamed module or a moved name would first fail on a GPU
machine. This reads the sources instead (``ast``) and resolves each import to its file.
"""
import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SRC = os.path.join(ROOT, "src")


def _modules(*tops):
    for top in tops or (os.path.join(SRC, "epcomm"),):
        for folder, _, files in os.walk(top):
            for name in files:
                if name.endswith(".py"):
                    yield os.path.join(folder, name)


def _target(path: str, level: int, module: str):
    """The file an import ``from <level dots><module> import ...`` in ``path`` reads (level 0: an
    absolute ``epcomm...`` module)."""
    base = os.path.dirname(path) if level else SRC
    for _ in range(level - 1):
        base = os.path.dirname(base)
    target = os.path.join(base, *module.split(".")) if module else base
    if os.path.isdir(target):
        return os.path.join(target, "__init__.py"), target
    return target + ".py", None


def _defined(path: str):
    """Top-level names a module defines (functions, classes, assignments, imports)."""
    tree = ast.parse(open(path, encoding="utf-8").read())
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                for leaf in ast.walk(target):
                    if isinstance(leaf, ast.Name):
                        names.add(leaf.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        if isinstance(node, ast.FunctionDef) and node.name == "__getattr__":  # names handed out lazily
            names.update(c.value for c in ast.walk(node) if isinstance(c, ast.Constant) and isinstance(c.value, str))
        elif isinstance(node, (ast.If, ast.Try)):  # names defined under a guard count too
            for inner in ast.walk(node):
                if isinstance(inner, (ast.FunctionDef, ast.ClassDef)):
                    names.add(inner.name)
                elif isinstance(inner, (ast.Import, ast.ImportFrom)):
                    names.update((alias.asname or alias.name).split(".")[0] for alias in inner.names)
                elif isinstance(inner, ast.Name) and isinstance(inner.ctx, ast.Store):
                    names.add(inner.id)
    return names


FILES = sorted(_modules(os.path.join(SRC, "epcomm"), os.path.join(ROOT, "tests"), os.path.join(ROOT, "scripts"),
                        os.path.join(ROOT, "examples"), os.path.join(ROOT, "compat")))


@pytest.mark.parametrize("path", FILES, ids=lambda p: os.path.relpath(p, ROOT))
def test_epcomm_imports_resolve(path):
    tree = ast.parse(open(path, encoding="utf-8").read())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "epcomm":
                    target, _ = _target(path, 0, alias.name)
                    assert os.path.exists(target), f"{os.path.relpath(path, ROOT)}:{node.lineno}: no module {alias.name}"
            continue
        if not isinstance(node, ast.ImportFrom):
            continue
        if not node.level and (node.module or "").split(".")[0] != "epcomm":
            continue
        if node.level and not path.startswith(SRC):
            continue  # (a test's own relative import: none today)
        target, package = _target(path, node.level, node.module or "")
        where = f"{os.path.relpath(path, ROOT)}:{node.lineno}"
        assert os.path.exists(target), f"{where}: no module {os.path.relpath(target, ROOT)}"
        defined = _defined(target)
        for alias in node.names:
            if alias.name == "*":
                continue
            submodule = package and os.path.exists(os.path.join(package, alias.name + ".py"))
            subpackage = package and os.path.isdir(os.path.join(package, alias.name))
            assert alias.name in defined or submodule or subpackage, \
                f"{where}: {alias.name!r} is not defined in {os.path.relpath(target, ROOT)}"


def _module_names():
    for path in _modules():
        rel = os.path.relpath(path, SRC)[:-3].replace(os.sep, ".")
        if not rel.endswith("__main__"):  # (running it is the CLI)
            yield rel[:-len(".__init__")] if rel.endswith(".__init__") else rel


@pytest.mark.parametrize("name", sorted(_module_names()))
def test_every_module_imports_where_triton_is_installed(name):
    """Where Triton is installed (not in CPU CI), import every module for real: module-level code
    runs, kernel specs are built."""
    pytest.importorskip("triton")
    import importlib
    importlib.import_module(name)
