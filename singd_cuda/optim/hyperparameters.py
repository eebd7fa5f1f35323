"""Validation of the hyperparameters in ``param_groups``, where they are read.

A group is validated in full when it is added (construction, ``add_param_group``), when
a checkpoint is loaded, and at the start of any step where one of its values changed
since the last validation (an edit of ``opt.param_groups[i][key]``, a learning-rate
scheduler). A group whose values are the same objects costs one identity test per
value, in C calls; a new object equal to the old value, one equality test. Callable
hyperparameters (``T``, ``damping``, ``lr_cov``, ``norm_damping``) are evaluated at the
group's step and their value checked at every step.

Changes that concern the state:

- ``structures``: free while none of the group's layers has factors; afterwards a
  ValueError (the factors of one structure do not convert into another).
- ``factor_dtype``: the factors of the group's layers are cast to the new dtype.
- ``norm_fisher``: fixed at construction (it decides which layers are preconditioned).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from itertools import repeat
from operator import is_
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from ..curvature.layers import KFAC_APPROXIMATIONS, LOSS_AVERAGES, Layer
from .graft import GRAFTS

# check(key, value) -> the value to store (normalised), or ValueError naming the fix
Check = Callable[[str, Any], Any]

SCHEDULABLE = ("T", "damping", "lr_cov", "norm_damping")
FACTOR_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
_UNREAD = ("params", "step")  # not hyperparameters: the parameters and the step counter
_STATEFUL = ("structures", "factor_dtype", "norm_fisher")  # changes that concern the state
_MISSING = object()  # what GroupWatch.changed reads for a key a group lost (no value is it)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def number(*, positive: bool = False, below_one: bool = False, optional: bool = False) -> Check:
    """A finite number >= 0 (> 0 with ``positive``; < 1 with ``below_one``; or None)."""

    def check(key: str, value: Any) -> Any:
        if optional and value is None:
            return value
        if below_one:
            if _is_number(value) and 0.0 <= value < 1.0:
                return value
            raise ValueError(f"{key} must be in [0, 1), got {value!r}")
        if _is_number(value) and (value > 0 if positive else value >= 0):
            return value
        if optional:
            raise ValueError(f"{key} must be >= 0 or None, got {value!r}")
        bound = "> 0" if positive else ">= 0"
        raise ValueError(f"{key} must be a number {bound}, got {value!r}")

    return check


def period(key: str, value: Any) -> Any:
    """An integer >= 1 (an integral float is accepted as the integer)."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    raise ValueError(f"{key} must be an integer >= 1 or a callable of the step, got {value!r}")


def optional_period(key: str, value: Any) -> Any:
    """None or an integer >= 1 (not a callable)."""
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        return value
    raise ValueError(f"{key} must be None or an integer >= 1, got {value!r}")


def optional_dimension(key: str, value: Any) -> Any:
    """None or an integer >= 0 (a dimension index)."""
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
        return value
    raise ValueError(f"{key} must be None or an integer >= 0, got {value!r}")


def one_of(options: tuple) -> Check:
    def check(key: str, value: Any) -> Any:
        if value in options and not isinstance(value, bool):
            return value
        raise ValueError(f"{key} must be one of {options}, got {value!r}")

    return check


def flag(key: str, value: Any) -> Any:
    if isinstance(value, bool):
        return value
    raise ValueError(f"{key} must be True or False, got {value!r}")


def factor_dtype(key: str, value: Any) -> Any:
    if value is None or value in FACTOR_DTYPES:
        return value
    raise ValueError(
        f"{key} must be None or one of torch.float64, float32, bfloat16, float16; got {value!r}"
    )


def betas(key: str, value: Any) -> Any:
    if (
        isinstance(value, tuple | list)
        and len(value) == 2
        and all(_is_number(b) and 0.0 <= b < 1.0 for b in value)
    ):
        return value
    raise ValueError(f"{key} must be a pair of numbers in [0, 1), got {value!r}")


def common_checks() -> dict[str, Check]:
    """The checks of every optimizer's group (see :meth:`KroneckerOptimizer.validate_group`)."""
    return dict(
        lr=number(),
        weight_decay=number(),
        fallback_lr=number(optional=True),
        fallback_betas=betas,
        fallback_eps=number(),
        fallback_weight_decay=number(),
        loss_average=one_of(LOSS_AVERAGES),
        batch_dim=optional_dimension,
        kfac_approx=one_of(KFAC_APPROXIMATIONS),
        graft=one_of(GRAFTS),
        factor_dtype=factor_dtype,
        stochastic_rounding=flag,
        norm_fisher=flag,
        norm_damping=number(),
        weight_rescale=flag,
        momentum_lr_ratio=number(optional=True),
        maximize=flag,
        T=period,
    )


def validate(group: dict, checks: dict[str, Check]) -> None:
    """Check every key of ``checks`` in ``group`` (a callable passes for the keys in
    :data:`SCHEDULABLE`: its value is checked at each step); store normalised values."""
    for key, check in checks.items():
        if key not in group:
            raise ValueError(f"the parameter group has no {key!r}")
        value = group[key]
        if callable(value) and key in SCHEDULABLE:
            continue
        normalised = check(key, value)
        if normalised is not value:
            group[key] = normalised


class GroupWatch:
    """The last validated values of each group (by position in ``param_groups``), and the
    callable hyperparameters to check at each step."""

    def __init__(self) -> None:
        self.snapshots: list[dict | None] = []
        self.checks: list[dict[str, Check]] = []
        self.scheduled: list[list[tuple[str, Check]]] = []

    def remember(
        self, index: int, group: dict, checks: dict[str, Check], keys: set[str] | None = None
    ) -> None:
        """Remember the group's values (only ``keys`` when given) and its checks."""
        while len(self.snapshots) <= index:
            self.snapshots.append(None)
            self.checks.append({})
            self.scheduled.append([])
        snapshot = self.snapshots[index]
        if keys is None or snapshot is None:
            self.snapshots[index] = {k: v for k, v in group.items() if k not in _UNREAD}
        else:
            snapshot.update((key, group[key]) for key in keys)
        self.checks[index] = checks
        if keys is None or not keys.isdisjoint(SCHEDULABLE):
            self.scheduled[index] = [
                (key, checks[key]) for key in SCHEDULABLE if key in checks and callable(group[key])
            ]

    def changed(self, index: int, group: dict) -> set[str] | None:
        """The keys whose value changed since the last validation (empty: none), or None
        when the group is new or gained or lost keys."""
        snapshot = self.snapshots[index] if index < len(self.snapshots) else None
        if snapshot is None or len(group) != len(snapshot) + len(_UNREAD):
            return None
        # the common case, every value the same object (a missing key reads as _MISSING,
        # which no value is): unchanged, by C calls alone (this runs at every forward
        # and step)
        if all(map(is_, map(group.get, snapshot, repeat(_MISSING)), snapshot.values())):
            return set()
        changed = set()
        for key, value in snapshot.items():
            current = group.get(key, _MISSING)
            if current is _MISSING:
                return None
            if current is not value and not _equal(current, value):
                changed.add(key)
        return changed


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return False
    try:
        return bool(a == b)
    except Exception:  # values whose == does not give a truth value
        return False


def watch_of(optimizer: Optimizer) -> GroupWatch:
    watch = optimizer.__dict__.get("_group_watch")
    if watch is None:
        watch = optimizer.__dict__["_group_watch"] = GroupWatch()
    return watch


def accept(optimizer: Optimizer, group: dict) -> None:
    """Validate a group in full and remember its values (a new or a loaded group)."""
    checks = optimizer.hyperparameter_checks(group)
    validate(group, checks)
    index = next((i for i, g in enumerate(optimizer.param_groups) if g is group), None)
    if index is not None:
        watch_of(optimizer).remember(index, group, checks)


def check_step(optimizer: Optimizer, scheduled: bool = True) -> None:
    """At the start of a step (and, with ``scheduled=False``, of a forward): re-validate
    the groups that changed since their last validation (applying the state consequences
    above), and check the value of every callable hyperparameter at the group's step."""
    watch = watch_of(optimizer)
    for index, group in enumerate(optimizer.param_groups):
        changed = watch.changed(index, group)
        if changed is None or changed:
            _revalidate(optimizer, watch, index, group, changed)
        if not scheduled:
            continue
        for key, check in watch.scheduled[index]:
            value = group[key](group["step"])
            try:
                check(key, value)
            except ValueError as error:
                raise ValueError(
                    f"{error} (the value of the callable {key} at step {group['step']} of "
                    f"param_groups[{index}])"
                ) from None


def _revalidate(
    optimizer: Optimizer,
    watch: GroupWatch,
    index: int,
    group: dict,
    changed: set[str] | None,
) -> None:
    """Validate the ``changed`` keys of a group (all when None, or when ``structures``
    changed: other rules may depend on it), apply the consequences, remember the values."""
    old = watch.snapshots[index] if index < len(watch.snapshots) else None
    everything = changed is None or "structures" in changed
    checks = optimizer.hyperparameter_checks(group) if everything else watch.checks[index]
    some = checks if everything else {key: checks[key] for key in changed if key in checks}
    old_values = None if old is None else {key: old[key] for key in _STATEFUL if key in old}
    try:
        validate(group, some)
    except ValueError as error:
        raise ValueError(f"param_groups[{index}]: {error}") from None
    if old_values is not None and (changed is None or not changed.isdisjoint(_STATEFUL)):
        _apply_changes(optimizer, index, group, old_values)
    watch.remember(index, group, checks, None if everything else changed)


def _apply_changes(optimizer: Optimizer, index: int, group: dict, old: dict) -> None:
    layers = [layer for layer in optimizer.layers if optimizer.group_of(layer) is group]
    with_factors = [layer for layer in layers if optimizer.state.get(layer.weight)]
    if old.get("norm_fisher") != group.get("norm_fisher"):
        raise ValueError(
            f"param_groups[{index}]['norm_fisher'] changed from {old.get('norm_fisher')!r} "
            f"to {group.get('norm_fisher')!r}; it is fixed at construction (set it back, or "
            f"pass it to {type(optimizer).__name__}(...))"
        )
    structures = group.get("structures")
    if structures is not None and tuple(old["structures"]) != structures:
        _check_factors_fit(optimizer, index, group, old, with_factors)
    if old.get("factor_dtype") != group.get("factor_dtype"):
        for layer in with_factors:
            _cast_factors(optimizer, layer, group)


def _check_factors_fit(optimizer, index: int, group: dict, old: dict, layers: list) -> None:
    """ValueError unless the existing factors of ``layers`` already have the layout of the
    group's new structures (e.g. created by this step's statistics, after the edit)."""
    for layer in layers:
        state = optimizer.state[layer.weight]
        expected = factor_keys(optimizer, layer, group)
        if all(key in state and same_layout(state[key], expected[key]) for key in expected):
            continue
        raise ValueError(
            f"param_groups[{index}]['structures'] changed from {tuple(old['structures'])} "
            f"to {group['structures']} after the group's factors were created; factors do "
            "not convert between structures: set it back, or start a new "
            f"{type(optimizer).__name__} with the new structures (its factors start at the "
            "identity)"
        )


def same_layout(value: Any, expected: Any) -> bool:
    """``value`` is laid out as ``expected`` (a tensor of its shape, a dict of such with
    the same keys, or a non-tensor)."""
    if isinstance(expected, dict):
        return (
            isinstance(value, dict)
            and set(value) == set(expected)
            and all(same_layout(value[k], expected[k]) for k in expected)
        )
    if isinstance(expected, Tensor):
        return isinstance(value, Tensor) and value.shape == expected.shape
    return not isinstance(value, Tensor | dict)


def factor_keys(optimizer: Optimizer, layer: Layer, group: dict) -> dict[str, Any]:
    """The state entries the group's rule creates for ``layer`` (its factors), on the
    meta device: keys, tensor shapes and dtypes, no memory."""
    meta = dataclasses.replace(
        layer,
        weight=torch.empty(layer.weight.shape, dtype=layer.weight.dtype, device="meta"),
        bias=None
        if layer.bias is None
        else torch.empty(layer.bias.shape, dtype=layer.bias.dtype, device="meta"),
    )
    fresh: dict[str, Any] = {}
    optimizer.rule_for(group).init_state(meta, group, fresh)
    return fresh


def _cast_factors(optimizer: Optimizer, layer: Layer, group: dict) -> None:
    state = optimizer.state[layer.weight]
    dtype = group["factor_dtype"] or layer.weight.dtype
    for key in factor_keys(optimizer, layer, group):
        value = state.get(key)
        if isinstance(value, Tensor) and value.is_floating_point():
            state[key] = value.to(dtype)
        elif isinstance(value, dict):
            state[key] = {k: v.to(dtype) for k, v in value.items()}
