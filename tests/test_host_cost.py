"""benchmarks/host_cost.py: the table runs end to end, and the read counter counts what the
library reads to the host, by call site, and nothing else. Mechanics only: no assertion
reads a number derived from a timing."""

from __future__ import annotations

import pytest
import torch

import singd_cuda.ops as ops
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
def test_table_has_every_optimizer(host_cost, tmp_path):
    host_cost.MODELS["tiny"] = (4, 8, 4, torch.nn.Tanh)  # shape of the table, not timings
    out = tmp_path / "host.md"
    assert host_cost.main(["--models", "tiny", "--steps", "2", "--out", str(out)]) == 0
    text = out.read_text()
    for name in host_cost.optimizers():
        assert f"| {name} |" in text
    adamw = next(line for line in text.splitlines() if line.startswith("| AdamW (foreach) |"))
    assert " | 1.00x | " in adamw  # its own ratio; the floor's column beside it is timed
    assert "| after the read µs |" in text
    # AdamW, the three floors and the two nonfinite='device' rows read none
    assert text.count(" | — |") == 6


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
