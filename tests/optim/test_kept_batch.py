"""The diagonal paths keep their batch's lists between steps (KeptBatch): every change
of what a step queues must rebuild them, bit for bit as a batch built anew each step."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from singd_cuda import SINGD, AdaFisher
from singd_cuda.optim.adafisher import KeptBatch

MAKERS = {
    "adafisher": lambda m: AdaFisher(m, lr=1e-2),
    "singd_diagonal": lambda m: SINGD(m, lr=1e-2, structures="diagonal", T=1),
}


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3))


def train(make, fresh_batch_each_step: bool) -> list[torch.Tensor]:
    net = model()
    opt = make(net)
    rule = opt.rule_for(opt.param_groups[0])
    generator = torch.Generator().manual_seed(1)
    for step in range(8):
        if fresh_batch_each_step:
            rule._kept = KeptBatch()
        opt.zero_grad()
        net(torch.randn(4, 5, generator=generator)).square().mean().backward()
        if step == 2:  # gradients laid out unlike their parameters
            grad = net[2].weight.grad
            net[2].weight.grad = grad.t().contiguous().t()  # column-major
            strided = torch.zeros(12)
            strided[::2] = net[2].bias.grad
            net[2].bias.grad = strided[::2]  # every other element
        if step == 4:  # a bias without a gradient
            net[0].bias.grad = None
        if step == 6:  # a checkpoint load: new state tensors
            opt.load_state_dict(opt.state_dict())
        opt.step()
    return [p.detach().clone() for p in net.parameters()]


@pytest.mark.parametrize("name", sorted(MAKERS))
def test_kept_batch_equals_a_batch_built_each_step(name):
    kept = train(MAKERS[name], fresh_batch_each_step=False)
    fresh = train(MAKERS[name], fresh_batch_each_step=True)
    for a, b in zip(kept, fresh, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", sorted(MAKERS))
def test_a_warm_batch_takes_the_gradients_as_they_are(name):
    """Weights' gradients and biases' vectors go to the fused op as they are: a warm step
    makes no view of a gradient (``_takes_as_is``)."""
    net = model()
    opt = MAKERS[name](net)
    for _ in range(2):
        opt.zero_grad()
        net(torch.randn(4, 5)).square().mean().backward()
        opt.step()
    kept = opt.rule_for(opt.param_groups[0])._kept
    assert kept._lists is not None
    assert kept._grad_views == [None] * 6


def conv_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(2, 3, 3), nn.Tanh(), nn.Flatten(), nn.Linear(12, 3))


def train_conv(make, fresh_batch_each_step: bool) -> tuple[list[torch.Tensor], list[int]]:
    """A conv weight's gradient is viewed as its (3, 18) matrix; at step 2 it comes
    channels_last (the same values, other strides): the kept view would read it wrongly."""
    net = conv_model()
    opt = make(net)
    rule = opt.rule_for(opt.param_groups[0])
    generator = torch.Generator().manual_seed(1)
    viewed = []
    for step in range(5):
        if fresh_batch_each_step:
            rule._kept = KeptBatch()
        opt.zero_grad()
        net(torch.randn(4, 2, 4, 4, generator=generator)).square().mean().backward()
        if step == 2:
            grad = net[0].weight.grad
            net[0].weight.grad = grad.contiguous(memory_format=torch.channels_last)
        opt.step()
        viewed.append(len(rule._kept._viewed))
    return [p.detach().clone() for p in net.parameters()], viewed


@pytest.mark.parametrize("name", sorted(MAKERS))
def test_a_viewed_gradient_laid_out_anew_rebuilds_the_batch(name):
    (kept, viewed), (fresh, _) = (train_conv(MAKERS[name], fresh) for fresh in (False, True))
    assert viewed[1] == 1  # the conv weight's gradient is viewed; the others taken as they are
    for a, b in zip(kept, fresh, strict=True):
        assert torch.equal(a, b)
