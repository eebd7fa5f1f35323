"""The last phase of a step: writing the parameters (momentum SGD with weight decay,
stochastic rounding for half-precision weights), in one op call per set of parameters."""

from __future__ import annotations

import torch
from torch import Tensor

from .. import ops
from ..structures.base import ACCUMULATES_IN, upcast


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
    trained = _trained(params, directions, states)
    if not trained:
        return
    momentum = group["momentum"]
    bufs = []
    if momentum != 0.0:
        for p, _, s in trained:
            if "momentum_buffer" not in s:
                s["momentum_buffer"] = torch.zeros_like(p)
            bufs.append(s["momentum_buffer"])
    ops.sgd_epilogue_(
        [p for p, _, _ in trained],
        [d for _, d, _ in trained],
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
    trained = _trained(params, directions, states)
    if not trained:
        return
    for p, _, s in trained:
        if "exp_avg" not in s:
            s["exp_avg"] = torch.zeros_like(p)
    ops.adam_epilogue_(
        [p for p, _, _ in trained],
        [d for _, d, _ in trained],
        [s["exp_avg"] for _, _, s in trained],
        lr=group["lr"],
        beta=group["momentum"],
        step=count,
        weight_decay=group["weight_decay"],
        decoupled=group["decoupled_weight_decay"],
        stochastic_rounding=group["stochastic_rounding"],
        seed=seed,
        found_inf=found_inf,
    )


def _trained(params: list[Tensor], directions: list, states: list[dict]) -> list[tuple]:
    """(parameter, its direction in the parameter's accumulation dtype, its state) of
    each parameter that has a gradient."""
    trained = []
    for p, d, s in zip(params, directions, states, strict=True):
        if p.grad is not None:
            # upcast(d, p.dtype), inline: two Python calls and a no-op .to's dispatch
            # saved per parameter where d is in that dtype already (the common case)
            dtype = ACCUMULATES_IN.get(p.dtype, p.dtype)
            trained.append((p, d if d.dtype == dtype else d.to(dtype), s))
    return trained
