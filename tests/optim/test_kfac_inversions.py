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


def test_a_singular_damped_factor_skips_the_step_with_a_warning():
    """damping=0 and a layer whose inputs are all zero (a dead ReLU before it): its A is
    singular. The inverse is non-finite, so the step is skipped with the factor warning
    (which names the fix) and nothing changes, where torch.linalg.inv raised mid-step."""
    from singd_cuda import KFAC

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    with torch.no_grad():
        model[0].weight.fill_(-1.0)
        model[0].bias.fill_(-5.0)
    opt = KFAC(model, lr=0.1, T=1, damping=0.0)
    weights = [p.clone() for p in model.parameters()]
    opt.zero_grad()
    model(torch.rand(8, 4)).square().mean().backward()
    with pytest.warns(RuntimeWarning, match="non-finite values.*larger damping"):
        opt.step()
    assert opt.param_groups[0]["step"] == 0
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights, strict=True))
