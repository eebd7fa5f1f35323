"""The set-up instructions in the order a reader runs them: the CPU build of torch is
named before the install block (installed after, pip keeps the CUDA build, ~6 GB)."""

from __future__ import annotations

import pytest

from .blocks import ROOT

CPU_TORCH = "pip install torch --index-url https://download.pytorch.org/whl/cpu"
INSTALL = 'python -m pip install -e ".[dev,harness,models,peers,docs]"'


@pytest.mark.parametrize("page", ["README.md", "docs/getting-started.md"])
def test_the_cpu_note_comes_before_the_install_block(page):
    text = " ".join((ROOT / page).read_text().split())
    assert CPU_TORCH in text and INSTALL in text, page
    assert text.index(CPU_TORCH) < text.index(INSTALL), page
