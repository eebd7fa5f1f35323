"""Behaviours torch's own optimizer tests (test/test_optim.py) check for every
torch.optim optimizer, on SINGD, IKFAC, AdaFisher and K-FAC (issue #30, items 1-5):
loading a state_dict twice, a step without gradients, ``maximize=True``, the "goes right
direction" quadratic at the defaults, and torch's AMP recipe with ``unscale_``; and what
torch.optim's step wrapper gives every optimizer: step hooks and the profiler's range."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from singd_cuda import KFAC, SINGD, AdaFisher

from .validation_cases import (
    CASES,
    assert_same,
    batch,
    make_model,
    make_optimizer,
    parameters,
    state_tensors,
    train,
)

NAMES = list(CASES)


def group_steps(opt) -> list[int]:
    return [group["step"] for group in opt.param_groups]


# ------------------------------------------------------------ 1. load_state_dict twice
@pytest.mark.parametrize("name", NAMES)
def test_a_state_dict_loads_twice_into_the_same_optimizer(name):
    """torch's __setstate__ adds "differentiable" to ``defaults`` on the first load; a
    second load (rolling back to a checkpoint again) must not demand it."""
    model = make_model()
    opt = make_optimizer(name, model)
    train(model, opt, 2)
    checkpoint, weights = opt.state_dict(), parameters(model)
    opt.load_state_dict(checkpoint)
    train(model, opt, 1, first_seed=2)
    opt.load_state_dict(opt.state_dict())
    opt.load_state_dict(checkpoint)  # the rollback
    with torch.no_grad():
        for p, w in zip(model.parameters(), weights, strict=True):
            p.copy_(w)
    train(model, opt, 1, first_seed=2)

    fresh_model = make_model()
    fresh = make_optimizer(name, fresh_model)
    train(fresh_model, fresh, 3)
    assert_same(parameters(model), parameters(fresh_model))
    assert_same(state_tensors(opt), state_tensors(fresh))


# ------------------------------------------------------------ 2. no gradients, no step
@pytest.mark.parametrize("name", NAMES)
def test_a_step_without_gradients_changes_nothing(name):
    model = make_model()
    opt = make_optimizer(name, model, T=2)
    train(model, opt, 3)
    weights, state, steps = parameters(model), state_tensors(opt), group_steps(opt)
    opt.zero_grad()
    opt.step()
    assert_same(parameters(model), weights)
    assert_same(state_tensors(opt), state)
    assert group_steps(opt) == steps


@pytest.mark.parametrize("name", NAMES)
def test_an_empty_step_does_not_shift_the_schedule(name):
    """T=2: a counted empty step would move every later factor update by one step."""
    model, reference = make_model(), make_model()
    opt, ref = make_optimizer(name, model, T=2), make_optimizer(name, reference, T=2)
    train(model, opt, 3)
    opt.zero_grad()
    opt.step()
    train(model, opt, 5, first_seed=3)
    train(reference, ref, 8)
    assert_same(parameters(model), parameters(reference))
    assert_same(state_tensors(opt), state_tensors(ref))


@pytest.mark.parametrize("name", ["singd-dense", "adafisher", "kfac"])
def test_a_group_without_gradients_sits_the_step_out(name):
    """Per group, as torch.optim.AdamW counts a parameter's steps: a group none of whose
    parameters has a gradient keeps its ``step`` and its parameters; the others step."""
    model = make_model()
    first, last = list(model[0].parameters()) + list(model[1].parameters()), model[3]
    opt = make_optimizer(name, model, params=[{"params": first}, {"params": last.parameters()}])
    train(model, opt, 2)
    frozen = parameters(last)
    opt.zero_grad()
    x, y = batch(2)
    F.cross_entropy(model(x), y).backward()
    for p in last.parameters():
        p.grad = None
    opt.step()
    assert group_steps(opt) == [3, 2]
    assert_same(parameters(last), frozen)


# ------------------------------------------------------------ 3. maximize
def run(model, opt, seeds, sign: float = 1.0, negate: list | None = None, scaler=None):
    """Steps on sign·loss; the gradients of ``negate`` are negated by hand before each
    step. Checks that the optimizer leaves every ``.grad`` as it was."""
    for seed in seeds:
        opt.zero_grad()
        x, y = batch(seed)
        loss = sign * F.cross_entropy(model(x), y)
        (loss if scaler is None else scaler.scale(loss)).backward()
        for p in negate or []:
            p.grad.neg_()
        grads = [p.grad.clone() for p in model.parameters()]
        if scaler is None:
            opt.step()
        else:
            scaler.step(opt)
            scaler.update()
        assert_same([p.grad for p in model.parameters()], grads)


@pytest.mark.parametrize("name", NAMES)
def test_maximize_is_the_update_of_the_negated_loss(name):
    """Bitwise: −g is exact and the statistics (squares of output gradients) do not
    change with the loss's sign."""
    model, reference = make_model(), make_model()
    run(model, make_optimizer(name, model, maximize=True), range(4))
    run(reference, make_optimizer(name, reference), range(4), sign=-1.0)
    assert_same(parameters(model), parameters(reference))


@pytest.mark.parametrize("name", ["singd-dense", "kfac"])
def test_maximize_with_norm_fisher_and_weight_decay(name):
    """The LayerNorm's diagonal-Fisher step negates its gradient too; weight decay does
    not change sign (as torch.optim)."""
    extra = dict(norm_fisher=True, weight_decay=0.1)
    model, reference = make_model(), make_model()
    run(model, make_optimizer(name, model, maximize=True, **extra), range(4))
    run(reference, make_optimizer(name, reference, **extra), range(4), sign=-1.0)
    assert_same(parameters(model), parameters(reference))


@pytest.mark.parametrize("name", ["singd-dense", "singd-diagonal", "adafisher", "kfac"])
def test_maximize_under_a_grad_scaler(name):
    def scaler():
        return torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=10**6)

    model, reference = make_model(), make_model()
    run(model, make_optimizer(name, model, maximize=True), range(3), scaler=scaler())
    run(reference, make_optimizer(name, reference), range(3), sign=-1.0, scaler=scaler())
    assert_same(parameters(model), parameters(reference))


@pytest.mark.parametrize("name", ["singd-dense", "ikfac", "adafisher", "kfac"])
def test_maximize_is_per_parameter_group(name):
    """Group 0 (the first Linear and the LayerNorm's AdamW fallback) maximises, group 1
    minimises: the same as negating group 0's gradients by hand."""
    model, reference = make_model(), make_model()

    def groups(m, maximize):
        first = list(m[0].parameters()) + list(m[1].parameters())
        return [{"params": first, "maximize": maximize}, {"params": m[3].parameters()}]

    opt = make_optimizer(name, model, params=groups(model, True))
    run(model, opt, range(4))
    ref = make_optimizer(name, reference, params=groups(reference, False))
    negate = list(reference[0].parameters()) + list(reference[1].parameters())
    run(reference, ref, range(4), negate=negate)
    assert_same(parameters(model), parameters(reference))
    assert opt.param_groups[0]["maximize"] and not opt.param_groups[1]["maximize"]


def test_maximize_is_validated_and_old_checkpoints_minimise():
    with pytest.raises(ValueError, match="maximize must be True or False"):
        SINGD(make_model(), maximize="yes")
    model = make_model()
    opt = make_optimizer("singd-dense", model)
    train(model, opt, 1)
    checkpoint = opt.state_dict()
    for group in checkpoint["param_groups"]:
        del group["maximize"]  # saved before the option existed
    fresh = make_optimizer("singd-dense", make_model(), maximize=True)
    fresh.load_state_dict(checkpoint)
    assert fresh.param_groups[0]["maximize"] is False


# ------------------------------------------- 4. torch's "goes right direction" problem
def goes_right_direction(cls, seed: int, steps: int = 20) -> tuple[float, float]:
    """test_optim.py's test_forloop_goes_right_direction on an nn.Linear(5, 10): weight,
    bias and input drawn from randn, loss (W x + b)² summed, ``steps`` steps at the
    optimizer's defaults. (initial loss, final loss)."""
    torch.manual_seed(seed)
    model = nn.Linear(5, 10)
    with torch.no_grad():
        model.weight.copy_(torch.randn(10, 5))
        model.bias.copy_(torch.randn(10))
    x = torch.randn(5)
    opt = cls(model)

    def closure():
        opt.zero_grad()
        loss = model(x).pow(2).sum()
        loss.backward()
        return loss

    initial = closure().item()
    for _ in range(steps):
        closure()
        opt.step()
    with torch.no_grad():
        return initial, model(x).pow(2).sum().item()


@pytest.mark.parametrize("cls", [SINGD, KFAC, AdaFisher])
def test_the_defaults_go_the_right_direction(cls):
    """Every one of 10 seeds ends below its start (torch checks one)."""
    results = [goes_right_direction(cls, seed) for seed in range(10)]
    assert all(final < initial for initial, final in results), results


# ------------------------------------------------------------ 5. torch's AMP recipe
@pytest.mark.parametrize("name", NAMES)
def test_the_amp_recipe_with_unscale_works_as_written(name):
    """scaler.unscale_(opt); clip_grad_norm_; scaler.step(opt), the optimizer built
    without grad_scaler=: bitwise the run without a scaler (a power-of-two scale)."""
    model, reference = make_model(), make_model()
    opt, ref = make_optimizer(name, model), make_optimizer(name, reference)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=10**6)
    for seed in range(4):
        x, y = batch(seed)
        opt.zero_grad()
        scaler.scale(F.cross_entropy(model(x), y)).backward()
        scaler.unscale_(opt)
        nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        scaler.step(opt)
        scaler.update()
        ref.zero_grad()
        F.cross_entropy(reference(x), y).backward()
        nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
        ref.step()
    assert_same(parameters(model), parameters(reference))
    assert_same(state_tensors(opt), state_tensors(ref))


def test_unscaled_gradients_stepped_outside_the_scaler_name_the_fix():
    """Only GradScaler.step hands its scaler over: a hand-rolled step after unscale_
    cannot know the statistics' scale."""
    model = make_model()
    opt = make_optimizer("singd-dense", model)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    x, y = batch(0)
    scaler.scale(F.cross_entropy(model(x), y)).backward()
    scaler.unscale_(opt)
    opt.found_inf = torch.zeros(())
    with pytest.raises(ValueError, match="grad_scaler=scaler"):
        opt.step()


# ------------------------------------------------------------ step hooks, profiler range
@pytest.mark.parametrize("name", ["singd-diagonal", "adafisher", "kfac"])
@pytest.mark.parametrize("where", ["optimizer", "global"])
def test_step_hooks_run_around_the_step(name, where):
    """A step pre-hook sees the state before the step, a post-hook the state after, on
    the optimizer's own hooks and torch's global ones; a pre-hook's (args, kwargs) reach
    the step; once removed, they run no more."""
    model = make_model()
    opt = make_optimizer(name, model)
    seen = []

    def pre(optimizer, args, kwargs):
        seen.append(
            ("pre", optimizer is opt, list(group["step"] for group in optimizer.param_groups))
        )
        return args, {"closure": None}

    def post(optimizer, args, kwargs):
        seen.append(
            ("post", optimizer is opt, list(group["step"] for group in optimizer.param_groups))
        )

    if where == "optimizer":
        handles = [opt.register_step_pre_hook(pre), opt.register_step_post_hook(post)]
    else:
        handles = [register_optimizer_step_pre_hook(pre), register_optimizer_step_post_hook(post)]
    try:
        train(model, opt, 2)
    finally:
        for handle in handles:
            handle.remove()
    assert seen == [
        ("pre", True, [0]),
        ("post", True, [1]),
        ("pre", True, [1]),
        ("post", True, [2]),
    ]
    train(model, opt, 1, first_seed=2)
    assert len(seen) == 4


@pytest.mark.parametrize("name", ["singd-diagonal", "adafisher"])
def test_a_profiled_step_is_one_range_and_an_unprofiled_one_trains_alike(name):
    """Under torch.profiler a step is the range ``Optimizer.step#<class>.step``, as
    torch.optim's steps are; without a profiler or a hook the step skips torch's wrapper
    (its range costs host time and records nothing), and trains bitwise alike."""
    model, reference = make_model(), make_model()
    opt, ref = make_optimizer(name, model), make_optimizer(name, reference)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        train(model, opt, 2)
    train(reference, ref, 2)
    ranges = [event.key for event in prof.key_averages()]
    assert f"Optimizer.step#{type(opt).__name__}.step" in ranges
    assert_same(parameters(model), parameters(reference))
    assert_same(state_tensors(opt), state_tensors(ref))
