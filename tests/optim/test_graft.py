"""Per-parameter step-size grafting (``graft="adam" | "rms"``) against a reference.

The reference is plain tensor math in this file, fed with the preconditioned gradient
Ĝ_p of a twin optimizer without graft (lr = 1, no momentum, no weight decay: its step is
W − Ĝ), kept on the same parameters and statistics each step: so Ĝ comes from the
ungrafted path and everything the graft adds (second moment, bias correction, norms,
where weight decay and momentum enter) is checked independently, in float64.
"""

from __future__ import annotations

import copy
import io
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from singd_cuda import KFAC, SINGD, AdaFisher

STEPS = 6
LR, MOMENTUM, WD = 0.05, 0.9, 1e-2
BETA2, EPS = 0.99, 1e-6  # the fallback's, which the "adam" graft uses

CONFIGS = {
    "singd-dense": lambda m, **k: SINGD(m, structures="dense", lr_cov=0.1, T=2, **k),
    "singd-diagonal": lambda m, **k: SINGD(m, structures="diagonal", lr_cov=0.1, T=2, **k),
    "singd-block": lambda m, **k: SINGD(m, structures="block_diagonal:3", lr_cov=0.1, T=2, **k),
    "ikfac": lambda m, **k: SINGD(m, structures="dense", kfac_like=True, lr_cov=0.1, T=2, **k),
    "kfac": lambda m, **k: KFAC(m, T=2, damping=1e-2, stat_decay=0.9, **k),
}


def model(dtype=torch.float64) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 7, bias=False), nn.ReLU(), nn.Linear(7, 3)
    ).to(dtype)


def batches(dtype=torch.float64):
    gen = torch.Generator().manual_seed(1)
    return [
        (torch.randn(10, 6, generator=gen, dtype=dtype), torch.randint(0, 3, (10,), generator=gen))
        for _ in range(STEPS)
    ]


def backward(net, x, y) -> None:
    F.cross_entropy(net(x), y).backward()


@pytest.mark.parametrize("graft", ["adam", "rms"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_graft_equals_the_reference_in_float64(name, graft):
    grafted = model()
    twin = copy.deepcopy(grafted)
    fallback = dict(fallback_betas=(0.9, BETA2), fallback_eps=EPS)
    opt = CONFIGS[name](grafted, lr=LR, momentum=MOMENTUM, weight_decay=WD, graft=graft, **fallback)
    plain = CONFIGS[name](twin, lr=1.0, momentum=0.0, weight_decay=0.0)
    params, twins = list(grafted.parameters()), list(twin.parameters())
    v = [torch.zeros_like(p) for p in params]
    buf = [torch.zeros_like(p) for p in params]
    for step, (x, y) in enumerate(batches(), start=1):
        with torch.no_grad():
            for t, p in zip(twins, params, strict=True):
                t.copy_(p)
        for o, net in ((opt, grafted), (plain, twin)):
            o.zero_grad()
            backward(net, x, y)
        before = [p.detach().clone() for p in params]
        grads = [p.grad.clone() for p in params]
        opt.step()
        plain.step()
        for i, (p, w, g, t) in enumerate(zip(params, before, grads, twins, strict=True)):
            natural = w - t.detach()  # Ĝ_p of the ungrafted path
            if graft == "adam":
                v[i] = BETA2 * v[i] + (1 - BETA2) * g * g
                u = g / ((v[i] / (1 - BETA2**step)).sqrt() + EPS)
                target = u.norm()
            else:
                target = 0.2 * math.sqrt(g.numel())
            direction = natural * (target / natural.norm()) + WD * w
            buf[i] = MOMENTUM * buf[i] + direction
            expected = w - LR * buf[i]
            torch.testing.assert_close(p.detach(), expected, rtol=1e-10, atol=1e-12)
    if graft == "adam":
        for p, ref in zip(params, v, strict=True):
            torch.testing.assert_close(opt.state[p]["graft_sq"], ref, rtol=1e-12, atol=0)
            assert opt.state[p]["graft_step"] == STEPS


@pytest.mark.parametrize("name", list(CONFIGS))
def test_rms_graft_sets_each_parameters_update_rms(name):
    """No momentum, no weight decay: every parameter moves by lr x RMS 0.2."""
    net = model()
    opt = CONFIGS[name](net, lr=LR, momentum=0.0, graft="rms")
    for x, y in batches()[:3]:
        before = [p.detach().clone() for p in net.parameters()]
        opt.zero_grad()
        backward(net, x, y)
        opt.step()
        for p, w in zip(net.parameters(), before, strict=True):
            rms = (w - p.detach()).square().mean().sqrt() / LR
            torch.testing.assert_close(rms, torch.tensor(0.2, dtype=rms.dtype), rtol=1e-10, atol=0)


@pytest.mark.parametrize("graft", ["adam", "rms"])
@pytest.mark.parametrize("name", ["singd-dense", "singd-diagonal", "kfac"])
def test_graft_in_bfloat16(name, graft):
    """bf16 weights: finite, and the update RMS (rms graft, no momentum) is 0.2 to bf16's
    rounding of the weights."""
    net = model(torch.bfloat16)
    opt = CONFIGS[name](net, lr=LR, momentum=0.0, graft=graft)
    for x, y in batches(torch.bfloat16)[:4]:
        before = [p.detach().float() for p in net.parameters()]
        opt.zero_grad()
        backward(net, x, y)
        opt.step()
        for p, w in zip(net.parameters(), before, strict=True):
            assert torch.isfinite(p).all()
            if graft == "rms":
                rms = (w - p.detach().float()).square().mean().sqrt() / LR
                assert abs(rms.item() - 0.2) < 0.05
    if graft == "adam":
        assert all(opt.state[p]["graft_sq"].dtype == torch.bfloat16 for p in net.parameters())


@pytest.mark.parametrize("name", ["singd-dense", "kfac"])
def test_a_step_skipped_on_the_device_leaves_the_graft_state(name):
    """nonfinite="device": an inf gradient skips the step on the device; parameters,
    momenta and the graft's second moments keep their values (the warning comes a step
    later)."""
    net = model()
    opt = CONFIGS[name](net, lr=LR, graft="adam", nonfinite="device")
    data = batches()
    for x, y in data[:3]:
        opt.zero_grad()
        backward(net, x, y)
        opt.step()
    params = list(net.parameters())
    kept = [p.detach().clone() for p in params]
    kept += [opt.state[p][k].clone() for p in params for k in ("graft_sq", "momentum_buffer")]
    opt.zero_grad()
    backward(net, *data[3])
    net[0].weight.grad[0, 0] = float("inf")
    opt.step()
    now = [p.detach() for p in params]
    now += [opt.state[p][k] for p in params for k in ("graft_sq", "momentum_buffer")]
    for a, b in zip(now, kept, strict=True):
        assert torch.equal(a, b)
    opt.zero_grad()
    backward(net, *data[4])
    with pytest.warns(RuntimeWarning, match="skipped on the device"):
        opt.step()
    assert all(torch.isfinite(p).all() for p in params)


def test_graft_is_validated():
    with pytest.raises(ValueError, match="graft must be one of"):
        SINGD(model(), graft="muon")
    with pytest.raises(ValueError, match="graft must be one of"):
        net = model()
        AdaFisher(net, params=[{"params": list(net.parameters()), "graft": "sgd"}])


def test_graft_is_per_parameter_group():
    net = model()
    groups = [{"params": net[0].parameters(), "graft": "rms"}, {"params": net[2:].parameters()}]
    opt = SINGD(net, params=groups, structures="dense", lr=LR, momentum=0.0)
    x, y = batches()[0]
    before = [p.detach().clone() for p in net.parameters()]
    backward(net, x, y)
    opt.step()
    moved = [
        (w - p.detach()).square().mean().sqrt() / LR
        for p, w in zip(net.parameters(), before, strict=True)
    ]
    assert all(abs(m.item() - 0.2) < 1e-10 for m in moved[:2])
    assert all(abs(m.item() - 0.2) > 1e-3 for m in moved[2:])


@pytest.mark.parametrize("graft", ["adam", "rms"])
@pytest.mark.parametrize("name", ["singd-dense", "singd-diagonal", "kfac"])
def test_a_constant_loss_scale_changes_nothing(name, graft):
    """A GradScaler's power-of-two scale is removed before the graft's second moment
    and norms: the same trajectory as without a scaler (float32)."""
    plain, scaled = model(torch.float32), model(torch.float32)
    opt = CONFIGS[name](plain, lr=LR, graft=graft)
    opt_scaled = CONFIGS[name](scaled, lr=LR, graft=graft)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=10**6)
    for x, y in batches(torch.float32):
        opt.zero_grad()
        backward(plain, x, y)
        opt.step()
        opt_scaled.zero_grad()
        scaler.scale(F.cross_entropy(scaled(x), y)).backward()
        scaler.step(opt_scaled)
        scaler.update()
    for a, b in zip(plain.parameters(), scaled.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        if graft == "adam":  # the second moment of the unscaled gradient
            torch.testing.assert_close(opt.state[a]["graft_sq"], opt_scaled.state[b]["graft_sq"])


@pytest.mark.parametrize("name", ["singd-block", "kfac"])
def test_checkpoint_resume_equals_the_uninterrupted_run(name):
    """The second moments and their counts travel in the state dict (weights_only)."""
    data = batches()
    whole = model()
    opt = CONFIGS[name](whole, lr=LR, graft="adam")
    for x, y in data:
        opt.zero_grad()
        backward(whole, x, y)
        opt.step()
    resumed = model()
    first = CONFIGS[name](resumed, lr=LR, graft="adam")
    for x, y in data[:3]:
        first.zero_grad()
        backward(resumed, x, y)
        first.step()
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    buffer.seek(0)
    second = CONFIGS[name](resumed, lr=LR, graft="adam")
    second.load_state_dict(torch.load(buffer, weights_only=True))
    for x, y in data[3:]:
        second.zero_grad()
        backward(resumed, x, y)
        second.step()
    for a, b in zip(whole.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)
