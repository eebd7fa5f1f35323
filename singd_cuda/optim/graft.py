"""Per-parameter step-size grafting (``graft=None | "adam" | "rms"``).

A grafted rule keeps the direction of each parameter's preconditioned gradient Ĝ_p
(its part of Ĝ: the weight, the bias) and takes its norm from elsewhere:

* ``"adam"``: the norm of Adam's normalised gradient u_p = G_p / (√v̂_p + ε) of the same
  (unscaled) gradient, v_p ← β₂ v_p + (1 − β₂) G_p², v̂_p = v_p / (1 − β₂ᵗ) with the
  fallback's β₂ (``fallback_betas[1]``) and ε (``fallback_eps``); one second-moment
  buffer per parameter (``state["graft_sq"]``, the parameter's dtype, float32 for
  float16 ones, as the fallback's) and its count t (``state["graft_step"]``).
* ``"rms"``: a fixed RMS, :data:`RMS_TARGET` = 0.2 per entry (Moonlight's rule, arXiv
  2502.16982: AdamW's typical update RMS), no state.

Where: on the preconditioned gradient, before weight decay and momentum, as Distributed
Shampoo grafts: the heavy-ball momentum then averages directions of a comparable size
whatever the preconditioner's scale did between factor updates, and weight decay stays
decoupled from the graft (γW is added after it, unscaled). So the step is
lr·buf with buf ← α₂ buf + graft(Ĝ) + γW.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from ..structures.base import upcast
from .fallback import moment_dtype

GRAFTS = (None, "adam", "rms")
RMS_TARGET = 0.2


def graft_(
    params: list[Tensor],
    directions: list[Tensor],
    states: list[dict],
    group: dict,
    inv_scale: Tensor | None = None,
    found_inf: Tensor | None = None,
    *,
    grads: list[Tensor] | None = None,
    reduce: Callable[[Tensor], None] | None = None,
) -> None:
    """Rescale each direction (Ĝ_p, unscaled, shaped like its parameter) in place to the
    group's graft norm; no-op for ``graft=None`` and for parameters without a gradient.

    ``inv_scale``: None or 1/loss scale (the gradients ``.grad`` still carry the scale);
    ``found_inf``: None or a one-element tensor, > 0: the step is skipped, the buffers
    keep their values (selected on the device). A direction of norm 0 stays 0.
    ``grads``: the unscaled gradients (shaped like ``params``) to use instead of
    ``.grad`` x ``inv_scale`` (a rule's :meth:`~.rule.LayerRule.apply` has them).
    ``reduce``: for parameters sharded by rows (FSDP2), an in-place sum over the ranks
    holding the other rows of a 1-D float64 tensor of partial sums (the squared norms and
    sizes of this rank's rows); every rank must call it with the same parameters.
    """
    graft = group["graft"]
    if graft is None:
        return
    trained = [i for i, p in enumerate(params) if p.grad is not None]
    if not trained:
        return
    d = [directions[i] for i in trained]
    norms = torch._foreach_norm(d)
    if graft == "rms":
        sizes = [torch.full_like(n, d[j].numel()) for j, n in enumerate(norms)]
        if reduce is not None:
            norms, sizes = _over_ranks(reduce, norms, sizes, squared=False)
        targets = torch._foreach_mul(torch._foreach_sqrt(sizes), RMS_TARGET)
    else:
        targets = _adam_norms(
            [params[i] for i in trained],
            [states[i] for i in trained],
            group,
            inv_scale,
            found_inf,
            None if grads is None else [grads[i] for i in trained],
        )
        if reduce is not None:
            norms, targets = _over_ranks(reduce, norms, targets, squared=True)
    tiny = torch.finfo(norms[0].dtype).tiny
    factors = torch._foreach_div(
        [t.to(n.dtype) for t, n in zip(targets, norms, strict=True)],
        torch._foreach_clamp_min(norms, tiny),
    )
    torch._foreach_mul_(d, factors)


def _over_ranks(
    reduce: Callable[[Tensor], None], norms: list[Tensor], others: list[Tensor], squared: bool
) -> tuple[list[Tensor], list[Tensor]]:
    """(norms, others) of whole parameters from this rank's rows: one ``reduce`` sums the
    squared norms and ``others`` (squared too when ``squared``: norms; else sizes)."""
    n = len(norms)
    local = torch.stack([t.to(torch.float64) for t in (*norms, *others)])
    end = len(local) if squared else n
    local[:end] = local[:end].square()
    reduce(local)
    local[:end] = local[:end].sqrt()
    values = local.unbind()
    return (
        [v.to(x.dtype) for v, x in zip(values[:n], norms, strict=True)],
        [v.to(x.dtype) for v, x in zip(values[n:], others, strict=True)],
    )


def _adam_norms(params, states, group, inv_scale, found_inf, grads) -> list[Tensor]:
    """‖G_p / (√v̂_p + ε)‖ of each parameter, updating its second moment (``grads``: the
    unscaled G_p, or None to take ``.grad`` x ``inv_scale``)."""
    beta2, eps = group["fallback_betas"][1], group["fallback_eps"]
    for param, state in zip(params, states, strict=True):
        if "graft_sq" not in state:
            state["graft_sq"] = torch.zeros_like(param, dtype=moment_dtype(param))
            state["graft_step"] = 0
        state["graft_step"] += 1
    if grads is not None:
        grads = [upcast(g, p.dtype) for g, p in zip(grads, params, strict=True)]
    else:
        grads = [upcast(p.grad, p.dtype) for p in params]
        if inv_scale is not None:
            grads = torch._foreach_mul(grads, inv_scale.to(grads[0].device, grads[0].dtype))
    buffers = [state["graft_sq"] for state in states]
    v = torch._foreach_mul([upcast(b) for b in buffers], beta2)
    torch._foreach_addcmul_(v, grads, grads, value=1.0 - beta2)
    if found_inf is None:
        kept = v
    else:  # the old moments where the step is skipped
        raised = found_inf.reshape(()) > 0
        kept = [torch.where(raised, upcast(b), new) for b, new in zip(buffers, v, strict=True)]
    torch._foreach_copy_(buffers, kept)
    corrections = [1.0 / math.sqrt(1.0 - beta2 ** state["graft_step"]) for state in states]
    denominators = torch._foreach_sqrt(v)
    torch._foreach_mul_(denominators, corrections)
    torch._foreach_add_(denominators, eps)
    return torch._foreach_norm(torch._foreach_div(grads, denominators))
