"""The curvature statistic of normalisation layers: their diagonal empirical Fisher.

After Osawa et al. (arXiv 1811.12019): BatchNorm, LayerNorm and GroupNorm weights and
biases are preconditioned by the diagonal (per channel, or per element for LayerNorm)
of the empirical Fisher, F = (1/L) Σ_terms ψ², where ψ is one loss term's gradient of
the parameter, with a damping of its own: Δ = grad / (F + λ_norm). This replaces the
first-order fallback for those parameters (``norm_fisher=True``; the update is in
:mod:`singd_cuda.optim.norm_fisher`).

The per-term gradients come from the captured layer input (normalised again here,
without the affine part) and the output gradient: ψ_γ = Σ g·x̂ and ψ_β = Σ g over the
positions of one term (a sample for ``loss_average="batch"``, a position for
"batch+sequence"). As for the Kronecker statistics, g carries √L so that the sum of
squares over terms is an average, and micro-batches and the loss scale are removed
as for the output-gradient side.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from .layers import Layer, own_parameter

NORM_LAYERS = (_BatchNorm, nn.LayerNorm, nn.GroupNorm)


def find_norm_layers(model: nn.Module, selected) -> list[Layer]:
    """The normalisation layers with a weight for which ``selected(param)`` holds."""
    layers = []
    for name, module in model.named_modules():
        if not isinstance(module, NORM_LAYERS):
            continue
        weight, bias = own_parameter(module, "weight"), own_parameter(module, "bias")
        if weight is None or not selected(weight):
            continue
        bias = bias if bias is not None and selected(bias) else None
        layers.append(Layer(name or type(module).__name__, module, weight, bias))
    return layers


def _normalised(module: nn.Module, x: Tensor) -> Tensor:
    """x̂: the layer's normalisation of ``x`` without the affine transform."""
    if isinstance(module, nn.LayerNorm):
        return F.layer_norm(x, module.normalized_shape, None, None, module.eps)
    if isinstance(module, nn.GroupNorm):
        return F.group_norm(x, module.num_groups, None, None, module.eps)
    if not module.training and module.running_mean is not None:
        # BatchNorm in eval(): the running statistics its forward used, not the batch's
        mean, var = module.running_mean.to(x.dtype), module.running_var.to(x.dtype)
        return F.batch_norm(x, mean, var, eps=module.eps)
    dims = [0, *range(2, x.dim())]  # BatchNorm in training: statistics of this batch
    mean = x.mean(dims, keepdim=True)
    var = x.var(dims, unbiased=False, keepdim=True)
    return (x - mean) * torch.rsqrt(var + module.eps)


def _per_term(
    module: nn.Module, values: Tensor, loss_average: str | None, batch_dim: int
) -> Tensor:
    """Sum ``values`` (shaped like the layer output) over the positions of each loss
    term: (terms, *parameter shape). A LayerNorm's terms are its samples along
    ``batch_dim`` of the leading dimensions (or every position for "batch+sequence");
    BatchNorm's and GroupNorm's along dimension 0 (N of N, C, ...)."""
    if isinstance(module, nn.LayerNorm):
        shape = tuple(module.normalized_shape)
        lead = values.shape[: values.dim() - len(shape)]
        if loss_average == "batch+sequence" or len(lead) <= 1:
            return values.reshape(-1, *shape)
        dim = _batch_axis(lead, batch_dim)
        return values.movedim(dim, 0).reshape(lead[dim], -1, *shape).sum(1)
    channels = values.shape[1]
    if loss_average == "batch+sequence":
        return values.movedim(1, -1).reshape(-1, channels)
    return values.reshape(values.shape[0], channels, -1).sum(-1)


def _batch_axis(lead: torch.Size, batch_dim: int) -> int:
    """The axis of a LayerNorm's leading dimensions ``lead`` that holds its batch:
    ``batch_dim``, or 0 when the output has no such axis."""
    return batch_dim if batch_dim < len(lead) else 0


def num_terms(module: nn.Module, grad: Tensor, loss_average: str | None, batch_dim: int = 0) -> int:
    """The loss terms a norm layer's output (or output gradient) covers; a LayerNorm's
    batch is dimension ``batch_dim`` of its leading dimensions (0 when it has no such)."""
    if isinstance(module, nn.LayerNorm):
        lead = grad.shape[: grad.dim() - len(module.normalized_shape)]
        if loss_average == "batch+sequence":
            return lead.numel()
        if not len(lead):
            return 1
        return lead[_batch_axis(lead, batch_dim)]
    if loss_average == "batch+sequence":
        return grad.numel() // grad.shape[1]
    return grad.shape[0]


def norm_statistic(
    layer: Layer, layer_input: Tensor, grad_output: Tensor, loss_average, dtype, batch_dim: int = 0
) -> Tensor:
    """The diagonal Fisher of this backward pass: [F_weight, F_bias] flattened, in ``dtype``
    (``batch_dim``: as for :func:`num_terms`)."""
    module = layer.module
    x = layer_input.detach().to(dtype)
    g = grad_output.detach().to(dtype)
    if loss_average is not None:
        g = g * math.sqrt(num_terms(module, g, loss_average, batch_dim))
    normalised = g * _normalised(module, x)
    parts = [_per_term(module, normalised, loss_average, batch_dim).square().sum(0)]
    if layer.bias is not None:
        parts.append(_per_term(module, g, loss_average, batch_dim).square().sum(0))
    return torch.cat([p.reshape(-1) for p in parts])


def empty_norm_statistic(layer: Layer, dtype, device) -> Tensor:
    return torch.zeros(sum(p.numel() for p in layer.params), dtype=dtype, device=device)
