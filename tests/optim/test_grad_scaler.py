"""torch.amp.GradScaler: a constant loss scale changes nothing.

The scale is a power of two and the loss is float32, so scaling the loss,
the gradients and the captured output gradients, and unscaling them again,
is exact: the runs must agree bitwise.
"""

from __future__ import annotations

import pytest
import torch

from .conftest import (
    MODELS,
    assert_models_equal,
    clone_model,
    loss_fn,
    make_optimizer,
    random_batches,
)

NAMES = ["singd-dense", "singd-hierarchical", "ikfac", "adafisher"]
STEPS = 6
MAX_NORM = 0.2  # small enough that clipping is active


def constant_scaler() -> torch.amp.GradScaler:
    return torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=10**6)


def run_plain(model, opt, batches, clip: bool):
    for x, y in batches:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()


def run_scaled(model, opt, batches, scaler, clip: bool):
    for x, y in batches:
        opt.zero_grad()
        scaler.scale(loss_fn(model(x), y)).backward()
        if clip:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        scaler.step(opt)
        scaler.update()
    assert scaler.get_scale() == 2.0**10


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("kind", ["mlp", "cnn"])
def test_constant_scale_equals_no_scaler(kind, name):
    model = MODELS[kind]()
    scaled = clone_model(model)
    batches = random_batches(kind, STEPS)
    run_plain(model, make_optimizer(name, model), batches, clip=False)
    run_scaled(scaled, make_optimizer(name, scaled), batches, constant_scaler(), clip=False)
    assert_models_equal(scaled, model)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("passed", [True, False])
def test_unscale_and_clip_equals_no_scaler(name, passed):
    """scaler.unscale_ + clip_grad_norm_, with grad_scaler=scaler passed to the optimizer
    or not (scaler.step hands it over: torch's recipe as written)."""
    model = MODELS["mlp"]()
    scaled = clone_model(model)
    batches = random_batches("mlp", STEPS)
    run_plain(model, make_optimizer(name, model), batches, clip=True)
    scaler = constant_scaler()
    extra = {"grad_scaler": scaler} if passed else {}
    run_scaled(scaled, make_optimizer(name, scaled, **extra), batches, scaler, clip=True)
    assert_models_equal(scaled, model)
