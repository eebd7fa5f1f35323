"""The update of normalisation-layer affine parameters under ``norm_fisher=True``.

After Osawa et al. (arXiv 1811.12019): Δ = grad / (F + λ_norm), F the diagonal empirical
Fisher of the last update step (captured by :mod:`singd_cuda.curvature.norm_layers`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..curvature.layers import Layer


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
