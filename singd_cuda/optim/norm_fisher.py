"""The update of normalisation-layer affine parameters under ``norm_fisher=True``.

After Osawa et al. (arXiv 1811.12019): Δ = grad / (F + λ_norm), F the diagonal empirical
Fisher of the last update step (captured by :mod:`singd_cuda.curvature.norm_layers`).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.optim import Optimizer

from ..curvature.layers import Layer
from .rule import scheduled
from .write import sgd_update_, unscaled


def store_fisher(layer: Layer, states: list[dict], statistic: Tensor) -> None:
    """Keep the new diagonal Fisher of each parameter in its state (``"fisher_diag"``)."""
    offset = 0
    for param, state in zip(layer.params, states, strict=True):
        values = statistic[offset : offset + param.numel()].reshape(param.shape)
        state["fisher_diag"] = values.to(torch.promote_types(param.dtype, torch.float32)).clone()
        offset += param.numel()


def preconditioned(grad: Tensor, state: dict, damping: float, rows: slice | None = None) -> Tensor:
    """grad / (F + λ_norm); the plain gradient until a first Fisher is known. ``rows``:
    the rows (dim 0) of the parameter that ``grad`` holds (an FSDP2 shard; None: all)."""
    fisher = state.get("fisher_diag")
    if fisher is None:
        return grad
    if rows is not None:
        fisher = fisher[rows]
    return grad / (fisher.to(grad.dtype) + damping)


def norm_step(opt: Optimizer, grad_scale: Tensor | None) -> None:
    """Normalisation-layer affine parameters under ``norm_fisher``: momentum SGD on
    grad / (F + norm_damping), F the diagonal empirical Fisher of the last update step
    (this step's statistics, when it has some). ``opt``: a KroneckerOptimizer."""
    shards = opt._shards()
    for layer in opt._norm_layers:
        group = opt.group_of(layer)
        states = [opt.state[p] for p in layer.params]
        pending = opt._pending.get(layer)
        if pending is not None:
            store_fisher(layer, states, pending["out"])
        damping = scheduled(group["norm_damping"], group["step"])
        view = layer if shards is None else shards.view(layer)  # FSDP2: this rank's rows
        rows = None if shards is None else view.rows
        directions = [
            None
            if param.grad is None
            else preconditioned(
                unscaled(param.grad, grad_scale, group["maximize"]), state, damping, rows
            )
            for param, state in zip(view.params, states, strict=True)
        ]
        sgd_update_(view.params, directions, states, group, opt._seed(group, layer.weight))
