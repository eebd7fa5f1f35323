"""The layer rules' a and g reproduce the layer's own weight gradient: for an ungrouped
layer G = gᵀa exactly (before the 1/√N and √L scalings), which pins the patch
extraction of Conv1d, Conv2d and Conv3d for every stride, dilation, padding and padding
mode; the diagonal paths' sums of squares are diag(aᵀa) of those patches."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from singd_cuda.curvature.layers import (
    Layer,
    SquareSums,
    grad_output_matrix,
    gradient_matrix,
    input_matrix,
    input_sum_squares,
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

CONVS_1D = [
    dict(kernel_size=1),  # pointwise
    dict(kernel_size=3, stride=2, padding=1),
    dict(kernel_size=3, stride=2, padding=2, dilation=2, padding_mode="circular"),
    dict(kernel_size=4, padding="same"),  # asymmetric padding
    dict(kernel_size=3, padding="same", dilation=2, padding_mode="reflect"),
    dict(kernel_size=2, padding=1, padding_mode="replicate"),
]
CONVS_3D = [
    dict(kernel_size=1),
    dict(kernel_size=(2, 3, 1), stride=(1, 2, 1), padding=(1, 0, 1), dilation=(2, 1, 1)),
    dict(kernel_size=2, padding="same"),
    dict(kernel_size=3, padding=1, padding_mode="reflect"),
    dict(kernel_size=(1, 2, 3), stride=2, padding=(0, 1, 1), padding_mode="circular"),
    dict(kernel_size=(3, 1, 2), padding=(1, 0, 1), padding_mode="replicate"),
]
CONV_1D_3D = [
    *[(nn.Conv1d, conv, (2, 4, 9)) for conv in CONVS_1D],
    *[(nn.Conv3d, conv, (2, 4, 5, 4, 6)) for conv in CONVS_3D],
]
CONV_CASES = [*CONV_1D_3D, *[(nn.Conv2d, conv, (2, 4, 7, 6)) for conv in CONVS]]


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


@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel")
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize(("cls", "conv", "shape"), CONV_1D_3D, ids=str)
def test_conv1d_and_conv3d_patches_reproduce_the_weight_gradient(cls, conv, shape, bias):
    torch.manual_seed(0)
    module = cls(4, 3, bias=bias, **conv).double()
    a, g, G = captured(module, torch.randn(*shape, dtype=torch.float64))
    torch.testing.assert_close(g.T @ a, G, rtol=1e-12, atol=1e-12)


@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel")
@pytest.mark.parametrize("unbatched", [False, True], ids=["batched", "unbatched"])
@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize(("cls", "conv", "shape"), CONV_CASES, ids=str)
def test_conv_sums_of_squares_are_the_patch_gram_diagonal(cls, conv, shape, groups, unbatched):
    """The diagonal paths' diag(aᵀa), computed without unfolding (the fused conv2d op for
    Conv1d and Conv2d, summed windows for Conv3d), equals the unfolded patches'."""
    torch.manual_seed(0)
    module = cls(4, 6, groups=groups, **conv).double()
    x = torch.randn(*shape, dtype=torch.float64)
    x = x[0] if unbatched else x
    layer = Layer("layer", module, module.weight, module.bias)
    a = input_matrix(layer, x, torch.float64)
    torch.testing.assert_close(
        input_sum_squares(layer, x, torch.float64), (a * a).sum(0), rtol=1e-12, atol=1e-14
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize(
    ("make", "shape"),
    [
        (lambda b: nn.Linear(5, 3, bias=b), (4, 5)),
        (lambda b: nn.Linear(5, 3, bias=b), (2, 4, 5)),
        (lambda b: nn.Conv2d(2, 3, 3, bias=b), (2, 2, 5, 4)),
    ],
    ids=["linear", "linear-3d", "conv2d"],
)
def test_square_sums_scale_is_a_separate_multiply(make, shape, bias, dtype):
    """SquareSums' ``scale`` (SINGD diagonal's k² and c², folded into the reductions)
    gives bitwise the unscaled sums times it: through the fused ops (float32 input summed
    in float32), after a conversion (float32 input, float64 statistics) and on the conv
    path."""
    torch.manual_seed(0)
    module = make(bias)
    layer = Layer("layer", module, module.weight, module.bias)
    sums = SquareSums(layer)
    x = torch.randn(*shape)
    g = module(x).detach().normal_()
    k2 = torch.rand(layer.dim_in, dtype=dtype) + 0.5
    c2 = torch.rand(layer.dim_out, dtype=dtype) + 0.5
    for weight in (1.0, 0.3):
        expected = sums.inputs(x, dtype, weight).mul_(k2)
        assert torch.equal(sums.inputs(x, dtype, weight, k2), expected)
    assert torch.equal(sums.outputs(g, dtype, c2), sums.outputs(g, dtype).mul_(c2))


@pytest.mark.parametrize("weight", [1.0, 0.3])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize(
    ("make", "shape"),
    [
        (lambda b: nn.Linear(5, 3, bias=b), (4, 2, 5)),
        (lambda b: nn.Linear(5, 3, bias=b), (4, 5)),
        (lambda b: nn.Linear(5, 3, bias=b), (5,)),
        (lambda b: nn.Conv2d(2, 3, 3, bias=b), (2, 2, 5, 4)),
    ],
    ids=["linear", "linear-2d", "linear-unbatched", "conv2d"],
)
def test_input_matrix_is_the_scaled_rows_with_a_ones_column(make, shape, x_dtype, bias, weight):
    """a = [rows, 1] / √N · √weight, bitwise as the plain composition computes it, in
    the statistics' dtype, in a new tensor (the callers scale it in place), whether or
    not the input is in the graph."""
    torch.manual_seed(0)
    module = make(bias)
    layer = Layer("m", module, module.weight, module.bias)
    for requires_grad in (False, True):
        x = torch.randn(shape, dtype=x_dtype, requires_grad=requires_grad)
        for dtype in (torch.float32, torch.float64):
            rows = layer.kind.inputs(module, x.detach().to(dtype))
            assert rows.dim() == 2
            if bias:
                rows = torch.cat([rows, rows.new_ones(rows.shape[0], 1)], dim=1)
            expected = (rows / math.sqrt(rows.shape[0])).mul_(math.sqrt(weight))
            a = input_matrix(layer, x, dtype, weight)
            assert a.dtype == dtype and not a.requires_grad
            assert torch.equal(a, expected)
            assert a.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    ("make", "shape"),
    [
        (lambda: nn.Linear(5, 3), (4, 3)),
        (lambda: nn.Linear(5, 3), (4, 2, 3)),
        (lambda: nn.Linear(5, 3), (3,)),
        (lambda: nn.Conv2d(2, 3, 3), (2, 3, 5, 4)),
    ],
    ids=["linear-2d", "linear", "linear-unbatched", "conv2d"],
)
def test_grad_output_matrix_is_the_kinds_rows(make, shape, x_dtype):
    """g = the kind's output-gradient rows in the statistics' dtype, detached, a view of
    the gradient where no cast is needed (the fast path of 2-D Linear gradients
    included)."""
    torch.manual_seed(0)
    module = make()
    layer = Layer("m", module, module.weight, module.bias)
    for requires_grad in (False, True):
        grad = torch.randn(shape, dtype=x_dtype, requires_grad=requires_grad)
        for dtype in (torch.float32, torch.float64):
            g = grad_output_matrix(layer, grad, dtype)
            expected = layer.kind.output_gradients(module, grad.detach().to(dtype))
            assert g.dim() == 2 and g.dtype == dtype and not g.requires_grad
            assert torch.equal(g, expected)
            if dtype == x_dtype and layer.kind.features_last:
                assert g.untyped_storage().data_ptr() == grad.untyped_storage().data_ptr()


def test_rows_of_a_strided_linear_input_are_its_values():
    """A 2-D input that is a strided view (a transposed tensor) gives the rows its values
    hold, as the contiguous input does, bitwise."""
    torch.manual_seed(0)
    module = nn.Linear(5, 3)
    layer = Layer("m", module, module.weight, module.bias)
    x = torch.randn(5, 4).T
    assert not x.is_contiguous()
    assert torch.equal(
        input_matrix(layer, x, torch.float32), input_matrix(layer, x.contiguous(), torch.float32)
    )
    g = torch.randn(3, 4).T
    assert torch.equal(grad_output_matrix(layer, g, torch.float32), g)
