"""Every hyperparameter in param_groups is validated where it is read, edits made
mid-training included: an out-of-range value raises a ValueError naming the key before
the step changes anything; a changed factor_dtype casts the factors; a changed structures
after the factors exist is an error; K-FAC's T_inv counts steps since the last inversion."""

from __future__ import annotations

import pytest
import torch

from singd_cuda import KFAC, SINGD
from singd_cuda.optim import hyperparameters

from .validation_cases import (
    CASES,
    assert_same,
    backward,
    make_model,
    make_optimizer,
    parameters,
    state_tensors,
    train,
)

COMMON_EDITS = [
    ("T", 0, "T must be an integer >= 1"),
    ("T", 2.5, "T must be an integer >= 1"),
    ("T", "3", "T must be an integer >= 1"),
    ("lr", -1.0, "lr must be a number >= 0"),
    ("lr", float("nan"), "lr must be a number >= 0"),
    ("damping", -1e-3, "damping must be a number"),
    ("momentum", 1.0, r"momentum must be in \[0, 1\)"),
    ("weight_decay", -0.1, "weight_decay must be a number >= 0"),
    ("loss_average", "mean", "loss_average must be one of"),
    ("factor_dtype", torch.int32, "factor_dtype must be None or one of"),
    ("stochastic_rounding", "yes", "stochastic_rounding must be True or False"),
    ("fallback_betas", (0.9, 1.0), r"fallback_betas must be a pair of numbers in \[0, 1\)"),
]
SINGD_EDITS = [
    ("lr_cov", -0.1, "lr_cov must be a number >= 0"),
    ("alpha1", 1.0, r"alpha1 must be in \[0, 1\)"),
    ("structures", "bogus", "unknown structure 'bogus'"),
]
EDITS = [
    pytest.param(name, key, value, match, id=f"{name}-{key}={value!r}")
    for name, (cls, _) in CASES.items()
    for key, value, match in COMMON_EDITS
    + (SINGD_EDITS if cls is SINGD else [])
    + ([("T_inv", 0, "T_inv must be None or an integer >= 1")] if cls is KFAC else [])
    + ([("damping", 0.0, "damping must be a number > 0")] if name == "adafisher" else [])
]


@pytest.mark.parametrize(("name", "key", "value", "match"), EDITS)
def test_an_invalid_edit_between_backward_and_step_raises_and_changes_nothing(
    name, key, value, match
):
    model = make_model()
    opt = make_optimizer(name, model)
    train(model, opt, 2)
    backward(model, opt, seed=2)
    params, state = parameters(model), state_tensors(opt)
    opt.param_groups[0][key] = value
    with pytest.raises(ValueError, match=rf"param_groups\[0\]: {match}"):
        opt.step()
    assert_same(parameters(model), params)
    assert_same(state_tensors(opt), state)


@pytest.mark.parametrize("name", ["singd-dense", "adafisher", "kfac"])
def test_an_edit_set_back_trains_on(name):
    model = make_model()
    opt = make_optimizer(name, model)
    train(model, opt, 1)
    backward(model, opt, seed=1)
    opt.param_groups[0]["lr"] = -1.0
    with pytest.raises(ValueError, match="lr must be"):
        opt.step()
    opt.param_groups[0]["lr"] = 0.01
    opt.step()
    assert opt.param_groups[0]["step"] == 2


@pytest.mark.parametrize(
    ("name", "key", "bad", "match"),
    [
        ("singd-dense", "damping", -1.0, "damping must be a number >= 0"),
        ("singd-diagonal", "lr_cov", -1.0, "lr_cov must be a number >= 0"),
        ("adafisher", "damping", 0.0, "damping must be a number > 0"),
        ("kfac", "damping", float("inf"), "damping must be a number >= 0"),
        ("singd-block_diagonal", "T", 1.5, "T must be an integer >= 1"),
    ],
)
def test_a_callable_is_checked_at_the_step_it_returns_a_bad_value(name, key, bad, match):
    good = CASES[name][1].get(key, 1 if key == "T" else 1e-2)
    model = make_model()
    opt = make_optimizer(name, model, **{key: lambda step: good if step < 2 else bad})
    train(model, opt, 2)
    backward(model, opt, seed=2)
    params = parameters(model)
    with pytest.raises(ValueError, match=rf"{match}.*callable {key} at step 2"):
        opt.step()
    assert_same(parameters(model), params)


def test_a_scheduler_edit_is_read_and_unchanged_groups_are_not_revalidated(monkeypatch):
    """lr = 0 written by hand freezes the preconditioned layers for that step; the full
    validation runs again only for steps where a value changed."""
    model = make_model()
    opt = make_optimizer("singd-dense", model)
    calls = []
    original = hyperparameters.validate
    monkeypatch.setattr(
        hyperparameters,
        "validate",
        lambda group, checks: calls.append(sorted(checks)) or original(group, checks),
    )
    train(model, opt, 3)
    assert calls == []  # nothing changed since construction
    opt.param_groups[0]["lr"] = 0.0
    weight = model[0].weight.detach().clone()
    train(model, opt, 2, first_seed=3)
    assert calls == [["lr"]]  # the changed key only
    assert torch.equal(model[0].weight, weight)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 1.0 / (1 + epoch))
    opt.param_groups[0]["lr"] = scheduler.base_lrs[0] = 0.05
    calls.clear()
    for seed in range(3):
        train(model, opt, 1, first_seed=10 + seed)
        scheduler.step()
    # the scheduler's new key initial_lr: the whole group once; then a new lr every step
    assert len(calls[0]) > 10 and calls[1:] == [["lr"]] * 2


@pytest.mark.parametrize("name", ["singd-dense", "singd-diagonal", "ikfac", "adafisher", "kfac"])
def test_a_changed_factor_dtype_casts_the_factors(name):
    model = make_model()
    opt = make_optimizer(name, model)
    train(model, opt, 2)
    backward(model, opt, seed=2)
    opt.param_groups[0]["factor_dtype"] = torch.bfloat16
    opt.step()
    state = opt.state[model[0].weight]
    factor_dtypes = {
        t.dtype
        for key, value in state.items()
        if key not in ("momentum_buffer", "exp_avg")
        for t in (value.values() if isinstance(value, dict) else [value])
        if isinstance(t, torch.Tensor)
    }
    assert factor_dtypes == {torch.bfloat16}
    assert state.get("momentum_buffer", state.get("exp_avg")).dtype == torch.float32
    train(model, opt, 2, first_seed=3)
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("name", ["singd-dense", "singd-diagonal", "singd-hierarchical", "ikfac"])
def test_structures_change_freely_before_the_factors_exist_and_never_after(name):
    model = make_model()
    opt = make_optimizer(name, model)
    opt.param_groups[0]["structures"] = ("low_rank:2", "diagonal")
    train(model, opt, 1)
    assert set(opt.state[model[0].weight]["K"]) == {"A", "B", "D"}  # low-rank parts
    backward(model, opt, seed=1)
    params, state = parameters(model), state_tensors(opt)
    opt.param_groups[0]["structures"] = "diagonal"
    with pytest.raises(ValueError, match=r"structures'\] changed from .*set it back"):
        opt.step()
    assert_same(parameters(model), params)
    assert_same(state_tensors(opt), state)
    opt.param_groups[0]["structures"] = ("low_rank:2", "diagonal")
    opt.step()


def test_an_edit_before_the_forward_is_validated_before_the_capture_reads_it():
    model = make_model()
    opt = make_optimizer("singd-dense", model)
    train(model, opt, 1)
    opt.param_groups[0]["structures"] = "dense"  # the same structure, as a name
    train(model, opt, 1, first_seed=1)


def test_norm_fisher_is_fixed_at_construction():
    model = make_model()
    opt = make_optimizer("singd-dense", model)
    train(model, opt, 1)
    backward(model, opt, seed=1)
    opt.param_groups[0]["norm_fisher"] = True
    with pytest.raises(ValueError, match=r"norm_fisher.*fixed at construction"):
        opt.step()


@pytest.mark.parametrize(
    ("T", "T_inv", "inversions"),
    [
        (10, 3, [0, 10, 20]),  # T_inv < T: every factor update (was every 30 steps)
        (1, 3, [0, 3, 6, 9, 12, 15, 18, 21, 24]),
        (3, 5, [0, 6, 12, 18, 24]),  # the first factor update >= T_inv steps later
        (2, None, list(range(0, 25, 2))),
    ],
)
def test_kfac_inverts_at_the_first_factor_update_T_inv_steps_after_the_last(T, T_inv, inversions):
    model = make_model()
    opt = KFAC(model, lr=0.05, damping=1e-2, T=T, T_inv=T_inv)
    seen = []
    for step in range(25):
        train(model, opt, 1, first_seed=step)
        inverse = opt.state[model[0].weight]["A_inv"]
        if step == 0 or not torch.equal(inverse, seen[-1][1]):
            seen.append((step, inverse.clone()))
    assert [step for step, _ in seen] == inversions


def test_group_watch_tells_unchanged_changed_and_renamed_keys():
    """GroupWatch.changed: nothing changed is an empty set (the values are the same
    objects, or equal ones); a new value names its key; a key swapped for another (the
    same count of keys, the lost one None) is a new group, None."""
    watch = hyperparameters.GroupWatch()
    group = {"params": [], "step": 0, "lr": 0.1, "graft": None, "betas": (0.9, 0.99)}
    watch.remember(0, group, {})
    assert watch.changed(0, group) == set()
    group["betas"] = (0.9, 0.99)  # an equal value, another object
    group["step"] = 5  # not a hyperparameter
    assert watch.changed(0, group) == set()
    group["lr"] = 0.2
    assert watch.changed(0, group) == {"lr"}
    group["lr"] = 0.1
    del group["graft"]
    group["grafting"] = None
    assert watch.changed(0, group) is None
    assert watch.changed(1, group) is None  # a group never seen
