"""Every fenced Python block of README.md and docs/**/*.md runs, so the examples cannot rot.

The blocks of one page run in order in one namespace, in a temporary working directory
(examples may write files). Markers above a block (``blocks.py``) mark it not run (with a
reason), needing optional packages, or slow.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess

import pytest
import torch

from .blocks import blocks, dangling_markers, pages

ALL = [block for page in pages() for block in blocks(page)]
FAILED = "__docs_example_failed__"


def _params():
    for block in ALL:
        marks = [pytest.mark.slow] if block.slow else []
        yield pytest.param(block, id=block.id, marks=marks)


@pytest.fixture(scope="module")
def namespaces() -> dict[str, dict]:
    return {}


@pytest.mark.parametrize("block", list(_params()))
def test_example_runs(block, namespaces, tmp_path_factory, monkeypatch):
    if block.not_run is not None:
        pytest.skip(f"not run: {block.not_run}")
    missing = [name for name in block.requires if importlib.util.find_spec(name) is None]
    if missing:
        pytest.skip(f"needs {', '.join(missing)}")
    page = block.page
    if page not in namespaces:
        torch.manual_seed(0)
        namespaces[page] = {"__name__": f"docs_example_{len(namespaces)}"}
        namespaces[page]["__workdir__"] = tmp_path_factory.mktemp("docs_example")
    namespace = namespaces[page]
    if namespace.get(FAILED):
        pytest.fail(f"an earlier block of {page} failed ({namespace[FAILED]})")
    monkeypatch.chdir(namespace["__workdir__"])
    try:
        exec(compile(block.code, block.id, "exec"), namespace)
    except BaseException:
        namespace[FAILED] = block.id
        raise


def test_examples_are_found():
    """The extraction sees the README's example and the pages' (a fence it misses would
    silently never run)."""
    by_page = {block.page for block in ALL}
    assert "README.md" in by_page
    assert "docs/adamw-to-singd.md" in by_page
    for page in pages():
        text = page.read_text()
        assert text.count("```python") == len(blocks(page)), page


def test_not_run_markers_have_reasons():
    blank = [block.id for block in ALL if block.not_run is not None and not block.not_run]
    assert not blank, f"<!-- not run: REASON --> needs a reason: {blank}"


def test_markers_sit_on_blocks():
    problems = [problem for page in pages() for problem in dangling_markers(page)]
    assert not problems, problems


@pytest.mark.skipif(shutil.which("ruff") is None, reason="needs ruff (the dev extra)")
def test_examples_are_ruff_formatted():
    """The examples read like the code base: ``ruff format`` leaves every block as it is."""
    unformatted = []
    for block in ALL:
        formatted = subprocess.run(
            ["ruff", "format", "--line-length", "100", "--stdin-filename", "example.py", "-"],
            input=block.code,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        if formatted != block.code:
            unformatted.append(block.id)
    assert not unformatted, f"run ruff format on these blocks: {unformatted}"
