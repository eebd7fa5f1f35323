"""The CUDA statistics reductions at the sizes and layouts that take their special paths:
more rows than one grid row of blocks covers, small feature maps, channels-last inputs."""

from __future__ import annotations

import pytest
import torch

from singd_cuda import ops
from singd_cuda.ops import reference

pytestmark = pytest.mark.gpu

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _expected(fn, x, *args, **kwargs):
    """The reference in float64 on the CPU, cast to the op's output dtype."""
    return fn(x.double().cpu(), *args, **kwargs)


def _close(actual, expected):
    assert actual.dtype == torch.float32 and actual.is_cuda
    torch.testing.assert_close(actual.double().cpu(), expected, rtol=1e-4, atol=1e-6)


def test_more_rows_than_the_grid_covers(cuda_ops):
    """2^21 + 5 rows: more than 65535 row blocks of 32 rows, so blocks loop over rows."""
    x = torch.randn(2**21 + 5, 6, device="cuda")
    _close(ops.col_sum_squares(x), _expected(reference.col_sum_squares, x))
    x = torch.randn(2**21 + 5, 3, 5, device="cuda")  # per-channel, small slices
    _close(ops.col_sum_squares(x, dim=1), _expected(reference.col_sum_squares, x, dim=1))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("hw", [1, 3, 7, 16, 19])
def test_channel_sums(cuda_ops, dtype, channels_last, hw):
    """Per-channel sums of a conv output gradient: 7 x 7 and smaller maps share blocks."""
    x = torch.randn(33, 24, hw, hw, device="cuda").to(dtype)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    _close(ops.col_sum_squares(x, dim=1), _expected(reference.col_sum_squares, x, dim=1))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
@pytest.mark.parametrize(
    ("hw", "kernel", "stride", "padding", "groups"),
    [(7, 3, 1, 1, 1), (7, 3, 2, 0, 2), (7, 1, 1, 0, 1), (14, 5, 2, 2, 4), (1, 1, 1, 0, 1)],
)
def test_conv_patch_sums(cuda_ops, dtype, channels_last, hw, kernel, stride, padding, groups):
    x = torch.randn(9, 16, hw, hw, device="cuda").to(dtype)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    args = (kernel, stride, padding, 1, groups)
    _close(
        ops.conv2d_patch_sum_squares(x, *args),
        _expected(reference.conv2d_patch_sum_squares, x, *args),
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [1, 5, 8, 33, 256, 1000])
def test_column_sums_with_unaligned_and_offset_rows(cuda_ops, dtype, d):
    """Column counts around the vector widths; a storage offset forces the scalar path."""
    base = torch.randn(517 * d + 1, device="cuda").to(dtype)
    for x in (base[:-1].view(517, d), base[1:].view(517, d)):
        _close(ops.col_sum_squares(x), _expected(reference.col_sum_squares, x))
