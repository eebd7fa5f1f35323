"""The timing pass: one configuration per cell, timed in interleaved rounds in this
process with one thread; a failing cell gets an error, never stops the others. No test
depends on how long anything took, only on what was measured and in which order."""

from __future__ import annotations

import pytest
import torch

from singd_cuda.harness import timing
from singd_cuda.harness.data import TASKS
from singd_cuda.harness.optimizers import OptimizerChoice
from singd_cuda.harness.runner import RunSpec
from singd_cuda.harness.timing import Timing, paired_ratios, time_cells

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tasks():
    return {"mnist1d_mlp": TASKS["mnist1d_mlp"]()}


def spec(name: str, structure=None, precision="fp32", factor="-", seed=0, lr=1e-3) -> RunSpec:
    choice = OptimizerChoice(name, structure)
    return RunSpec("mnist1d_mlp", choice, precision, factor, seed, 4, (("lr", lr),))


def test_one_timing_per_cell_in_interleaved_rounds(tasks, monkeypatch):
    """Seeds of one cell are timed once (the first); every round times every cell, the
    order rotated each round; one thread during the pass, restored after."""
    specs = [spec("adamw", seed=0), spec("adamw", seed=1)]
    specs += [spec("singd", "diagonal", factor=f) for f in ("fp32", "bf16")]
    calls, threads = [], []
    run = timing._Cell.run

    def logged(self, steps):
        calls.append((self.spec.cell, self.spec.seed, steps))
        threads.append(torch.get_num_threads())
        return run(self, steps)

    monkeypatch.setattr(timing._Cell, "run", logged)
    before = torch.get_num_threads()
    rounds_done = []
    timings = time_cells(specs, tasks, CPU, rounds=3, block=2, on_round=rounds_done.append)
    assert torch.get_num_threads() == before and set(threads) == {1}
    keys = list(dict.fromkeys(s.cell for s in specs))
    assert list(timings) == keys and rounds_done == [0, 1, 2]
    assert all(seed == 0 and steps == 2 for _, seed, steps in calls)
    timed = [key for key, _, _ in calls[len(keys) :]]  # after one warm-up block each
    assert timed == keys + keys[1:] + keys[:1] + keys[2:] + keys[:2]
    for t in timings.values():
        assert t.error is None and t.clock == "cpu"
        assert len(t.cpu_ms) == len(t.wall_ms) == 3 and all(ms > 0 for ms in t.cpu_ms)
        assert t.ms == t.cpu_ms and t.spread()[1] <= t.spread()[0] <= t.spread()[2]


def test_a_failing_cell_gets_an_error_and_the_others_are_timed(tasks):
    """An optimizer that raises at construction (unknown keyword) and a cell whose loss
    turns non-finite (a huge learning rate) have no time; AdamW's cell is timed."""
    bad_keyword = RunSpec(
        "mnist1d_mlp", OptimizerChoice("kfac"), "fp32", "fp32", 0, 4, (("lr", 1e-3), ("nope", 1))
    )
    exploding = spec("adamw", precision="bf16-pure", lr=1e12)
    timings = time_cells([spec("adamw"), bad_keyword, exploding], tasks, CPU, rounds=2, block=5)
    assert timings[bad_keyword.cell].error.startswith("TypeError")
    assert "non-finite training loss" in timings[exploding.cell].error
    for key in (bad_keyword.cell, exploding.cell):
        assert timings[key].ms == [] and timings[key].spread() is None
    assert len(timings[spec("adamw").cell].ms) == 2


def test_paired_ratios_and_records_round_trip():
    key = ("t", "kfac", "fp32", "fp32")
    cell = Timing(key, "cpu", cpu_ms=[2.0, 4.0, 3.0], wall_ms=[9.0, 9.0, 9.0])
    reference = Timing(("t", "adamw", "fp32", "-"), "cpu", cpu_ms=[1.0, 4.0, 1.5])
    assert paired_ratios(cell, reference) == [2.0, 1.0, 2.0]
    assert cell.spread() == (3.0, 2.0, 4.0)
    assert Timing("k", "wall", [1.0], [5.0]).spread() == (5.0, 5.0, 5.0)
    assert Timing.from_record(cell.record()) == cell
    assert timing.agreement({key: cell}) == pytest.approx(3.0)
