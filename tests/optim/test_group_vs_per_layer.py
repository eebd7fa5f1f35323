"""A heterogeneous model trained through the optimizer equals, bit for bit, the same model
trained with one optimizer instance per layer.

The per-layer reference shares nothing between layers: each layer has its own optimizer
(``params`` = that layer's parameters), so no stack, op list, normaliser or finite check
holds two layers, and every group is one layer. The model mixes what the stacked paths
must keep apart: equal-shape layers (with and without bias) beside odd shapes, a Conv2d, a
float64 layer inside a float32 model, a frozen layer, an idle layer (unused, so without
gradient or statistics, on odd steps) and a layer whose batch changes between steps (it
sees the first k rows only). ``torch.equal`` on every parameter and every state tensor.

A lone optimizer whose parameters have no gradient does not step at all (as torch.optim),
so the idle layer's instance also holds ``clock``, a scalar that always has a gradient
(trained by the AdamW fallback): its step count then runs as the shared optimizer's does
(the factor update period T counts optimizer steps, not the layer's).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from singd_cuda import KFAC, SINGD, AdaFisher

STEPS = 8
SUB_BATCH = [8, 5, 3, 8, 6, 2, 7, 4]  # rows the sub-batch layer sees at each step


class Hetero(nn.Module):
    """(B, 2, 4, 4) float32 images -> 5 classes, through the layers described above."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(2, 3, 3, padding=1)
        self.first = nn.Linear(48, 12)
        self.same = nn.ModuleList([nn.Linear(12, 12) for _ in range(3)])
        self.same_no_bias = nn.ModuleList([nn.Linear(12, 12, bias=False) for _ in range(2)])
        self.wide = nn.Linear(12, 20, dtype=torch.float64)
        self.frozen = nn.Linear(20, 12).requires_grad_(False)
        self.idle = nn.Linear(12, 12)
        self.sub = nn.Linear(12, 12)
        self.head = nn.Linear(12, 5)
        self.clock = nn.Parameter(torch.ones(()))
        self.step = 0

    def forward(self, x):
        h = torch.tanh(self.first(torch.tanh(self.conv(x)).flatten(1)))
        for layer in (*self.same, *self.same_no_bias):
            h = torch.tanh(layer(h))
        h = torch.tanh(self.frozen(torch.tanh(self.wide(h.double())).float()))
        if self.step % 2 == 0:
            h = h + torch.tanh(self.idle(h))
        k = SUB_BATCH[self.step]
        h = torch.cat([torch.tanh(self.sub(h[:k])), h[k:]])
        return self.head(h) * self.clock


OPTIMIZERS = {
    "adafisher": lambda model, params: AdaFisher(model, params, lr=0.01, weight_decay=1e-2),
    "singd-diagonal": lambda model, params: SINGD(
        model, params, lr=0.01, lr_cov=0.05, T=2, structures="diagonal"
    ),
    "singd-block_diagonal": lambda model, params: SINGD(
        model, params, lr=0.01, lr_cov=0.05, T=2, structures="block_diagonal:4"
    ),
    "singd-dense": lambda model, params: SINGD(
        model, params, lr=0.01, lr_cov=0.05, T=1, structures="dense"
    ),
    "kfac": lambda model, params: KFAC(model, params, lr=0.01, T=1, T_inv=2),
}


def train(model: Hetero, opts: list[torch.optim.Optimizer]) -> None:
    g = torch.Generator().manual_seed(1)
    for step in range(STEPS):
        model.step = step
        x, y = torch.randn(8, 2, 4, 4, generator=g), torch.randint(0, 5, (8,), generator=g)
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()
        for opt in opts:
            opt.step()


def per_layer_params(model: Hetero) -> list[list[nn.Parameter]]:
    """Each layer's parameters, the idle layer's with the clock."""
    layers = [m for m in model.modules() if m is not model and list(m.parameters(recurse=False))]
    return [[*m.parameters(), *([model.clock] if m is model.idle else [])] for m in layers]


def flat(state: dict, prefix: str = "") -> dict[str, object]:
    """A parameter's state, nested dicts flattened to ``a/b`` keys."""
    out = {}
    for key, value in state.items():
        if isinstance(value, dict):
            out.update(flat(value, f"{prefix}{key}/"))
        else:
            out[f"{prefix}{key}"] = value
    return out


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_group_path_equals_per_layer_instances_bitwise(name):
    grouped, reference = Hetero(), Hetero()
    make = OPTIMIZERS[name]
    opt = make(grouped, None)
    per_layer = [make(reference, params) for params in per_layer_params(reference)]
    train(grouped, [opt])
    train(reference, per_layer)
    for (key, a), b in zip(grouped.named_parameters(), reference.parameters(), strict=True):
        assert torch.equal(a, b), key
    # parameter i of the model is parameter j of its layer's instance
    names = {id(p): n for n, p in grouped.named_parameters()}
    states = opt.state_dict()["state"]
    index = {id(p): i for i, p in enumerate(grouped.parameters())}
    compared = 0
    for params, ref_opt in zip(per_layer_params(grouped), per_layer, strict=True):
        ref_states = ref_opt.state_dict()["state"]
        for j, p in enumerate(params):
            mine, theirs = flat(states.get(index[id(p)], {})), flat(ref_states.get(j, {}))
            assert mine.keys() == theirs.keys(), names[id(p)]
            for key, value in mine.items():
                if isinstance(value, torch.Tensor):
                    assert torch.equal(value, theirs[key]), (names[id(p)], key)
                    compared += 1
                else:
                    assert value == theirs[key], (names[id(p)], key)
    assert compared >= len(index) - 2  # every trained parameter has state (not the frozen)
