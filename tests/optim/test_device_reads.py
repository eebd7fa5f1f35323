"""A steady-state step reads the device at most once: the non-finite verdict (flags raised
on the device by every check, read together after the factor updates); with
``nonfinite='device'`` it reads nothing (every write consumes the flags on the device). Counted with
benchmarks/host_cost.py's ``counting_reads``: calls of ``Tensor.item``, ``__bool__``,
``__float__``, ``__int__``, ``tolist`` on floating-point or boolean tensors from inside
singd_cuda. With a GradScaler the count is the same (the scaler's found_inf joins the
flags instead of being read on its own)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from singd_cuda import KFAC, SINGD, AdaFisher

from ..host_cost_script import loaded
from ..loops import backward_and_step

ITERATIONS = 4

OPTIMIZERS = {
    "singd-diagonal": lambda m: SINGD(m, lr=1e-3, structures="diagonal", T=1),
    "singd-block_diagonal:32": lambda m: SINGD(m, lr=1e-3, structures="block_diagonal:32", T=1),
    "singd-dense": lambda m: SINGD(m, lr=1e-3, structures="dense", T=1),
    "singd-dense-normalize_lr_cov": lambda m: SINGD(
        m, lr=1e-3, structures="dense", T=1, normalize_lr_cov=True
    ),
    "ikfac": lambda m: SINGD(m, lr=1e-3, structures="dense", T=1, kfac_like=True),
    "adafisher": lambda m: AdaFisher(m, lr=1e-3, T=1),
    "kfac": lambda m: KFAC(m, lr=1e-3, T=1),
    "singd-diagonal-T3": lambda m: SINGD(m, lr=1e-3, structures="diagonal", T=3),
}


@pytest.fixture(scope="module")
def counting_reads():
    with loaded() as module:
        yield module.counting_reads


def _iterate(model, opt, x, y, scaler) -> None:
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y)
    backward_and_step(loss, opt, scaler)


def _steady_reads(counting_reads, name: str, scaled: bool, nonfinite: str):
    """(the reads of ITERATIONS steady-state iterations by call site, the model), after
    three warm-up iterations (first statistics and state creation, warm start)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 40), nn.Tanh(), nn.Linear(40, 6))
    opt = OPTIMIZERS[name](model)
    opt.nonfinite = nonfinite
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8) if scaled else None
    x, y = torch.randn(16, 12), torch.randint(0, 6, (16,))
    for _ in range(3):
        _iterate(model, opt, x, y, scaler)
    with counting_reads() as reads:
        for _ in range(ITERATIONS):
            _iterate(model, opt, x, y, scaler)
    assert torch.isfinite(next(model.parameters())).all()
    return reads


@pytest.mark.parametrize("scaled", [False, True], ids=["plain", "grad_scaler"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_at_most_one_read_per_steady_state_step(counting_reads, name, scaled):
    reads = _steady_reads(counting_reads, name, scaled, "warn")
    assert sum(reads.values()) <= ITERATIONS, dict(reads)
    assert all("finite.py" in site for site in reads), dict(reads)


@pytest.mark.parametrize("scaled", [False, True], ids=["plain", "grad_scaler"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_no_read_when_skips_are_decided_on_the_device(counting_reads, name, scaled):
    reads = _steady_reads(counting_reads, name, scaled, "device")
    assert not reads, dict(reads)
