"""Cells, formatting and plots: a diverged run never stretches an axis or prints as a
huge number; time to target and the comparison against AdamW."""

from __future__ import annotations

import math

import pytest
from matplotlib.container import ErrorbarContainer

from singd_cuda.harness.optimizers import OptimizerChoice
from singd_cuda.harness.report import (
    cell_record,
    cell_row,
    cells,
    headers,
    loss_axis_range,
    memory_rows,
    plot_curves,
    plot_memory,
    plot_time_to_target,
)
from singd_cuda.harness.runner import RunResult, RunSpec
from singd_cuda.harness.timing import Timing

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


def timed_grid(grid_runs):
    """The grid with timing-pass times for AdamW and SINGD fp32 (not the bf16 cell)."""
    adamw, singd = ("t", "adamw", "fp32", "-"), ("t", "singd:diagonal", "fp32", "fp32")
    timings = {
        adamw: Timing(adamw, "cpu", cpu_ms=[1.0, 2.0, 1.0], wall_ms=[50.0] * 3),
        singd: Timing(singd, "cpu", cpu_ms=[2.0, 2.0, 4.0], wall_ms=[50.0] * 3),
    }
    return cells(grid_runs, timings)


def test_timed_times_replace_the_parallel_grids_and_say_so(grid):
    """With a timing pass: seconds = median steps x timed step time (median [min–max]
    over the rounds), time vs AdamW = steps ratio x the round-by-round step-time ratio;
    the parallel grid's times (1 ms per step here) appear nowhere in the row."""
    runs = [r for c in grid.values() for r in c.runs]
    table = timed_grid(runs)
    singd = table[("t", "singd:diagonal", "fp32", "fp32")]
    bad = table[("t", "singd:diagonal", "bf16-pure", "bf16")]
    assert singd.timed_seconds() == pytest.approx((0.04, 0.04, 0.08))  # 20 steps x 2 [2, 4] ms
    row = cell_row(singd, timed=True)
    assert row[8] == "0.04 [0.04–0.08]"
    # steps 20/30, step-time ratios per round 2, 1, 4 -> 1.33 [0.67–2.67]
    assert row[9] == "1.33x [0.67x–2.67x]" and row[11] == "2.00 [2.00–4.00]"
    assert cell_row(bad, timed=True)[8:] == ["not reached", "—", f"{bad.state_mib:.3f}", "—"]
    record = cell_record(singd)
    assert record["timed_time_vs_adamw"] == pytest.approx((4 / 3, 2 / 3, 8 / 3))
    assert record["time_vs_adamw"] == pytest.approx(2 / 3)  # the parallel grid's, kept
    timed, parallel = headers(True), headers(False)
    assert [h for h in timed if "(" in h] == [
        "s to target (timed)",
        "time vs AdamW (timed)",
        "step ms (timed)",
    ]
    assert [h for h in parallel if "(" in h] == [
        "s to target (parallel grid)",
        "time vs AdamW (parallel grid)",
        "step ms (parallel grid)",
    ]


def test_time_to_target_plot_says_where_its_times_come_from(grid, tmp_path):
    runs = [r for c in grid.values() for r in c.runs]
    timed = plot_time_to_target(tmp_path / "a.png", timed_grid(runs))
    parallel = plot_time_to_target(tmp_path / "b.png", grid)
    assert "timing pass" in timed.axes[0].get_xlabel()
    assert "parallel grid" in parallel.axes[0].get_xlabel()
    whiskers = [c for c in timed.axes[0].containers if isinstance(c, ErrorbarContainer)]
    assert len(whiskers) == 1 and len(whiskers[0].lines[2][0].get_segments()) == 3
    assert not any(isinstance(c, ErrorbarContainer) for c in parallel.axes[0].containers)


def test_memory_plot_has_factor_bars_only_for_optimizers_with_factors(grid, tmp_path):
    """AdamW (no factors) gets one "no factors" bar, SINGD one bar per factor dtype."""
    assert memory_rows("t", grid)[0] == [
        "adamw",
        f"{grid['t', 'adamw', 'fp32', '-'].state_mib:.3f}",
        "—",
    ]
    fig = plot_memory(tmp_path / "m.png", grid)
    bars = {c.get_label(): len(c.patches) for c in fig.axes[0].containers}
    assert bars == {"fp32 factors": 1, "no factors": 1}  # SINGD fp32; no bf16 cell on fp32
    runs = [r for c in grid.values() for r in c.runs]
    runs += [fake("singd:diagonal", "fp32", "bf16", s, [2.3, 1.0, 0.7, 0.6]) for s in range(3)]
    fig = plot_memory(tmp_path / "m.png", cells(runs))
    bars = {c.get_label(): len(c.patches) for c in fig.axes[0].containers}
    assert bars == {"fp32 factors": 1, "bf16 factors": 1, "no factors": 1}
