"""The built-in first-order fallback (AdamW) for parameters outside supported layers.

Norm affine parameters, embeddings and free parameters train with it inside
the same optimizer, so one optimizer trains the whole model.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..structures.base import upcast
from .epilogue import write_param_


def adamw_update_(
    param: Tensor,
    grad: Tensor,
    state: dict,
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    generator: torch.Generator | None = None,
) -> None:
    """One AdamW step (as torch.optim.AdamW) on ``param`` with an unscaled ``grad``.

    State: ``step`` (float32 scalar tensor), ``exp_avg``, ``exp_avg_sq`` in the
    parameter's dtype; math in float32 (float64 for float64 parameters).
    """
    if "step" not in state:
        state["step"] = torch.zeros((), dtype=torch.float32)
        state["exp_avg"] = torch.zeros_like(param)
        state["exp_avg_sq"] = torch.zeros_like(param)
    state["step"] += 1
    step = float(state["step"])
    beta1, beta2 = betas
    g = upcast(grad, param.dtype).to(upcast(param).dtype)
    exp_avg = upcast(state["exp_avg"]).mul(beta1).add_(g, alpha=1.0 - beta1)
    exp_avg_sq = upcast(state["exp_avg_sq"]).mul(beta2).addcmul_(g, g, value=1.0 - beta2)
    state["exp_avg"].copy_(exp_avg)
    state["exp_avg_sq"].copy_(exp_avg_sq)
    p = upcast(param) * (1.0 - lr * weight_decay)
    denom = (exp_avg_sq / (1.0 - beta2**step)).sqrt_().add_(eps)
    write_param_(param, p - (lr / (1.0 - beta1**step)) * exp_avg / denom, generator)
