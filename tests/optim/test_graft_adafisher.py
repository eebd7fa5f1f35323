"""AdaFisher with ``graft="adam" | "rms"`` against a dense reference written here.

The reference recomputes everything from the layers' inputs and output gradients (read
by hooks of this file): the EMAs h and s of the mean squared inputs and output
gradients, their min–max normalisation, F̃ = s′ ⊗ h′ + λ, then either AdaFisher's own
step (graft=None: the first moment of G, bounded by lr per entry; this checks the
reference against the fused op) or the grafted one: Ĝ = G / F̃, each parameter's part
rescaled to the graft's norm, m ← βm + (1 − β)(graft(Ĝ) + γW), W ← W − lr·m / (1 − βᵗ).
"""

from __future__ import annotations

import io
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from singd_cuda import SINGD, AdaFisher

STEPS, BATCH = 6, 10
LR, BETA, DAMPING, EMA = 0.05, 0.9, 1e-2, 0.8
BETA2, EPS = 0.99, 1e-6  # the fallback's, which the "adam" graft uses


def model(dtype=torch.float64) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 7, bias=False), nn.ReLU(), nn.Linear(7, 3)
    ).to(dtype)


def batches(dtype=torch.float64, steps=STEPS):
    gen = torch.Generator().manual_seed(1)
    return [
        (
            torch.randn(BATCH, 6, generator=gen, dtype=dtype),
            torch.randint(0, 3, (BATCH,), generator=gen),
        )
        for _ in range(steps)
    ]


class Recorder:
    """The inputs (with a ones column for a bias) and output gradients of every Linear."""

    def __init__(self, net: nn.Module) -> None:
        self.a: dict[nn.Linear, torch.Tensor] = {}
        self.g: dict[nn.Linear, torch.Tensor] = {}
        for module in net:
            if isinstance(module, nn.Linear):
                module.register_forward_hook(self._hook)

    def _hook(self, module, inputs, output) -> None:
        x = inputs[0].detach()
        if module.bias is not None:
            x = torch.cat([x, torch.ones_like(x[:, :1])], dim=1)
        self.a[module] = x

        def keep(grad):
            self.g[module] = grad.detach()

        output.register_hook(keep)


def normalised(v: torch.Tensor) -> torch.Tensor:
    span = v.max() - v.min()
    return torch.ones_like(v) if span == 0 else (v - v.min()) / span


class Reference:
    """Dense AdaFisher (+ graft) of the Linear layers of ``net``, plain tensor math."""

    def __init__(self, net, graft, weight_decay, decoupled, factor_dtype=torch.float64):
        self.factor_dtype = factor_dtype  # h and s are stored rounded to it
        self.layers = [m for m in net if isinstance(m, nn.Linear)]
        self.graft, self.wd, self.decoupled = graft, weight_decay, decoupled
        self.h = {m: torch.zeros(m.in_features + (m.bias is not None)) for m in self.layers}
        self.s = {m: torch.zeros(m.out_features) for m in self.layers}
        self.m = {p: torch.zeros_like(p) for m in self.layers for p in m.parameters()}
        self.v = {p: torch.zeros_like(p) for p in self.m}
        self.t = 0

    def step(self, recorder: Recorder) -> dict:
        """The new value of every parameter (the parameters are not written)."""
        self.t += 1
        new = {}
        for layer in self.layers:
            a, g = recorder.a[layer], recorder.g[layer] * BATCH  # per-sample loss gradients
            for ema, stat in ((self.h, a.square().mean(0)), (self.s, g.square().mean(0))):
                value = EMA * ema[layer] + (1 - EMA) * stat
                ema[layer] = value.to(self.factor_dtype).to(value.dtype)
            Ft = torch.outer(normalised(self.s[layer]), normalised(self.h[layer])) + DAMPING
            params = list(layer.parameters())
            columns = [Ft[:, : layer.in_features]] + ([Ft[:, -1]] if len(params) > 1 else [])
            for p, Fp in zip(params, columns, strict=True):
                new[p] = self._update(p, Fp)
        return new

    def _update(self, p, Fp):
        w, grad, t = p.detach(), p.grad, self.t
        decay = 0 if self.decoupled else self.wd * w
        if self.graft is None:  # AdaFisher's own step
            self.m[p] = BETA * self.m[p] + (1 - BETA) * (grad + decay)
            step = (LR / (1 - BETA**t) * self.m[p] / Fp).clamp(-LR, LR)
        else:
            natural = grad / Fp
            if self.graft == "adam":
                self.v[p] = BETA2 * self.v[p] + (1 - BETA2) * grad**2
                target = (grad / ((self.v[p] / (1 - BETA2**t)).sqrt() + EPS)).norm()
            else:
                target = 0.2 * math.sqrt(grad.numel())
            grafted = natural * (target / natural.norm())
            self.m[p] = BETA * self.m[p] + (1 - BETA) * (grafted + decay)
            step = LR / (1 - BETA**t) * self.m[p]
        return w * (1 - LR * self.wd if self.decoupled else 1) - step


CASES = [
    (None, 0.0, False),
    ("adam", 0.0, False),
    ("rms", 0.0, False),
    ("adam", 1e-2, False),
    ("rms", 1e-2, True),
    ("adam", 1e-2, True),
]


def run_case(graft, weight_decay, decoupled, build=AdaFisher, factor_dtype=None):
    net = model()
    recorder = Recorder(net)
    opt = build(
        net,
        lr=LR,
        momentum=BETA,
        damping=DAMPING,
        ema_decay=EMA,
        T=1,
        weight_decay=weight_decay,
        decoupled_weight_decay=decoupled,
        graft=graft,
        fallback_betas=(0.9, BETA2),
        fallback_eps=EPS,
        factor_dtype=factor_dtype,
    )
    reference = Reference(net, graft, weight_decay, decoupled, factor_dtype or torch.float64)
    worst = 0.0
    for x, y in batches():
        opt.zero_grad()
        F.cross_entropy(net(x), y).backward()
        expected = reference.step(recorder)
        opt.step()
        for p, value in expected.items():
            worst = max(worst, (p.detach() - value).abs().max().item())
            torch.testing.assert_close(p.detach(), value, rtol=1e-10, atol=1e-12)
    return net, opt, reference, worst


@pytest.mark.parametrize(("graft", "weight_decay", "decoupled"), CASES)
def test_adafisher_graft_equals_the_dense_reference_in_float64(graft, weight_decay, decoupled):
    net, opt, reference, _ = run_case(graft, weight_decay, decoupled)
    if graft == "adam":
        for p in net.parameters():
            torch.testing.assert_close(opt.state[p]["graft_sq"], reference.v[p], rtol=1e-12, atol=0)
            assert opt.state[p]["graft_step"] == STEPS


def test_singd_adafisher_structure_grafts_alike():
    """``SINGD(structures="adafisher")`` is the same rule: the same reference."""

    def build(net, **kwargs):
        return SINGD(net, structures="adafisher", **kwargs)

    run_case("adam", 1e-2, False, build=build)


@pytest.mark.parametrize("graft", ["adam", "rms"])
def test_rms_of_the_first_grafted_step(graft):
    """Step 1 (m = (1 − β)·d, bias correction 1/(1 − β)): each parameter moves by
    lr·‖d‖; with "rms" that is RMS 0.2·lr per entry, past the per-entry bound lr of the
    ungrafted step where an entry needs it."""
    net = model()
    opt = AdaFisher(net, lr=LR, graft=graft)
    before = [p.detach().clone() for p in net.parameters()]
    x, y = batches()[0]
    F.cross_entropy(net(x), y).backward()
    opt.step()
    for p, w in zip(net.parameters(), before, strict=True):
        rms = (w - p.detach()).square().mean().sqrt() / LR
        if graft == "rms":
            torch.testing.assert_close(rms, torch.tensor(0.2, dtype=rms.dtype), rtol=1e-12, atol=0)
        assert torch.isfinite(rms) and rms > 0


@pytest.mark.parametrize("graft", ["adam", "rms"])
def test_adafisher_graft_with_bfloat16_factors(graft):
    """bf16 factors (h, s stored in bfloat16; float64 weights and arithmetic): equal to
    the reference that rounds its EMAs to bfloat16 likewise, within 1e-10 relative."""
    _, opt, _, _ = run_case(graft, 1e-2, False, factor_dtype=torch.bfloat16)
    for layer in opt.layers:
        assert opt.state[layer.weight]["h"].dtype == torch.bfloat16


@pytest.mark.parametrize("graft", ["adam", "rms"])
def test_adafisher_graft_with_bfloat16_weights(graft):
    """bf16 weights (factors and moments in bf16, arithmetic in float32): finite, and
    the first step (m̂ = the grafted direction) moves each parameter by RMS 0.2·lr with
    "rms", to bf16's rounding of the weights."""
    net = model(torch.bfloat16)
    opt = AdaFisher(net, lr=LR, graft=graft)
    for step, (x, y) in enumerate(batches(torch.bfloat16)[:4]):
        before = [p.detach().float() for p in net.parameters()]
        opt.zero_grad()
        F.cross_entropy(net(x), y).backward()
        opt.step()
        for p, w in zip(net.parameters(), before, strict=True):
            assert torch.isfinite(p).all()
            if graft == "rms" and step == 0:
                rms = (w - p.detach().float()).square().mean().sqrt() / LR
                assert abs(rms.item() - 0.2) < 0.05
    if graft == "adam":
        assert all(opt.state[p]["graft_sq"].dtype == torch.bfloat16 for p in net.parameters())


@pytest.mark.parametrize("graft", ["adam", "rms"])
def test_a_step_skipped_on_the_device_leaves_every_state(graft):
    """nonfinite="device": an inf gradient skips the grafted step on the device;
    parameters, first moments and second moments keep their values."""
    net = model()
    opt = AdaFisher(net, lr=LR, graft=graft, nonfinite="device")
    data = batches()
    for x, y in data[:3]:
        opt.zero_grad()
        F.cross_entropy(net(x), y).backward()
        opt.step()
    params = list(net.parameters())
    keys = ("exp_avg", "graft_sq") if graft == "adam" else ("exp_avg",)
    kept = [p.detach().clone() for p in params]
    kept += [opt.state[p][k].clone() for p in params for k in keys]
    opt.zero_grad()
    F.cross_entropy(net(data[3][0]), data[3][1]).backward()
    net[0].weight.grad[0, 0] = float("inf")
    opt.step()
    now = [p.detach() for p in params] + [opt.state[p][k] for p in params for k in keys]
    for a, b in zip(now, kept, strict=True):
        assert torch.equal(a, b)
    opt.zero_grad()
    F.cross_entropy(net(data[4][0]), data[4][1]).backward()
    with pytest.warns(RuntimeWarning, match="skipped on the device"):
        opt.step()
    assert all(torch.isfinite(p).all() for p in params)


def test_the_grafted_step_is_not_the_fused_one():
    """Grafting changes the step (a test of the graft path must be able to fail)."""
    plain, grafted = model(), model()
    opts = [AdaFisher(plain, lr=LR), AdaFisher(grafted, lr=LR, graft="adam")]
    for x, y in batches()[:2]:
        for net, opt in zip((plain, grafted), opts, strict=True):
            opt.zero_grad()
            F.cross_entropy(net(x), y).backward()
            opt.step()
    pairs = zip(plain.parameters(), grafted.parameters(), strict=True)
    assert max((a - b).abs().max() for a, b in pairs) > 1e-4


def test_checkpoint_resume_equals_the_uninterrupted_run():
    """The grafted AdaFisher's moments and counts travel in the state dict."""
    data = batches()
    whole, resumed = model(), model()
    opt = AdaFisher(whole, lr=LR, graft="adam")
    first = AdaFisher(resumed, lr=LR, graft="adam")
    for i, (x, y) in enumerate(data):
        for net, o in ((whole, opt), (resumed, first)) if i < 3 else ((whole, opt),):
            o.zero_grad()
            F.cross_entropy(net(x), y).backward()
            o.step()
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    buffer.seek(0)
    second = AdaFisher(resumed, lr=LR, graft="adam")
    second.load_state_dict(torch.load(buffer, weights_only=True))
    for x, y in data[3:]:
        second.zero_grad()
        F.cross_entropy(resumed(x), y).backward()
        second.step()
    for a, b in zip(whole.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)
