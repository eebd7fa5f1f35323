"""benchmarks/vs_peers.py: a tiny grid runs end to end and reports what the optimizer adds
over the plain model's forward + backward, with ratios and target verdicts. Mechanics only:
no assertion reads a number derived from a timing (those are noise on a busy machine)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "vs_peers.py"


@pytest.fixture(scope="module")
def vs_peers():
    spec = importlib.util.spec_from_file_location("vs_peers", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["vs_peers"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    yield module
    del sys.modules["vs_peers"]


def test_small_grid_writes_the_table(vs_peers, tmp_path):
    pytest.importorskip("singd")
    out = tmp_path / "peers.md"
    argv = ["--quick", "--structures", "dense", "diagonal", "--steps", "3", "--out", str(out)]
    assert vs_peers.main(argv) == 0
    text = out.read_text()
    assert "Plain model forward + backward" in text
    lines = text.splitlines()
    header = next(line for line in lines if line.startswith("| model |"))
    columns = [cell.strip() for cell in header.strip("|").split("|")]
    rows = [
        dict(zip(columns, (cell.strip() for cell in line.strip("|").split("|")), strict=True))
        for line in lines
        if line.startswith("| mlp | float32 | 10 |")
    ]
    assert {row["optimizer"] for row in rows} == {
        "ours",
        "ours-ref",
        "singd-0.0.5",
        "adamw-foreach",
        "adamw-fused",
    }
    assert not any("error" in cell for row in rows for cell in row.values())
    dense = next(row for row in rows if row["structure"] == "dense" and row["optimizer"] == "ours")
    assert float(dense["cache KiB"]) > 0  # K Kᵀ and C Cᵀ are cached at T = 10
    # the required matrix products are timed for the structures that have them
    diagonal = next(r for r in rows if r["structure"] == "diagonal" and r["optimizer"] == "ours")
    assert dense["products"] != "-" and diagonal["products"] == "-"
    verdicts = [line for line in text.splitlines() if line.startswith("- ")]
    assert any("ours/singd (stats + step)" in line for line in verdicts)
    assert any("ours/AdamW-foreach (stats + step)" in line for line in verdicts)


def test_overhead_pairs_each_round_with_the_plain_model(vs_peers):
    runners = vs_peers.build_runners("mlp", ["diagonal"], 10, None, ["ours"])
    assert [r.name for r in runners] == ["plain", "ours"]
    assert runners[0].opt is None
