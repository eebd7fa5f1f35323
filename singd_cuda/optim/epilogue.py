"""The update epilogue shared by every optimizer: weight decay, momentum, parameter write.

All math runs in float32 (float64 for float64 parameters); the write back to a
bfloat16 parameter may use stochastic rounding so that updates smaller than
half a bf16 ulp survive on average.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..structures.base import upcast


def stochastic_round_to_bf16(value: Tensor, generator: torch.Generator) -> Tensor:
    """float32 ``value`` rounded to bfloat16 up or down with probability by distance.

    ``generator`` must live on ``value``'s device.
    """
    bits = value.to(torch.float32).view(torch.int32)
    noise = torch.randint(
        0, 1 << 16, bits.shape, generator=generator, dtype=torch.int32, device=bits.device
    )
    rounded = (bits + noise) & -65536  # clear the 16 low bits
    return rounded.view(torch.float32).to(torch.bfloat16)


def write_param_(param: Tensor, value: Tensor, generator: torch.Generator | None) -> None:
    """param ← value (computed in the accumulation dtype), stochastically rounded if asked."""
    if generator is not None and param.dtype == torch.bfloat16:
        param.copy_(stochastic_round_to_bf16(value, generator))
    else:
        param.copy_(value)


def sgd_momentum_update_(
    param: Tensor,
    direction: Tensor,
    state: dict,
    *,
    lr: float,
    momentum: float,
    weight_decay: float,
    generator: torch.Generator | None = None,
) -> None:
    """Δ = direction + γ·p; buf ← α₂·buf + Δ; p ← p − lr·buf (DESIGN.md section 2).

    ``direction`` is the unscaled, preconditioned gradient shaped like ``param``.
    The buffer lives in ``state["momentum_buffer"]`` in the parameter's dtype.
    """
    p = upcast(param)
    step = upcast(direction, param.dtype).to(p.dtype)
    if weight_decay != 0.0:
        step = step + weight_decay * p
    if momentum != 0.0:
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(param)
        buf = state["momentum_buffer"]
        step = upcast(buf).mul(momentum).add_(step)
        buf.copy_(step)
    write_param_(param, p - lr * step, generator)


def adam_style_update_(
    param: Tensor,
    direction: Tensor,
    denominator: Tensor | float,
    state: dict,
    *,
    lr: float,
    beta: float,
    step: int,
    weight_decay: float,
    decoupled: bool,
    generator: torch.Generator | None = None,
) -> None:
    """AdaFisher's update: m ← βm + (1−β)(g [+ γp]); p ← p − lr·(m/(1−βᵗ))/denominator.

    No square root: ``denominator`` is the Fisher F̃ (broadcastable to ``param``).
    Decoupled weight decay multiplies p by (1 − lr·γ) instead of adding γp to g.
    """
    p = upcast(param)
    grad = upcast(direction, param.dtype).to(p.dtype)
    if weight_decay != 0.0 and not decoupled:
        grad = grad + weight_decay * p
    if "exp_avg" not in state:
        state["exp_avg"] = torch.zeros_like(param)
    exp_avg = state["exp_avg"]
    m = upcast(exp_avg).mul(beta).add_(grad, alpha=1.0 - beta)
    exp_avg.copy_(m)
    if weight_decay != 0.0 and decoupled:
        p = p * (1.0 - lr * weight_decay)
    write_param_(param, p - lr * (m / (1.0 - beta**step)) / denominator, generator)
