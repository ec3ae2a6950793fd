"""``epcomm.testing`` holds what a user's own tests import (routing, reference, launcher) and the
modules whose docstrings say why they stay (``epcomm check`` runs the sweeps; the two-level model
is the multi-node plan's statement); the project's scenario suites live in tests/, and nothing in
the package imports them. Source files stay under 700 lines."""
import ast
import os

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
TESTING = os.path.join(ROOT, "src", "epcomm", "testing")
PUBLIC = {"__init__.py", "launcher.py", "reference.py", "routing.py"}


def test_the_testing_package_keeps_the_helpers_and_says_why_it_keeps_more():
    kept = {name for name in os.listdir(TESTING) if name.endswith(".py")}
    for name in sorted(kept - PUBLIC):
        docstring = ast.get_docstring(ast.parse(open(os.path.join(TESTING, name)).read())) or ""
        assert "Kept in the package" in docstring, f"testing/{name}: move it to tests/ or say why it stays"
    assert kept - PUBLIC == {"sweeps.py", "two_level.py"}, kept


def test_no_module_of_the_package_imports_the_projects_tests():
    suites = {name[:-3] for name in os.listdir(os.path.dirname(os.path.abspath(__file__))) if name.endswith(".py")}
    found = []
    for folder, _, files in os.walk(os.path.join(ROOT, "src", "epcomm")):
        for name in (n for n in files if n.endswith(".py")):
            path = os.path.join(folder, name)
            for node in ast.walk(ast.parse(open(path).read())):
                modules = [node.module] if isinstance(node, ast.ImportFrom) and not node.level else \
                    [a.name for a in node.names] if isinstance(node, ast.Import) else []
                found += [f"{os.path.relpath(path, ROOT)}: {m}" for m in modules if m and m.split(".")[0] in suites]
    assert not found, found


def test_no_file_of_the_package_scripts_examples_or_tests_over_700_lines():
    long = {}
    for top in ("src", "scripts", "examples", "tests"):
        for folder, _, files in os.walk(os.path.join(ROOT, top)):
            for name in (n for n in files if n.endswith((".py", ".sh"))):
                path = os.path.join(folder, name)
                if (lines := sum(1 for _ in open(path))) > 700:
                    long[os.path.relpath(path, ROOT)] = lines
    assert not long, f"split these files (the limit is 700 lines): {long}"
