"""Summaries of a grid: cells over seeds, verdicts, time-to-target, the Markdown report,
the JSON and the PNG plots.

Times: with a timing pass (:mod:`.timing`, the default), the report's step times, seconds
to target and time against AdamW come from it, labelled "timed", each as median
[min–max] over its rounds. Without one (``--no-timing``, older records) they come from the
grid's own step times, measured while other runs shared the machine, and are labelled
"parallel grid": rough. ``results.json`` keeps both; its ``median_step_ms``,
``seconds_to_target`` and ``time_vs_adamw`` are always the parallel grid's.

Runs that differ only in the seed form one cell, keyed (task, optimizer label, model
precision, factor precision). Numbers are means ± sample standard deviations over the
seeds that stayed finite; failed seeds (non-finite, error, diverged) are counted, never
averaged, so a diverged run shows as "diverged" or "nan", not as a huge number. The
verdict rule is in :mod:`singd_cuda.harness.stats`.
"""

from __future__ import annotations

import json
import math
import statistics
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

from .precision import NO_FACTORS
from .runner import RunResult
from .stats import Summary, median_or_none, summarize, verdict
from .timing import Timing, paired_ratios

MIB = 2**20
SCHEMA = "singd_cuda.harness/2"
REFERENCE = "adamw"


@dataclass
class Cell:
    """The runs of one (task, optimizer label, precision, factor) over all seeds."""

    key: tuple[str, str, str, str]
    runs: list[RunResult]
    fp32: Cell | None = None
    target: float | None = None  # AdamW's final held-out loss (mean over seeds): fp32's,
    # or, in a grid without fp32 AdamW, that of AdamW's first precision in the grid
    reference: Cell | None = None  # AdamW's cell in the same precision (else fp32)
    timing: Timing | None = None  # from the timing pass, if one ran

    @property
    def failed(self) -> int:
        return sum(not r.stable for r in self.runs)

    @property
    def failures(self) -> str:
        """What went wrong, how often: empty, or e.g. "1/3 nan@40", "3/3 diverged"."""
        bad = [r for r in self.runs if not r.stable]
        if not bad:
            return ""
        worst = min(bad, key=lambda r: (r.first_nonfinite_step is None, r.first_nonfinite_step))
        return f"{len(bad)}/{len(self.runs)} {worst.status}"

    @property
    def loss(self) -> Summary | None:
        return summarize([r.final_loss for r in self.runs if r.final_loss is not None])

    @property
    def accuracy(self) -> Summary | None:
        return summarize([r.final_accuracy for r in self.runs if r.final_accuracy is not None])

    @property
    def verdict(self) -> str:
        if self.fp32 is None or self.fp32 is self:
            return "failed" if self.failed else "reference"
        return verdict(self.loss, self.fp32.loss, self.failed)

    def reach(self) -> tuple[float | None, float | None, int]:
        """(median steps, median seconds, seeds that reached) to :attr:`target`."""
        if self.target is None:
            return None, None, 0
        hits = [r.reach(self.target) for r in self.runs]
        steps = median_or_none([h[0] if h else None for h in hits])
        seconds = median_or_none([h[1] if h else None for h in hits])
        return steps, seconds, sum(h is not None for h in hits)

    @property
    def state_mib(self) -> float:
        return statistics.fmean(r.state_bytes for r in self.runs) / MIB

    @property
    def step_ms(self) -> float | None:
        """Median step time of the grid's runs (parallel grid: beside other runs)."""
        times = [t for r in self.runs for t in r.step_ms]
        return statistics.median(times) if times else None

    def timed_step(self) -> tuple[float, float, float] | None:
        """(median, min, max) ms per step from the timing pass, or None."""
        return self.timing.spread() if self.timing is not None else None

    def timed_seconds(self) -> tuple[float, float, float] | None:
        """Median steps to target x the timed (median, min, max) step time, in seconds."""
        steps, _, _ = self.reach()
        spread = self.timed_step()
        if steps is None or spread is None:
            return None
        return tuple(steps * ms / 1e3 for ms in spread)


def cells(
    results: list[RunResult], timings: dict[tuple, Timing] | None = None
) -> dict[tuple[str, str, str, str], Cell]:
    """Cell key -> Cell in grid order, linked to their fp32 cell (without the fp32 model in
    the grid: their cell at the grid's first precision, fp32 factors), their AdamW reference,
    the task's target loss (AdamW's fp32 cell's, else its first cell's: a grid of
    bf16 autocast alone still has a target) and their entry of ``timings`` (the timing
    pass), if any."""
    grouped: dict[tuple, list[RunResult]] = defaultdict(list)
    for r in results:
        grouped[r.spec.cell].append(r)
    table = {key: Cell(key, runs) for key, runs in grouped.items()}
    first_adamw: dict[str, Cell] = {}
    first_precision: dict[str, str] = {}  # the reference precision of a grid without fp32
    for key, cell in table.items():
        first_precision.setdefault(key[0], key[2])
        if key[1] == REFERENCE:
            first_adamw.setdefault(key[0], cell)
    for (task, label, precision, factor), cell in table.items():
        full = "fp32" if factor != NO_FACTORS else factor
        cell.fp32 = table.get((task, label, "fp32", full)) or table.get(
            (task, label, first_precision[task], full)
        )
        base = table.get((task, REFERENCE, "fp32", NO_FACTORS), first_adamw.get(task))
        cell.reference = table.get((task, REFERENCE, precision, NO_FACTORS), base)
        if base is not None and base.loss is not None:
            cell.target = base.loss.mean
        cell.timing = (timings or {}).get(cell.key)
    return table


# ------------------------------------------------------------------ formatting
def fmt_summary(s: Summary | None, cell: Cell, fmt: str = ".4f", scale: float = 1.0) -> str:
    """Mean ± std ("0.4123 ± 0.0101"), or what the failed seeds were when none stayed finite."""
    if s is None:
        return "diverged" if any(r.status == "diverged" for r in cell.runs) else "nan"
    spread = f" ± {format(s.std * scale, fmt)}" if s.n > 1 else ""
    return f"{format(s.mean * scale, fmt)}{spread}"


def fmt_seconds(value: float | None) -> str:
    return "not reached" if value is None else f"{value:.2f}"


def fmt_ratio(value: float | None) -> str:
    if value is None or not math.isfinite(value):
        return "—"
    return f"{value:.2f}x"


def fmt_spread(spread: tuple[float, float, float] | None, fmt: str, unit: str = "") -> str:
    """ "1.23 [1.10–1.40]" (median [min–max]), or "—"."""
    if spread is None:
        return "—"
    mid, low, high = (format(v, fmt) + unit for v in spread)
    return f"{mid} [{low}–{high}]"


def timed_ratio(cell: Cell) -> tuple[float, float, float] | None:
    """(median, min, max) over the timing rounds of the cell's time to target over its
    AdamW reference's: steps-to-target ratio x the round's step-time ratio (both cells
    timed in the same round), or None."""
    ref = cell.reference
    if ref is None or cell.timing is None or ref.timing is None:
        return None
    steps, ref_steps = cell.reach()[0], ref.reach()[0]
    if steps is None or not ref_steps:
        return None
    ratios = [steps / ref_steps * r for r in paired_ratios(cell.timing, ref.timing)]
    return (statistics.median(ratios), min(ratios), max(ratios)) if ratios else None


def time_ratio(cell: Cell) -> float | None:
    """The cell's median seconds to target over its AdamW reference's, both from the
    grid's own step times (parallel grid)."""
    _, seconds, _ = cell.reach()
    if cell.reference is None or seconds is None:
        return None
    _, ref_seconds, _ = cell.reference.reach()
    return seconds / ref_seconds if ref_seconds else None


TIMED, PARALLEL = "timed", "parallel grid"


def headers(timed: bool) -> tuple[str, ...]:
    """The table's columns; the time columns say where their times come from."""
    how = TIMED if timed else PARALLEL
    return (
        "optimizer",
        "precision",
        "factors",
        "held-out loss",
        "test acc %",
        "failed seeds",
        "vs fp32",
        "steps to target",
        f"s to target ({how})",
        f"time vs AdamW ({how})",
        "state MiB",
        f"step ms ({how})",
    )


def is_timed(table_cells: dict) -> bool:
    """Whether the grid's times come from a timing pass."""
    return any(c.timing is not None for c in table_cells.values())


def cell_row(cell: Cell, timed: bool = False) -> list[str]:
    """One table row of ``cell`` (columns :func:`headers`): with ``timed``, the times of
    the timing pass as median [min–max]; else the parallel grid's medians."""
    _, label, precision, factor = cell.key
    steps, seconds, reached = cell.reach()
    n = len(cell.runs)
    reach_note = f" ({reached}/{n})" if cell.target is not None and reached < n else ""
    return [
        label,
        precision,
        factor,
        fmt_summary(cell.loss, cell),
        fmt_summary(cell.accuracy, cell, ".1f", 100.0),
        cell.failures or f"0/{n}",
        cell.verdict,
        ("not reached" if steps is None else f"{steps:.0f}") + reach_note,
        *(timed_columns(cell) if timed else parallel_columns(cell, seconds)),
    ]


def timed_columns(cell: Cell) -> list[str]:
    """s to target, time vs AdamW, state MiB and step ms with the timing pass's times."""
    seconds = cell.timed_seconds()
    step = "—" if cell.timing is None or cell.timing.error else fmt_spread(cell.timed_step(), ".2f")
    return [
        "not reached" if cell.reach()[0] is None else fmt_spread(seconds, ".2f"),
        fmt_spread(timed_ratio(cell), ".2f", "x"),
        f"{cell.state_mib:.3f}",
        step,
    ]


def parallel_columns(cell: Cell, seconds: float | None) -> list[str]:
    """The same columns from the grid's own (parallel, noisy) step times."""
    return [
        fmt_seconds(seconds),
        fmt_ratio(time_ratio(cell)),
        f"{cell.state_mib:.3f}",
        "—" if cell.step_ms is None else f"{cell.step_ms:.2f}",
    ]


def markdown_table(headers: list[str] | tuple[str, ...], rows: list[list[str]]) -> str:
    """A GitHub Markdown table."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def task_table(task: str, table_cells: dict) -> str:
    """The Markdown table of one task: one row per cell."""
    timed = is_timed(table_cells)
    rows = [cell_row(c, timed) for key, c in table_cells.items() if key[0] == task]
    return markdown_table(headers(timed), rows)


def text_table(headers, rows: list[list[str]]) -> str:
    """A plain aligned text table for the terminal."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(lines)


# ------------------------------------------------------------------------ JSON
def run_record(r: RunResult) -> dict:
    """The JSON record of one run (non-finite values as null)."""
    s = r.spec
    return {
        "task": s.task,
        "optimizer": s.optimizer.name,
        "structure": s.optimizer.structure,
        "options": [list(option) for option in s.optimizer.options],
        "label": s.optimizer.label,
        "precision": s.precision,
        "factor": s.factor,
        "seed": s.seed,
        "hparams": dict(s.hparams),
        "steps": s.steps,
        "steps_run": len(r.step_ms),
        "status": r.status,
        "first_nonfinite_step": r.first_nonfinite_step,
        "prune": s.prune,
        "pruned_at": r.pruned_at,
        "error": r.error,
        "final_loss": r.final_loss,
        "final_accuracy": r.final_accuracy,
        "best_loss": r.best_loss,
        "state_bytes": r.state_bytes,
        "median_step_ms": r.median_step_ms,
        "wall_s": r.wall_s,
        "train_loss": r.train_loss,
        "eval_steps": r.eval_steps,
        "eval_loss": r.eval_loss,
        "eval_accuracy": r.eval_accuracy,
        "eval_seconds": r.eval_seconds,
    }


def cell_record(cell: Cell) -> dict:
    """The JSON summary of one cell. ``median_step_ms``, ``seconds_to_target`` and
    ``time_vs_adamw`` come from the grid's own step times (parallel grid, noisy); the
    ``timed_*`` values, [median, min, max] over the rounds, from the timing pass (None
    without one, or where the cell has no time: ``timing_error``)."""
    task, label, precision, factor = cell.key
    steps, seconds, reached = cell.reach()
    loss, acc = cell.loss, cell.accuracy
    return {
        "task": task,
        "label": label,
        "precision": precision,
        "factor": factor,
        "seeds": len(cell.runs),
        "failed_seeds": cell.failed,
        "failures": cell.failures,
        "loss_mean": loss and loss.mean,
        "loss_std": loss and loss.std,
        "accuracy_mean": acc and acc.mean,
        "accuracy_std": acc and acc.std,
        "verdict": cell.verdict,
        "target_loss": cell.target,
        "steps_to_target": steps,
        "seconds_to_target": seconds,
        "seeds_reaching_target": reached,
        "time_vs_adamw": time_ratio(cell),
        "state_mib": cell.state_mib,
        "median_step_ms": cell.step_ms,
        "timed_step_ms": cell.timed_step(),
        "timed_seconds_to_target": cell.timed_seconds(),
        "timed_time_vs_adamw": timed_ratio(cell),
        "timing_error": cell.timing.error if cell.timing is not None else None,
    }


def write_json(path: Path, meta: dict, results: list[RunResult], table_cells: dict) -> None:
    """``results.json``: schema tag, run metadata, every run and every cell."""
    payload = {
        "schema": SCHEMA,
        **meta,
        "cells": [cell_record(c) for c in table_cells.values()],
        "runs": [run_record(r) for r in results],
    }
    path.write_text(json.dumps(payload, indent=1))


# ----------------------------------------------------------------------- plots
def _series(cell: Cell, values: str) -> tuple[np.ndarray, np.ndarray] | None:
    """(steps, (seeds, evals) array) of the stable runs' ``eval_loss`` or
    ``eval_accuracy``, or None without a stable run."""
    stable = [r for r in cell.runs if r.stable]
    if not stable:
        return None
    steps = np.array(stable[0].eval_steps)
    return steps, np.array([getattr(r, values) for r in stable], dtype=float)


def loss_axis_range(cells_: list[Cell]) -> tuple[float, float]:
    """(low, high) of the loss axis: from the lowest finite held-out loss to 1.5x the
    highest initial loss, so a diverged run cannot stretch the axis."""
    finite = [x for c in cells_ for r in c.runs for x in r.eval_loss if x is not None]
    starts = [r.eval_loss[0] for c in cells_ for r in c.runs if r.eval_loss and r.eval_loss[0]]
    if not finite or not starts:
        return 0.1, 10.0
    low = max(min(finite) * 0.8, 1e-4)
    return low, max(1.5 * max(starts), low * 2)


def plot_curves(path: Path, task: str, table_cells: dict) -> Figure:
    """``curves_<task>.png``: small multiples, one column per optimizer; the top row the
    held-out loss (log axis, clipped to :func:`loss_axis_range`), the bottom row the
    held-out accuracy. One colour per (precision, factors); mean over stable seeds with
    a min–max band; a failed seed is marked with an x at the top of the loss panel at
    the step it failed, labelled with its status. Returns the figure."""
    mine = [c for k, c in table_cells.items() if k[0] == task]
    labels = list(dict.fromkeys(c.key[1] for c in mine))
    modes = list(dict.fromkeys(c.key[2:] for c in mine))
    colors = {m: f"C{i % 10}" for i, m in enumerate(modes)}
    styles = {m: "-" if i < 10 else "--" for i, m in enumerate(modes)}
    low, high = loss_axis_range(mine)
    fig = Figure(figsize=(3.2 * len(labels) + 1.5, 6.0), layout="constrained")
    axes = fig.subplots(2, len(labels), squeeze=False, sharex="col")
    for j, label in enumerate(labels):
        top, bottom = axes[0, j], axes[1, j]
        for cell in (c for c in mine if c.key[1] == label):
            mode = cell.key[2:]
            name = f"{mode[0]} / factors {mode[1]}"
            for ax, values in ((top, "eval_loss"), (bottom, "eval_accuracy")):
                series = _series(cell, values)
                if series is None:
                    continue
                steps, ys = series
                ys = np.clip(ys, low, high) if values == "eval_loss" else ys
                ax.plot(steps, ys.mean(0), styles[mode], color=colors[mode], lw=1.2, label=name)
                ax.fill_between(steps, ys.min(0), ys.max(0), color=colors[mode], alpha=0.15)
            for r in cell.runs:
                if not r.stable:
                    at = (
                        r.first_nonfinite_step
                        if r.first_nonfinite_step is not None
                        else r.spec.steps
                    )
                    top.plot(at, high / 1.08, "x", color=colors[mode], ms=8, mew=2)
                    top.annotate(
                        r.status.split("@")[0],
                        (at, high / 1.08),
                        fontsize=6,
                        color=colors[mode],
                        xytext=(2, -8),
                        textcoords="offset points",
                    )
        top.set_yscale("log")
        top.set_ylim(low, high)
        top.set_title(label, fontsize=9)
        bottom.set_ylim(0.0, 1.0)
        bottom.set_xlabel("step")
        for ax in (top, bottom):
            ax.grid(alpha=0.3)
    axes[0, 0].set_ylabel("held-out loss (log, clipped)")
    axes[1, 0].set_ylabel("held-out accuracy")
    handles, names = [], []
    for ax in axes[0]:
        for h, n in zip(*ax.get_legend_handles_labels(), strict=True):
            if n not in names:
                handles.append(h)
                names.append(n)
    fig.legend(handles, names, loc="outside right upper", fontsize=7)
    fig.suptitle(f"{task}: mean over seeds, band = min..max; x = failed seed", fontsize=10)
    fig.savefig(path, dpi=100)
    return fig


def plot_time_to_target(path: Path, table_cells: dict) -> Figure:
    """``time_to_target.png``: training seconds to AdamW's fp32 final held-out loss per
    cell, one panel per task; "not reached" written where it was not. With a timing pass
    its times (median steps x timed step time, whiskers min..max over the rounds), else
    the parallel grid's (no whiskers); the axis label says which. Returns the figure."""
    timed = is_timed(table_cells)
    tasks = list(dict.fromkeys(k[0] for k in table_cells))
    rows = max(len([k for k in table_cells if k[0] == t]) for t in tasks)
    fig = Figure(figsize=(8, 0.22 * rows * len(tasks) + 1.2 * len(tasks)), layout="constrained")
    axes = fig.subplots(len(tasks), 1, squeeze=False)[:, 0]
    for ax, task in zip(axes, tasks, strict=True):
        mine = [c for k, c in table_cells.items() if k[0] == task]
        names = [f"{c.key[1]} {c.key[2]}/{c.key[3]}" for c in mine]
        if timed:
            spreads = [c.timed_seconds() for c in mine]
        else:
            spreads = [(s, s, s) if s is not None else None for s in (c.reach()[1] for c in mine)]
        seconds = [s[0] if s else None for s in spreads]
        reached = [s[2] for s in spreads if s is not None]
        top = max(reached) * 1.15 if reached else 1.0
        ys = range(len(mine))
        optimizers = list(dict.fromkeys(c.key[1] for c in mine))
        colors = [f"C{optimizers.index(c.key[1]) % 10}" for c in mine]
        whiskers = np.array([[s[0] - s[1], s[2] - s[0]] if s else [0.0, 0.0] for s in spreads])
        ax.barh(
            ys,
            [s if s is not None else 0.0 for s in seconds],
            color=colors,
            xerr=whiskers.T if timed else None,
            error_kw={"lw": 0.8, "capsize": 2},
        )
        for y, s in zip(ys, seconds, strict=True):
            if s is None:
                ax.text(top * 0.01, y, "not reached", va="center", fontsize=6, color="red")
        ax.set_yticks(list(ys), names, fontsize=6)
        ax.invert_yaxis()
        ax.set_xlim(0, top)
        ax.set_xlabel(
            "seconds to AdamW's final held-out loss: median steps x "
            + (
                "step time of the timing pass (whiskers: min..max)"
                if timed
                else "step time in the parallel grid (noisy)"
            ),
            fontsize=7,
        )
        ax.set_title(task, fontsize=9)
        ax.grid(axis="x", alpha=0.3)
    fig.savefig(path, dpi=100)
    return fig


def plot_memory(path: Path, table_cells: dict) -> Figure:
    """``memory.png``: optimizer-state MiB per optimizer/structure (fp32 model), one panel
    per task: a bar per factor dtype for optimizers with factors, one "no factors" bar for
    the others (AdamW, the peers). Returns the figure."""
    tasks = list(dict.fromkeys(k[0] for k in table_cells))
    fig = Figure(figsize=(9, 3.2 * len(tasks)), layout="constrained")
    axes = fig.subplots(len(tasks), 1, squeeze=False)[:, 0]
    series = (("fp32 factors", 1, -0.2), ("bf16 factors", 2, 0.2), ("no factors", 1, 0.0))
    for ax, task in zip(axes, tasks, strict=True):
        rows = memory_rows(task, table_cells)
        plain = {label for (t, label, _, factor) in table_cells if factor == NO_FACTORS}
        for name, index, offset in series:
            xs, values = [], []
            for i, row in enumerate(rows):
                if (row[0] in plain) == (name == "no factors") and row[index] != "—":
                    xs.append(i + offset)
                    values.append(float(row[index]))
            if xs:
                color = "0.6" if name == "no factors" else None
                ax.bar(xs, values, 0.4, label=name, color=color)
        ax.set_xticks(range(len(rows)), [r[0] for r in rows], rotation=30, ha="right", fontsize=7)
        ax.set_ylabel("optimizer state MiB")
        ax.set_title(f"{task}: optimizer-state memory", fontsize=9)
        ax.legend(fontsize=7)
        ax.grid(axis="y", alpha=0.3)
    fig.savefig(path, dpi=100)
    return fig


def memory_rows(task: str, table_cells: dict) -> list[list[str]]:
    """[label, MiB with fp32 factors, MiB with bf16 factors] per optimizer label, from
    the cells with the fp32 model; an optimizer without factors (AdamW) has its state in
    the first column and "—" in the second."""
    rows = []
    for label in dict.fromkeys(k[1] for k in table_cells if k[0] == task):
        plain = table_cells.get((task, label, "fp32", NO_FACTORS))
        if plain is not None:
            rows.append([label, f"{plain.state_mib:.3f}", "—"])
            continue
        row = [label]
        for factor in ("fp32", "bf16"):
            cell = table_cells.get((task, label, "fp32", factor))
            row.append("—" if cell is None else f"{cell.state_mib:.3f}")
        rows.append(row)
    return rows


# ------------------------------------------------------------- memory command
def memory_table(model: str, rows: list) -> str:
    """The text table of the ``memory`` sub-command for one model."""
    first = rows[0]
    adamw = next((r.measured_bytes for r in rows if r.label == "adamw"), None)
    body = []
    for r in rows:
        if r.formula_bytes is None:
            formula, check = "—", "measured only"
        elif r.measured_bytes == r.formula_bytes:
            formula, check = f"{r.formula_bytes / MIB:.2f}", "= formula"
        else:
            difference = r.measured_bytes - r.formula_bytes
            formula, check = f"{r.formula_bytes / MIB:.2f}", f"differs by {difference} B"
        body.append(
            [
                r.label,
                f"{r.measured_bytes / MIB:.2f}",
                formula,
                fmt_ratio(r.measured_bytes / adamw if adamw else None),
                f"{r.peak_bytes / MIB:.1f}",
                check,
            ]
        )
    headers = ["optimizer", "state MiB", "formula MiB", "vs AdamW", "peak step MiB", "check"]
    title = f"{model} ({first.parameters / 1e6:.1f} M parameters); peak: {first.peak_method}"
    return title + "\n" + text_table(headers, body)


def plot_memory_rows(path: Path, rows: list) -> None:
    """``memory.png`` of the ``memory`` sub-command: state MiB per optimizer, per model."""
    models = list(dict.fromkeys(r.model for r in rows))
    fig = Figure(figsize=(10, 3.4 * len(models)), layout="constrained")
    axes = fig.subplots(len(models), 1, squeeze=False)[:, 0]
    for ax, model in zip(axes, models, strict=True):
        mine = [r for r in rows if r.model == model]
        xs = range(len(mine))
        ax.bar(xs, [r.measured_bytes / MIB for r in mine], 0.4, label="optimizer state")
        ax.bar(
            [x + 0.4 for x in xs], [r.peak_bytes / MIB for r in mine], 0.4, label="peak step memory"
        )
        ax.set_xticks(
            [x + 0.2 for x in xs], [r.label for r in mine], rotation=30, ha="right", fontsize=8
        )
        ax.set_ylabel("MiB")
        ax.set_title(f"{model}: memory per optimizer / structure")
        ax.legend(fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    fig.savefig(path, dpi=110)
