"""Launch mechanics of the CUDA list ops: many tensors (several launches of one dtype
group), a side stream, a device other than the current one."""

from __future__ import annotations

import pytest
import torch

from singd_cuda import ops
from singd_cuda.ops import reference

from .conftest import assert_bitwise, on, randn

pytestmark = pytest.mark.gpu

N_TENSORS = 130  # > 4 launches of the diagonal step's batch (27 entries each)


def _lists(gen, dtype=torch.float32):
    shapes = [(1 + i % 7, 1 + (i * 37) % 301) for i in range(N_TENSORS)]
    params = [randn(s, dtype, gen, offset=i % 3) for i, s in enumerate(shapes)]
    grads = [randn(s, dtype, gen) for s in shapes]
    bufs = [randn(s, torch.float32, gen) for s in shapes]
    rows = [randn((s[0],), torch.float32, gen, low=0.5) for s in shapes]
    cols = [randn((s[1],), torch.float32, gen, low=0.5) for s in shapes]
    return [params, grads, bufs, rows, cols]


def _step(lists, fused: bool) -> None:
    params, grads, bufs, rows, cols = lists
    kwargs = dict(
        mode="adafisher", lr=0.01, momentum=0.9, damping=1e-3, weight_decay=1e-2, step=2,
        stochastic_rounding=True, seed=7,
    )  # fmt: skip
    module = ops if fused else reference
    module.diag_precond_step_(params, grads, bufs, rows, cols, **kwargs)
    module.sgd_epilogue_(params, grads, bufs, lr=0.1, momentum=0.9, stochastic_rounding=True)
    module.adam_epilogue_(params, grads, bufs, lr=0.1, beta=0.9, step=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_many_tensors_take_several_launches(cuda_ops, gen, dtype):
    lists = _lists(gen, dtype)
    expected = [on("cpu", t) for t in lists]
    _step(expected, fused=False)
    got = [on("cuda", t) for t in lists]
    _step(got, fused=True)
    torch.cuda.synchronize()
    assert_bitwise(got[0] + got[2], expected[0] + expected[2], "130 tensors")


def test_side_stream(cuda_ops, gen):
    """Inputs written and the ops run on a side stream: the kernels use the current stream."""
    lists = _lists(gen)
    expected = [on("cpu", t) for t in lists]
    _step(expected, fused=False)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        got = [on("cuda", t) for t in lists]
        _step(got, fused=True)
        sums = (
            ops.col_sum_squares(got[0][-1]),
            ops.conv2d_patch_sum_squares(
                got[0][-1].float().view(1, 1, *got[0][-1].shape), 3, padding=1
            ),
        )
    side.synchronize()
    assert_bitwise(got[0] + got[2], expected[0] + expected[2], "side stream")
    x = expected[0][-1].float()
    torch.testing.assert_close(sums[0].cpu(), reference.col_sum_squares(x))
    torch.testing.assert_close(
        sums[1].cpu(), reference.conv2d_patch_sum_squares(x.view(1, 1, *x.shape), 3, padding=1)
    )


def test_non_current_device(cuda_ops, gen):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    lists = _lists(gen)
    expected = [on("cpu", t) for t in lists]
    _step(expected, fused=False)
    with torch.cuda.device(0):
        got = [on("cuda:1", t) for t in lists]
        _step(got, fused=True)
        x = torch.randn(300, 70, device="cuda:1")
        sums = ops.col_sum_squares(x)
    torch.cuda.synchronize(1)
    assert_bitwise(got[0] + got[2], expected[0] + expected[2], "cuda:1")
    assert sums.device == x.device
    torch.testing.assert_close(sums.cpu(), reference.col_sum_squares(x.cpu()))
