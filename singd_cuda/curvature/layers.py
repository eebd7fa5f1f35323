"""Per-layer-type rules: how a supported layer's input, output gradient and
parameter gradient become the matrices a (N x d_K), g (N x d_C) and G (d_C x d_K).

Supported layers: ``nn.Linear`` (any leading dims, flattened into N) and
``nn.Conv2d`` (groups, stride, dilation, every padding and padding mode; the
input is unfolded into patches, averaged over channel groups). With a bias, a
column of ones is appended to a and the bias gradient to G.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

SUPPORTED_LAYERS = (nn.Linear, nn.Conv2d)
LOSS_AVERAGES = ("batch", "batch+sequence", None)


@dataclass(eq=False)
class Layer:
    """One preconditioned layer: its module, its trained parameters and factor sizes.

    ``modules`` are all the modules that hold ``weight`` (one, unless the weight is
    shared; ``module`` is the first): their calls all add to the layer's statistics.
    """

    name: str
    module: nn.Module
    weight: nn.Parameter
    bias: nn.Parameter | None  # None when absent or not trained by the optimizer
    modules: tuple[nn.Module, ...] = ()

    def __post_init__(self) -> None:
        if not self.modules:
            self.modules = (self.module,)

    @property
    def dim_in(self) -> int:
        """d_K: flattened weight columns, plus one for a trained bias."""
        return self.weight[0].numel() + (self.bias is not None)

    @property
    def dim_out(self) -> int:
        """d_C: output features / channels."""
        return self.weight.shape[0]

    @property
    def params(self) -> list[nn.Parameter]:
        return [self.weight] if self.bias is None else [self.weight, self.bias]

    def __repr__(self) -> str:  # names and shapes, never tensor contents
        bias = ", bias" if self.bias is not None else ""
        weight = tuple(self.weight.shape)
        return f"Layer('{self.name}', {type(self.module).__name__}, weight {weight}{bias})"


def bypassed_modules(model: nn.Module) -> set[int]:
    """ids of supported modules whose own forward never runs, so no statistics reach
    them: ``nn.MultiheadAttention`` uses ``out_proj.weight`` directly. Their
    parameters train with the fallback instead."""
    return {id(m.out_proj) for m in model.modules() if isinstance(m, nn.MultiheadAttention)}


def _conv_patches(module: nn.Conv2d, x: Tensor) -> Tensor:
    """Unfolded patches (B * O1 * O2, C_in/groups * k1 * k2), averaged over groups."""
    padding = module.padding
    if module.padding_mode != "zeros" or isinstance(padding, str):
        # pad as the layer's own forward does ('same' may be asymmetric)
        mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
        x = F.pad(x, module._reversed_padding_repeated_twice, mode=mode)
        padding = (0, 0)
    if module.groups > 1:
        batch, channels = x.shape[:2]
        x = x.reshape(batch, module.groups, channels // module.groups, *x.shape[2:]).mean(1)
    patches = F.unfold(
        x, module.kernel_size, dilation=module.dilation, padding=padding, stride=module.stride
    )
    return patches.transpose(1, 2).flatten(0, 1)


def input_matrix(layer: Layer, x: Tensor, dtype: torch.dtype) -> Tensor:
    """a: (N, d_K) in ``dtype``, the layer input with ones for the bias, scaled by 1/√N."""
    x = x.detach().to(dtype)
    if isinstance(layer.module, nn.Conv2d):
        a = _conv_patches(layer.module, x if x.dim() == 4 else x.unsqueeze(0))
    else:
        a = x.reshape(-1, x.shape[-1])
    if layer.bias is not None:
        a = torch.cat([a, a.new_ones(a.shape[0], 1)], dim=1)
    return a / math.sqrt(max(a.shape[0], 1))


def loss_terms(layer: Layer, output: Tensor, loss_average: str | None) -> int:
    """The loss terms one call's output (or output gradient) covers: its batch size, times
    its positions for "batch+sequence" (an unbatched input is a batch of one)."""
    shape = output.shape
    if isinstance(layer.module, nn.Conv2d):
        batch = shape[0] if len(shape) == 4 else 1
        return batch * (shape[-2:].numel() if loss_average == "batch+sequence" else 1)
    leading = shape[:-1]
    if loss_average == "batch+sequence":
        return leading.numel()
    return leading[0] if len(leading) else 1


def _batched_grad(layer: Layer, grad: Tensor, loss_average: str | None) -> tuple[Tensor, int]:
    """(grad with a batch dimension for conv layers, L): L the number of loss terms the
    loss averages over (batch, or batch times positions for "batch+sequence")."""
    if isinstance(layer.module, nn.Conv2d):
        if grad.dim() == 3:
            grad = grad.unsqueeze(0)
        positions = grad.shape[2:].numel() if loss_average == "batch+sequence" else 1
        return grad, grad.shape[0] * positions
    leading = grad.shape[:-1]
    if loss_average == "batch+sequence":
        return grad, leading.numel()
    return grad, leading[0] if len(leading) else 1


def grad_output_matrix(layer: Layer, grad: Tensor, loss_average: str | None, dtype) -> Tensor:
    """g: (N, d_C) in ``dtype``, the output gradient scaled by √L (L loss terms)."""
    grad, num_terms = _batched_grad(layer, grad.detach().to(dtype), loss_average)
    if isinstance(layer.module, nn.Conv2d):
        g = grad.permute(0, 2, 3, 1).reshape(-1, grad.shape[1])
    else:
        g = grad.reshape(-1, grad.shape[-1])
    if loss_average is None:
        return g
    return g * math.sqrt(num_terms)


def input_sum_squares(layer: Layer, x: Tensor, dtype: torch.dtype) -> Tensor:
    """diag(aᵀa) of :func:`input_matrix` (column sums of squares, bias entry included)
    without materialising a: one pass over the input (conv patches are not unfolded)."""
    from ..ops import col_sum_squares, conv2d_patch_sum_squares

    x = x.detach()
    if isinstance(layer.module, nn.Conv2d):
        module = layer.module
        x = x if x.dim() == 4 else x.unsqueeze(0)
        padding = module.padding
        if module.padding_mode != "zeros" or isinstance(padding, str):
            mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
            x = F.pad(x, module._reversed_padding_repeated_twice, mode=mode)
            padding = (0, 0)
        rows = x.shape[0] * _conv_positions(module, x.shape[-2:], padding)
        h = conv2d_patch_sum_squares(
            x, module.kernel_size, module.stride, padding, module.dilation, module.groups
        )
    else:
        rows = x.numel() // max(x.shape[-1], 1)
        h = col_sum_squares(x, -1)
    h = h.to(dtype)
    if layer.bias is not None:
        h = torch.cat([h, h.new_full((1,), float(rows))])
    return h.mul_(1.0 / max(rows, 1))


def _conv_positions(module: nn.Conv2d, size, padding) -> int:
    out = 1
    dims = zip(size, module.kernel_size, module.stride, padding, module.dilation, strict=True)
    for n, k, s, p, d in dims:
        out *= max((n + 2 * p - d * (k - 1) - 1) // s + 1, 0)
    return out


def grad_output_sum_squares(
    layer: Layer, grad: Tensor, loss_average: str | None, dtype: torch.dtype
) -> Tensor:
    """diag(gᵀg) of :func:`grad_output_matrix`, in one pass over the output gradient."""
    from ..ops import col_sum_squares

    grad, num_terms = _batched_grad(layer, grad.detach(), loss_average)
    conv = isinstance(layer.module, nn.Conv2d)
    s = col_sum_squares(grad, 1 if conv else -1)
    s = s.to(dtype)
    return s if loss_average is None else s.mul_(float(num_terms))


def gradient_matrix(layer: Layer, dtype: torch.dtype) -> Tensor:
    """G: (d_C, d_K) in ``dtype``, the weight gradient with the bias gradient appended."""
    G = layer.weight.grad.detach().reshape(layer.dim_out, -1).to(dtype)
    if layer.bias is None:
        return G
    bias_grad = layer.bias.grad
    if bias_grad is None:
        bias_grad = torch.zeros_like(layer.bias)
    return torch.cat([G, bias_grad.detach().reshape(-1, 1).to(dtype)], dim=1)


def split_matrix(layer: Layer, M: Tensor) -> list[Tensor]:
    """Inverse of :func:`gradient_matrix`: M (d_C, d_K) into tensors shaped like the params."""
    if layer.bias is None:
        return [M.reshape(layer.weight.shape)]
    return [M[:, :-1].reshape(layer.weight.shape), M[:, -1].reshape(layer.bias.shape)]
