"""Parameters whose data is replaced between steps (``p.data = ...``, ``model.to(dtype)``,
as torch's ``Module._apply`` does): the optimizer keeps the same parameter objects, so
what it keeps between steps (views of the parameters, stacks in their dtype) must follow
the new data, never write into the old."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from singd_cuda import KFAC, SINGD, AdaFisher

BUILDERS = {
    "singd-diagonal": lambda m, T: SINGD(m, lr=0.1, T=T, structures="diagonal"),
    "singd-block": lambda m, T: SINGD(m, lr=0.1, T=T),
    "adafisher": lambda m, T: AdaFisher(m, lr=0.1, T=T),
    "kfac": lambda m, T: KFAC(m, lr=0.1, T=T),
}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(m for _ in range(3) for m in (nn.Linear(6, 6), nn.Tanh())))


def _train(name: str, T: int, swap_at: int | None, cast_at: int | None = None) -> nn.Module:
    model = _model()
    opt = BUILDERS[name](model, T)
    g = torch.Generator().manual_seed(1)
    dtype = torch.float32
    for step in range(5):
        if step == swap_at:
            for p in model.parameters():
                p.data = p.data.clone()
        if step == cast_at:
            dtype = torch.float64
            model.to(dtype)
        before = [p.detach().clone() for p in model.parameters()]
        opt.zero_grad()
        model(torch.randn(8, 6, generator=g).to(dtype)).square().mean().backward()
        opt.step()
        moved = [not torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True)]
        assert all(moved), f"step {step}: a parameter did not move"
    return model


@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("name", list(BUILDERS))
def test_replaced_parameter_data_trains_as_if_never_replaced(name, T):
    swapped, reference = _train(name, T, swap_at=2), _train(name, T, swap_at=None)
    for a, b in zip(swapped.parameters(), reference.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("name", list(BUILDERS))
def test_a_model_cast_between_steps_keeps_training(name, T):
    model = _train(name, T, swap_at=None, cast_at=2)
    assert all(p.dtype == torch.float64 and torch.isfinite(p).all() for p in model.parameters())
