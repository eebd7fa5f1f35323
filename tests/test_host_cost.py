"""benchmarks/host_cost.py: the table runs end to end, and the read counter counts what the
library reads to the host, by call site, and nothing else. Mechanics only: no assertion
reads a number derived from a timing."""

from __future__ import annotations

import pytest
import torch

import singd_cuda.ops as ops
from singd_cuda import KFAC
from singd_cuda.optim import finite

from .host_cost_script import loaded


@pytest.fixture(scope="module")
def host_cost():
    with loaded() as module:
        yield module


def test_reads_are_counted_at_the_library_call_site(host_cost):
    flags = torch.zeros(3)
    with host_cost.counting_reads() as counts:
        flags.sum().item()  # this test's own read: not the library's
        bool(torch.ones((), dtype=torch.bool))
        check = finite.FiniteCheck(reasons=1)
        check.check([flags], 0)
        assert check.verdict() is None  # reads its flags inside singd_cuda
        int(torch.ones((), dtype=torch.int64))  # integer host counters are not counted
    assert sum(counts.values()) >= 1
    assert all(site.startswith("singd_cuda/optim/finite.py:") for site in counts)
    assert float(flags.sum()) == 0.0  # the methods are restored


@pytest.mark.skipif(not ops.fused_available("cpu"), reason="fused ops not built")
@pytest.mark.parametrize("block", [1, 2])
def test_table_has_every_optimizer(host_cost, tmp_path, block):
    host_cost.MODELS["tiny"] = (4, 8, 4, torch.nn.Tanh)  # shape of the table, not timings
    out = tmp_path / "host.md"
    argv = ["--models", "tiny", "--steps", "3", "--block", str(block), "--out", str(out)]
    assert host_cost.main(argv) == 0
    text = out.read_text()
    timed = "3 timed steps" if block == 1 else "4 timed steps in blocks of 2"
    assert f"batch 4, {timed} (plain" in text
    for name in host_cost.optimizers():
        assert f"| {name} |" in text
    adamw = next(line for line in text.splitlines() if line.startswith("| AdamW (foreach) |"))
    assert " | 1.00x | " in adamw  # its own ratio; the floor's column beside it is timed
    assert "| after the read µs |" in text
    # AdamW, the five floors and the two nonfinite='device' rows read none
    assert text.count(" | — |") == 8


def _timed(host_cost, times: list[float], T: int = 1):
    competitor = object.__new__(host_cost.Competitor)
    competitor.times, competitor.T = times, T
    competitor.updates = [i % T == 0 for i in range(len(times))]
    return competitor


def test_ratio_interval_resamples_rounds_alike(host_cost):
    """The interval of overhead ÷ AdamW's: a ratio the same in every round has no spread
    (the same rounds are drawn for the three rows); noisy rounds give an interval that
    holds the whole run's ratio; blocks are resampled whole, update steps amortized."""
    plain = _timed(host_cost, [1.0] * 40)
    adamw = _timed(host_cost, [2.0 + 0.1 * (i % 7) for i in range(40)])
    doubled = _timed(host_cost, [1.0 + 2 * (t - 1.0) for t in adamw.times])
    for block in (1, 4):
        interval = host_cost.ratio_interval(plain, adamw, doubled, block=block)
        assert interval == pytest.approx((2.0, 2.0), rel=1e-9)
    noisy = _timed(host_cost, [2.5 + 0.4 * ((5 * i) % 11) / 10 for i in range(40)])
    low, high = host_cost.ratio_interval(plain, adamw, noisy, block=1)
    whole = (host_cost.median_ms(noisy.times) - 1e3) / (host_cost.median_ms(adamw.times) - 1e3)
    assert low < whole < high
    # T=4 in blocks of 4: every round holds one update step (3.0) and three others (1.5),
    # amortized (3 x 1.5 + 3.0) / 4 = 1.875 over the plain 1.0, against AdamW's 2.0
    constant = _timed(host_cost, [2.0] * 40)
    periodic = _timed(host_cost, [3.0 if i % 4 == 0 else 1.5 for i in range(40)], T=4)
    interval = host_cost.ratio_interval(plain, constant, periodic, block=4)
    assert interval == pytest.approx((0.875, 0.875), rel=1e-9)


def test_contract_floor_counts_only_passes_that_reach_the_weights(host_cost):
    """The contract floor's output sums count a backward pass only when it accumulates
    into the weights' ``.grad``: ``torch.autograd.grad`` leaves none, ``backward`` its own."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 4))
    floor = host_cost.ContractFloor(model, lr=1e-3)
    x = torch.randn(3, 4, requires_grad=True)
    torch.autograd.grad(model(x).square().sum(), x)  # no .grad: nothing counts
    assert not floor.s_new.any() and not any(floor.staged)
    out = model(x)
    out.retain_grad()
    out.square().sum().backward()
    assert torch.equal(floor.s_new[1], out.grad.square().sum(0))
    assert not any(floor.staged)


@pytest.mark.parametrize("invert_every_step", [False, True])
def test_kfac_floor_follows_kfac(host_cost, invert_every_step):
    """K-FAC's floor does K-FAC's work, not less: in float64 its parameters follow
    ``KFAC(T=1)``'s (T_inv=1 when it inverts every step, else only at the first step)
    over four steps of a mean loss, while they move by far more."""

    def model():
        torch.manual_seed(0)
        layers = [torch.nn.Linear(5, 5), torch.nn.Tanh(), torch.nn.Linear(5, 5)]
        return torch.nn.Sequential(*layers, torch.nn.Tanh(), torch.nn.Linear(5, 5)).double()

    floor_model, kfac_model = model(), model()
    floor = host_cost.KfacFloor(floor_model, lr=0.1, invert_every_step=invert_every_step)
    kfac = KFAC(kfac_model, lr=0.1, T=1, T_inv=1 if invert_every_step else 10**9)
    gen = torch.Generator().manual_seed(1)
    for _ in range(4):
        x = torch.randn(7, 5, generator=gen, dtype=torch.float64)
        y = torch.randint(0, 5, (7,), generator=gen)
        for net, opt in ((floor_model, floor), (kfac_model, kfac)):
            net.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(net(x), y).backward()
            opt.step()
    start = model()
    for ours, theirs, initial in zip(
        floor_model.parameters(), kfac_model.parameters(), start.parameters(), strict=True
    ):
        torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-10)
        assert (ours - initial).abs().max() > 1e-2
