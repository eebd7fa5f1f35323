"""Shared optimizers, models and trajectory helpers of the contract tests.

Every contract is checked on SINGD (dense, block-diagonal and diagonal factors), IKFAC,
AdaFisher and K-FAC, in float64 on tiny models so that "equal" can mean 1e-10.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from singd_cuda import KFAC, SINGD, AdaFisher

FEATURES, HIDDEN, CLASSES = 6, 8, 3

OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "singd-dense": lambda m, **k: SINGD(
        m, lr=0.05, lr_cov=0.1, T=1, structures="dense", weight_decay=1e-2, **k
    ),
    "singd-block": lambda m, **k: SINGD(
        m, lr=0.05, lr_cov=0.1, T=2, structures="block_diagonal:3", **k
    ),
    "singd-diagonal": lambda m, **k: SINGD(m, lr=0.05, lr_cov=0.1, T=1, structures="diagonal", **k),
    "ikfac": lambda m, **k: SINGD(
        m, lr=0.05, lr_cov=0.1, T=1, structures="dense", kfac_like=True, **k
    ),
    "adafisher": lambda m, **k: AdaFisher(m, lr=0.01, T=1, **k),
    "kfac": lambda m, **k: KFAC(m, lr=0.05, T=1, stat_decay=0.9, damping=1e-2, **k),
}
NAMES = list(OPTIMIZERS)


@pytest.fixture(autouse=True, scope="module")
def _one_intra_op_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make_optimizer(name: str, model: nn.Module, **extra) -> torch.optim.Optimizer:
    return OPTIMIZERS[name](model, **extra)


def mlp(seed: int = 0) -> nn.Sequential:
    """6 → 8 → 3, float64."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, CLASSES))
    return model.double()


def batches(steps: int, size: int = 10, seed: int = 1) -> list[tuple[Tensor, Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(size, FEATURES, generator=gen, dtype=torch.float64),
            torch.randint(0, CLASSES, (size,), generator=gen),
        )
        for _ in range(steps)
    ]


def loss_sum(output: Tensor, target: Tensor) -> Tensor:
    return F.cross_entropy(output, target, reduction="sum")


def params_of(model: nn.Module) -> list[Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def assert_close_params(first: list[Tensor], second: list[Tensor], rtol=1e-10, atol=1e-12):
    assert len(first) == len(second)
    for a, b in zip(first, second, strict=True):
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol)


def run(name: str, model: nn.Module, step_fn, steps: int = 4, **extra) -> list[Tensor]:
    """``step_fn(model, opt, x, y)`` for each batch (it must call opt.step()); the final
    parameters."""
    opt = make_optimizer(name, model, **extra)
    for x, y in batches(steps):
        step_fn(model, opt, x, y)
    return params_of(model)


def plain_step(model, opt, x, y) -> None:
    opt.zero_grad()
    (loss_sum(model(x), y) / len(y)).backward()
    opt.step()
