"""A factor above 64 MiB warns at construction, naming the layer and a structure that
fits; SINGD's default structure is block_diagonal:32, whose factor state is as stated."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from singd_cuda import KFAC, SINGD, AdaFisher
from singd_cuda.optim.factor_memory import (
    FACTOR_WARNING_BYTES,
    LargeFactorWarning,
    structure_bytes,
)

from .validation_cases import make_model, train


def wide_model(width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(width, 4, bias=False), nn.Tanh(), nn.Linear(4, 3))


def no_large_factor_warning(build) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", LargeFactorWarning)
        build()


def test_the_threshold_is_64_MiB():
    assert FACTOR_WARNING_BYTES == 64 * 2**20


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: SINGD(wide_model(8192), structures="dense"), "Pass structures="),
        (lambda: SINGD(wide_model(4097), structures="dense", kfac_like=True), "structures="),
        (lambda: KFAC(wide_model(4097)), "K-FAC's factors are dense"),
        (
            lambda: SINGD(wide_model(6000), structures="dense", factor_dtype=torch.bfloat16),
            "structures=",
        ),
    ],
)
def test_a_dense_side_above_the_threshold_warns_naming_a_structure_that_fits(build, match):
    with pytest.warns(LargeFactorWarning, match=rf"'0' \(4, \d+\).*{match}.*block_diagonal:32"):
        build()


@pytest.mark.parametrize(
    "build",
    [
        lambda: SINGD(wide_model(4096), structures="dense"),  # exactly 64 MiB: no warning
        lambda: SINGD(wide_model(5792), structures="dense", factor_dtype=torch.bfloat16),
        lambda: SINGD(wide_model(8192)),  # the default structure
        lambda: SINGD(wide_model(8192), structures="diagonal"),
        lambda: SINGD(wide_model(8192), structures="low_rank:8"),
        lambda: AdaFisher(wide_model(8192)),
        lambda: KFAC(wide_model(4095)),
    ],
)
def test_no_warning_below_the_threshold(build):
    no_large_factor_warning(build)


def test_the_default_structure_is_block_diagonal_32():
    model = make_model()
    opt = SINGD(model)
    assert opt.param_groups[0]["structures"] == ("block_diagonal:32", "block_diagonal:32")


@pytest.mark.parametrize("factor_dtype", [None, torch.bfloat16])
def test_the_factor_state_of_the_default_is_the_stated_formula(factor_dtype):
    """K, m_K, C, m_C of each layer take 2 * (bytes(d_K) + bytes(d_C)), bytes(d) =
    (⌊d/32⌋·32² + (d mod 32)²) · itemsize: the README's figures use this formula."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(100, 70), nn.Tanh(), nn.Linear(70, 33, bias=False))
    opt = SINGD(model, T=1, factor_dtype=factor_dtype)
    x = torch.randn(4, 100)
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()
    itemsize = (factor_dtype or torch.float32).itemsize
    for layer, (d_K, d_C) in zip(opt.layers, [(101, 70), (70, 33)], strict=True):
        state = opt.state[layer.weight]
        measured = sum(
            t.numel() * t.element_size()
            for key in ("K", "m_K", "C", "m_C")
            for t in state[key].values()
        )
        formula = 2 * (
            structure_bytes("block_diagonal:32", d_K, itemsize)
            + structure_bytes("block_diagonal:32", d_C, itemsize)
        )
        by_hand = 2 * itemsize * sum((d // 32) * 32**2 + (d % 32) ** 2 for d in (d_K, d_C))
        assert measured == formula == by_hand


def test_no_warning_for_the_small_models_of_the_tests():
    def build_and_train():
        model = make_model()
        train(model, SINGD(model, T=1), 1)

    no_large_factor_warning(build_and_train)
