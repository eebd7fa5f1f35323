"""benchmarks/gpu_check.py: imports, exits cleanly without CUDA, and its measuring and
reporting logic runs end to end on the CPU (``--dry-run``, tiny sizes)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

import singd_cuda.ops as ops

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_check.py"


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_without_cuda_says_so_and_exits_zero(gpu_check, monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "gpu.md"
    assert gpu_check.main(["--out", str(out)]) == 0
    assert "CUDA is not available" in capsys.readouterr().out
    assert not out.exists()


@pytest.mark.skipif(not ops.fused_available("cpu"), reason="fused ops not built")
def test_dry_run_writes_the_table(gpu_check, tmp_path):
    out = tmp_path / "gpu.md"
    assert gpu_check.main(["--dry-run", "--out", str(out)]) == 0
    text = out.read_text()
    assert "DRY RUN" in text
    for needle in ("device-to-device copy", "AdaFisher: optimizer.step()", "Conv2d", "target"):
        assert needle in text
    assert ops.diag_precond_step_.__module__ == "singd_cuda.ops"  # the probe was undone
