"""Train and measure one (task, optimizer, precision, factor dtype, seed) run.

A run evaluates the held-out loss and accuracy before training, at
:data:`EVALUATIONS` evenly spaced steps and after the last step, and records the
training wall-clock time (evaluations excluded) of every step; time to target is the
step at which the held-out loss first reaches the target times the median step time.
It stops at the first non-finite training or held-out loss (or at an exception from the
optimizer, e.g. a failed inverse) and reports where; it never raises, so one broken run
cannot stop the grid. A run that stays finite but ends with a held-out loss above its
initial one is reported as diverged.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .data import Task
from .memory import state_bytes
from .optimizers import OptimizerChoice
from .precision import FACTOR_DTYPES, PRECISIONS, Precision

#: Held-out evaluations per run (plus the one before training).
EVALUATIONS = 20


@dataclass(frozen=True)
class RunSpec:
    """One run of the grid. ``factor`` is a key of ``FACTOR_DTYPES`` or ``"-"`` (no
    factors); ``hparams`` the tuned values as sorted (name, value) pairs; ``prune``
    (loss, fraction), when given, stops the run at the first evaluation at or after
    ``fraction`` of its steps whose held-out loss is above ``loss`` (a tuning trial that
    cannot win; the same rule for every optimizer of a sweep)."""

    task: str
    optimizer: OptimizerChoice
    precision: str
    factor: str
    seed: int
    steps: int
    hparams: tuple[tuple[str, float], ...]
    prune: tuple[float, float] | None = None

    @property
    def cell(self) -> tuple[str, str, str, str]:
        """The table cell this run belongs to: (task, optimizer label, precision, factor)."""
        return (self.task, self.optimizer.label, self.precision, self.factor)

    @property
    def lr(self) -> float:
        return dict(self.hparams)["lr"]


@dataclass
class RunResult:
    """What one run measured. Losses are None where they were not finite.

    ``eval_seconds[i]``: cumulative training wall-clock seconds (forward, backward,
    optimizer step; evaluations excluded) before ``eval_steps[i]``, as measured (kept
    in the JSON; time to target uses the median step time, see :meth:`reach`).
    """

    spec: RunSpec
    train_loss: list[float | None] = field(default_factory=list)
    eval_steps: list[int] = field(default_factory=list)
    eval_loss: list[float | None] = field(default_factory=list)
    eval_accuracy: list[float | None] = field(default_factory=list)
    eval_seconds: list[float] = field(default_factory=list)
    first_nonfinite_step: int | None = None
    pruned_at: int | None = None
    error: str | None = None
    state_bytes: int = 0
    step_ms: list[float] = field(default_factory=list)
    wall_s: float = 0.0  # the whole run, evaluations and set-up included

    @property
    def diverged(self) -> bool:
        """Finite throughout, but the held-out loss ended above where it started."""
        losses = self.eval_loss
        return self.first_nonfinite_step is None and len(losses) > 1 and losses[-1] > losses[0]

    @property
    def stable(self) -> bool:
        """No non-finite loss, no optimizer error, no divergence, and not pruned."""
        return self.first_nonfinite_step is None and self.pruned_at is None and not self.diverged

    @property
    def status(self) -> str:
        """``"stable"``, ``"diverged"``, ``"nan@<step>"``, ``"error@<step>"`` or
        ``"pruned@<step>"``."""
        if self.pruned_at is not None:
            return f"pruned@{self.pruned_at}"
        if self.first_nonfinite_step is not None:
            return f"{'error' if self.error else 'nan'}@{self.first_nonfinite_step}"
        return "diverged" if self.diverged else "stable"

    @property
    def final_loss(self) -> float | None:
        """The held-out loss after the last step (None unless the run is stable)."""
        return self.eval_loss[-1] if self.stable else None

    @property
    def final_accuracy(self) -> float | None:
        """The held-out accuracy after the last step (None unless the run is stable)."""
        return self.eval_accuracy[-1] if self.stable else None

    @property
    def best_loss(self) -> float | None:
        """The lowest finite held-out loss seen."""
        finite = [x for x in self.eval_loss if x is not None]
        return min(finite) if finite else None

    @property
    def median_step_ms(self) -> float | None:
        """Median wall time of one training step (forward, backward, optimizer step)."""
        return statistics.median(self.step_ms) if self.step_ms else None

    def reach(self, target: float) -> tuple[int, float] | None:
        """(step, seconds) of the first evaluation with held-out loss <= ``target``, or
        None when no evaluation reaches it. Seconds = step x the run's median measured
        step time: robust to one-off stalls (the first build of the fused ops, a burst
        of load from other processes) that a cumulative clock would count."""
        median = self.median_step_ms
        for step, loss in zip(self.eval_steps, self.eval_loss, strict=True):
            if loss is not None and loss <= target:
                return step, step * (median or 0.0) / 1e3
        return None


def _finite(value: torch.Tensor) -> float | None:
    x = value.item()
    return x if math.isfinite(x) else None


def _evaluate(
    task: Task, model, precision: Precision, device: torch.device
) -> tuple[float | None, float | None]:
    model.eval()
    with torch.no_grad(), precision.autocast(device):
        x = precision.cast_input(task.eval_x.to(device))
        logits = model(x)
        target = task.eval_y.to(device)
        loss = _finite(task.loss(logits, target))
    model.train()
    return loss, (task.accuracy(logits, target) if loss is not None else None)


def build_optimizer(task: Task, spec: RunSpec, model: torch.nn.Module, scaler):
    """The optimizer of ``spec`` for ``model`` (already in the spec's model precision)."""
    return spec.optimizer.build(
        model,
        dict(spec.hparams),
        FACTOR_DTYPES.get(spec.factor),
        PRECISIONS[spec.precision].stochastic_rounding,
        scaler,
        task.loss_average,
    )


def training_step(
    task: Task, precision: Precision, model: torch.nn.Module, optimizer, scaler, x, y
) -> float | None:
    """One training step: forward under the precision's autocast, then, if the loss is
    finite, backward and the optimizer step (through ``scaler`` when there is one).
    Returns the loss, or None (and no step taken) when it is not finite."""
    optimizer.zero_grad(set_to_none=True)
    with precision.autocast(x.device):
        loss = task.loss(model(x), y)
    value = _finite(loss)
    if value is None:
        return None
    if scaler is None:
        loss.backward()
        optimizer.step()
    else:
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    return value


def train(
    task: Task,
    spec: RunSpec,
    device: torch.device,
    on_step: Callable[[int], None] = lambda step: None,
) -> RunResult:
    """Train ``spec`` on ``task`` and measure it; ``on_step`` is called after each step."""
    started = time.perf_counter()
    result = RunResult(spec)
    precision = PRECISIONS[spec.precision]
    torch.manual_seed(spec.seed)
    model = precision.prepare(task.make_model().to(device))
    scaler = precision.make_scaler(device)
    batches = task.batch_indices(spec.steps, spec.seed)
    eval_every = max(1, spec.steps // EVALUATIONS)
    step, optimizer, seconds = 0, None, 0.0

    def evaluate(at: int) -> bool:
        loss, accuracy = _evaluate(task, model, precision, device)
        result.eval_steps.append(at)
        result.eval_loss.append(loss)
        result.eval_accuracy.append(accuracy)
        result.eval_seconds.append(seconds)
        if loss is None:
            result.first_nonfinite_step = at
            return False
        if spec.prune is not None and at >= spec.prune[1] * spec.steps and loss > spec.prune[0]:
            result.pruned_at = at
            return False
        return True

    try:
        optimizer = build_optimizer(task, spec, model, scaler)
        if not evaluate(0):
            result.wall_s = time.perf_counter() - started
            return result
        for step in range(spec.steps):
            idx = batches[step]
            x = precision.cast_input(task.train_x[idx].to(device))
            y = task.train_y[idx].to(device)
            start = time.perf_counter()
            result.train_loss.append(training_step(task, precision, model, optimizer, scaler, x, y))
            if result.train_loss[-1] is None:
                result.first_nonfinite_step = step
                break
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            elapsed = time.perf_counter() - start
            seconds += elapsed
            result.step_ms.append(1e3 * elapsed)
            on_step(step)
            if ((step + 1) % eval_every == 0 or step + 1 == spec.steps) and not evaluate(step + 1):
                break
    except FloatingPointError:  # the optimizer met a non-finite gradient
        result.first_nonfinite_step = step
    except Exception as exc:  # an optimizer failing is a result of the run, not a crash
        result.error = f"{type(exc).__name__}: {exc}"
        result.first_nonfinite_step = step
    if optimizer is not None:
        result.state_bytes = state_bytes(optimizer)
    result.wall_s = time.perf_counter() - started
    return result
