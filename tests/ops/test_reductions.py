"""col_sum_squares, input_sum_squares and conv2d_patch_sum_squares against the reference
(which unfolds)."""

from __future__ import annotations

import pytest
import torch

from singd_cuda.ops import reference

from .conftest import DTYPES, LAYOUTS, make

# Accumulated sums of squares: summation order differs from torch.sum's.
RTOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 1e-5, torch.float16: 1e-5}

# (shape, dim): 2-D column sums (d around the vector widths), leading dims, channel sums
# of a conv gradient, a 1-D input, empty inputs.
COL_CASES = [
    ((1, 1), -1),
    ((5, 3), -1),
    ((257, 33), -1),
    ((64, 128), -1),
    ((2, 7, 16), -1),
    ((3, 5, 4, 6), 1),
    ((2, 9, 8, 8), 1),
    ((11,), 0),
    ((0, 5), -1),
    ((4, 0), -1),
    ((0, 3, 2, 2), 1),
    ((4000, 40), 0),
]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", COL_CASES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES)
def test_col_sum_squares(device, gen, dtype, case, layout):
    shape, dim = case
    x = make(shape, dtype, device, gen, layout)
    out = torch.ops.singd_cuda.col_sum_squares(x, dim)
    expected = reference.col_sum_squares(x, dim)
    assert out.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert out.shape == (shape[dim],)
    torch.testing.assert_close(out, expected, rtol=RTOL[dtype], atol=0)


# (shape of a Linear layer's input, weight w): rows of d, leading dims, one row, no rows,
# no columns, a 1-D input; w exactly 1 (the capture's common case), a count, a fraction.
INPUT_CASES = [
    ((8, 16), 8.0),
    ((5, 3), 1.0),
    ((2, 7, 16), 14.0),
    ((1, 1), 0.1),
    ((257, 33), 1.0 / 3.0),
    ((0, 5), 1.0),
    ((4, 0), 4.0),
    ((11,), 1.0),
]


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("layout", ["contiguous", "strided"])
@pytest.mark.parametrize("case", INPUT_CASES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES)
def test_input_sum_squares(device, gen, dtype, case, layout, bias):
    """The fused op equals, bit for bit, col_sum_squares followed by separate multiplies by
    1/N and w and the bias entry N multiplied alike (the capture's former epilogue), and
    is close to the reference."""
    shape, weight = case
    x = make(shape, dtype, device, gen, layout)
    out = torch.ops.singd_cuda.input_sum_squares(x, weight, bias)
    rows = x.numel() // max(x.shape[-1], 1)
    scale = 1.0 / max(rows, 1)
    separate = torch.ops.singd_cuda.col_sum_squares(x, -1).mul_(scale).mul_(weight)
    if bias:
        entry = separate.new_full((1,), float(rows)).mul_(scale).mul_(weight)
        separate = torch.cat([separate, entry])
    assert out.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert out.shape == (shape[-1] + bias,)
    assert torch.equal(out, separate)
    expected = reference.input_sum_squares(x, weight, bias)
    torch.testing.assert_close(out, expected, rtol=RTOL[dtype], atol=0)


@pytest.mark.parametrize("case", [((8, 16), -1), ((257, 33), -1), ((3, 5, 4, 6), 1), ((0, 5), -1)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_scale_is_a_separate_multiply(device, gen, dtype, case):
    """``scale`` multiplies the result as a separate ``mul_`` by that vector would, bit for
    bit, in both ops and in the reference (SINGD's diagonal capture folds c² and k² in)."""
    shape, dim = case
    x = make(shape, dtype, device, gen, "contiguous")
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    scale = torch.rand(shape[dim], dtype=acc, device=device, generator=None) + 0.5
    ops = torch.ops.singd_cuda
    scaled = ops.col_sum_squares(x, dim, scale)
    assert torch.equal(scaled, ops.col_sum_squares(x, dim).mul_(scale))
    assert torch.equal(
        reference.col_sum_squares(x, dim, scale), reference.col_sum_squares(x, dim).mul_(scale)
    )
    if dim != -1:
        return
    for bias in (False, True):
        scale = torch.rand(shape[-1] + bias, dtype=acc, device=device) + 0.5
        scaled = ops.input_sum_squares(x, 3.0, bias, scale)
        assert torch.equal(scaled, ops.input_sum_squares(x, 3.0, bias).mul_(scale))
        expected = reference.input_sum_squares(x, 3.0, bias).mul_(scale)
        assert torch.equal(reference.input_sum_squares(x, 3.0, bias, scale), expected)


def test_a_scale_that_does_not_fit_is_refused(cpu_ops):
    x = torch.randn(4, 3)
    ops = torch.ops.singd_cuda
    with pytest.raises(RuntimeError, match=r"scale has dtype Double.*convert it with \.to"):
        ops.col_sum_squares(x, -1, torch.ones(3, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="scale must be a vector of 3 entries"):
        ops.col_sum_squares(x, -1, torch.ones(4))
    with pytest.raises(RuntimeError, match="scale must be a vector of 4 entries"):
        ops.input_sum_squares(x, 1.0, True, torch.ones(3))
    with pytest.raises(RuntimeError, match="scale must be a vector of 3 entries"):
        ops.input_sum_squares(x, 1.0, False, torch.ones(1, 3))


# (B, C, H, W), kernel_size, stride, padding, dilation, groups
CONV_CASES = [
    ((2, 3, 8, 8), (3, 3), (1, 1), (1, 1), (1, 1), 1),
    ((2, 4, 9, 7), (2, 3), (2, 1), (0, 2), (1, 2), 2),
    ((1, 6, 11, 11), (5, 5), (3, 3), (4, 4), (2, 2), 3),
    ((3, 4, 5, 6), (1, 1), (1, 1), (0, 0), (1, 1), 4),
    ((2, 2, 4, 4), (4, 4), (1, 1), (3, 3), (1, 1), 1),
    ((2, 2, 3, 3), (3, 3), (5, 5), (2, 2), (1, 1), 1),
    ((0, 4, 6, 6), (3, 3), (1, 1), (1, 1), (1, 1), 2),
    ((16, 8, 16, 16), (3, 3), (2, 2), (1, 1), (1, 1), 1),
]


@pytest.mark.parametrize("layout", ["contiguous", "strided"])
@pytest.mark.parametrize("case", CONV_CASES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES)
def test_conv2d_patch_sum_squares(device, gen, dtype, case, layout):
    shape, *geometry = case
    x = make(shape, dtype, device, gen, layout)
    out = torch.ops.singd_cuda.conv2d_patch_sum_squares(x, *geometry)
    expected = reference.conv2d_patch_sum_squares(x, *geometry)
    assert out.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    torch.testing.assert_close(out, expected, rtol=RTOL[dtype], atol=0)


def test_conv2d_patch_sum_squares_is_diag_of_the_gram(gen):
    """The reference equals diag(aᵀa) of the group-averaged unfolded input."""
    x = make((2, 6, 5, 5), torch.float64, "cpu", gen)
    a = torch.nn.functional.unfold(x.view(2, 3, 2, 5, 5).mean(1), (3, 3), padding=1)
    a = a.transpose(1, 2).reshape(-1, 2 * 9)
    expected = (a.T @ a).diagonal()
    torch.testing.assert_close(reference.conv2d_patch_sum_squares(x, 3, 1, 1, 1, 3), expected)


def test_invalid_geometry_raises(cpu_ops):
    x = torch.zeros(1, 4, 5, 5)
    with pytest.raises(RuntimeError, match=r"groups \(3\) must divide the channels \(4\)"):
        cpu_ops.conv2d_patch_sum_squares(x, (3, 3), (1, 1), (0, 0), (1, 1), 3)
    with pytest.raises(RuntimeError, match="does not fit the padded input"):
        cpu_ops.conv2d_patch_sum_squares(x, (7, 7), (1, 1), (0, 0), (1, 1), 1)
    with pytest.raises(RuntimeError, match="must be 4-D"):
        cpu_ops.conv2d_patch_sum_squares(x[0], (3, 3), (1, 1), (0, 0), (1, 1), 1)
