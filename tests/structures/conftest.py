"""Shared cases for the structure tests: specs, sizes, dtypes and tolerances."""

from __future__ import annotations

import pytest
import torch

from singd_cuda import structures

# Parametrised specs chosen so that block size / rank / k1+k2 both divide and do
# not divide the sizes, and also exceed them (the structures then reduce to dense).
SPECS = [
    "dense",
    "diagonal",
    "block_diagonal:1",
    "block_diagonal:4",
    "block_diagonal:5",
    "block_diagonal:32",
    "block_diagonal:200",
    "low_rank:1",
    "low_rank:3",
    "low_rank:8",
    "low_rank:200",
    "tril_toeplitz",
    "triu_toeplitz",
    "hierarchical:2,3",
    "hierarchical:15,15",
    "hierarchical:200,5",
]
SIZES = [1, 2, 7, 31, 64, 129]

# Normwise relative tolerances: max|ours - ref| <= rtol * max(|ref|, 1e-30).
# float64 / float32 are the bounds; the half types store every result
# rounded once (unit roundoff 2^-8 for bf16, 2^-11 for fp16) after float32
# accumulation, so a few units of roundoff of the largest entry is the bound.
RTOL = {
    torch.float64: 1e-10,
    torch.float32: 1e-5,
    torch.bfloat16: 2e-2,
    torch.float16: 4e-3,
}
DTYPES = list(RTOL)


def assert_close_normwise(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype):
    """Compare in float64 against the largest entry of the reference."""
    actual, expected = actual.double(), expected.double()
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    scale = expected.abs().max().clamp_min(1e-30) if expected.numel() else 1.0
    err = (actual - expected).abs().max() if expected.numel() else 0.0
    assert err <= RTOL[dtype] * scale, (
        f"error {float(err):.3e} > {RTOL[dtype]:.1e} * {float(scale):.3e}"
    )


def random_member(S, d: int, dtype: torch.dtype, generator: torch.Generator):
    """A random, non-symmetric member of the family S, stored in ``dtype``."""
    M = torch.randn(d, d, dtype=torch.float64, generator=generator)
    return S.from_dense(M).to(dtype=dtype)


def free_mask(S, d: int) -> torch.Tensor:
    """Boolean (d, d): the entries a member of S may hold."""
    return S.from_dense(torch.ones(d, d, dtype=torch.float64)).to_dense() != 0


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(0)


def get(spec: str):
    return structures.get(spec)
