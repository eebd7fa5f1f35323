"""Sums of many vectors at once (SINGD's diagonal traces and means) are bit for bit the
sums of one vector at a time."""

from __future__ import annotations

import pytest
import torch

from singd_cuda.optim.grouped import StackedSums


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_sums_of_a_stack_equal_one_at_a_time(dtype):
    generator = torch.Generator().manual_seed(0)
    lengths = [1, 7, 16, 17, 16, 64, 257, 17, 1025, 16]
    vectors = [
        (torch.randn(n, generator=generator, dtype=torch.float64) * 8).exp().to(dtype)
        for n in lengths
    ]
    out_dtypes = [torch.float32, torch.float64] if dtype != torch.float64 else [torch.float64]
    outs = [
        torch.full((1,), float("nan"), dtype=out_dtypes[i % len(out_dtypes)])
        for i in range(len(vectors))
    ]
    sums = StackedSums()
    for _ in range(2):  # built, then kept
        for out in outs:
            out.fill_(float("nan"))
        sums(vectors, outs)
    for vector, out in zip(vectors, outs, strict=True):
        assert torch.equal(out, torch.sum(vector, 0, keepdim=True, dtype=out.dtype))
