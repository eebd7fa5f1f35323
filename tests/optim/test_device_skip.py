"""``nonfinite='device'``: a skip decided on the device, without reading it back.

Contract: a steady-state step with a non-finite gradient (or the GradScaler's found_inf)
changes no tensor of the model or the optimizer (parameters, momenta, factors, moments:
bitwise), its statistics are dropped, and the host counters (the step count, a layer's
update count, the fallback's step tensors) count it as a step. The warning comes at the
next step (none for the GradScaler's routine skip). Steps that create state (a layer's first
statistics) read their verdict and skip exactly as ``nonfinite='warn'``. A run without a
skip is bitwise the run of ``nonfinite='warn'``."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from singd_cuda import KFAC

from .conftest import (
    MODELS,
    assert_bitwise_equal,
    assert_states_equal,
    flat_state,
    loss_fn,
    make_optimizer,
    random_batches,
    snapshot,
)

NAMES = ["singd-dense", "singd-block_diagonal", "singd-tril_toeplitz", "ikfac", "adafisher", "kfac"]
COUNTERS = ("/step", "/factor_updates", "/inverted_at")  # host counters: a skip counts


def _optimizer(name, model, **extra):
    if name == "kfac":
        return KFAC(model, lr=0.01, T=1, T_inv=2, **extra)
    return make_optimizer(name, model, **extra)


def _train(model, opt, batches, scaler=None, bad=None):
    for index, (x, y) in enumerate(batches):
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        (loss if scaler is None else scaler.scale(loss)).backward()
        if index == bad:
            next(model.parameters()).grad.view(-1)[0] = float("inf")
        if scaler is None:
            opt.step()
        else:
            scaler.step(opt)
            scaler.update()


def _tensors_unchanged(model, opt, before) -> None:
    params, state = before
    for p, q in zip(model.parameters(), params, strict=True):
        assert_bitwise_equal(p.detach(), q)
    old, new = flat_state(state), flat_state(opt.state_dict())
    assert old.keys() == new.keys()
    for key, value in old.items():
        if key.endswith(COUNTERS) or "param_groups" in key:
            continue
        if isinstance(value, torch.Tensor):
            assert_bitwise_equal(value, new[key], key)
        else:
            assert value == new[key], key


@pytest.mark.parametrize("kind", ["mlp", "cnn"])
@pytest.mark.parametrize("name", NAMES)
def test_without_a_skip_equals_warn_mode(name, kind):
    model = MODELS[kind]()
    reference = copy.deepcopy(model)
    batches = random_batches(kind, 5)
    opt = _optimizer(name, model, nonfinite="device")
    ref_opt = _optimizer(name, reference)
    _train(model, opt, batches)
    _train(reference, ref_opt, batches)
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert_bitwise_equal(p.detach(), q.detach())
    assert_states_equal(opt.state_dict(), copy.deepcopy(ref_opt.state_dict()))


@pytest.mark.parametrize("scaled", [False, True], ids=["plain", "grad_scaler"])
@pytest.mark.parametrize("name", NAMES)
def test_skip_changes_no_tensor_and_warns_late(name, scaled):
    model = MODELS["mlp"]()
    opt = _optimizer(name, model, nonfinite="device")
    scaler = None
    if scaled:
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=10**6)
    batches = random_batches("mlp", 6)
    _train(model, opt, batches[:3], scaler)  # states exist: the next steps are steady
    before = snapshot(model, opt)
    step = opt.param_groups[0]["step"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing at the skipped step itself
        _train(model, opt, batches[3:4], scaler, bad=0)
    _tensors_unchanged(model, opt, before)
    assert opt.param_groups[0]["step"] == step + 1  # the host counter counts it
    if scaled:
        assert scaler.get_scale() == 2.0**9
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the scaler's skip is routine
            _train(model, opt, batches[4:5], scaler)
    else:
        with pytest.warns(RuntimeWarning, match="non-finite gradient.*an earlier step"):
            _train(model, opt, batches[4:5], scaler)
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("name", NAMES)
def test_a_step_creating_state_skips_exactly(name):
    """The first statistics create the layer states: that step reads its verdict and
    drops them, as nonfinite='warn' does (its warning is immediate)."""
    model = MODELS["mlp"]()
    opt = _optimizer(name, model, nonfinite="device")
    before = snapshot(model, opt)
    with pytest.warns(RuntimeWarning, match="non-finite gradient"):
        _train(model, opt, random_batches("mlp", 1), bad=0)
    for p, q in zip(model.parameters(), before[0], strict=True):
        assert_bitwise_equal(p.detach(), q)
    assert_states_equal(opt.state_dict(), before[1])


def test_a_non_finite_input_is_reported_late():
    """An inf in the batch makes the statistics and the gradients non-finite: skipped on
    the device, no tensor changed, reported at the next step."""
    model = MODELS["mlp"]()
    opt = make_optimizer("singd-dense", model, nonfinite="device")
    batches = random_batches("mlp", 5)
    _train(model, opt, batches[:3])
    x, y = batches[3]
    x = x.clone()
    x[0, 0] = float("inf")
    before = snapshot(model, opt)
    opt.zero_grad()
    loss_fn(model(x), y).backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step()
    _tensors_unchanged(model, opt, before)
    with pytest.warns(RuntimeWarning, match="non-finite .*an earlier step"):
        _train(model, opt, batches[4:5])


@pytest.mark.parametrize("name", ["singd-dense", "adafisher", "kfac"])
def test_fallback_moments_are_kept_on_a_skip(name):
    """A LayerNorm trains with the AdamW fallback: its moments are selected on the device
    (torch.where), so a skipped step leaves them bitwise unchanged too."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(12, 16), torch.nn.LayerNorm(16), torch.nn.Tanh(), torch.nn.Linear(16, 5)
    )
    opt = _optimizer(name, model, nonfinite="device")
    batches = random_batches("mlp", 5)
    _train(model, opt, batches[:3])
    before = snapshot(model, opt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the late warning of this skip comes next step
        _train(model, opt, batches[3:4], bad=0)
    _tensors_unchanged(model, opt, before)
    assert any("exp_avg_sq" in key for key in flat_state(before[1]))  # the fallback's
