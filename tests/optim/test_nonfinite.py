"""A step with a non-finite gradient changes nothing: parameters, factors,
momenta, step counters (the full state_dict, bitwise), and its statistics are
dropped. Without a GradScaler it warns (or raises with nonfinite='raise')."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from .conftest import (
    MODELS,
    assert_bitwise_equal,
    assert_states_equal,
    clone_model,
    loss_fn,
    make_optimizer,
    random_batches,
    snapshot,
)

NAMES = ["singd-dense", "singd-tril_toeplitz", "ikfac", "adafisher"]
# step 0: the statistics of the bad step create the state; step 2: an update step with
# existing state (T=1 and T=2 capture statistics on both)
BAD_STEPS = [0, 2]


def warm_up(model, opt, batches, bad_step):
    for x, y in batches[:bad_step]:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()


def inject_inf(model):
    next(model.parameters()).grad[0].view(-1)[0] = float("inf")


def assert_unchanged(model, opt, before):
    params, state = before
    for p, q in zip(model.parameters(), params, strict=True):
        assert_bitwise_equal(p.detach(), q)
    assert_states_equal(opt.state_dict(), state)


@pytest.mark.parametrize("bad_step", BAD_STEPS)
@pytest.mark.parametrize("name", NAMES)
def test_inf_without_scaler_warns_and_changes_nothing(name, bad_step):
    model = MODELS["mlp"]()
    opt = make_optimizer(name, model)
    batches = random_batches("mlp", 6)
    warm_up(model, opt, batches, bad_step)
    before = snapshot(model, opt)
    x, y = batches[bad_step]
    opt.zero_grad()
    loss_fn(model(x), y).backward()
    inject_inf(model)
    with pytest.warns(RuntimeWarning, match="non-finite gradient"):
        opt.step()
    assert_unchanged(model, opt, before)


@pytest.mark.parametrize("bad_step", BAD_STEPS)
@pytest.mark.parametrize("name", NAMES)
def test_inf_with_raise_raises_and_changes_nothing(name, bad_step):
    model = MODELS["mlp"]()
    opt = make_optimizer(name, model, nonfinite="raise")
    batches = random_batches("mlp", 6)
    warm_up(model, opt, batches, bad_step)
    before = snapshot(model, opt)
    x, y = batches[bad_step]
    opt.zero_grad()
    loss_fn(model(x), y).backward()
    inject_inf(model)
    with pytest.raises(FloatingPointError, match="non-finite"):
        opt.step()
    assert_unchanged(model, opt, before)


@pytest.mark.parametrize("unscale", [False, True], ids=["step", "unscale+clip"])
@pytest.mark.parametrize("bad_step", BAD_STEPS)
@pytest.mark.parametrize("name", NAMES)
def test_inf_with_scaler_changes_nothing(name, bad_step, unscale):
    model = MODELS["cnn"]()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=10**6)
    opt = make_optimizer(name, model, grad_scaler=scaler)
    batches = random_batches("cnn", 6)
    warm_up(model, opt, batches, bad_step)
    before = snapshot(model, opt)
    x, y = batches[bad_step]
    opt.zero_grad()
    scaler.scale(loss_fn(model(x), y)).backward()
    inject_inf(model)
    if unscale:
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the scaler's skip is routine: no warning
        scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 2.0**9  # the scaler saw the inf and backed off
    assert_unchanged(model, opt, before)


@pytest.mark.parametrize("bad_step", BAD_STEPS)
@pytest.mark.parametrize("name", NAMES)
def test_skipped_step_drops_its_statistics(name, bad_step):
    """Skipping batch b then training on the rest equals never seeing batch b."""
    model = MODELS["mlp"](dtype=torch.float64)
    reference = clone_model(model)
    batches = random_batches("mlp", 6, dtype=torch.float64)
    opt, ref_opt = make_optimizer(name, model), make_optimizer(name, reference)
    for index, (x, y) in enumerate(batches):
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        if index == bad_step:
            inject_inf(model)
            with pytest.warns(RuntimeWarning):
                opt.step()
            continue
        opt.step()
        ref_opt.zero_grad()
        loss_fn(reference(x), y).backward()
        ref_opt.step()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert_bitwise_equal(p.detach(), q.detach())
    assert_states_equal(opt.state_dict(), copy.deepcopy(ref_opt.state_dict()))


@pytest.mark.parametrize("bad_step", BAD_STEPS)
@pytest.mark.parametrize("name", NAMES)
def test_scaler_skip_then_continue_equals_never_seeing_the_batch(name, bad_step):
    """With a GradScaler: the skip halves the scale, later statistics are unscaled by the
    new scale (exactly: powers of two), and the skipped batch leaves no trace."""
    model = MODELS["mlp"]()
    reference = clone_model(model)
    batches = random_batches("mlp", 6)
    opt, ref_opt = make_optimizer(name, model), make_optimizer(name, reference)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=10**6)
    for index, (x, y) in enumerate(batches):
        opt.zero_grad()
        scaler.scale(loss_fn(model(x), y)).backward()
        if index == bad_step:
            inject_inf(model)
        scaler.step(opt)
        scaler.update()
        if index == bad_step:
            continue
        ref_opt.zero_grad()
        loss_fn(reference(x), y).backward()
        ref_opt.step()
    assert scaler.get_scale() == 2.0**9
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert_bitwise_equal(p.detach(), q.detach())
    assert_states_equal(opt.state_dict(), copy.deepcopy(ref_opt.state_dict()))
