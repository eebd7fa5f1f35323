"""``singd-harness tune``: a log-grid sweep of each optimizer's learning rate (the
other settings at the library defaults) in fp32 on each task, the same number of trials per
optimizer (:attr:`OptimizerEntry.tune_grid`), scored by the final held-out loss averaged over the
tuning seeds (a failed seed scores +inf). The chosen values are used in every precision.

``--record`` writes them into :mod:`singd_cuda.harness.tuned` with the command, so the
default run uses them without re-tuning.
"""

from __future__ import annotations

import json
import math
import statistics
from datetime import datetime
from pathlib import Path

from . import tuned
from .optimizers import OPTIMIZERS, OptimizerChoice, label_name
from .report import markdown_table
from .runner import RunResult, RunSpec

TUNED_MODULE = Path(tuned.__file__)


def hparams_for(task: str, choice: OptimizerChoice) -> tuple[dict[str, float], str]:
    """(tuned values, where they come from) for ``choice`` on ``task``: the recorded
    values of this label, else of another label of the same optimizer (e.g. another
    SINGD structure), else the middle of its tuning grid."""
    table = tuned.TUNED.get(task, {})
    if choice.label in table:
        return dict(table[choice.label]), "tuned"
    for label, values in table.items():
        if label_name(label) == choice.name:
            return dict(values), f"tuned for {label}"
    grid = OPTIMIZERS[choice.name].tune_grid
    return dict(grid[len(grid) // 2]), "untuned (middle of the grid)"


def trial_specs(
    tasks: list[str],
    choices: list[OptimizerChoice],
    steps: dict[str, int],
    seeds: list[int],
    precision: str = "fp32",
    grids: dict[str, tuple[dict[str, float], ...]] | None = None,
    prune: tuple[float, float] | None = None,
) -> list[RunSpec]:
    """Every trial of the sweep: the model in ``precision`` with fp32 factors, each point
    of the optimizer's grid (``grids[label]`` where given, else its table grid), each
    seed; ``prune`` is :attr:`RunSpec.prune` for every trial alike."""
    grids = grids or {}
    return [
        RunSpec(
            task,
            choice,
            precision,
            "fp32" if choice.has_factors else "-",
            seed,
            steps[task],
            tuple(sorted(point.items())),
            prune,
        )
        for task in tasks
        for choice in choices
        for point in grids.get(choice.label, OPTIMIZERS[choice.name].tune_grid)
        for seed in seeds
    ]


def score(runs: list[RunResult]) -> float:
    """Mean final held-out loss over the seeds; +inf when any seed failed."""
    finals = [r.final_loss for r in runs]
    return math.inf if None in finals else statistics.fmean(finals)


def choose(results: list[RunResult]) -> tuple[dict, list[dict]]:
    """({task: {label: best hparams}}, sweep rows) from the trials' results."""
    groups: dict[tuple, list[RunResult]] = {}
    for r in results:
        groups.setdefault((r.spec.task, r.spec.optimizer.label, r.spec.hparams), []).append(r)
    rows, best = [], {}
    for (task, label, hparams), runs in groups.items():
        value = score(runs)
        status = ", ".join(sorted({r.status for r in runs if not r.stable}))
        row = {"task": task, "label": label, **dict(hparams), "score": value, "status": status}
        rows.append(row)
        current = best.get((task, label))
        if current is None or value < current[0]:
            best[(task, label)] = (value, dict(hparams))
    chosen: dict[str, dict] = {}
    for (task, label), (_, hparams) in best.items():
        chosen.setdefault(task, {})[label] = hparams
    return chosen, rows


def sweep_markdown(rows: list[dict], chosen: dict) -> str:
    """The sweep table: one row per trial, the chosen one marked."""
    body = []
    for row in rows:
        hp = {k: v for k, v in row.items() if k not in ("task", "label", "score", "status")}
        mark = "**chosen**" if chosen[row["task"]][row["label"]] == hp else ""
        value = f"{row['score']:.4f}"
        if math.isinf(row["score"]):
            value = row.get("status") or "failed"
        body.append([row["task"], row["label"], f"{hp['lr']:g}", value, mark])
    headers = ["task", "optimizer", "lr", "final held-out loss", ""]
    return markdown_table(headers, body)


def write_outputs(out: Path, chosen: dict, rows: list[dict], meta: dict) -> None:
    """``tuned.json`` (chosen values, sweep rows, metadata) and ``sweep.md``."""
    payload = {**meta, "chosen": chosen, "sweep": rows}
    text = json.dumps(payload, indent=1).replace("Infinity", "null")
    (out / "tuned.json").write_text(text)
    (out / "sweep.md").write_text(
        f"# Learning-rate sweep\n\nCommand: `{meta['command']}`\n\n{sweep_markdown(rows, chosen)}\n"
    )


def record(chosen: dict, meta: dict, path: Path = TUNED_MODULE) -> None:
    """Rewrite :mod:`singd_cuda.harness.tuned` with ``chosen``, merged over the values
    already recorded for other tasks and optimizers: the step counts merge likewise, and
    the command joins the earlier ones (``&&``) unless it is the last of them."""
    merged = {task: dict(values) for task, values in tuned.TUNED.items()}
    for task, values in chosen.items():
        merged.setdefault(task, {}).update(values)
    steps = {**tuned.STEPS, **meta["steps"]}
    command = meta["command"]
    if tuned.COMMAND and not tuned.COMMAND.endswith(command):
        command = f"{tuned.COMMAND} && {command}"
    path.write_text(
        '"""Tuned hyperparameters of the harness, written by ``singd-harness tune --record``.\n\n'
        "The default run uses these values in every precision; re-tune with ``--tune``.\n"
        '"""\n\n'
        f"COMMAND = {json.dumps(command)}  # noqa: E501\n"
        f"CREATED = {json.dumps(meta['created'])}\n"
        f"{_assignment('STEPS: dict[str, int]', steps)}\n"
        f"{_assignment('TUNED: dict[str, dict[str, dict[str, float]]]', merged)}\n"
    )


def _assignment(target: str, value: dict, width: int = 100) -> str:
    """``target = value`` as ruff formats it (so the recorded module stays ``ruff format``
    clean): a dict on one line when it fits, else one item per line with trailing commas;
    keys sorted, strings in double quotes."""
    return f"{target} = {_literal(value, 0, width - len(target) - 3, width)}"


def _literal(value, indent: int, room: int, width: int) -> str:
    if not isinstance(value, dict):
        return json.dumps(value) if isinstance(value, str) else repr(value)
    items = sorted(value.items())
    inline = ", ".join(f"{json.dumps(k)}: {_literal(v, 0, width, width)}" for k, v in items)
    if len(inline) + 2 <= room:
        return "{" + inline + "}"
    pad = " " * (indent + 4)
    lines = []
    for key, item in items:
        head = f"{pad}{json.dumps(key)}: "
        lines.append(f"{head}{_literal(item, indent + 4, width - len(head) - 1, width)},")
    return "{\n" + "\n".join(lines) + "\n" + " " * indent + "}"


def now() -> str:
    return datetime.now().isoformat(timespec="seconds")
