"""Summaries of a grid: rich tables, one-line verdicts, JSON and PNG plots.

Runs that differ only in the seed are merged into one table cell: losses are averaged
over seeds, and the cell is unstable if any seed is. A cell's verdict is

* ``failed``: some seed hit a non-finite loss or an optimizer error, or diverged (its
  held-out loss ended above where it started);
* ``degraded``: stable, but its best held-out loss is more than
  :data:`DEGRADED_RATIO` x the same optimizer's fp32 run's best;
* ``ok``: otherwise.
"""

from __future__ import annotations

import json
import math
import statistics
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from matplotlib.figure import Figure
from rich.table import Table
from rich.text import Text

from .runner import RunResult

DEGRADED_RATIO = 1.5
MIB = 2**20
SCHEMA = "singd_cuda.harness/1"
STYLES = {"ok": "green", "degraded": "yellow", "failed": "red"}


@dataclass
class Cell:
    """The runs of one (task, optimizer, precision) over all seeds."""

    runs: list[RunResult]
    fp32: Cell | None = None

    @property
    def final(self) -> float | None:
        finals = [r.final_loss for r in self.runs]
        return None if None in finals else statistics.fmean(finals)

    @property
    def best(self) -> float | None:
        bests = [r.best_loss for r in self.runs if r.best_loss is not None]
        return statistics.fmean(bests) if bests else None

    @property
    def status(self) -> str:
        bad = [r for r in self.runs if not r.stable]
        if not bad:
            return "stable"
        # the earliest non-finite step first; "diverged" (no such step) after all of them
        worst = min(bad, key=lambda r: (r.first_nonfinite_step is None, r.first_nonfinite_step))
        if len(self.runs) == 1:
            return worst.status
        return f"{worst.status} ({len(bad)}/{len(self.runs)} seeds)"

    @property
    def rel_fp32(self) -> float | None:
        """Best held-out loss over the fp32 cell's (None when either is missing). The best
        rather than the final loss, so one late spike of a short run does not decide it."""
        if self.fp32 is None or self.best is None or not self.fp32.best:
            return None
        return self.best / self.fp32.best

    @property
    def state_mib(self) -> float:
        return statistics.fmean(r.state_bytes for r in self.runs) / MIB

    @property
    def step_ms(self) -> float | None:
        times = [t for r in self.runs for t in r.step_ms]
        return statistics.median(times) if times else None

    @property
    def verdict(self) -> str:
        if self.status != "stable":
            return "failed"
        rel = self.rel_fp32
        return "degraded" if rel is not None and rel > DEGRADED_RATIO else "ok"


def cells(results: list[RunResult]) -> dict[tuple[str, str, str], Cell]:
    """(task, optimizer label, precision) -> Cell, in grid order."""
    grouped: dict[tuple[str, str, str], list[RunResult]] = defaultdict(list)
    for r in results:
        grouped[(r.spec.task, r.spec.optimizer.label, r.spec.precision)].append(r)
    table = {key: Cell(runs) for key, runs in grouped.items()}
    for (task, label, _), cell in table.items():
        cell.fp32 = table.get((task, label, "fp32"))
    return table


def _num(value: float | None, fmt: str) -> str:
    return "—" if value is None else format(value, fmt)


def _ratio(value: float | None) -> str:
    if value is None:
        return "—"
    return f"{value:.2f}x" if value < 100 else f"{value:.1e}x"


def task_table(task: str, description: str, table_cells: dict) -> Table:
    """The rich table of one task: one row per (optimizer, precision)."""
    table = Table(title=f"{task}: {description}", title_justify="left")
    for header in ("optimizer", "precision", "final loss", "best loss", "stability"):
        table.add_column(header, no_wrap=True)
    for header in ("vs fp32", "state MiB", "step ms"):
        table.add_column(header, justify="right", no_wrap=True)
    keys = [k for k in table_cells if k[0] == task]
    for i, key in enumerate(keys):
        cell = table_cells[key]
        rel = cell.rel_fp32
        table.add_row(
            key[1],
            key[2],
            _num(cell.final, ".4f"),
            _num(cell.best, ".4f"),
            Text(cell.status, style=STYLES["ok" if cell.status == "stable" else "failed"]),
            Text(_ratio(rel), style=STYLES[cell.verdict]),
            f"{cell.state_mib:.3f}",
            _num(cell.step_ms, ".1f"),
            end_section=i + 1 < len(keys) and keys[i + 1][1] != key[1],
        )
    return table


def verdicts(table_cells: dict) -> dict[str, Text]:
    """Optimizer label -> one line: the precisions where it is ok, degraded or failed (a
    precision takes its worst verdict over the tasks), then its state MiB per task."""
    by_label: dict[str, list] = defaultdict(list)
    for (task, label, precision), cell in table_cells.items():
        by_label[label].append((task, precision, cell))
    rank = list(STYLES)
    lines = {}
    for label, entries in by_label.items():
        worst: dict[str, str] = {}
        for _, precision, cell in entries:
            kind = worst.get(precision, "ok")
            worst[precision] = max(kind, cell.verdict, key=rank.index)
        line = Text()
        for kind in rank:
            modes = [p for p, k in worst.items() if k == kind]
            if not modes:
                continue
            details = [
                f"{p} [{t} {_problem(c)}]" if c.verdict != "ok" else None
                for t, p, c in entries
                if p in modes
            ]
            what = ", ".join(d for d in details if d) if kind != "ok" else ", ".join(modes)
            line.append(f"{kind} in {what}; ", style=STYLES[kind])
        memory = []
        for task in dict.fromkeys(t for t, _, _ in entries):
            mib = [c.state_mib for t, _, c in entries if t == task]
            spread = f"{max(mib):.2f}" + (f"→{min(mib):.2f}" if min(mib) < max(mib) else "")
            memory.append(f"{task} {spread}")
        line.append(f"state MiB {', '.join(memory)}")
        lines[label] = line
    return lines


def _problem(cell: Cell) -> str:
    if cell.status != "stable":
        return cell.status
    return f"{_ratio(cell.rel_fp32)} fp32"


def _clean(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


def run_record(r: RunResult, cell: Cell) -> dict:
    """The JSON record of one run."""
    s = r.spec
    rel = None
    if cell.fp32 is not None:
        ref = [f.best_loss for f in cell.fp32.runs if f.spec.seed == s.seed]
        if ref and ref[0] and r.best_loss is not None:
            rel = r.best_loss / ref[0]
    return {
        "task": s.task,
        "optimizer": s.optimizer.name,
        "structure": s.optimizer.structure,
        "label": s.optimizer.label,
        "precision": s.precision,
        "seed": s.seed,
        "lr": s.lr,
        "steps": s.steps,
        "steps_run": len(r.step_ms),
        "status": r.status,
        "first_nonfinite_step": r.first_nonfinite_step,
        "error": r.error,
        "final_loss": _clean(r.final_loss),
        "best_loss": _clean(r.best_loss),
        "rel_fp32": rel,
        "state_bytes": r.state_bytes,
        "state_mib": r.state_bytes / MIB,
        "median_step_ms": r.median_step_ms,
        "train_loss": r.train_loss,
        "eval_steps": r.eval_steps,
        "eval_loss": r.eval_loss,
    }


def write_json(path: Path, meta: dict, results: list[RunResult], table_cells: dict) -> None:
    """``results.json``: schema tag, run metadata, every run, and the verdict lines."""
    by_run = {id(r): cell for cell in table_cells.values() for r in cell.runs}
    payload = {
        "schema": SCHEMA,
        **meta,
        "runs": [run_record(r, by_run[id(r)]) for r in results],
        "verdicts": {label: line.plain for label, line in verdicts(table_cells).items()},
    }
    path.write_text(json.dumps(payload, indent=1))


def _smooth(values: list[float | None], window: int) -> tuple[list[int], list[float]]:
    steps, out = [], []
    for i, v in enumerate(values):
        if v is None:
            break
        chunk = [x for x in values[max(0, i - window + 1) : i + 1] if x is not None]
        steps.append(i)
        out.append(statistics.fmean(chunk))
    return steps, out


def plot_losses(path: Path, task: str, results: list[RunResult]) -> None:
    """``loss_<task>.png``: one panel per precision, training loss (moving average) per
    optimizer; an x marks where a run went non-finite."""
    runs = [r for r in results if r.spec.task == task]
    precisions = list(dict.fromkeys(r.spec.precision for r in runs))
    labels = list(dict.fromkeys(r.spec.optimizer.label for r in runs))
    colors = {label: f"C{i % 10}" for i, label in enumerate(labels)}
    styles = {label: "-" if i < 10 else "--" for i, label in enumerate(labels)}
    fig = Figure(figsize=(4.2 * len(precisions), 3.8), layout="constrained")
    axes = fig.subplots(1, len(precisions), sharey=True, squeeze=False)[0]
    for ax, precision in zip(axes, precisions, strict=True):
        for r in (r for r in runs if r.spec.precision == precision):
            label = r.spec.optimizer.label
            window = max(1, r.spec.steps // 20)
            xs, ys = _smooth(r.train_loss, window)
            first = r.spec.seed == min(q.spec.seed for q in runs)
            ax.plot(
                xs, ys, styles[label], color=colors[label], lw=1.2, label=label if first else None
            )
            if r.first_nonfinite_step is not None and ys:
                ax.plot(xs[-1], ys[-1], "x", color=colors[label], ms=9, mew=2)
        ax.set_title(f"{task} — {precision}")
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("training loss (moving average)")
    fig.legend(*axes[0].get_legend_handles_labels(), loc="outside right upper", fontsize=8)
    fig.savefig(path, dpi=110)


def plot_memory(path: Path, table_cells: dict) -> None:
    """``memory.png``: optimizer-state MiB per optimizer/structure, one bar per
    precision (factor dtype), one panel per task."""
    tasks = list(dict.fromkeys(k[0] for k in table_cells))
    fig = Figure(figsize=(10, 3.6 * len(tasks)), layout="constrained")
    axes = fig.subplots(len(tasks), 1, squeeze=False)[:, 0]
    for ax, task in zip(axes, tasks, strict=True):
        keys = [k for k in table_cells if k[0] == task]
        labels = list(dict.fromkeys(k[1] for k in keys))
        precisions = list(dict.fromkeys(k[2] for k in keys))
        width = 0.8 / len(precisions)
        for j, precision in enumerate(precisions):
            xs = [i + j * width for i, label in enumerate(labels)]
            mib = [
                table_cells[(task, label, precision)].state_mib
                if (task, label, precision) in table_cells
                else 0.0
                for label in labels
            ]
            ax.bar(xs, mib, width, label=precision)
        ax.set_xticks(
            [i + 0.4 - width / 2 for i in range(len(labels))],
            labels,
            rotation=30,
            ha="right",
            fontsize=8,
        )
        ax.set_ylabel("optimizer state MiB")
        ax.set_title(f"{task}: optimizer-state memory (factors in the precision's dtype)")
        ax.legend(fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    fig.savefig(path, dpi=110)


def memory_table(model: str, rows: list) -> Table:
    """The rich table of the ``memory`` sub-command for one model."""
    first = rows[0]
    table = Table(
        title=f"{model} ({first.parameters / 1e6:.1f} M parameters)", title_justify="left"
    )
    table.add_column("optimizer", no_wrap=True)
    for header in ("state MiB", "formula MiB", "vs AdamW", "peak step MiB"):
        table.add_column(header, justify="right", no_wrap=True)
    table.add_column("check", no_wrap=True)
    adamw = next((r.measured_bytes for r in rows if r.label == "adamw"), None)
    for r in rows:
        ok = r.measured_bytes == r.formula_bytes
        table.add_row(
            r.label,
            f"{r.measured_bytes / MIB:.2f}",
            f"{r.formula_bytes / MIB:.2f}",
            _ratio(r.measured_bytes / adamw if adamw else None),
            f"{r.peak_bytes / MIB:.1f}",
            Text(
                "= formula" if ok else f"differs by {r.measured_bytes - r.formula_bytes} B",
                style="green" if ok else "red",
            ),
        )
    table.caption = f"peak: {first.peak_method}"
    return table


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
