"""The README reads in five minutes and the docs are manuals: the README keeps its order and stays
near 150 lines, every doc opens with a short summary (what works, where it was measured, what is
open), and every file a doc links to exists (the notebook under docs/notes/ included)."""
import os
import re

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
DOCS = os.path.join(ROOT, "docs")
MANUALS = sorted(name for name in os.listdir(DOCS) if name.endswith(".md"))


def _read(*parts):
    return open(os.path.join(ROOT, *parts), encoding="utf-8").read()


def test_the_readme_is_short_and_in_the_newcomers_order():
    readme = _read("README.md")
    assert len(readme.splitlines()) <= 150
    headings = re.findall(r"^## (.+)$", readme, flags=re.M)
    assert headings == ["Requirements", "Quick start", "A runnable example: 2 CPU ranks", "The API in short",
                        "Where to read more"], headings
    assert "scripts/demo.sh" in readme and "scripts/test.sh" in readme
    for name in MANUALS:
        assert f"docs/{name}" in readme, f"README does not point to docs/{name}"


def test_every_doc_opens_with_its_summary():
    for name in MANUALS:
        head = "\n".join(_read("docs", name).splitlines()[:16])
        assert "**In short.**" in head, name
        for bullet in ("- **What works", "- **Where it was", "- **Open"):
            assert bullet in head, (name, bullet)


def test_every_link_of_the_readme_and_the_docs_exists():
    pages = [("README.md", ROOT)] + [(os.path.join("docs", name), DOCS) for name in MANUALS] + \
        [(os.path.join("docs", "notes", name), os.path.join(DOCS, "notes"))
         for name in os.listdir(os.path.join(DOCS, "notes")) if name.endswith(".md")]
    missing = []
    for page, base in pages:
        for target in re.findall(r"\]\(([^)#\s]+)\)", _read(page)):
            if not target.startswith("http") and not os.path.exists(os.path.join(base, target)):
                missing.append(f"{page}: {target}")
        for target in re.findall(r"`((?:docs|tests|scripts|examples|src)/[\w./-]+\.(?:md|py|sh))`", _read(page)):
            if not os.path.exists(os.path.join(ROOT, target)):
                missing.append(f"{page}: {target}")
    assert not missing, missing
