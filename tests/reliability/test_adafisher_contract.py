"""AdaFisher: damping 0 is rejected (the min–max normalised F̃ has a zero entry), at
construction, on a mid-training edit and from a callable; the bias correction counts each
layer's own updates, so a layer first used late gets the first step of a fresh optimizer."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from singd_cuda import SINGD, AdaFisher

from .validation_cases import backward, make_model, train

BUILDERS = {
    "AdaFisher": lambda model, **kw: AdaFisher(model, **kw),
    "SINGD-adafisher": lambda model, **kw: SINGD(model, structures="adafisher", **kw),
}


@pytest.mark.parametrize("builder", BUILDERS)
def test_damping_zero_is_rejected_at_construction(builder):
    with pytest.raises(ValueError, match="damping must be a number > 0, got 0"):
        BUILDERS[builder](make_model(), damping=0.0)


@pytest.mark.parametrize("builder", BUILDERS)
def test_damping_zero_is_rejected_when_edited_or_scheduled(builder):
    model = make_model()
    opt = BUILDERS[builder](model, T=1)
    train(model, opt, 1)
    backward(model, opt, seed=1)
    opt.param_groups[0]["damping"] = 0
    with pytest.raises(ValueError, match="damping must be a number > 0"):
        opt.step()
    scheduled = BUILDERS[builder](make_model(), T=1, damping=lambda step: 0.0)
    backward(scheduled.model, scheduled, seed=0)
    with pytest.raises(ValueError, match=r"damping must be a number > 0.*callable damping"):
        scheduled.step()


def test_singd_with_other_structures_accepts_damping_zero():
    SINGD(make_model(), structures="diagonal", damping=0.0)


class TwoBranches(nn.Module):
    """Independent branches: a late branch's gradient does not depend on the other's."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.early = nn.Linear(5, 3)
        self.late = nn.Linear(4, 3)
        self.use_late = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.early(x[:, :5]).square().mean()
        if self.use_late:
            out = out + self.late(x[:, 5:]).tanh().square().mean()
        return out


def step(model: TwoBranches, opt, seed: int) -> None:
    opt.zero_grad()
    model(torch.randn(8, 9, generator=torch.Generator().manual_seed(seed))).backward()
    opt.step()


@pytest.mark.parametrize("builder", BUILDERS)
@pytest.mark.parametrize("T", [1, 2])
def test_a_layer_first_used_late_gets_the_first_step_of_a_fresh_optimizer(builder, T):
    late_start = TwoBranches()
    fresh = copy.deepcopy(late_start)
    opt = BUILDERS[builder](late_start, lr=0.01, momentum=0.9, T=T)
    for seed in range(4):
        step(late_start, opt, seed)
    assert opt.state[late_start.late.weight] == {}
    fresh_opt = BUILDERS[builder](fresh, lr=0.01, momentum=0.9, T=T)
    late_start.use_late = fresh.use_late = True
    before = late_start.late.weight.detach().clone()
    assert torch.equal(before, fresh.late.weight)
    step(late_start, opt, 4)  # step 4: a statistics step for T in {1, 2}, as step 0
    step(fresh, fresh_opt, 4)
    torch.testing.assert_close(late_start.late.weight, fresh.late.weight, rtol=0, atol=0)
    torch.testing.assert_close(late_start.late.bias, fresh.late.bias, rtol=0, atol=0)
    assert not torch.equal(late_start.late.weight, before)
    assert opt.state[late_start.late.weight]["step"] == 1
    assert opt.state[late_start.early.weight]["step"] == 5
