"""Gradient accumulation: k micro-batches (loss/k each, one backward each, one step)
equal one batch of k times the size."""

from __future__ import annotations

import pytest
import torch

from .conftest import MODELS, clone_model, loss_fn, make_optimizer, random_batches

NAMES = ["singd-dense", "singd-block_diagonal", "singd-tril_toeplitz", "ikfac", "adafisher"]


@pytest.mark.parametrize("k", [4])
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("kind", ["mlp", "cnn"])
def test_micro_batches_equal_one_batch(kind, name, k):
    model = MODELS[kind](dtype=torch.float64)
    accumulated = clone_model(model)
    batches = random_batches(kind, 5, batch_size=16, dtype=torch.float64)
    opt, opt_acc = make_optimizer(name, model), make_optimizer(name, accumulated)
    for x, y in batches:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
        opt_acc.zero_grad()
        for xs, ys in zip(x.chunk(k), y.chunk(k), strict=True):
            (loss_fn(accumulated(xs), ys) / k).backward()
        opt_acc.step()
    for p, q in zip(model.parameters(), accumulated.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=1e-10, atol=1e-13)
