"""The built-in first-order fallback (AdamW) for parameters outside supported layers.

Norm affine parameters, embeddings and free parameters train with it inside
the same optimizer, so one optimizer trains the whole model.
"""

from __future__ import annotations

import operator
from itertools import repeat

import torch
from torch import Tensor
from torch.optim import Optimizer

from .. import ops
from ..structures.base import upcast
from .write import unscaled

FALLBACK_KEY = "exp_avg_sq"  # an entry of the fallback's states alone


def in_fallback(state: dict) -> bool:
    """Whether a parameter state is the fallback's (a preconditioned layer's parameters
    hold it while the layer waits for its first curvature statistics)."""
    return FALLBACK_KEY in state


def all_preconditioned(states: list[dict]) -> bool:
    """Whether every one of ``states`` holds a preconditioned layer's factors: none is
    empty or the fallback's (:func:`in_fallback`), by C calls alone."""
    return all(states) and not any(map(operator.contains, states, repeat(FALLBACK_KEY)))


def moment_dtype(param: Tensor) -> torch.dtype:
    """The dtype of an Adam moment of ``param``: its own, float32 for a float16 one ((1 − β₂)·g²
    underflows float16's range, and v̂ = 0 makes the step m̂/ε explode)."""
    return torch.float32 if param.dtype == torch.float16 else param.dtype


def adam_directions(
    params: list[Tensor],
    grads: list[Tensor],
    states: list[dict],
    betas: tuple[float, float],
    eps: float,
    found_inf: Tensor | None = None,
) -> list[Tensor]:
    """Update the moments and return AdamW's bias-corrected step directions m̂ / (√v̂ + ε),
    one foreach call per operation for all parameters.

    State per parameter: ``step`` (float32 scalar tensor on the CPU), ``exp_avg``,
    ``exp_avg_sq`` in the parameter's dtype (float32 for float16 parameters: (1 − β₂)·g²
    underflows float16's range, and v̂ = 0 makes the step m̂/ε explode), created on the
    first call. ``grads`` are unscaled, shaped like ``params``; the math and the returned
    directions are float32 (float64 for float64 parameters). ``found_inf`` (one-element
    tensor, > 0: skip): the moments keep their values, selected on the device; the host
    ``step`` counts anyway.
    """
    for param, state in zip(params, states, strict=True):
        if "step" not in state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(param, dtype=moment_dtype(param))
            state["exp_avg_sq"] = torch.zeros_like(param, dtype=moment_dtype(param))
        state["step"] += 1
    steps = [float(state["step"]) for state in states]
    beta1, beta2 = betas
    g = [upcast(grad, param.dtype) for grad, param in zip(grads, params, strict=True)]
    exp_avg = torch._foreach_mul([upcast(state["exp_avg"]) for state in states], beta1)
    torch._foreach_add_(exp_avg, g, alpha=1.0 - beta1)
    exp_avg_sq = torch._foreach_mul([upcast(state["exp_avg_sq"]) for state in states], beta2)
    torch._foreach_addcmul_(exp_avg_sq, g, g, value=1.0 - beta2)
    raised = None if found_inf is None else found_inf.reshape(()) > 0
    for key, new in (("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        moments = [state[key] for state in states]
        if raised is not None:  # the old moments where the step is skipped
            new = [torch.where(raised, m, n) for m, n in zip(moments, new, strict=True)]
        torch._foreach_copy_(moments, new)
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
    found_inf: Tensor | None = None,
) -> None:
    """One AdamW step (as torch.optim.AdamW) on every parameter, written in one
    :func:`singd_cuda.ops.sgd_epilogue_` call (decoupled weight decay, no momentum).

    ``grads`` are the unscaled gradients, shaped like ``params``; ``states`` hold the
    moments (see :func:`adam_directions`); ``stochastic_rounding``, ``seed`` and
    ``found_inf`` as in :mod:`singd_cuda.ops`.
    """
    ops.sgd_epilogue_(
        params,
        adam_directions(params, grads, states, betas, eps, found_inf),
        [],
        lr=lr,
        weight_decay=weight_decay,
        decoupled=True,
        stochastic_rounding=stochastic_rounding,
        seed=seed,
        found_inf=found_inf,
    )


def fallback_step(
    opt: Optimizer,
    grad_scale: Tensor | None,
    params: list[Tensor],
    found_inf: Tensor | None = None,
) -> None:
    """AdamW on those of ``params`` that have a gradient (still scaled by ``grad_scale``
    when given), one write per parameter group; FSDP2 shards are updated as
    torch.optim.AdamW updates them. ``found_inf``: None, or the step's skip flag decided
    on the device. ``opt``: a KroneckerOptimizer."""
    by_group: dict[int, list[Tensor]] = {}
    for p in params:
        if p.grad is not None:
            by_group.setdefault(opt._param_group[id(p)], []).append(p)
    shards = opt._shards()
    for index, members in by_group.items():
        group = opt.param_groups[index]
        states = [opt.state[p] for p in members]
        seed = opt._seed(group, members[0])
        grads = [p.grad for p in members]
        if shards is not None:
            members, grads = [shards.local(p) for p in members], [shards.local(g) for g in grads]
        adamw_update_(
            members,
            [unscaled(g, grad_scale, group["maximize"]) for g in grads],
            states,
            lr=group["lr"] if group["fallback_lr"] is None else group["fallback_lr"],
            betas=group["fallback_betas"],
            eps=group["fallback_eps"],
            weight_decay=group["fallback_weight_decay"],
            stochastic_rounding=group["stochastic_rounding"],
            seed=seed,
            found_inf=found_inf,
        )
