"""The capture's kept decisions (``_layer_call``: whether a group takes statistics and
a call's loss terms; ``_accumulate_statistics``: a layer's diagonal statistics path)
change nothing: training with edits that change what they decided (``loss_average``,
``batch_dim``, ``kfac_approx``, ``structures``, ``T``, the batch, the model's batch), a
skipped step that restores the state a layer's first statistics created, and a rollback
by ``load_state_dict`` is bitwise the same as training that drops them before each
forward."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from singd_cuda import KFAC, SINGD, AdaFisher

STEPS = 6
EDIT_AT = 2


def set_group(key, value):
    def edit(opt, model, saved):
        opt.param_groups[0][key] = value

    return edit


def poison_gradient(opt, model, saved):
    """After the backward: a non-finite gradient, so the step is skipped."""
    model[0].weight.grad[0, 0] = float("inf")


def save(opt, model, saved):
    saved.append((copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())))


def roll_back(opt, model, saved):
    model_state, opt_state = saved[0]
    model.load_state_dict(model_state)
    opt.load_state_dict(opt_state)


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4))


def sequence_first_transformer() -> nn.Module:
    """Its Linear layers count dimension 1 and say the model's batch at every call."""
    return nn.Sequential(
        nn.TransformerEncoderLayer(6, nhead=2, dim_feedforward=16, dropout=0.0),
        nn.Linear(6, 4),
    )


class Reshaping(nn.Module):
    """Its layer sees (3, 5, 6) whatever the model's input: counted along dimension 0
    when the model's batch is 3, along dimension 1 when it is 5."""

    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(6, 4)

    def forward(self, x):
        return self.layer(x.reshape(3, 5, 6))


def same_batch(step: int) -> tuple[int, ...]:
    return (5, 3, 6)


def train(
    make,
    before: dict,
    after_backward: dict,
    drop_plans: bool,
    model_fn=mlp,
    shape=same_batch,
    micro_batches: int = 1,
) -> list[torch.Tensor]:
    """STEPS steps of a model taking inputs of ``shape(step)``, each of
    ``micro_batches`` forward and backward passes; ``before[step]`` runs before the
    step's first forward, ``after_backward[step]`` after its first backward."""
    torch.manual_seed(0)
    model = model_fn().double()
    opt = make(model)
    generator = torch.Generator().manual_seed(1)
    saved: list = []
    for step in range(STEPS):
        for edit in before.get(step, ()):
            edit(opt, model, saved)
        opt.zero_grad()
        for micro_batch in range(micro_batches):
            if drop_plans:
                opt._wants.clear()
                opt._call_plans.clear()
                opt._statistics_plans.clear()
            x = torch.randn(shape(step), generator=generator, dtype=torch.float64)
            out = model(x)
            y = torch.randn(out.shape, generator=generator, dtype=torch.float64)
            ((out - y) ** 2).mean().backward()
            for edit in after_backward.get(step, ()) if micro_batch == 0 else ():
                edit(opt, model, saved)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # the skipped step's warning
            opt.step()
    return [p.detach().clone() for p in model.parameters()]


OPTIMIZERS = {
    "singd-diagonal": lambda m: SINGD(m, lr=0.1, structures="diagonal", T=1),
    "adafisher": lambda m: AdaFisher(m, lr=0.01),
    "singd-dense": lambda m: SINGD(m, lr=0.1, structures="dense", T=1),
    "kfac": lambda m: KFAC(m, lr=0.1, T=1),
}

SCENARIOS = {
    "loss_average": ({EDIT_AT: [set_group("loss_average", "batch+sequence")]}, {}),
    "batch_dim": ({EDIT_AT: [set_group("batch_dim", 1)]}, {}),
    "kfac_approx": ({EDIT_AT: [set_group("kfac_approx", "reduce")]}, {}),
    "T": ({EDIT_AT: [set_group("T", 2)]}, {}),
    "skipped_first_step": ({}, {0: [poison_gradient]}),
    "rollback": ({EDIT_AT: [save], EDIT_AT + 2: [roll_back]}, {}),
}


@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_plans_change_nothing(name, scenario):
    before, after_backward = SCENARIOS[scenario]
    make = OPTIMIZERS[name]
    kept = train(make, before, after_backward, drop_plans=False)
    dropped = train(make, before, after_backward, drop_plans=True)
    for a, b in zip(kept, dropped, strict=True):
        assert torch.equal(a, b)


def test_structures_edited_after_a_skipped_first_step():
    """The skipped step restores the state the diagonal statistics created, so the
    structures may change; the next statistics take the new structures' path."""
    before = {1: [set_group("structures", ("dense", "dense"))]}
    after_backward = {0: [poison_gradient]}
    make = OPTIMIZERS["singd-diagonal"]
    kept = train(make, before, after_backward, drop_plans=False)
    dropped = train(make, before, after_backward, drop_plans=True)
    for a, b in zip(kept, dropped, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_sequence_first_layers_count_at_every_call(name):
    make = OPTIMIZERS[name]
    kept = train(make, {}, {}, drop_plans=False, model_fn=sequence_first_transformer)
    dropped = train(make, {}, {}, drop_plans=True, model_fn=sequence_first_transformer)
    for a, b in zip(kept, dropped, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_new_sequence_length_is_counted_anew(name):
    """The model's batch stays 5; with loss_average="batch+sequence" the count follows
    the output's shape."""
    make = OPTIMIZERS[name]
    before = {0: [set_group("loss_average", "batch+sequence")]}
    shape = lambda step: (5, 3, 6) if step < EDIT_AT else (5, 2, 6)  # noqa: E731
    kept = train(make, before, {}, drop_plans=False, shape=shape)
    dropped = train(make, before, {}, drop_plans=True, shape=shape)
    for a, b in zip(kept, dropped, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_the_model_batch_decides_the_count(name):
    """The layer's output has one shape; the model's batch alternates between 3 and 5."""
    make = OPTIMIZERS[name]
    shape = lambda step: (3, 5 * 6) if step % 2 else (5, 3 * 6)  # noqa: E731
    kept = train(make, {}, {}, drop_plans=False, model_fn=Reshaping, shape=shape)
    dropped = train(make, {}, {}, drop_plans=True, model_fn=Reshaping, shape=shape)
    for a, b in zip(kept, dropped, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_T_edited_between_micro_batches(name):
    """T = 2, then 1 from the second micro-batch of step 1 on: that step takes the
    second micro-batch's statistics only."""
    make = OPTIMIZERS[name]
    before, after_backward = {0: [set_group("T", 2)]}, {1: [set_group("T", 1)]}
    kept = train(make, before, after_backward, drop_plans=False, micro_batches=2)
    dropped = train(make, before, after_backward, drop_plans=True, micro_batches=2)
    for a, b in zip(kept, dropped, strict=True):
        assert torch.equal(a, b)
