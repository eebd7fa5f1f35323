"""Curvature capture under the ways models are really written: in-place
activations, a module used twice, modules unused in a step, eval / no_grad
forwards between steps, activation checkpointing."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from singd_cuda import SINGD

from .conftest import (
    IN_FEATURES,
    NUM_CLASSES,
    assert_models_equal,
    assert_states_equal,
    clone_model,
    loss_fn,
    make_mlp,
    make_optimizer,
    random_batches,
    snapshot,
    train,
)
from .test_dense_reference import factor_update

NAMES = ["singd-dense", "singd-block_diagonal", "ikfac", "adafisher"]


@pytest.mark.parametrize("name", NAMES)
def test_inplace_activation_equals_out_of_place(name):
    """nn.ReLU(inplace=True) right after a Linear rewrites the Linear's output."""
    plain, inplace = make_mlp(), make_mlp(inplace=True)
    batches = random_batches("mlp", 5)
    train(plain, make_optimizer(name, plain), batches)
    train(inplace, make_optimizer(name, inplace), batches)
    assert_models_equal(inplace, plain)


class SharedLayer(nn.Module):
    """``shared`` is applied twice in one forward."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.shared, self.out = nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x, keep=None):
        z1 = self.shared(torch.tanh(self.inp(x)))
        z2 = self.shared(torch.tanh(z1))
        if keep is not None:
            keep += [z1, z2]
        return self.out(torch.tanh(z2))


def test_eager_statistics_step_returns_the_layer_output_itself():
    """The capture hooks the output's gradient instead of copying the output."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(inplace=True), nn.Linear(3, 2))
    returned = []
    model[0].register_forward_hook(lambda module, args, out: returned.append(out))
    opt = SINGD(model, T=1)
    x = torch.randn(5, 4)
    hidden = model[0](x)  # a statistics step
    assert hidden is returned[0]
    model[2](model[1](hidden)).square().sum().backward()
    assert model[0] in {layer.module for layer in opt._capture.committed}


def test_module_used_twice_has_the_statistics_of_one_call_on_both_inputs():
    """Both uses count, as one call on their joined inputs (20 samples): aᵀa averages
    the two uses' rows, gᵀg sums both uses' output gradients scaled by 20; checked
    against the dense formulas on the first step (K = C = I, m = 0, no momentum yet)."""
    model = SharedLayer().double()
    twin = clone_model(model)  # no hooks: the expected values come from here
    hp = dict(lr=0.1, damping=1e-3, alpha1=0.5, lr_cov=0.1, weight_decay=1e-2)
    opt = SINGD(model, structures="dense", T=1, momentum=0.9, warm_start=False, **hp)
    x = torch.randn(10, 6, dtype=torch.float64)
    y = torch.randint(0, 3, (10,))
    W0 = torch.cat([model.shared.weight, model.shared.bias[:, None]], 1).detach().clone()

    # the expected statistics, from the two uses' inputs and output gradients
    keep = []
    g1, g2 = torch.autograd.grad(loss_fn(twin(x, keep), y), keep)
    z1, _ = keep
    inputs = [torch.tanh(twin.inp(x)), torch.tanh(z1)]
    a = [torch.cat([h, torch.ones(10, 1, dtype=h.dtype)], 1) / math.sqrt(20) for h in inputs]
    aTa = sum(ai.T @ ai for ai in a).detach()
    gTg = sum((gi * math.sqrt(20)).T @ (gi * math.sqrt(20)) for gi in (g1, g2))
    eye8, eye9 = torch.eye(8, dtype=torch.float64), torch.eye(9, dtype=torch.float64)
    K, C, _, _ = factor_update(
        eye9, eye8, 0 * eye9, 0 * eye8, aTa, gTg, kfac_like=False, **{
            k: hp[k] for k in ("damping", "alpha1", "lr_cov")
        }
    )  # fmt: skip

    opt.zero_grad()
    loss_fn(model(x), y).backward()
    G = torch.cat([model.shared.weight.grad, model.shared.bias.grad[:, None]], 1)
    opt.step()
    state = opt.state[model.shared.weight]
    torch.testing.assert_close(state["K"]["mat"], K, rtol=1e-10, atol=1e-13)
    torch.testing.assert_close(state["C"]["mat"], C, rtol=1e-10, atol=1e-13)
    W1 = W0 - hp["lr"] * ((C @ C.T) @ G @ (K @ K.T) + hp["weight_decay"] * W0)
    W = torch.cat([model.shared.weight, model.shared.bias[:, None]], 1)
    torch.testing.assert_close(W, W1, rtol=1e-10, atol=1e-13)


class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(IN_FEATURES, 16)
        self.heads = nn.ModuleList([nn.Linear(16, NUM_CLASSES), nn.Linear(16, NUM_CLASSES)])

    def forward(self, x, head: int):
        return self.heads[head](torch.tanh(self.body(x)))


@pytest.mark.parametrize("name", NAMES)
def test_module_unused_in_a_step_is_left_alone(name):
    """Head 1 is unused on steps 0-2 (grad None: no state, no update), used on step 3,
    unused again on step 4 (its parameters and state do not move)."""
    model = TwoHeads()
    opt = make_optimizer(name, model, T=1)
    batches = random_batches("mlp", 5)
    head = model.heads[1]
    untouched = [p.detach().clone() for p in head.parameters()]
    for t, (x, y) in enumerate(batches):
        which = 1 if t == 3 else 0
        if t == 4:
            params_before = [p.detach().clone() for p in head.parameters()]
            state_before = {
                k: v.clone() for k, v in opt.state[head.weight].items() if torch.is_tensor(v)
            }
        opt.zero_grad()
        loss_fn(model(x, which), y).backward()
        opt.step()
        if t == 2:
            assert not opt.state.get(head.weight)
            for p, q in zip(head.parameters(), untouched, strict=True):
                assert torch.equal(p, q)
        if t == 3:
            assert opt.state[head.weight]
    for p, q in zip(head.parameters(), params_before, strict=True):
        assert torch.equal(p, q)
    for key, value in state_before.items():
        assert torch.equal(opt.state[head.weight][key], value)


@pytest.mark.parametrize("name", NAMES)
def test_eval_and_no_grad_forwards_change_nothing(name):
    """Forwards in eval mode, under no_grad, or never backpropagated, before the
    backward, between backward and step, and after the step: no effect."""
    model = make_mlp()
    probed = clone_model(model)
    batches = random_batches("mlp", 6)
    probe = torch.randn(7, IN_FEATURES)
    train(model, opt := make_optimizer(name, model), batches)
    probed_opt = make_optimizer(name, probed)

    def probes():
        probed.eval()
        probed(probe)
        probed.train()
        with torch.no_grad():
            probed(probe)
        probed(probe)  # training mode, grad enabled, but never backpropagated

    for x, y in batches:
        probed_opt.zero_grad()
        probes()
        loss_fn(probed(x), y).backward()
        probes()  # between backward and step
        probed_opt.step()
        probes()
    assert_models_equal(probed, model)
    assert_states_equal(probed_opt.state_dict(), snapshot(model, opt)[1])


class Checkpointed(nn.Module):
    """The middle block runs under torch.utils.checkpoint (or not, ``mode=None``)."""

    def __init__(self, mode):
        super().__init__()
        torch.manual_seed(0)
        self.mode = mode
        self.inp = nn.Linear(IN_FEATURES, 16)
        self.block = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16))
        self.out = nn.Linear(16, NUM_CLASSES)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        if self.mode is None:
            h = self.block(h)
        else:
            h = checkpoint(self.block, h, use_reentrant=self.mode == "reentrant")
        return self.out(torch.tanh(h))


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("mode", ["reentrant", "non-reentrant"])
def test_activation_checkpointing_counts_once(mode, name):
    plain, checkpointed = Checkpointed(None), Checkpointed(mode)
    batches = random_batches("mlp", 6)
    train(plain, opt := make_optimizer(name, plain), batches)
    train(checkpointed, ck_opt := make_optimizer(name, checkpointed), batches)
    assert_models_equal(checkpointed, plain)
    assert_states_equal(ck_opt.state_dict(), opt.state_dict())


@pytest.mark.parametrize("name", NAMES)  # SINGD proper is blind to a miscount: ×k·÷k
@pytest.mark.parametrize("mode", ["reentrant", "non-reentrant"])
def test_checkpointing_the_whole_model_counts_once(mode, name):
    """The model's own forward is recomputed: it must not count as a second micro-batch."""
    plain = make_mlp()
    checkpointed = clone_model(plain)
    batches = random_batches("mlp", 6)
    train(plain, opt := make_optimizer(name, plain), batches)
    ck_opt = make_optimizer(name, checkpointed)
    for x, y in batches:
        ck_opt.zero_grad()
        x = x.clone().requires_grad_()  # reentrant checkpointing needs an input with grad
        out = checkpoint(checkpointed, x, use_reentrant=mode == "reentrant")
        loss_fn(out, y).backward()
        ck_opt.step()
    assert_models_equal(checkpointed, plain)
    assert_states_equal(ck_opt.state_dict(), opt.state_dict())


def test_statistics_are_captured_on_statistics_steps_only():
    """No tensor hook and no statistics between update steps; on update steps every
    micro-batch's forward counts its loss terms (w = 16 each)."""
    model = make_mlp()
    opt = SINGD(model, T=2, structures="diagonal")
    x, y = random_batches("mlp", 1)[0]
    for step in range(4):
        for _ in range(3):  # three micro-batches per step
            loss_fn(model(x), y).backward()
        committed = opt._capture.committed
        if step % 2 == 0:
            assert [c.terms for c in committed.values()] == [48.0] * 3, step
        else:
            assert not committed, step
        opt.step()
        opt.zero_grad()
