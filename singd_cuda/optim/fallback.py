"""The built-in first-order fallback (AdamW) for parameters outside supported layers.

Norm affine parameters, embeddings and free parameters train with it inside
the same optimizer, so one optimizer trains the whole model.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import ops
from ..structures.base import upcast


def in_fallback(state: dict) -> bool:
    """Whether a parameter state is the fallback's (a preconditioned layer's parameters
    hold it while the layer waits for its first curvature statistics)."""
    return "exp_avg_sq" in state


def adam_directions(
    params: list[Tensor],
    grads: list[Tensor],
    states: list[dict],
    betas: tuple[float, float],
    eps: float,
) -> list[Tensor]:
    """Update the moments and return AdamW's bias-corrected step directions m̂ / (√v̂ + ε),
    one foreach call per operation for all parameters.

    State per parameter: ``step`` (float32 scalar tensor on the CPU), ``exp_avg``,
    ``exp_avg_sq`` in the parameter's dtype, created on the first call. ``grads`` are
    unscaled, shaped like ``params``; the math and the returned directions are float32
    (float64 for float64 parameters).
    """
    for param, state in zip(params, states, strict=True):
        if "step" not in state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(param)
            state["exp_avg_sq"] = torch.zeros_like(param)
        state["step"] += 1
    steps = [float(state["step"]) for state in states]
    beta1, beta2 = betas
    g = [upcast(grad, param.dtype) for grad, param in zip(grads, params, strict=True)]
    exp_avg = torch._foreach_mul([upcast(state["exp_avg"]) for state in states], beta1)
    torch._foreach_add_(exp_avg, g, alpha=1.0 - beta1)
    exp_avg_sq = torch._foreach_mul([upcast(state["exp_avg_sq"]) for state in states], beta2)
    torch._foreach_addcmul_(exp_avg_sq, g, g, value=1.0 - beta2)
    torch._foreach_copy_([state["exp_avg"] for state in states], exp_avg)
    torch._foreach_copy_([state["exp_avg_sq"] for state in states], exp_avg_sq)
    denom = torch._foreach_div(exp_avg_sq, [1.0 - beta2**step for step in steps])
    torch._foreach_sqrt_(denom)
    torch._foreach_add_(denom, eps)
    torch._foreach_div_(exp_avg, [1.0 - beta1**step for step in steps])
    torch._foreach_div_(exp_avg, denom)
    return exp_avg


def adamw_update_(
    params: list[Tensor],
    grads: list[Tensor],
    states: list[dict],
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    stochastic_rounding: bool = False,
    seed: int = 0,
) -> None:
    """One AdamW step (as torch.optim.AdamW) on every parameter, written in one
    :func:`singd_cuda.ops.sgd_epilogue_` call (decoupled weight decay, no momentum).

    ``grads`` are the unscaled gradients, shaped like ``params``; ``states`` hold the
    moments (see :func:`adam_directions`); ``stochastic_rounding`` and ``seed`` as in
    :mod:`singd_cuda.ops`.
    """
    ops.sgd_epilogue_(
        params,
        adam_directions(params, grads, states, betas, eps),
        [],
        lr=lr,
        weight_decay=weight_decay,
        decoupled=True,
        stochastic_rounding=stochastic_rounding,
        seed=seed,
    )
