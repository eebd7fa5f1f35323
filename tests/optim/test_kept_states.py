"""The step's state look-ups by C calls (``_weights_states``: the weights' states through
their statistics plans; ``_params_states``: each layer's parameter states, kept between steps)
are the optimizer's state objects at every step: after ordinary steps, a skipped first
step that restores the states it created, a ``load_state_dict`` (new state objects), and
a group added after construction. Between statistics (T > 1) the layers a step
preconditions, found through the plans by C calls, are those :meth:`_started` names one
by one."""

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
        next(model.parameters()).grad[0, 0] = float("nan")
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


class TwoHeads(nn.Module):
    """A trunk and two heads; ``head`` picks the one the forward uses."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk, self.a, self.b = nn.Linear(4, 5), nn.Linear(5, 3), nn.Linear(5, 3)
        self.head = "a"

    def forward(self, x):
        return getattr(self, self.head)(torch.tanh(self.trunk(x)))


@pytest.mark.parametrize("name", ["singd-diagonal", "singd-block", "kfac"])
def test_layers_between_statistics_are_the_started_ones(name):
    """Between statistics a head not yet captured waits for its statistics (the fallback
    trains it): also after a ``load_state_dict`` from before its first statistics (its
    plan holds the replaced state), and a layer whose state was emptied waits again. Each
    step's answer equals the per-layer one (:meth:`_started`)."""
    model = TwoHeads()
    opt = {
        "singd-diagonal": lambda: SINGD(model, structures="diagonal", lr=0.05, T=3),
        "singd-block": lambda: SINGD(model, lr=0.05, T=3),
        "kfac": lambda: KFAC(model, lr=0.05, T=3),
    }[name]()
    answers = []
    found = opt._layers_to_step

    def recorded():
        with_grad, waiting = found()
        expected = [layer for layer in with_grad + waiting if not opt._started(layer)]
        answers.append((bool(opt._pending), [layer.weight for layer in waiting]))
        assert waiting == expected
        return with_grad, waiting

    def step_with(head: str) -> None:
        model.head = head
        step(model, opt)

    opt._layers_to_step = recorded
    step(model, opt, poison=True)  # skipped: its statistics come again next step
    step_with("a")
    step_with("b")
    saved = copy.deepcopy(opt.state_dict())
    step_with("b")
    step_with("b")  # statistics: b starts
    opt.load_state_dict(saved)  # from before b's first statistics
    step_with("b")
    step_with("a")  # statistics
    opt.state[model.a.weight].clear()
    step_with("a")
    a, b = model.a.weight, model.b.weight
    assert answers == [
        (True, []), (True, []), (False, [b]), (False, [b]), (True, []),
        (False, [b]), (True, []), (False, [a]),
    ]  # fmt: skip
