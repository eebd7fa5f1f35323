"""The optimizer in an ordinary training loop: LR schedulers, per-group settings,
zero_grad, frozen parameters."""

from __future__ import annotations

import itertools

import pytest
import torch

from singd_cuda import SINGD, AdaFisher

from .conftest import (
    assert_bitwise_equal,
    assert_models_equal,
    clone_model,
    loss_fn,
    make_mlp,
    random_batches,
    train,
)


def one_step(model, opt, batch):
    x, y = batch
    opt.zero_grad()
    loss_fn(model(x), y).backward()
    opt.step()


@pytest.mark.parametrize("cls", [SINGD, AdaFisher])
def test_step_lr_changes_the_lr_used(cls):
    """StepLR equals setting the group's lr by hand before each step, and differs from
    a constant lr."""
    model = make_mlp()
    by_hand, constant = clone_model(model), clone_model(model)
    batches = random_batches("mlp", 6)
    opt = cls(model, lr=0.05, T=1)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.1)
    train(model, opt, batches, scheduler=scheduler)
    hand_opt = cls(by_hand, lr=0.05, T=1)
    for t, batch in enumerate(batches):
        hand_opt.param_groups[0]["lr"] = 0.05 * 0.1 ** (t // 2)
        one_step(by_hand, hand_opt, batch)
    train(constant, cls(constant, lr=0.05, T=1), batches)
    assert_models_equal(model, by_hand)
    assert not torch.equal(model[0].weight, constant[0].weight)


GROUP_SETTINGS = [
    dict(structures="diagonal", T=2, factor_dtype=torch.bfloat16, lr=0.02),
    dict(structures=("tril_toeplitz", "block_diagonal:4"), T=3),
    dict(kfac_like=True, weight_decay=1e-2),  # other settings from the defaults
]


def test_param_groups_have_their_own_settings():
    """Per-group structures, T, factor_dtype, lr, kfac_like: the one optimizer with three
    groups equals three optimizers, one per layer, with those settings."""
    model = make_mlp()
    separate = clone_model(model)
    batches = random_batches("mlp", 7)
    defaults = dict(structures="dense", lr=0.05, lr_cov=0.05, T=1)
    layers = [model[0], model[2], model[4]]
    opt = SINGD(
        model,
        [
            dict(params=layer.parameters(), **s)
            for layer, s in zip(layers, GROUP_SETTINGS, strict=True)
        ],
        **defaults,
    )
    singles = [
        SINGD(separate, separate[i].parameters(), **{**defaults, **settings})
        for i, settings in zip((0, 2, 4), GROUP_SETTINGS, strict=True)
    ]
    K_history = []
    for batch in batches:
        one_step(model, opt, batch)
        x, y = batch
        for single in singles:
            single.zero_grad()
        loss_fn(separate(x), y).backward()
        for single in singles:
            single.step()
        K_history.append(opt.state[model[0].weight]["K"]["diag"].clone())
    assert_models_equal(model, separate)
    # the settings really differ: dtypes, structures, update periods
    state = [opt.state[layer.weight] for layer in layers]
    assert state[0]["K"]["diag"].dtype == torch.bfloat16
    assert state[1]["K"].keys() != state[1]["C"].keys()
    assert state[2]["K"]["mat"].dtype == torch.float32
    changed = [not torch.equal(a, b) for a, b in itertools.pairwise(K_history)]
    assert changed == [t % 2 == 0 for t in range(1, len(batches))]  # T=2: steps 2, 4, 6


def test_zero_grad_then_step_changes_nothing():
    model = make_mlp()
    opt = SINGD(model, structures="dense", T=1, lr=0.05)
    batches = random_batches("mlp", 3)
    train(model, opt, batches[:2])
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()  # nothing to do: no gradients
    for p, q in zip(model.parameters(), before, strict=True):
        assert_bitwise_equal(p.detach(), q)
    x, y = batches[2]
    loss_fn(model(x), y).backward()
    opt.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())


@pytest.mark.parametrize("cls", [SINGD, AdaFisher])
def test_frozen_parameters_stay_put(cls):
    """A frozen layer takes no statistics and no update (it is preconditioned once
    unfrozen, see tests/reliability); a bias frozen at construction drops out of the factor
    (d_K without the ones column); freezing after construction also holds."""
    model = make_mlp()
    model[0].requires_grad_(False)
    model[2].bias.requires_grad_(False)
    opt = cls(model, lr=0.05, T=1)
    assert [layer.module for layer in opt.layers] == [model[0], model[2], model[4]]
    assert opt.layers[1].dim_in == 16  # no bias column
    model[4].bias.requires_grad_(False)  # frozen after construction: grad stays None
    frozen = {
        name: p.detach().clone() for name, p in model.named_parameters() if not p.requires_grad
    }
    trained = {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}
    train(model, opt, random_batches("mlp", 3))
    for name, p in model.named_parameters():
        if name in frozen:
            assert_bitwise_equal(p.detach(), frozen[name], name)
        else:
            assert not torch.equal(p.detach(), trained[name]), name
    assert not opt.state[model[0].weight]  # never captured, never stepped


def test_add_param_group_after_construction():
    """A group added later (progressive unfreezing) is found, hooked and trained with its
    own settings: the same as passing it to the constructor."""
    model = make_mlp()
    upfront = clone_model(model)
    batches = random_batches("mlp", 4)
    first = list(model[0].parameters()) + list(model[2].parameters())
    opt = SINGD(model, first, structures="dense", lr=0.05, T=1)
    opt.add_param_group(dict(params=model[4].parameters(), structures="diagonal", lr=0.02))
    assert [layer.module for layer in opt.layers] == [model[0], model[2], model[4]]
    groups = [
        dict(params=list(upfront[0].parameters()) + list(upfront[2].parameters())),
        dict(params=upfront[4].parameters(), structures="diagonal", lr=0.02),
    ]
    train(model, opt, batches)
    train(upfront, SINGD(upfront, groups, structures="dense", lr=0.05, T=1), batches)
    assert_models_equal(model, upfront)


def test_bad_param_group_added_later_leaves_the_optimizer_as_it_was():
    model = make_mlp()
    opt = SINGD(model, model[0].parameters(), structures="dense", lr=0.05, T=1)
    with pytest.raises(ValueError, match="not a parameter of the model"):
        opt.add_param_group(dict(params=make_mlp(seed=1)[2].parameters()))
    with pytest.raises(ValueError, match="lr must be"):
        opt.add_param_group(dict(params=model[2].parameters(), lr=-1.0))
    assert len(opt.param_groups) == 1
    assert [layer.module for layer in opt.layers] == [model[0]]
    train(model, opt, random_batches("mlp", 2))


@pytest.mark.parametrize("cls", [SINGD, AdaFisher])
def test_step_with_closure(cls):
    """step(closure): the closure's forward/backward feed this step's statistics."""
    model = make_mlp()
    with_closure = clone_model(model)
    batches = random_batches("mlp", 3)
    train(model, cls(model, lr=0.05, T=1), batches)
    opt = cls(with_closure, lr=0.05, T=1)
    for x, y in batches:

        def closure(x=x, y=y):
            opt.zero_grad()
            loss = loss_fn(with_closure(x), y)
            loss.backward()
            return loss

        assert torch.isfinite(opt.step(closure))
    assert_models_equal(with_closure, model)
