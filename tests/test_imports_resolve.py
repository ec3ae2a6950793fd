"""Every ``from .x import name`` inside epcomm names a module that exists and a name it defines.

The GPU modules import Triton, which the CPU CI does not install, so their imports never run
there: a renamed module or a moved name would first fail on a GPU machine. This reads the
sources instead (``ast``) and resolves each relative import to its file.
"""
import ast
import os

import pytest

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")


def _modules():
    for folder, _, files in os.walk(os.path.join(SRC, "epcomm")):
        for name in files:
            if name.endswith(".py"):
                yield os.path.join(folder, name)


def _target(path: str, level: int, module: str):
    """The file a relative import ``from <level dots><module> import ...`` in ``path`` reads."""
    base = os.path.dirname(path)
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


@pytest.mark.parametrize("path", sorted(_modules()), ids=lambda p: os.path.relpath(p, SRC))
def test_relative_imports_resolve(path):
    tree = ast.parse(open(path, encoding="utf-8").read())
    for node in ast.walk(tree):
        if not (isinstance(node, ast.ImportFrom) and node.level):
            continue
        target, package = _target(path, node.level, node.module or "")
        where = f"{os.path.relpath(path, SRC)}:{node.lineno}"
        assert os.path.exists(target), f"{where}: no module {target}"
        defined = _defined(target)
        for alias in node.names:
            if alias.name == "*":
                continue
            submodule = package and os.path.exists(os.path.join(package, alias.name + ".py"))
            subpackage = package and os.path.isdir(os.path.join(package, alias.name))
            assert alias.name in defined or submodule or subpackage, \
                f"{where}: {alias.name!r} is not defined in {os.path.relpath(target, SRC)}"
