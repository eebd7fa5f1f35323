"""Cells, formatting and plots: a diverged run never stretches an axis or prints as a
huge number; time to target and the comparison against AdamW."""

from __future__ import annotations

import math

import pytest

from singd_cuda.harness.optimizers import OptimizerChoice
from singd_cuda.harness.report import (
    cell_row,
    cells,
    loss_axis_range,
    plot_curves,
    plot_time_to_target,
)
from singd_cuda.harness.runner import RunResult, RunSpec

STEPS = [0, 10, 20, 30]


def fake(label: str, precision: str, factor: str, seed: int, losses, seconds=(0, 1, 2, 3)):
    """A finished run with the given held-out losses (None = non-finite) at STEPS."""
    name, _, structure = label.partition(":")
    spec = RunSpec(
        "t", OptimizerChoice(name, structure or None), precision, factor, seed, 30, (("lr", 0.1),)
    )
    r = RunResult(spec)
    n = len(losses)
    r.eval_steps, r.eval_loss = STEPS[:n], list(losses)
    r.eval_accuracy = [None if x is None else 0.1 * (i + 1) for i, x in enumerate(losses)]
    r.eval_seconds = list(seconds[:n])
    r.step_ms = [1.0] * (STEPS[n - 1] if n else 0)
    if None in losses:
        r.first_nonfinite_step = STEPS[losses.index(None)]
    return r


@pytest.fixture
def grid():
    runs = []
    for seed, shift in enumerate((0.0, 0.02, -0.02)):
        runs.append(fake("adamw", "fp32", "-", seed, [2.3, 1.5, 1.0 + shift, 0.8 + shift]))
        runs.append(fake("singd:diagonal", "fp32", "fp32", seed, [2.3, 1.0, 0.7, 0.6 + shift]))
        # bf16: one seed explodes to 1e12 (diverged), one goes nan
        bad = [2.3, 50.0, 1e9, 1e12] if seed == 0 else [2.3, 1.1, 0.8, 0.7 + shift]
        if seed == 1:
            bad = [2.3, 1.2, None]
        runs.append(fake("singd:diagonal", "bf16-pure", "bf16", seed, bad))
    return cells(runs)


def test_cell_statistics_verdicts_and_time_to_target(grid):
    adamw = grid[("t", "adamw", "fp32", "-")]
    singd = grid[("t", "singd:diagonal", "fp32", "fp32")]
    bad = grid[("t", "singd:diagonal", "bf16-pure", "bf16")]
    assert adamw.loss.mean == pytest.approx(0.8) and adamw.loss.n == 3
    assert singd.target == pytest.approx(0.8)
    # 0.7 <= 0.8 first at step 20 in every seed; seconds = steps x median step (1 ms)
    assert singd.reach() == pytest.approx((20, 0.02, 3))
    assert adamw.reach()[0] == 30
    assert bad.failed == 2 and bad.verdict == "failed"
    row = cell_row(bad)
    assert "2/3" in row[5] and row[6] == "failed"
    assert not any("e+" in c or "1000000" in c for c in row)
    assert cell_row(singd)[9] == f"{2 / 3:.2f}x"  # 20 steps vs AdamW's 30 at 1 ms each


def test_all_seeds_diverged_reads_diverged_not_a_number():
    runs = [fake("kfac", "fp32", "fp32", s, [2.3, 1e6, 1e13]) for s in range(3)]
    row = cell_row(cells(runs)[("t", "kfac", "fp32", "fp32")])
    assert row[3] == row[4] == "diverged" and row[5] == "3/3 diverged"


def test_loss_axis_ignores_the_diverged_run(grid, tmp_path):
    low, high = loss_axis_range(list(grid.values()))
    assert high == pytest.approx(1.5 * 2.3) and 0 < low <= 0.58 * 0.8 + 1e-9
    fig = plot_curves(tmp_path / "c.png", "t", grid)
    loss_axes = [ax for ax in fig.axes if ax.get_yscale() == "log"]
    assert len(loss_axes) == 2  # one column per optimizer label
    for ax in loss_axes:
        bottom, top = ax.get_ylim()
        assert top == pytest.approx(high) and bottom == pytest.approx(low)
        for line in ax.get_lines():
            assert max(line.get_ydata()) <= high
    texts = [t.get_text() for ax in fig.axes for t in ax.texts]
    assert "diverged" in texts and "nan" in texts  # the failed seeds are marked
    colours = {line.get_color() for line in loss_axes[1].get_lines() if line.get_label()[0] != "_"}
    assert len(colours) == 2  # fp32/fp32 and bf16-pure/bf16 differ
    assert (tmp_path / "c.png").stat().st_size > 0


def test_time_to_target_chart_marks_not_reached(grid, tmp_path):
    plot_time_to_target(tmp_path / "t.png", grid)
    assert (tmp_path / "t.png").stat().st_size > 0
    assert math.isfinite(cell_row(grid[("t", "adamw", "fp32", "-")])[8].count("."))


def test_target_without_fp32_adamw_is_adamws_first_precision():
    runs = [
        fake("adamw", "bf16-amp", "-", 0, [2.0, 1.5, 1.2, 1.0]),
        fake("singd:diagonal", "bf16-amp", "fp32", 0, [2.0, 1.1, 0.9, 0.8]),
    ]
    table = cells(runs)
    singd = table[("t", "singd:diagonal", "bf16-amp", "fp32")]
    assert singd.target == 1.0 and singd.reach()[0] == 20


def test_verdict_without_fp32_model_is_against_the_first_precision():
    """A language-model grid of bf16 autocast and pure fp16 (no fp32 model): each
    optimizer's cells are judged against its bf16-autocast cell with fp32 factors."""
    runs = []
    for seed, shift in enumerate((0.0, 0.01, -0.01)):
        runs.append(fake("adamw", "bf16-amp", "-", seed, [2.0, 1.5, 1.2, 1.0 + shift]))
        runs.append(fake("adamw", "fp16-pure", "-", seed, [2.0, None]))
        runs.append(fake("singd:diagonal", "bf16-amp", "fp32", seed, [2.0, 1.1, 0.9, 0.8 + shift]))
        runs.append(fake("singd:diagonal", "bf16-amp", "fp16", seed, [2.0, 1.1, 0.9, 1.2 + shift]))
        runs.append(fake("singd:diagonal", "fp16-pure", "fp32", seed, [2.0, 1.1, 0.9, 0.8 - shift]))
    table = cells(runs)
    assert table[("t", "adamw", "bf16-amp", "-")].verdict == "reference"
    assert table[("t", "adamw", "fp16-pure", "-")].verdict == "failed"
    assert table[("t", "singd:diagonal", "bf16-amp", "fp32")].verdict == "reference"
    assert table[("t", "singd:diagonal", "bf16-amp", "fp16")].verdict == "degraded"
    assert table[("t", "singd:diagonal", "fp16-pure", "fp32")].verdict == "same within noise"
