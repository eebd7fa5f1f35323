"""Docstrings name only files of this repository, and on the API pages as links.

The API pages (mkdocstrings, ``::: name`` in a docs page) render docstrings as Markdown on
the page that names them, so a file a rendered docstring mentions must be a link,
``[docs/x.md](../x.md)``, relative to that page; plain text would show as a dead path.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from pathlib import Path

import pytest

import singd_cuda

from .blocks import ROOT

LINK = re.compile(r"\[[^\]]*\]\(([^)\s#]+)(?:#[^)\s]*)?\)")
FILE = re.compile(r"(?<![\w/.-])([\w./-]+\.md)\b")
PACKAGE = Path(singd_cuda.__file__).parent
DOCS = ROOT / "docs"


def _all_docstrings() -> list[tuple[str, str]]:
    """(where, docstring) of every module, class and function of the package, from source."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in [tree, *ast.walk(tree)]:
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                doc = ast.get_docstring(node)
                if doc:
                    name = getattr(node, "name", "<module>")
                    found.append((f"{path.relative_to(ROOT)}:{name}", doc))
    return found


def _resolve(name: str):
    module, _, attr = name.rpartition(".")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError):
        return importlib.import_module(name)


def _rendered_docstrings() -> list[tuple[Path, str, str]]:
    """(page, object name, docstring) of every object an API directive renders, its
    public members included."""
    found = []
    for page in sorted(DOCS.rglob("*.md")):
        for name in re.findall(r"^::: ([\w.]+)", page.read_text(), re.MULTILINE):
            obj = _resolve(name)
            found.append((page, name, inspect.getdoc(obj) or ""))
            if inspect.isclass(obj):
                for attr, member in vars(obj).items():
                    if not attr.startswith("_"):
                        found.append((page, f"{name}.{attr}", inspect.getdoc(member) or ""))
    return found


def _plain_mentions(doc: str) -> list[str]:
    return FILE.findall(LINK.sub("", doc))


def _names_a_document(mention: str) -> bool:
    """A path (``docs/x.md``) or a capitalised name (``DESIGN.md``); a plain lower-case name
    (``report.md``) is a file the code writes."""
    return "/" in mention or mention[0].isupper()


def test_docstrings_name_only_files_of_the_repository():
    """A document a docstring names is a path from the repository root; a link's target is
    relative to the API pages (one folder below docs/)."""
    missing = []
    for where, doc in _all_docstrings():
        missing += [
            (where, f)
            for f in _plain_mentions(doc)
            if _names_a_document(f) and not (ROOT / f).is_file()
        ]
        missing += [
            (where, t)
            for t in LINK.findall(doc)
            if t.endswith(".md") and not (DOCS / "api" / t).resolve().is_file()
        ]
    assert not missing, missing


def test_files_named_on_the_api_pages_are_links_that_resolve():
    rendered = _rendered_docstrings()
    assert any(name == "singd_cuda.SINGD" for _, name, _ in rendered)
    plain, broken = [], []
    for page, name, doc in rendered:
        plain += [(name, f) for f in _plain_mentions(doc)]
        broken += [
            (page.name, name, t)
            for t in LINK.findall(doc)
            if t.endswith(".md") and not (page.parent / t).resolve().is_file()
        ]
    assert not plain, f"make these links, [docs/x.md](../x.md): {plain}"
    assert not broken, broken


@pytest.mark.parametrize("doc", ["see docs/optimizers/singd.md.", "(DESIGN.md section 2)"])
def test_the_checks_see_a_plain_mention(doc):
    assert [m for m in _plain_mentions(doc) if _names_a_document(m)]


def test_a_link_is_not_a_plain_mention():
    assert not _plain_mentions("see [docs/optimizers/singd.md](../optimizers/singd.md).")
