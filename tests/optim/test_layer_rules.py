"""The layer rules' a and g reproduce the layer's own weight gradient: for an ungrouped
layer G = gᵀa exactly (before the 1/√N and √L scalings), which pins the patch
extraction for every stride, dilation, padding and padding mode."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from singd_cuda.curvature.layers import (
    Layer,
    grad_output_matrix,
    gradient_matrix,
    input_matrix,
)

CONVS = [
    dict(kernel_size=3, stride=1, padding=1),
    dict(kernel_size=3, stride=2, padding=0),
    dict(kernel_size=(2, 3), stride=(2, 1), padding=(1, 0), dilation=(1, 2)),
    dict(kernel_size=4, padding="same"),  # asymmetric padding
    dict(kernel_size=3, padding="same", dilation=2, padding_mode="reflect"),
    dict(kernel_size=3, padding="valid"),
    dict(kernel_size=3, stride=2, padding=2, padding_mode="circular"),
    dict(kernel_size=3, padding=1, padding_mode="replicate"),
]


def captured(module: nn.Module, x: torch.Tensor):
    """(a, g, G) of one backward of sum(output · random)."""
    out = module(x)
    out.retain_grad()
    (out * torch.randn_like(out)).sum().backward()
    layer = Layer("layer", module, module.weight, module.bias)
    a = input_matrix(layer, x, torch.float64)
    a = a * math.sqrt(a.shape[0])  # undo the 1/√N
    g = grad_output_matrix(layer, out.grad, torch.float64)
    return a, g, gradient_matrix(layer, torch.float64)


@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel")  # torch's own
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("conv", CONVS, ids=str)
def test_conv_patches_reproduce_the_weight_gradient(conv, bias):
    torch.manual_seed(0)
    module = nn.Conv2d(3, 4, bias=bias, **conv).double()
    a, g, G = captured(module, torch.randn(2, 3, 7, 6, dtype=torch.float64))
    torch.testing.assert_close(g.T @ a, G, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("shape", [(5, 6), (2, 3, 6), (2, 2, 2, 6)])
def test_linear_rows_reproduce_the_weight_gradient(shape):
    torch.manual_seed(0)
    module = nn.Linear(6, 4).double()
    a, g, G = captured(module, torch.randn(*shape, dtype=torch.float64))
    torch.testing.assert_close(g.T @ a, G, rtol=1e-12, atol=1e-12)
