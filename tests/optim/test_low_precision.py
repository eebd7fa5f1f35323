"""Low precision: every structure under bf16 autocast trains like float32, and
models moved to bfloat16 (factors in bfloat16, with and without stochastic
rounding of the parameter write) stay finite and learn.

Data: labels of a fixed random teacher with 10% flipped (conftest), 4096
samples, batches of 128, 200 steps, lr decayed linearly to zero so the final
loss is not at the mercy of the last few batches. The full CNN grid is
marked slow; the MLP grid and a CNN subset run by default.
"""

from __future__ import annotations

import functools

import pytest
import torch

from singd_cuda import SINGD, AdaFisher

from .conftest import MODELS, cycle_batches, loss_fn, teacher_dataset, train

STEPS, BATCH = 200, 128
STRUCTURES = [
    "dense",
    "diagonal",
    "block_diagonal:8",
    "low_rank:4",
    "tril_toeplitz",
    "triu_toeplitz",
    "hierarchical:4,4",
    "adafisher",
    "ikfac",
]
CNN_DEFAULT = {"dense", "block_diagonal:8", "hierarchical:4,4", "adafisher"}


def grid():
    for kind in ("mlp", "cnn"):
        for structure in STRUCTURES:
            slow = kind == "cnn" and structure not in CNN_DEFAULT
            yield pytest.param(kind, structure, marks=[pytest.mark.slow] if slow else [])


def make_optimizer(structure: str, model, **kwargs):
    if structure == "adafisher":
        return AdaFisher(model, lr=2e-3, **kwargs)
    common = dict(lr=3e-3, damping=1e-2, lr_cov=0.05, T=5)
    if structure == "ikfac":
        # warm-started IKFAC (per-side damping λ) goes non-finite on the CNN at lr 3e-3 in
        # pure bf16 and in fp32 ends worse than at 1e-3 (README, the harness record)
        common["lr"] = 1e-3
        return SINGD(model, structures="dense", kfac_like=True, **common, **kwargs)
    return SINGD(model, structures=structure, **common, **kwargs)


@functools.cache
def dataset(kind: str):
    return teacher_dataset(kind, size=4096)


def fit(kind, structure, model_dtype=torch.float32, autocast_dtype=None, **kwargs):
    """(initial loss, final full-data loss, model) after STEPS steps."""
    x, y = dataset(kind)
    x = x.to(model_dtype)
    model = MODELS[kind](dtype=model_dtype)
    opt = make_optimizer(structure, model, **kwargs)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1 - t / STEPS)
    losses = train(model, opt, cycle_batches(x, y, BATCH), STEPS, autocast_dtype, schedule)
    assert all(torch.isfinite(torch.tensor(losses)))
    assert all(torch.isfinite(p).all() for p in model.parameters())
    with torch.no_grad():
        final = loss_fn(model(x), y).item()
    return losses[0], final, model


@pytest.mark.parametrize(("kind", "structure"), list(grid()))
def test_bf16_autocast_matches_float32(kind, structure):
    initial, final32, _ = fit(kind, structure)
    _, final16, _ = fit(kind, structure, autocast_dtype=torch.bfloat16)
    assert final32 < 0.7 * initial  # it learned something
    assert abs(final16 - final32) <= 0.05 * final32, (final16, final32)


@pytest.mark.parametrize("stochastic_rounding", [False, True], ids=["nearest", "stochastic"])
@pytest.mark.parametrize(("kind", "structure"), list(grid()))
def test_pure_bf16_is_finite(kind, structure, stochastic_rounding):
    initial, final, model = fit(
        kind,
        structure,
        model_dtype=torch.bfloat16,
        factor_dtype=torch.bfloat16,
        stochastic_rounding=stochastic_rounding,
    )
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert final < 0.7 * initial


def test_stochastic_rounding_changes_the_write():
    """With stochastic rounding the bf16 parameters differ from round-to-nearest."""
    kwargs = dict(model_dtype=torch.bfloat16, factor_dtype=torch.bfloat16)
    _, _, nearest = fit("mlp", "dense", **kwargs)
    _, _, rounded = fit("mlp", "dense", stochastic_rounding=True, **kwargs)
    assert any(
        not torch.equal(p, q)
        for p, q in zip(nearest.parameters(), rounded.parameters(), strict=True)
    )


class TwinLinear(torch.nn.Module):
    """Two identical layers on the same input: identical gradients and statistics."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.first, self.second = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)
        self.second.load_state_dict(self.first.state_dict())

    def forward(self, x):
        return self.first(x) + self.second(x)


@pytest.mark.parametrize("stochastic_rounding", [False, True])
def test_stochastic_rounding_is_independent_across_layers(stochastic_rounding):
    """Twin layers stay bitwise twins with round-to-nearest, but not under stochastic
    rounding: each parameter must draw its own rounding noise."""
    model = TwinLinear().to(torch.bfloat16)
    opt = SINGD(
        model,
        structures="dense",
        lr=1e-2,
        T=1,
        factor_dtype=torch.bfloat16,
        stochastic_rounding=stochastic_rounding,
    )
    x = torch.randn(32, 16, dtype=torch.bfloat16)
    for _ in range(3):
        opt.zero_grad()
        model(x).float().square().mean().backward()
        opt.step()
    twins = torch.equal(model.first.weight, model.second.weight)
    assert twins != stochastic_rounding
