"""The built-in first-order fallback (AdamW) for parameters outside supported layers.

Norm affine parameters, embeddings and free parameters train with it inside
the same optimizer, so one optimizer trains the whole model.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import ops
from ..structures.base import upcast


def adam_direction(
    param: Tensor, grad: Tensor, state: dict, betas: tuple[float, float], eps: float
) -> Tensor:
    """Update the moments and return AdamW's bias-corrected step direction m̂ / (√v̂ + ε).

    State: ``step`` (float32 scalar tensor), ``exp_avg``, ``exp_avg_sq`` in the
    parameter's dtype, created on the first call. ``grad`` is unscaled, shaped like
    ``param``; the math and the returned direction are float32 (float64 for float64
    parameters).
    """
    if "step" not in state:
        state["step"] = torch.zeros((), dtype=torch.float32)
        state["exp_avg"] = torch.zeros_like(param)
        state["exp_avg_sq"] = torch.zeros_like(param)
    state["step"] += 1
    step = float(state["step"])
    beta1, beta2 = betas
    g = upcast(grad, param.dtype)
    exp_avg = upcast(state["exp_avg"]).mul(beta1).add_(g, alpha=1.0 - beta1)
    exp_avg_sq = upcast(state["exp_avg_sq"]).mul(beta2).addcmul_(g, g, value=1.0 - beta2)
    state["exp_avg"].copy_(exp_avg)
    state["exp_avg_sq"].copy_(exp_avg_sq)
    denom = (exp_avg_sq / (1.0 - beta2**step)).sqrt_().add_(eps)
    return exp_avg.div_(1.0 - beta1**step).div_(denom)


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
    moments (see :func:`adam_direction`); ``stochastic_rounding`` and ``seed`` as in
    :mod:`singd_cuda.ops`.
    """
    directions = [
        adam_direction(p, g, s, betas, eps) for p, g, s in zip(params, grads, states, strict=True)
    ]
    ops.sgd_epilogue_(
        params,
        directions,
        [],
        lr=lr,
        weight_decay=weight_decay,
        decoupled=True,
        stochastic_rounding=stochastic_rounding,
        seed=seed,
    )
