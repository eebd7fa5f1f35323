"""Optimizer cases and a small model shared by the validation tests of tests/reliability.

Every case trains the same model: two Linear layers and a LayerNorm (so the AdamW
fallback is part of the state), float32 unless a test asks otherwise.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from singd_cuda import KFAC, SINGD, AdaFisher

IN, HIDDEN, OUT = 6, 8, 4

CASES = {
    "singd-dense": (SINGD, dict(structures="dense", lr=0.05, lr_cov=0.05, T=1)),
    "singd-block_diagonal": (SINGD, dict(structures="block_diagonal:3", lr=0.05, T=1)),
    "singd-diagonal": (SINGD, dict(structures="diagonal", lr=0.05, lr_cov=0.05, T=1)),
    "singd-hierarchical": (SINGD, dict(structures="hierarchical:2,2", lr=0.05, T=1)),
    "ikfac": (SINGD, dict(structures="dense", kfac_like=True, lr=0.05, lr_cov=0.05, T=1)),
    "adafisher": (AdaFisher, dict(lr=0.01, T=1)),
    "kfac": (KFAC, dict(lr=0.05, T=1, damping=1e-2)),
}


def make_model(dtype: torch.dtype | None = None, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(IN, HIDDEN), nn.LayerNorm(HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, OUT)
    )
    return model if dtype is None else model.to(dtype)


def make_optimizer(name: str, model: nn.Module, **extra) -> torch.optim.Optimizer:
    cls, kwargs = CASES[name]
    return cls(model, **{**kwargs, **extra})


def batch(seed: int, dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(16, IN, generator=gen, dtype=dtype or torch.get_default_dtype())
    return x, torch.randint(0, OUT, (16,), generator=gen)


def backward(model: nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    """zero_grad, forward and backward of one batch (no step)."""
    opt.zero_grad()
    x, y = batch(seed, next(model.parameters()).dtype)
    F.cross_entropy(model(x), y).backward()


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, first_seed: int = 0):
    for seed in range(first_seed, first_seed + steps):
        backward(model, opt, seed)
        opt.step()


def parameters(model: nn.Module) -> list[Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def state_tensors(opt: torch.optim.Optimizer) -> list[Tensor]:
    """Copies of every tensor of the optimizer state, in a fixed order."""
    out: list[Tensor] = []

    def walk(value) -> None:
        if isinstance(value, Tensor):
            out.append(value.detach().clone())
        elif isinstance(value, dict):
            for key in sorted(value):
                walk(value[key])

    for index, state in sorted(opt.state_dict()["state"].items()):
        walk({str(index): state})
    return out


def assert_same(first: list[Tensor], second: list[Tensor]) -> None:
    assert len(first) == len(second)
    for a, b in zip(first, second, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
