"""The last phase of a step: writing the parameters (momentum SGD with weight decay,
stochastic rounding for half-precision weights), in one op call per set of parameters."""

from __future__ import annotations

import operator

import torch
from torch import Tensor

from .. import ops
from ..structures.base import ACCUMULATES_IN, upcast

_GRAD, _DTYPE = operator.attrgetter("grad"), operator.attrgetter("dtype")


def unscaled(grad: Tensor, grad_scale: Tensor | None, maximize: bool = False) -> Tensor:
    """grad / grad_scale in the accumulation dtype of grad's dtype (float32 for half
    types), negated with ``maximize`` (the gradient of the negated loss); never ``grad``
    itself when it changes."""
    grad = upcast(grad)
    if grad_scale is not None:
        grad = grad / grad_scale.to(grad.device, grad.dtype)
    return grad.neg() if maximize else grad


def gradient_factor(inv_scale: Tensor | None, group: dict, device: torch.device) -> Tensor | None:
    """What a group's gradients are multiplied by: ``inv_scale`` (a one-element tensor, the
    inverse loss scale; None for 1), negated for a group with ``maximize``. A product by
    −1 is exact, and rounding is symmetric in the sign, so a maximising step is bitwise
    the step on the negated loss."""
    if not group["maximize"]:
        return inv_scale
    if inv_scale is None:
        return torch.full((), -1.0, dtype=torch.float32, device=device)
    return inv_scale.neg()


def sgd_update_(
    params: list[Tensor],
    directions: list[Tensor | None],
    states: list[dict],
    group: dict,
    seed: int,
    found_inf: Tensor | None = None,
) -> None:
    """Momentum SGD with coupled weight decay on the parameters that have a gradient (the
    others, e.g. a bias frozen after construction, are left alone), in one
    :func:`singd_cuda.ops.sgd_epilogue_` call with the group's ``lr``, ``momentum``,
    ``weight_decay`` and ``stochastic_rounding``.

    Args:
        params: the parameters, any shapes, float32/bfloat16/float16/float64.
        directions: the unscaled preconditioned gradients, shaped like ``params``, in
            any floating dtype (used in the parameter's accumulation dtype: float32 for
            half types); ignored (may be None) for parameters without a gradient.
        states: the parameters' states; the momentum buffer ``state["momentum_buffer"]``
            (the parameter's dtype) is created as zeros when missing and momentum != 0.
        seed: the stochastic-rounding seed of the call.
        found_inf: None, or a one-element float32 tensor on the parameters' device: when
            > 0 the call changes nothing (read by the op on the device).
    """
    params, directions, states = _trained(params, directions, states)
    if not params:
        return
    momentum = group["momentum"]
    bufs = _buffers(params, states, "momentum_buffer") if momentum != 0.0 else []
    ops.sgd_epilogue_(
        params,
        directions,
        bufs,
        lr=group["lr"],
        momentum=momentum,
        weight_decay=group["weight_decay"],
        stochastic_rounding=group["stochastic_rounding"],
        seed=seed,
        found_inf=found_inf,
    )


def adam_update_(
    params: list[Tensor],
    directions: list[Tensor | None],
    states: list[dict],
    group: dict,
    count: int,
    seed: int,
    found_inf: Tensor | None = None,
) -> None:
    """AdaFisher's Adam-style write along given directions on the parameters that have a
    gradient, in one :func:`singd_cuda.ops.adam_epilogue_` call: m ← βm + (1 − β)(d + γW)
    (γW when ``decoupled_weight_decay`` is False), W ← W − lr·m / (1 − βᶜᵒᵘⁿᵗ) (decoupled:
    W ← (1 − lr·γ)W first), β = the group's ``momentum``.

    ``directions``, ``seed``, ``found_inf``: as :func:`sgd_update_`; ``states``: the first
    moment ``state["exp_avg"]`` (the parameter's dtype) is created as zeros when missing;
    ``count``: the 1-based count of the bias correction.
    """
    params, directions, states = _trained(params, directions, states)
    if not params:
        return
    ops.adam_epilogue_(
        params,
        directions,
        _buffers(params, states, "exp_avg"),
        lr=group["lr"],
        beta=group["momentum"],
        step=count,
        weight_decay=group["weight_decay"],
        decoupled=group["decoupled_weight_decay"],
        stochastic_rounding=group["stochastic_rounding"],
        seed=seed,
        found_inf=found_inf,
    )


def _trained(params: list[Tensor], directions: list, states: list[dict]) -> tuple[list, ...]:
    """(the parameters that have a gradient, their directions in the parameter's
    accumulation dtype, their states). The common case, every parameter with a gradient
    and every direction in that dtype already, takes C calls alone."""
    kinds = set(map(type, map(_GRAD, params))) | set(map(type, directions))
    if len(params) == len(directions) == len(states) and type(None) not in kinds:
        dtypes = set(map(_DTYPE, params))
        if len(dtypes) == 1:
            dtype = next(iter(dtypes))
            if set(map(_DTYPE, directions)) == {ACCUMULATES_IN.get(dtype, dtype)}:
                return params, directions, states
    trained: tuple[list, list, list] = ([], [], [])
    for p, d, s in zip(params, directions, states, strict=True):
        if p.grad is not None:
            # upcast(d, p.dtype), inline: two Python calls and a no-op .to's dispatch
            # saved per parameter where d is in that dtype already
            dtype = ACCUMULATES_IN.get(p.dtype, p.dtype)
            trained[0].append(p)
            trained[1].append(d if d.dtype == dtype else d.to(dtype))
            trained[2].append(s)
    return trained


def _buffers(params: list[Tensor], states: list[dict], key: str) -> list[Tensor]:
    """``state[key]`` of every parameter's state, created as zeros like the parameter
    where missing."""
    try:
        return list(map(operator.itemgetter(key), states))
    except KeyError:
        for p, s in zip(params, states, strict=True):
            if key not in s:
                s[key] = torch.zeros_like(p)
        return list(map(operator.itemgetter(key), states))
