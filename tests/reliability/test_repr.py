"""repr of an optimizer: its name, per group the hyperparameters its rule reads and the
number of preconditioned layers, never tensor contents; repr of a Layer: name, module
kind and weight shape."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from singd_cuda import SINGD

from .validation_cases import CASES, make_model, make_optimizer, train

ADAFISHER_ONLY = ("ema_decay", "decoupled_weight_decay")
SINGD_ONLY = ("alpha1", "lr_cov", "kfac_like", "normalize_lr_cov")


def keys_shown(text: str) -> set[str]:
    return {line.split(":")[0].strip() for line in text.splitlines() if line.startswith("    ")}


@pytest.mark.parametrize("name", list(CASES))
def test_optimizer_repr_is_short_and_shows_no_tensor(name):
    model = make_model()
    opt = make_optimizer(name, model)
    train(model, opt, 1)
    text = repr(opt)
    assert text.startswith(f"{type(opt).__name__} (")
    assert "Parameter Group 0: 2 preconditioned layer(s), 2 parameter(s) with the AdamW" in text
    assert "tensor(" not in text and "Parameter containing" not in text
    assert len(text.splitlines()) < 30
    assert {"lr", "momentum", "damping", "T", "step"} <= keys_shown(text)


@pytest.mark.parametrize("name", ["singd-dense", "singd-diagonal", "singd-block_diagonal"])
def test_singd_groups_hide_adafisher_only_keys(name):
    shown = keys_shown(repr(make_optimizer(name, make_model())))
    assert not shown & set(ADAFISHER_ONLY)
    assert {"alpha1", "lr_cov", "structures"} <= shown


def test_ikfac_hides_alpha1_and_adafisher_structure_hides_singd_keys():
    assert "alpha1" not in keys_shown(repr(make_optimizer("ikfac", make_model())))
    shown = keys_shown(repr(SINGD(make_model(), structures="adafisher")))
    assert set(ADAFISHER_ONLY) <= shown and not shown & set(SINGD_ONLY)


def test_per_group_keys_and_layer_counts():
    model = make_model()
    opt = SINGD(
        model,
        [
            dict(params=model[0].parameters(), structures="adafisher"),
            dict(params=[*model[1].parameters(), *model[3].parameters()], kfac_like=True),
        ],
    )
    first, second = repr(opt).split("Parameter Group 1")
    assert "1 preconditioned layer(s), 0 parameter(s)" in first
    assert ": 1 preconditioned layer(s), 2 parameter(s)" in second
    assert "ema_decay" in first and "ema_decay" not in second


def test_repr_size_does_not_grow_with_the_model():
    torch.manual_seed(0)
    big = nn.Sequential(nn.Linear(300, 300), nn.Linear(300, 10))
    text = repr(SINGD(big))
    assert len(text) < 1500 and "tensor(" not in text


def test_layer_repr_shows_name_kind_and_shape():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(4 * 6 * 6, 5, bias=False))
    opt = SINGD(model)
    assert repr(opt.layers) == (
        "[Layer('0', Conv2d, weight (4, 3, 3, 3), bias), Layer('2', Linear, weight (5, 144))]"
    )
