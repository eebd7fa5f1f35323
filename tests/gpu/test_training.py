"""Whole training runs on CUDA: the fused ops and the reference path
(``SINGD_CUDA_FUSED=0``) give the same trajectory, step by step.

As on the CPU (tests/optim/test_fused_parity.py), the fused update is bitwise equal to the
reference and only the statistics' summation order differs; AdaFisher amplifies that by up
to 1/damping, so float32 runs use damping 0.1 and the default damping runs in float64.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from singd_cuda import KFAC, SINGD, AdaFisher

pytestmark = pytest.mark.gpu

STEPS = 8
CASES = {
    "singd-diagonal": (
        SINGD,
        dict(lr=0.05, lr_cov=0.05, T=1, structures="diagonal", weight_decay=1e-2, alpha1=0.3),
        torch.float32,
    ),
    "singd-dense": (SINGD, dict(lr=0.05, lr_cov=0.05, T=2), torch.float32),
    "adafisher-float32": (
        AdaFisher,
        dict(lr=0.01, T=1, damping=0.1, weight_decay=1e-2),
        torch.float32,
    ),
    "adafisher-float64": (AdaFisher, dict(lr=0.01, T=1, weight_decay=1e-2), torch.float64),
    "kfac": (KFAC, dict(lr=0.05, T=2), torch.float32),
}
TOLERANCE = {torch.float32: (1e-5, 1e-6), torch.float64: (1e-10, 1e-12)}


def _model(dtype, channels_last: bool) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, stride=2, groups=2),
        nn.Flatten(),
        nn.Linear(8 * 3 * 3, 16),
        nn.Tanh(),
        nn.Linear(16, 10),
    ).to(device="cuda", dtype=dtype)
    return model.to(memory_format=torch.channels_last) if channels_last else model


def _train(name, fused, monkeypatch, channels_last):
    monkeypatch.setenv("SINGD_CUDA_FUSED", "1" if fused else "0")
    cls, kwargs, dtype = CASES[name]
    model = _model(dtype, channels_last)
    opt = cls(model, **kwargs)
    gen = torch.Generator().manual_seed(1)
    trajectory = []
    for _ in range(STEPS):
        x = torch.randn(16, 3, 7, 7, generator=gen, dtype=dtype).cuda()
        if channels_last:
            x = x.to(memory_format=torch.channels_last)
        y = torch.randint(0, 10, (16,), generator=gen).cuda()
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        trajectory.append([p.detach().clone() for p in model.parameters()])
    return trajectory


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("name", list(CASES))
def test_fused_and_reference_trajectories_agree(cuda_ops, monkeypatch, name, channels_last):
    fused = _train(name, True, monkeypatch, channels_last)
    reference = _train(name, False, monkeypatch, channels_last)
    rtol, atol = TOLERANCE[CASES[name][2]]
    for step, (got, want) in enumerate(zip(fused, reference, strict=True)):
        for p, q in zip(got, want, strict=True):
            torch.testing.assert_close(
                p, q, rtol=rtol, atol=atol, msg=lambda m, s=step: f"step {s}: {m}"
            )
