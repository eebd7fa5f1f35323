"""The timing pass: per-step times measured where nothing else of the harness runs.

The grid's runs go in parallel (one per core), so the step times they record include
whatever the other workers and the rest of the machine did meanwhile; on a shared 2-core
CPU the same configuration's median step varied 4x between seeds. The report's times
come from this pass instead: after the grid, in one process with one intra-op thread,
each cell (task, optimizer, model precision, factor precision; its first seed's
configuration and batches) is built once, warmed up for one block, and then timed for
``rounds`` blocks of ``block`` training steps, the cells interleaved round by round (the
order rotated each round), so that a burst of outside load hits every cell alike. A
block's time is its mean per step; a cell's step time is the median over its rounds,
its spread the min and max. ``block`` defaults to 10, a multiple of the curvature update
period ``T`` of every default (K-FAC and SINGD 10, AdaFisher 1), so every timed block
holds the same number of curvature updates and inversions.

The clock is the process's CPU time (:func:`time.process_time`) on the CPU, where with
one thread it is the time the step computed and does not count the time the process
waited for a core (other jobs); the wall clock is recorded beside it, and their ratio is
reported: about 1 when nothing else competed. On CUDA the clock is the wall clock after a
device synchronisation (the CPU time of a process that waits for a GPU says nothing).

A cell whose training loss turns non-finite or whose optimizer raises during the pass
has no time (its ``error`` says why); the pass never raises for one cell.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .data import Task
from .precision import PRECISIONS
from .runner import RunSpec, build_optimizer, training_step

#: Timed blocks per cell and training steps per block (after one warm-up block).
ROUNDS = 4
BLOCK = 10


@dataclass
class Timing:
    """The timed blocks of one cell: mean milliseconds per step of each round, by the
    process CPU clock and by the wall clock; ``clock`` names the one the report uses."""

    key: tuple[str, str, str, str]
    clock: str  # "cpu" or "wall"
    cpu_ms: list[float] = field(default_factory=list)
    wall_ms: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def ms(self) -> list[float]:
        """Per-round milliseconds per step by :attr:`clock` (empty when it failed)."""
        return [] if self.error else (self.cpu_ms if self.clock == "cpu" else self.wall_ms)

    def spread(self) -> tuple[float, float, float] | None:
        """(median, min, max) milliseconds per step over the rounds, or None."""
        ms = self.ms
        return (statistics.median(ms), min(ms), max(ms)) if ms else None

    def record(self) -> dict:
        task, label, precision, factor = self.key
        return {
            "task": task,
            "label": label,
            "precision": precision,
            "factor": factor,
            "clock": self.clock,
            "cpu_ms": self.cpu_ms,
            "wall_ms": self.wall_ms,
            "error": self.error,
        }

    @classmethod
    def from_record(cls, r: dict) -> Timing:
        key = (r["task"], r["label"], r["precision"], r["factor"])
        return cls(key, r["clock"], r["cpu_ms"], r["wall_ms"], r["error"])


def paired_ratios(cell: Timing, reference: Timing) -> list[float]:
    """Round-by-round ratios of ``cell``'s step time to ``reference``'s (both timed in
    the same rounds, so outside load drifting between rounds cancels)."""
    return [a / b for a, b in zip(cell.ms, reference.ms, strict=False) if b > 0]


class _Cell:
    """One cell's model, optimizer and batches during the pass."""

    def __init__(self, task: Task, spec: RunSpec, device: torch.device, steps: int) -> None:
        self.task, self.spec, self.device = task, spec, device
        self.precision = PRECISIONS[spec.precision]
        torch.manual_seed(spec.seed)
        self.model = self.precision.prepare(task.make_model().to(device))
        self.scaler = self.precision.make_scaler(device)
        self.optimizer = build_optimizer(task, spec, self.model, self.scaler)
        self.batches = task.batch_indices(steps, spec.seed)
        self.step = 0

    def run(self, steps: int) -> tuple[float, float]:
        """Train ``steps`` steps; (CPU seconds, wall seconds). Raises FloatingPointError
        at a non-finite training loss."""
        cpu, wall = time.process_time(), time.perf_counter()
        for _ in range(steps):
            idx = self.batches[self.step]
            x = self.precision.cast_input(self.task.train_x[idx].to(self.device))
            y = self.task.train_y[idx].to(self.device)
            if (
                training_step(
                    self.task, self.precision, self.model, self.optimizer, self.scaler, x, y
                )
                is None
            ):
                raise FloatingPointError(f"non-finite training loss at timing step {self.step}")
            self.step += 1
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.process_time() - cpu, time.perf_counter() - wall


def time_cells(
    specs: list[RunSpec],
    tasks: dict[str, Task],
    device: torch.device,
    rounds: int = ROUNDS,
    block: int = BLOCK,
    on_round: Callable[[int], None] = lambda r: None,
) -> dict[tuple[str, str, str, str], Timing]:
    """Time one spec per cell (the first of each cell in ``specs``), interleaved, in this
    process with one intra-op thread; ``on_round`` is called after each round."""
    firsts: dict[tuple, RunSpec] = {}
    for spec in specs:
        firsts.setdefault(spec.cell, spec)
    clock = "wall" if device.type == "cuda" else "cpu"
    timings = {key: Timing(key, clock) for key in firsts}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        live: dict[tuple, _Cell] = {}
        for key, spec in firsts.items():
            try:
                live[key] = _Cell(tasks[spec.task], spec, device, block * (rounds + 1))
                live[key].run(block)  # warm-up: first calls, caches, the first inversion
            except Exception as exc:  # a cell failing is a result, never a crash
                timings[key].error = f"{type(exc).__name__}: {exc}"
                live.pop(key, None)
        order = list(live)
        for r in range(rounds):
            shift = r % len(order) if order else 0
            for key in order[shift:] + order[:shift]:
                if timings[key].error:
                    continue
                try:
                    cpu, wall = live[key].run(block)
                except Exception as exc:
                    timings[key].error = f"{type(exc).__name__}: {exc}"
                    live.pop(key)
                    continue
                timings[key].cpu_ms.append(1e3 * cpu / block)
                timings[key].wall_ms.append(1e3 * wall / block)
            on_round(r)
    finally:
        torch.set_num_threads(threads)
    return timings


def agreement(timings: dict) -> float | None:
    """Median over the timed cells of wall time / CPU time per step: about 1 when the
    process always had a core to itself."""
    ratios = [
        statistics.median(t.wall_ms) / statistics.median(t.cpu_ms)
        for t in timings.values()
        if not t.error and t.cpu_ms and statistics.median(t.cpu_ms) > 0
    ]
    return statistics.median(ratios) if ratios else None
