"""Non-finite statistics or factors skip the step with every state unchanged, with a
warning (or FloatingPointError with nonfinite="raise"), exactly like a non-finite
gradient."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from .conftest import NAMES, batches, loss_sum, make_optimizer, params_of


class Scale(nn.Module):
    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x):
        return x * self.factor


def overflowing_model() -> nn.Sequential:
    """float32; the first layer sees inputs of 1e19, so Σ x² overflows (> 3.4e38) in its
    statistics while the forward, the loss and every gradient stay finite."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), Scale(1e-25), nn.Tanh(), nn.Linear(8, 3))


def step_on(model, opt, x, y) -> None:
    opt.zero_grad()
    (loss_sum(model(x), y) / len(y)).backward()
    opt.step()


def assert_unchanged(model, opt, params, state) -> None:
    for before, after in zip(params, model.parameters(), strict=True):
        assert torch.equal(before, after)
    assert_same_state(opt.state_dict(), state)


def assert_same_state(first, second) -> None:
    if isinstance(first, dict):
        assert first.keys() == second.keys()
        for key in first:
            assert_same_state(first[key], second[key])
    elif isinstance(first, torch.Tensor):
        assert torch.equal(first, second)
    elif isinstance(first, list):
        assert len(first) == len(second)
        for a, b in zip(first, second, strict=True):
            assert_same_state(a, b)
    else:
        assert first == second


@pytest.mark.parametrize("name", NAMES)
def test_overflowing_statistics_skip_the_step(name):
    model = overflowing_model()
    opt = make_optimizer(name, model)
    (x, y), (x1, y1), (x2, y2) = [(x.float(), y) for x, y in batches(3)]
    step_on(model, opt, x, y)  # normal steps 0 and 1: states exist, and step 2 takes
    step_on(model, opt, x1, y1)  # statistics for T = 1 and T = 2
    params, state = params_of(model), copy.deepcopy(opt.state_dict())
    with pytest.warns(RuntimeWarning, match="non-finite curvature statistics"):
        step_on(model, opt, x2 * 1e19, y2)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert_unchanged(model, opt, params, state)
    step_on(model, opt, x2, y2)  # and goes on normally afterwards
    assert not torch.equal(params[-1], model[3].bias)


@pytest.mark.parametrize("name", ["singd-dense", "kfac"])
def test_overflowing_statistics_raise_when_asked(name):
    model = overflowing_model()
    opt = make_optimizer(name, model, nonfinite="raise")
    x, y = batches(1)[0]
    with pytest.raises(FloatingPointError, match="non-finite curvature statistics"):
        step_on(model, opt, x.float() * 1e19, y)


@pytest.mark.parametrize("name", ["singd-dense", "ikfac"])
def test_a_grown_factor_is_named_when_the_statistics_overflow(name):
    """SINGD's statistics are products with its factors (H_K = Kᵀ aᵀa K): with ordinary
    inputs, a factor K grown to 1e20 overflows them, and the message names that cause and
    its fix (the LLaMA's IKFAC at lr 1e-4 grew K to 4e18 in 85 steps this way)."""
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    opt = make_optimizer(name, model, nonfinite="raise")
    (x, y), (x1, y1) = [(x.float(), y) for x, y in batches(2)]
    step_on(model, opt, x, y)
    for part in opt.state[model[0].weight]["K"].values():
        part.mul_(1e20)
    with pytest.raises(FloatingPointError, match="a factor K or C grown large: normalize_lr_cov"):
        step_on(model, opt, x1, y1)


def test_statistics_without_factors_name_the_inputs_alone():
    model = overflowing_model()
    opt = make_optimizer("kfac", model, nonfinite="raise")
    x, y = batches(1)[0]
    with pytest.raises(FloatingPointError) as raised:
        step_on(model, opt, x.float() * 1e19, y)
    assert "(an overflow in the layer inputs or output gradients)" in str(raised.value)


@pytest.mark.parametrize(
    ("name", "scale"), [("singd-diagonal", 1e5), ("adafisher", 3e3), ("kfac", 3e3)]
)
def test_factor_overflow_in_float16_restores_every_factor(name, scale):
    """Inputs scaled by ``scale`` give statistics that are finite in float32 but overflow
    float16 factors (65504). (Dense SINGD's trace-normalised update stays finite here.)"""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    # from K = C = I: the scale is chosen for those factors (warm-started ones are scaled
    # to the first statistics, and the saturated tanh then keeps the update finite)
    cold = {"warm_start": False} if name.startswith("singd") else {}
    opt = make_optimizer(name, model, factor_dtype=torch.float16, **cold)
    (x, y), (x2, y2) = [(x.float(), y) for x, y in batches(2)]
    step_on(model, opt, x, y)
    params, state = params_of(model), copy.deepcopy(opt.state_dict())
    with pytest.warns(RuntimeWarning, match="non-finite"):
        step_on(model, opt, x2 * scale, y2)
    assert_unchanged(model, opt, params, state)
