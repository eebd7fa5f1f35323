"""The step's state look-ups by C calls (``_weights_states``: the weights' states through
their statistics plans; ``_params_states``: each layer's parameter states, kept between steps)
are the optimizer's state objects at every step: after ordinary steps, a skipped first
step that restores the states it created, a ``load_state_dict`` (new state objects), and
a group added after construction."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from singd_cuda import KFAC, SINGD, AdaFisher

OPTIMIZERS = {
    "singd-diagonal": lambda m, p=None: SINGD(m, p, structures="diagonal", lr=0.05, T=1),
    "singd-block": lambda m, p=None: SINGD(m, p, lr=0.05, T=1),
    "adafisher": lambda m, p=None: AdaFisher(m, p, lr=0.01),
    "kfac": lambda m, p=None: KFAC(m, p, lr=0.05, T=1),
}


def assert_current(opt) -> None:
    """Both look-ups answer with the objects ``opt.state`` holds now."""
    layers = list(opt._layers)
    kept = opt._params_states(layers)
    for layer, states in zip(layers, kept, strict=True):
        assert all(s is opt.state[p] for s, p in zip(states, layer.params, strict=True))
    weights = opt._weights_states(layers)
    assert all(s is opt.state[layer.weight] for s, layer in zip(weights, layers, strict=True))


def step(model, opt, poison: bool = False) -> None:
    x, y = torch.randn(6, 4), torch.randint(0, 3, (6,))
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    if poison:
        model[0].weight.grad[0, 0] = float("nan")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt.step()


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 5), nn.Tanh(), nn.Linear(5, 3))


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_kept_state_look_ups_follow_the_state(name):
    model = mlp()
    opt = OPTIMIZERS[name](model)
    step(model, opt, poison=True)  # skipped: the states its statistics created are restored
    assert_current(opt)
    for _ in range(2):
        step(model, opt)
        assert_current(opt)
    saved = copy.deepcopy(opt.state_dict())
    step(model, opt)
    opt.load_state_dict(saved)  # new state objects
    assert_current(opt)
    step(model, opt)
    assert_current(opt)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_kept_state_look_ups_after_a_group_is_added(name):
    model = mlp()
    make = OPTIMIZERS[name]
    first_two = [p for i in (0, 2) for p in model[i].parameters()]
    opt = make(model, first_two)
    step(model, opt)
    assert len(opt._layers) == 2
    opt.add_param_group({"params": list(model[4].parameters())})
    step(model, opt)
    assert_current(opt)
    assert len(opt._layers) == 3
