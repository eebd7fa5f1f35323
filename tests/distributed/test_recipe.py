"""The large-batch recipe of Osawa et al. (arXiv 1811.12019), single process:
diagonal Fisher for normalisation layers, weight rescaling, momentum tied to the
learning rate, and T / damping as callables of the step."""

from __future__ import annotations

import copy
import io
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from singd_cuda import KFAC, SINGD
from singd_cuda.distributed import Piecewise, Warmup

F64 = torch.float64
OPTIMIZERS = {"singd": SINGD, "kfac": KFAC}


# ------------------------------------------------------------------ models and data
def conv_model(norm: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    layer = {"batch": nn.BatchNorm2d(4), "group": nn.GroupNorm(2, 4)}[norm]
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1), layer, nn.Tanh(), nn.Flatten(), nn.Linear(64, 3)
    ).to(F64)


def sequence_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 6), nn.LayerNorm(6), nn.Tanh(), nn.Linear(6, 3)).to(F64)


def image_batch(size: int = 8, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(size, 2, 4, 4, generator=gen, dtype=F64)
    return x, torch.randint(0, 3, (size,), generator=gen)


def sequence_batch(seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 5, 5, generator=gen, dtype=F64)
    return x, torch.randint(0, 3, (4, 5), generator=gen)


def terms_of(model: nn.Module, kind: str, loss_average: str):
    """(per-term losses ℓ_k, L) with the optimised loss = (1/L) Σ ℓ_k."""
    if kind == "sequence":
        x, y = sequence_batch()
        ce = F.cross_entropy(model(x).transpose(1, 2), y, reduction="none")  # (B, T)
        if loss_average == "batch+sequence":
            return ce.reshape(-1), ce.numel()
        return ce.sum(1), ce.shape[0]
    x, y = image_batch()
    ce = F.cross_entropy(model(x), y, reduction="none")
    return ce, ce.shape[0]


NORM_CASES = [
    ("batch", "image", "batch"),
    ("batch-eval", "image", "batch"),  # the running statistics normalise
    ("batch-eval-untracked", "image", "batch"),  # no running statistics: the batch's
    ("group", "image", "batch"),
    ("layer", "sequence", "batch"),
    ("layer", "sequence", "batch+sequence"),
]


def build(norm: str):
    if norm == "layer":
        return sequence_model()
    if norm.startswith("batch-eval"):  # a BatchNorm in eval() mode
        model = conv_model("batch")
        if norm.endswith("untracked"):
            model[1] = nn.BatchNorm2d(4, track_running_stats=False).to(F64)
        with torch.no_grad():  # running statistics away from the batch's
            model(3.0 * image_batch(seed=5)[0] + 1.0)
        return model.eval()
    return conv_model(norm)


# ------------------------------------------------------------------ norm Fisher
@pytest.mark.parametrize(("norm", "kind", "loss_average"), NORM_CASES)
def test_norm_fisher_is_the_per_term_empirical_fisher_and_sets_the_update(norm, kind, loss_average):
    model = build(norm)
    norm_layer = model[1]
    before = [p.detach().clone() for p in (norm_layer.weight, norm_layer.bias)]
    lr, damping = 0.1, 1e-2
    twin = copy.deepcopy(model)  # before the optimizer hooks the model
    opt = SINGD(
        model,
        structures="dense",
        lr=lr,
        T=1,
        norm_fisher=True,
        norm_damping=damping,
        loss_average=loss_average,
    )
    # the per-term gradients, one autograd call per term, on the unhooked copy
    terms, L = terms_of(twin, kind, loss_average)
    params = [twin[1].weight, twin[1].bias]
    psi = [torch.autograd.grad(term, params, retain_graph=True) for term in terms]
    expected = [sum(p[i] ** 2 for p in psi) / L for i in range(2)]
    terms, L = terms_of(model, kind, loss_average)
    opt.zero_grad()
    (terms.sum() / L).backward()
    grads = [norm_layer.weight.grad.clone(), norm_layer.bias.grad.clone()]
    opt.step()
    for i, param in enumerate((norm_layer.weight, norm_layer.bias)):
        state = opt.state[param]
        assert "exp_avg" not in state  # not the AdamW fallback
        torch.testing.assert_close(state["fisher_diag"], expected[i], rtol=1e-10, atol=1e-14)
        step = grads[i] / (expected[i] + damping)  # first step: momentum buffer = Δ
        torch.testing.assert_close(param.detach(), before[i] - lr * step, rtol=1e-10, atol=1e-12)


def test_without_norm_fisher_norm_parameters_use_the_fallback():
    model = conv_model("batch")
    opt = SINGD(model, structures="dense", lr=0.1, T=1)
    x, y = image_batch()
    F.cross_entropy(model(x), y).backward()
    opt.step()
    assert "exp_avg" in opt.state[model[1].weight]


def teacher(seed: int = 3, size: int = 256):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(size, 2, 4, 4, generator=gen, dtype=F64)
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Flatten(), nn.Linear(32, 3)).to(F64)
    with torch.no_grad():
        y = net(x * 2).argmax(1)
    return x, y


def train_loss(model, opt, steps: int = 40, batch: int = 32, scheduler=None) -> tuple[float, float]:
    x, y = teacher()
    losses = []
    for t in range(steps):
        idx = torch.arange(t * batch, (t + 1) * batch) % x.shape[0]
        opt.zero_grad()
        loss = F.cross_entropy(model(x[idx]), y[idx])
        loss.backward()
        opt.step()
        if scheduler is not None:
            scheduler.step()
        losses.append(loss.item())
    return sum(losses[:5]) / 5, sum(losses[-5:]) / 5


@pytest.mark.parametrize("name", ["singd", "kfac"])
def test_norm_fisher_trains(name):
    model = conv_model("batch")
    opt = OPTIMIZERS[name](model, lr=0.05, T=2, damping=1e-2, norm_fisher=True, norm_damping=1e-2)
    first, last = train_loss(model, opt)
    assert last < 0.6 * first


# ------------------------------------------------------------------ weight rescaling
@pytest.mark.parametrize("name", ["singd", "kfac"])
def test_weight_rescale_sets_each_weight_norm_after_the_update(name):
    plain, rescaled = conv_model("group"), conv_model("group")
    opts = [
        OPTIMIZERS[name](m, lr=0.05, T=1, weight_rescale=flag)
        for m, flag in ((plain, False), (rescaled, True))
    ]
    x, y = image_batch()
    for model, opt in zip((plain, rescaled), opts, strict=True):
        F.cross_entropy(model(x), y).backward()
        opt.step()
    for index in (0, 4):  # the conv and the linear layer
        w_plain, w = plain[index].weight.detach(), rescaled[index].weight.detach()
        target = math.sqrt(2 * w.shape[0])
        torch.testing.assert_close(w, w_plain * target / w_plain.norm(), rtol=1e-12, atol=0)
        torch.testing.assert_close(w.norm(), torch.tensor(target, dtype=F64))
        torch.testing.assert_close(rescaled[index].bias, plain[index].bias, rtol=0, atol=0)


def test_weight_rescale_trains():
    model = conv_model("group")
    opt = SINGD(model, structures="dense", lr=0.05, T=2, damping=1e-2, weight_rescale=True)
    first, last = train_loss(model, opt)
    assert last < 0.6 * first
    for index in (0, 4):
        weight = model[index].weight
        assert abs(weight.norm().item() - math.sqrt(2 * weight.shape[0])) < 1e-9


# ------------------------------------------------------------------ momentum / lr ratio
def halving(step: int) -> float:
    return 1.0 if step < 3 else 0.5


@pytest.mark.parametrize("name", ["singd", "kfac"])
def test_momentum_follows_the_scheduled_learning_rate(name):
    ratio, lr = 8.0, 0.1
    models = [conv_model("group"), conv_model("group")]
    tied = OPTIMIZERS[name](models[0], lr=lr, T=2, momentum_lr_ratio=ratio)
    manual = OPTIMIZERS[name](models[1], lr=lr, T=2)
    schedulers = [torch.optim.lr_scheduler.LambdaLR(o, halving) for o in (tied, manual)]
    x, y = image_batch()
    seen = []
    for _ in range(6):
        for model, opt in zip(models, (tied, manual), strict=True):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
        manual.param_groups[0]["momentum"] = ratio * manual.param_groups[0]["lr"]
        tied.step()
        manual.step()
        seen.append(tied.param_groups[0]["momentum"])
        for scheduler in schedulers:
            scheduler.step()
    assert seen == pytest.approx([0.8, 0.8, 0.8, 0.4, 0.4, 0.4])
    for p, q in zip(models[0].parameters(), models[1].parameters(), strict=True):
        assert torch.equal(p, q)


def test_momentum_lr_ratio_trains_and_is_validated():
    model = conv_model("batch")
    opt = SINGD(model, structures="dense", lr=0.05, T=2, damping=1e-2, momentum_lr_ratio=18.0)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=20, gamma=0.5)
    first, last = train_loss(model, opt, scheduler=scheduler)
    assert last < 0.6 * first
    assert opt.param_groups[0]["momentum"] == pytest.approx(18.0 * 0.025)
    with pytest.raises(ValueError, match="momentum_lr_ratio"):
        SINGD(model, momentum_lr_ratio=-1.0)
    with pytest.raises(ValueError, match="not in"):
        opt = SINGD(model, structures="dense", lr=0.5, momentum_lr_ratio=2.0)
        x, y = image_batch()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    with pytest.raises(ValueError, match="norm_damping"):
        SINGD(model, norm_damping=-1.0)


# ------------------------------------------------------------------ schedules
def test_schedule_values():
    refresh = Piecewise([1, 10], [500])
    assert [refresh(s) for s in (0, 499, 500, 10_000)] == [1, 1, 10, 10]
    warmup = Warmup(start=1e-1, target=1e-3, steps=10)
    assert warmup(0) == pytest.approx(1e-1)
    assert warmup(5) == pytest.approx(1e-2)  # geometric
    assert warmup(10) == warmup(99) == 1e-3
    with pytest.raises(ValueError):
        Piecewise([1, 2], [3, 4])
    with pytest.raises(ValueError):
        Warmup(start=0.0, target=1.0, steps=3)


def test_a_state_dict_with_schedules_loads_with_weights_only():
    model = conv_model("group")
    opt = SINGD(
        model, structures="dense", T=Piecewise([1, 10], [500]), damping=Warmup(1e-1, 1e-3, 100)
    )
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    assert loaded["param_groups"][0]["T"] == Piecewise([1, 10], [500])
    assert loaded["param_groups"][0]["damping"](100) == 1e-3


def test_refresh_every_step_for_500_steps_then_every_10():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 2))
    opt = SINGD(model, lr=1e-3, structures="diagonal", T=Piecewise([1, 10], [500]))
    rule = opt.rule_for(opt.param_groups[0])
    updates = []
    original = rule.update_factors

    def recording(layer, group, state, pending, step):
        updates.append(step)
        original(layer, group, state, pending, step)

    rule.update_factors = recording
    x = torch.randn(4, 3)
    for _ in range(521):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    assert updates == [*range(500), 500, 510, 520]


@pytest.mark.parametrize("name", ["singd", "kfac"])
def test_callable_T_and_damping_equal_setting_them_by_hand(name):
    """Damping warm-up and a refresh schedule read at each step, as if set by hand."""
    period, damping = Piecewise([1, 3], [4]), Warmup(start=1.0, target=1e-3, steps=8)
    models = [conv_model("group"), conv_model("group")]
    scheduled = OPTIMIZERS[name](models[0], lr=0.05, T=period, damping=damping)
    by_hand = OPTIMIZERS[name](models[1], lr=0.05, T=1, damping=1.0)
    x, y = image_batch()
    for step in range(12):
        by_hand.param_groups[0]["T"] = period(step)
        by_hand.param_groups[0]["damping"] = damping(step)
        for model, opt in zip(models, (scheduled, by_hand), strict=True):
            opt.zero_grad()
            F.cross_entropy(model(x * (1 + step / 10)), y).backward()
            opt.step()
    for p, q in zip(models[0].parameters(), models[1].parameters(), strict=True):
        assert torch.equal(p, q)
    different = conv_model("group")
    fixed = OPTIMIZERS[name](different, lr=0.05, T=1, damping=1e-3)
    for step in range(12):
        fixed.zero_grad()
        F.cross_entropy(different(x * (1 + step / 10)), y).backward()
        fixed.step()
    assert not torch.equal(different[0].weight, models[0][0].weight)  # the schedule mattered
