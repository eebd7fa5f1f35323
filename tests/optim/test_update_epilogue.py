"""Every parameter write of every optimizer goes through the fused ops of
:mod:`singd_cuda.ops` (one epilogue, one stochastic rounding): nothing under
singd_cuda/optim writes a parameter itself, the seeds are a pure function of
(step, parameter), rounding through the optimizer is unbiased, and parameters that
cannot be viewed as matrices still take the one fused diagonal pass."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils._pytree import tree_map

import singd_cuda.ops as ops
from singd_cuda import KFAC, SINGD, AdaFisher

from .conftest import IN_FEATURES, NUM_CLASSES, count_diagonal_steps, loss_fn, random_batches

WRITING_OPS = ("sgd_epilogue_", "adam_epilogue_", "diag_precond_step_")

CASES = {
    "singd-dense": (SINGD, dict(structures="dense", lr=0.05, T=1)),
    "singd-diagonal": (SINGD, dict(lr=0.05, T=1, structures="diagonal")),
    "singd-norm-fisher": (SINGD, dict(structures="dense", lr=0.05, T=1, norm_fisher=True)),
    "kfac": (KFAC, dict(lr=0.05, T=1)),
    "adafisher": (AdaFisher, dict(lr=0.01, T=1)),
}


class Mixed(nn.Module):
    """Linear layers, a LayerNorm (fallback or norm Fisher) and a free parameter (fallback)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.hidden = nn.Linear(IN_FEATURES, 16)
        self.norm = nn.LayerNorm(16)
        self.scale = nn.Parameter(torch.ones(1))
        self.head = nn.Linear(16, NUM_CLASSES)

    def forward(self, x):
        return self.head(torch.tanh(self.norm(self.hidden(x))) * self.scale)


def recording_ops(monkeypatch) -> list[dict]:
    """Replace the ops that write parameters by recorders that change nothing (the
    diagonal step also where a kept batch resolves it, ``ops.diag_precond_step_for``)."""
    calls: list[dict] = []
    for name in WRITING_OPS:

        def record(params, *args, name=name, **kwargs):
            calls.append(dict(op=name, params=list(params), **kwargs))

        monkeypatch.setattr(ops, name, record)
        if name == "diag_precond_step_":
            monkeypatch.setattr(ops, "diag_precond_step_for", lambda device, op=record: op)
    return calls


def storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


@pytest.mark.parametrize("name", list(CASES))
def test_every_parameter_write_goes_through_the_ops(name, monkeypatch):
    """With the ops replaced by recorders a step changes no parameter (no module of the
    optimizers writes or rounds one itself), and every trained parameter was handed to
    an op with stochastic rounding on and seed = step * 1_000_003 + the index of the
    call's first parameter."""
    model = Mixed().to(torch.bfloat16)
    cls, kwargs = CASES[name]
    opt = cls(model, stochastic_rounding=True, **kwargs)
    index = {storage(p): i for i, p in enumerate(model.parameters())}
    recorded = recording_ops(monkeypatch)  # for every step (a kept batch keeps its op)
    for step, (x, y) in enumerate(random_batches("mlp", 3, dtype=torch.bfloat16)):
        before = [p.detach().clone() for p in model.parameters()]
        start = len(recorded)
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
        calls = recorded[start:]
        for p, q in zip(model.parameters(), before, strict=True):
            assert torch.equal(p, q)
        written = [storage(p) for call in calls for p in call["params"]]
        assert sorted(written) == sorted(index)  # each parameter exactly once
        for call in calls:
            assert call["stochastic_rounding"] is True
            assert call["seed"] == step * 1_000_003 + index[storage(call["params"][0])]


def test_fallback_writes_a_group_in_one_call(monkeypatch):
    model = Mixed()
    opt = SINGD(model, structures="dense", lr=0.05, T=1)
    calls = recording_ops(monkeypatch)
    x, y = random_batches("mlp", 1)[0]
    loss_fn(model(x), y).backward()
    opt.step()
    fallback = [id(p) for p in (model.scale, model.norm.weight, model.norm.bias)]  # group order
    assert [[id(p) for p in c["params"]] for c in calls if c.get("decoupled")] == [fallback]


ULP_BELOW_ONE = 2.0**-8  # bfloat16 spacing in [0.5, 1)


@pytest.mark.parametrize("name", ["singd-dense", "kfac", "fallback"])
def test_stochastic_rounding_is_unbiased_through_the_optimizer(name):
    """Steps of a tenth of an ulp: round-to-nearest never moves a bf16 parameter from 1,
    stochastic rounding moves it by the sum of the steps on average. The gradient is
    set by hand (no statistics) after the layer's factors were created (a layer without
    factors or statistics would train with the fallback), so the preconditioner is the
    identity and the fallback's AdamW direction is 1/(1 + eps)."""
    steps, lr = 20, 0.1 * ULP_BELOW_ONE
    moved = {}
    for rounding in (False, True):
        model = nn.Linear(64, 64).to(torch.bfloat16)
        model.free = nn.Parameter(torch.ones(64, 64, dtype=torch.bfloat16))
        nn.init.ones_(model.weight)
        cls = KFAC if name == "kfac" else SINGD
        opt = cls(model, lr=lr, momentum=0.0, T=1, stochastic_rounding=rounding)
        param = model.free if name == "fallback" else model.weight
        (layer,) = opt.layers
        group = opt.group_of(layer)
        opt.rule_for(group).init_state(layer, group, opt.state[layer.weight])
        for _ in range(steps):
            for p in model.parameters():
                p.grad = torch.ones_like(p)
            opt.step()
        moved[rounding] = (1.0 - param.float()).mean().item()
    assert moved[False] == 0.0
    assert moved[True] == pytest.approx(steps * lr, rel=0.05)


def channels_last_cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 6, 3, padding=1), nn.Conv2d(6, 4, 3, groups=2), nn.Flatten()
    ).to(memory_format=torch.channels_last)


@pytest.mark.parametrize("name", ["singd-diagonal", "adafisher"])
def test_non_viewable_parameters_take_the_fused_pass(name, monkeypatch):
    """channels_last conv weights (and their gradients and buffers) cannot be viewed as
    (d_C, n) matrices: they are updated through copies, in the same single call per
    step, bitwise like contiguous ones, and keep their memory format."""
    cls, kwargs = CASES[name]
    strided = channels_last_cnn()
    dense = copy.deepcopy(strided).to(memory_format=torch.contiguous_format)
    assert not strided[0].weight.is_contiguous()
    opts = [cls(model, momentum=0.9, **kwargs) for model in (strided, dense)]
    gen = torch.Generator().manual_seed(3)
    # a real step starts the factors (a layer without statistics trains with the fallback);
    # the twin takes over its state (contiguous), as the two convolutions round apart
    strided(torch.randn(2, 3, 8, 8, generator=gen)).square().sum().backward()
    opts[0].step()
    dense.load_state_dict(strided.state_dict())
    opts[1].load_state_dict(opts[0].state_dict())
    for state in opts[1].state.values():
        state.update(tree_map(lambda t: t.contiguous() if torch.is_tensor(t) else t, state))
    calls = count_diagonal_steps(monkeypatch)
    for _ in range(3):  # gradients by hand: no statistics, identical inputs to the op
        for p, q in zip(strided.parameters(), dense.parameters(), strict=True):
            grad = torch.randn(p.shape, generator=gen)
            p.grad, q.grad = torch.empty_like(p).copy_(grad), grad
        for opt in opts:
            opt.step()
    assert calls == [4] * 6  # 2 convs x (weight, bias), per step and optimizer
    for p, q in zip(strided.parameters(), dense.parameters(), strict=True):
        assert torch.equal(p, q)
    assert strided[0].weight.is_contiguous(memory_format=torch.channels_last)
    buffer = "exp_avg" if name == "adafisher" else "momentum_buffer"
    first, second = (
        opt.state[m[0].weight][buffer] for opt, m in zip(opts, (strided, dense), strict=True)
    )
    assert torch.equal(first, second)
