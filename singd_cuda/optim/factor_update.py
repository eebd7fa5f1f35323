"""The factor-update phase of a step: new factors from the step's statistics.

Layers whose rules give equal :meth:`~singd_cuda.optim.rule.LayerRule.group_key` update
as one stack; what the updates overwrite is saved first, so that a non-finite result
(flagged here, read once by the step) restores every factor.
"""

from __future__ import annotations

from torch.optim import Optimizer

from ..curvature.layers import Layer
from .finite import FACTORS
from .grouped import stack_parts
from .rule import LayerRule


def update_factors(opt: Optimizer, layers: list[Layer]) -> None:
    """Update the factors of those of ``layers`` that have statistics this step
    (``opt._pending``), saving what they overwrite in ``opt._undo``, and flag a
    non-finite result in ``opt._finite``. ``opt``: a KroneckerOptimizer."""
    pending_of = opt._pending
    updated = [layer for layer in layers if layer in pending_of]
    groups, layer_group = opt.param_groups, opt._layer_group
    states = [opt._layer_state(layer, groups[layer_group[layer]]) for layer in updated]
    opt._undo.save(states)
    distribute_factors = opt._sync is not None and opt._sync.distribute_factors
    # per group: (rule, whether its start_factors is its own: LayerRule's starts nothing,
    # so it is not called per layer), and the layers that update
    rules: dict[int, tuple[LayerRule, bool]] = {}
    members: dict[int, list[tuple[Layer, dict, dict]]] = {}
    for layer, state in zip(updated, states, strict=True):
        pending = pending_of[layer]
        index = layer_group[layer]
        group = groups[index]
        if index not in rules:
            rule = opt.rule_for(group)
            rules[index] = rule, type(rule).start_factors is not LayerRule.start_factors
        rule, starts = rules[index]
        if distribute_factors:
            rule.finish_shared(layer, group, state, pending)
        if starts:
            started = rule.start_factors(layer, group, state, pending)
            if started is None:  # out of the factor dtype: skipped as an overflow is
                opt._finite.flag(layer.weight.device, FACTORS).fill_(1.0)
            if not started:
                continue  # the statistics cannot start this layer's factors (yet)
        members.setdefault(index, []).append((layer, state, pending))
    for index, entries in members.items():
        group_layers, group_states, pendings = (list(c) for c in zip(*entries, strict=True))
        group, rule = groups[index], rules[index][0]
        keys = rule.group_keys(group_layers, group, group_states)
        for part in stack_parts(group_layers, keys):
            rule.update_factors_many(
                [group_layers[i] for i in part],
                group,
                [group_states[i] for i in part],
                [pendings[i] for i in part],
                group["step"],
            )
    opt._finite.check(opt._undo.updated(), FACTORS)
