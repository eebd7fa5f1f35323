"""benchmarks/capture_cost.py: the record's tables run end to end and leave the library as
it was. Mechanics only: no assertion reads a number derived from a timing."""

from __future__ import annotations

import pytest

import singd_cuda.ops as ops
from singd_cuda.curvature.layers import SquareSums

from .host_cost_script import loaded


@pytest.mark.skipif(not ops.fused_available("cpu"), reason="fused ops not built")
def test_the_record_has_every_row_and_restores_the_square_sums(tmp_path):
    kept = (SquareSums.inputs, SquareSums.outputs)
    out = tmp_path / "capture.md"
    with loaded("capture_cost") as module:
        assert module.main(["--iterations", "2", "--steps", "2", "--out", str(out)]) == 0
    assert (SquareSums.inputs, SquareSums.outputs) == kept
    text = out.read_text()
    for row in ("| plain model", "| AdaFisher |", "| input side only", "| no square sums"):
        assert row in text
    assert "the input side's op" in text and "outside every op" in text
    assert "| `singd_cuda::diag_precond_step_` | 1 |" in text
