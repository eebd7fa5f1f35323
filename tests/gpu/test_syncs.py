"""A steady-state step on CUDA synchronises at most once: the non-finite verdict, read
after the factor updates (tests/optim/test_device_reads.py counts the same reads on the
CPU). ``torch.cuda.set_sync_debug_mode("warn")`` makes every synchronising call warn; the
test counts those warnings over a few steps (with ``"error"`` the one allowed read would
raise). K-FAC runs between inversions (an inversion's LAPACK info check synchronises).
With ``nonfinite='device'`` a steady-state step synchronises never: under
``set_sync_debug_mode("error")`` any synchronising call raises."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from singd_cuda import KFAC, SINGD, AdaFisher

from ..loops import backward_and_step

pytestmark = pytest.mark.gpu

ITERATIONS = 4
OPTIMIZERS = {
    "singd-diagonal": lambda m: SINGD(m, lr=1e-3, structures="diagonal", T=1),
    "singd-block_diagonal:32": lambda m: SINGD(m, lr=1e-3, structures="block_diagonal:32", T=1),
    "singd-dense": lambda m: SINGD(m, lr=1e-3, structures="dense", T=1),
    "adafisher": lambda m: AdaFisher(m, lr=1e-3, T=1),
    "kfac": lambda m: KFAC(m, lr=1e-3, T=1, T_inv=10**9),
}


def _iterate(model, opt, x, y, scaler) -> None:
    opt.zero_grad()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = F.cross_entropy(model(x).float(), y)
    backward_and_step(loss, opt, scaler)


def _steady_steps(name: str, scaled: bool, nonfinite: str, sync_debug_mode: str) -> None:
    """Three warm-up iterations (first statistics and state creation, warm start), then
    ITERATIONS under ``torch.cuda.set_sync_debug_mode(sync_debug_mode)``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 10)).cuda()
    opt = OPTIMIZERS[name](model)
    opt.nonfinite = nonfinite
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**8) if scaled else None
    x = torch.randn(32, 64, device="cuda")
    y = torch.randint(0, 10, (32,), device="cuda")
    for _ in range(3):
        _iterate(model, opt, x, y, scaler)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode(sync_debug_mode)
    try:
        for _ in range(ITERATIONS):
            _iterate(model, opt, x, y, scaler)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert torch.isfinite(next(model.parameters())).all()


@pytest.mark.parametrize("scaled", [False, True], ids=["plain", "grad_scaler"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_at_most_one_sync_per_steady_state_step(cuda_ops, name, scaled):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _steady_steps(name, scaled, "warn", "warn")
    syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message)]
    assert len(syncs) <= ITERATIONS, syncs


@pytest.mark.parametrize("scaled", [False, True], ids=["plain", "grad_scaler"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_no_sync_when_skips_are_decided_on_the_device(cuda_ops, name, scaled):
    _steady_steps(name, scaled, "device", "error")  # any synchronising call raises
