"""Single runs: determinism, early stop on non-finite values, and the data."""

from __future__ import annotations

import math

import torch

from singd_cuda.harness.data import TASKS, VOCAB, corpus_text, digits_task, encode, lm_task
from singd_cuda.harness.optimizers import OptimizerChoice
from singd_cuda.harness.runner import RunSpec, train

CPU = torch.device("cpu")


def test_batches_depend_only_on_the_seed():
    task = digits_task()
    assert torch.equal(task.batch_indices(30, 1), task.batch_indices(30, 1))
    assert not torch.equal(task.batch_indices(30, 1), task.batch_indices(30, 2))
    epoch = task.batch_indices(task.train_x.shape[0] // task.batch_size, 0).flatten()
    assert epoch.unique().numel() == epoch.numel()  # no repeats within an epoch


def test_lm_corpus_ships_with_python():
    text = corpus_text()
    assert len(text) > 100_000 and "def " in text
    ids = encode("ab\n\t")
    assert ids.tolist() == [VOCAB.index("a"), VOCAB.index("b"), 0, len(VOCAB)]
    task = lm_task()
    assert torch.equal(task.train_x[:, 1:], task.train_y[:, :-1])
    assert set(TASKS) == {"digits", "lm"}


def test_runs_are_deterministic():
    task = digits_task()
    spec = RunSpec("digits", OptimizerChoice("singd", "diagonal"), "fp32", 0, 4, 0.05)
    first, second = train(task, spec, CPU), train(task, spec, CPU)
    assert first.stable and first.train_loss == second.train_loss
    assert first.eval_loss == second.eval_loss


def test_divergent_run_stops_early_and_reports():
    spec = RunSpec("digits", OptimizerChoice("adamw"), "bf16-pure", 0, 50, 1e30)
    result = train(digits_task(), spec, CPU)
    assert not result.stable and result.status.startswith(("nan@", "error@"))
    assert result.first_nonfinite_step < 50
    assert len(result.step_ms) <= result.first_nonfinite_step
    assert result.final_loss is None
    assert result.best_loss is not None and math.isfinite(result.best_loss)
