"""The factor-update phase of a step: new factors from the step's statistics.

Layers whose rules give equal :meth:`~singd_cuda.optim.rule.LayerRule.group_key` update
as one stack; what the updates overwrite is saved first, so that a non-finite result
(flagged here, read once by the step) restores every factor.
"""

from __future__ import annotations

from torch.optim import Optimizer

from ..curvature.layers import Layer
from .fallback import all_preconditioned
from .finite import FACTORS
from .grouped import positions_by, stack_parts
from .rule import LayerRule


def update_factors(opt: Optimizer, layers: list[Layer]) -> None:
    """Update the factors of those of ``layers`` that have statistics this step
    (``opt._pending``), saving what they overwrite in ``opt._undo``, and flag a
    non-finite result in ``opt._finite``. ``opt``: a KroneckerOptimizer."""
    pending_of = opt._pending
    updated = [layer for layer in layers if layer in pending_of] if pending_of else []
    if not updated:  # a step between statistics: nothing to save, check or update
        opt._undo.save([])
        return
    groups = opt.param_groups
    states = _weight_states(opt, updated)
    pendings = list(map(pending_of.__getitem__, updated))
    indices = list(map(opt._layer_group.__getitem__, updated))
    parts = positions_by(indices)  # per parameter group
    rules = {indices[part[0]]: opt.rule_for(groups[indices[part[0]]]) for part in parts}
    opt._undo.save(states, _untouched(groups, rules, indices, parts, states))
    distribute_factors = opt._sync is not None and opt._sync.distribute_factors
    if distribute_factors or not all(
        rules[indices[part[0]]].started(groups[indices[part[0]]], _members(states, part))
        for part in parts
    ):
        parts = _each_layer(opt, updated, states, pendings, indices, rules, distribute_factors)
    for part in parts:
        index = indices[part[0]]
        group, rule = groups[index], rules[index]
        group_layers = _members(updated, part)
        group_states, group_pendings = _members(states, part), _members(pendings, part)
        keys = rule.group_keys(group_layers, group, group_states)
        for stack in stack_parts(group_layers, keys):
            rule.update_factors_many(
                _members(group_layers, stack),
                group,
                _members(group_states, stack),
                _members(group_pendings, stack),
                group["step"],
            )
    opt._finite.check(opt._undo.updated(), FACTORS)


def _members(items: list, positions: list[int]) -> list:
    """``items`` at ``positions`` (in order, a part of ``range(len(items))``): ``items``
    itself when the part is all of them (the common case, one group and one stack)."""
    return items if len(positions) == len(items) else [items[i] for i in positions]


def _untouched(groups, rules, indices, parts, states) -> tuple[str, ...]:
    """The state keys every group's rule leaves as they are in this update
    (:meth:`~.rule.LayerRule.untouched`)."""
    found = None
    for part in parts:
        group = groups[indices[part[0]]]
        keys = rules[indices[part[0]]].untouched(group, [states[i] for i in part], group["step"])
        found = keys if found is None else tuple(key for key in found if key in keys)
    return found or ()


def _weight_states(opt: Optimizer, layers: list[Layer]) -> list[dict]:
    """The weights' states of ``layers`` (:meth:`_layer_state`: the factors of a layer at
    its first statistics are created there), by C calls alone when every layer has its
    factors already (:meth:`_weights_states`)."""
    states = opt._weights_states(layers)
    if all_preconditioned(states):
        return states
    groups, layer_group = opt.param_groups, opt._layer_group
    return [opt._layer_state(layer, groups[layer_group[layer]]) for layer in layers]


def _each_layer(
    opt: Optimizer,
    layers: list[Layer],
    states: list[dict],
    pendings: list[dict],
    indices: list[int],
    rules: dict[int, LayerRule],
    distribute_factors: bool,
) -> list[list[int]]:
    """Layer by layer, in order: the shared statistics' finish (``distribute_factors``)
    and the rules' :meth:`~.rule.LayerRule.start_factors`; the positions per group of
    the layers that go on to their factor update."""
    groups = opt.param_groups
    own_start = {
        i: type(rule).start_factors is not LayerRule.start_factors for i, rule in rules.items()
    }
    going: dict[int, list[int]] = {}
    for position, (layer, state, pending) in enumerate(zip(layers, states, pendings, strict=True)):
        index = indices[position]
        group, rule = groups[index], rules[index]
        if distribute_factors:
            rule.finish_shared(layer, group, state, pending)
        if own_start[index]:
            started = rule.start_factors(layer, group, state, pending)
            if started is None:  # out of the factor dtype: skipped as an overflow is
                opt._finite.flag(layer.weight.device, FACTORS).fill_(1.0)
            if not started:
                continue  # the statistics cannot start this layer's factors (yet)
        going.setdefault(index, []).append(position)
    return list(going.values())
