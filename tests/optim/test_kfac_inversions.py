"""K-FAC's inversions of many factors at once are bit for bit those of one factor at a time."""

from __future__ import annotations

import pytest
import torch

from singd_cuda.optim.kfac import invert_into


def damped_inverse(factor: torch.Tensor, damping: float, method: str) -> torch.Tensor:
    """The one-matrix reference: (F + damping·I)⁻¹ in the accumulation dtype."""
    F = factor.to(torch.float64 if factor.dtype == torch.float64 else torch.float32)
    eye = torch.eye(F.shape[0], dtype=F.dtype)
    if method == "inverse":
        return torch.linalg.inv(F + damping * eye)
    eigenvalues, Q = torch.linalg.eigh(F.nan_to_num(0.0, 0.0, 0.0))
    return (Q / (eigenvalues + damping)) @ Q.T


def factors(count: int, d: int, dtype: torch.dtype) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(d)
    X = torch.randn(count, 3 * d, d, generator=generator, dtype=torch.float64)
    return list((X.mT @ X / (3 * d)).to(dtype).unbind(0))


@pytest.mark.parametrize("d", [1, 4, 5, 8, 9, 16, 17, 32, 33])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("method", ["inverse", "eigen"])
@pytest.mark.parametrize("count", [1, 3, 8])
def test_inverses_of_a_stack_equal_one_at_a_time(d, dtype, method, count):
    given = factors(count, d, dtype)
    targets = [torch.full((d, d), float("nan"), dtype=dtype) for _ in given]
    invert_into(given, targets, 0.03, method)
    for factor, target in zip(given, targets, strict=True):
        assert torch.equal(target, damped_inverse(factor, 0.03, method).to(dtype))


def test_a_nonfinite_factor_gives_a_nonfinite_inverse_and_leaves_the_others():
    given = factors(4, 16, torch.float32)
    given[2][0, 0] = float("nan")
    targets = [torch.empty(16, 16) for _ in given]
    invert_into(given, targets, 0.03, "inverse")
    assert not targets[2].isfinite().all()
    for index in (0, 1, 3):
        assert torch.equal(targets[index], damped_inverse(given[index], 0.03, "inverse"))
