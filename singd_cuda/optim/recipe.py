"""The large-batch recipe of Osawa et al. (arXiv 1811.12019): schedules and weight rescaling.

* ``T`` and ``damping`` accept callables of the step; :class:`Piecewise` and
  :class:`Warmup` are picklable ones, e.g. ``T=Piecewise([1, 10], [500])`` (refresh the
  factors every step for 500 steps, then every 10) and
  ``damping=Warmup(start=1e-1, target=1e-3, steps=1000)`` (damping decays geometrically
  from a large value to its target). Both survive ``torch.load(weights_only=True)``.
* ``weight_rescale=True``: after its update, each preconditioned layer's weight is
  rescaled to the norm √(2·d_out) it has in expectation under He initialisation.
* ``momentum_lr_ratio=r``: the momentum is set to r·lr from the learning rate read at
  each step, so an LR schedule moves both in a fixed ratio.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ..structures.base import upcast


@dataclass(frozen=True)
class Piecewise:
    """values[i] for boundaries[i-1] <= step < boundaries[i] (boundaries ascending)."""

    values: Sequence[float]
    boundaries: Sequence[int]

    def __post_init__(self) -> None:
        if len(self.values) != len(self.boundaries) + 1:
            raise ValueError("Piecewise needs one more value than boundaries")
        if list(self.boundaries) != sorted(self.boundaries):
            raise ValueError("Piecewise boundaries must be ascending")

    def __call__(self, step: int) -> float:
        return self.values[bisect.bisect_right(list(self.boundaries), step)]


@dataclass(frozen=True)
class Warmup:
    """Geometric interpolation from ``start`` (step 0) to ``target`` (step ``steps`` on)."""

    start: float
    target: float
    steps: int

    def __post_init__(self) -> None:
        if self.start <= 0 or self.target <= 0 or self.steps < 0:
            raise ValueError("Warmup needs start > 0, target > 0 and steps >= 0")

    def __call__(self, step: int) -> float:
        if step >= self.steps:
            return self.target
        fraction = step / self.steps
        return math.exp((1 - fraction) * math.log(self.start) + fraction * math.log(self.target))


# Optimizer state_dicts hold the schedules in their param_groups: let torch.load with
# weights_only=True (the default) rebuild them.
torch.serialization.add_safe_globals([Piecewise, Warmup])


def rescale_weight_(weight: Tensor) -> None:
    """W ← W · √(2·d_out) / ‖W‖ (d_out = output features or channels); zero W is left alone."""
    w = upcast(weight)
    norm = torch.linalg.vector_norm(w)
    if float(norm) > 0.0:
        weight.copy_(w * (math.sqrt(2.0 * weight.shape[0]) / norm))


def momentum_from_ratio(group: dict) -> None:
    """group["momentum"] ← momentum_lr_ratio · lr, when the group has a ratio."""
    ratio = group.get("momentum_lr_ratio")
    if ratio is None:
        return
    momentum = ratio * group["lr"]
    if not 0.0 <= momentum < 1.0:
        raise ValueError(
            f"momentum_lr_ratio {ratio} x lr {group['lr']} = {momentum} is not in [0, 1)"
        )
    group["momentum"] = momentum
