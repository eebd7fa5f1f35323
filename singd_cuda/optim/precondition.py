"""The precondition-and-write phase of a step for the preconditioned layers.

A layer's rule preconditions its gradient with the layer's factors and writes its
parameters, one layer at a time (:meth:`~singd_cuda.optim.rule.LayerRule.apply`) or, for
a rule that fuses, one pass per parameter group (``apply_many``). Parameters sharded by
rows (FSDP2) go through the :class:`~singd_cuda.optim.scale_out.Shards` of the step.
"""

from __future__ import annotations

import operator

import torch
from torch import Tensor
from torch.optim import Optimizer

from ..curvature.layers import Layer, gradient_matrix
from ..structures.base import accumulation_dtype
from .grouped import positions_by
from .recipe import rescale_weight_
from .write import gradient_factor

_FIRST = operator.itemgetter(0)


def precondition_layers(
    opt: Optimizer, layers: list[Layer], grad_scale: Tensor | None, found_inf: Tensor | None
) -> None:
    """Update the parameters of ``layers`` (gradients still scaled by ``grad_scale``, or
    unscaled when None); rules that fuse update their group's layers in one pass.
    ``found_inf``: None, or the step's skip flag decided on the device (every write
    consumes it). ``opt``: a KroneckerOptimizer."""
    groups = opt.param_groups
    indices = list(map(opt._layer_group.__getitem__, layers))
    layer_states = opt._params_states(layers)  # each layer's parameters' states
    parts = positions_by(indices)  # per parameter group
    one_group = len(parts) == 1
    fused = []  # per group that fuses: (group, rule, its layers, their states)
    for part in parts:
        group = groups[indices[part[0]]]
        rule = opt.rule_for(group)
        members = layers if one_group else [layers[i] for i in part]
        states_of = layer_states if one_group else [layer_states[i] for i in part]
        if not all(map(_FIRST, states_of)):  # a layer without state yet
            for layer, states in zip(members, states_of, strict=True):
                if not states[0]:
                    rule.init_state(layer, group, states[0])
        if rule.fuses_apply(group):
            fused.append((group, rule, members, states_of))
            continue
        for layer, states in zip(members, states_of, strict=True):
            G = gradient_matrix(layer, accumulation_dtype(layer.weight.dtype))
            if grad_scale is not None:
                G = G / grad_scale.to(G.device, G.dtype)
            if group["maximize"]:
                G = G.neg()  # (never in place: G may be a view of the gradient)
            seed = opt._seed(group, layer.weight)
            rule.apply(layer, group, states, G, group["step"], seed, found_inf=found_inf)
            if group["weight_rescale"]:
                rescale_weight_(layer.weight)
    inv_scale = None
    for group, rule, members, states_of in fused:
        if grad_scale is not None and inv_scale is None:
            inv_scale = grad_scale.to(members[0].weight.device, torch.float32).reciprocal()
        seed = opt._seed(group, members[0].weight)
        factor = gradient_factor(inv_scale, group, members[0].weight.device)
        rule.apply_many(members, group, states_of, factor, group["step"], seed, found_inf=found_inf)
        if group["weight_rescale"]:
            for layer in members:
                rescale_weight_(layer.weight)


def precondition_shards(opt: Optimizer, layers: list[Layer], grad_scale: Tensor | None) -> None:
    """Every rank updates its rows of every layer of ``layers`` (FSDP2; the owner of a
    layer, or every rank, preconditions). ``opt``: a KroneckerOptimizer."""
    sync, shards = opt._sync, opt._shards()
    entries = []
    for layer in layers:
        group = opt.group_of(layer)
        rule = opt.rule_for(group)
        if sync.owns(layer) and not opt.state[layer.weight]:
            rule.init_state(layer, group, opt.state[layer.weight])
        states = [opt.state[p] for p in layer.params]
        seed = opt._seed(group, layer.weight)
        entries.append(shards.entry(layer, rule, group, states, seed, sync.owner_of(layer)))
    inv_scale = None
    if grad_scale is not None:
        inv_scale = grad_scale.to(opt._layers[0].weight.device, torch.float32).reciprocal()
    shards.step(entries, inv_scale)
