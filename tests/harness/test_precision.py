"""The fp16 axes: fp16 Kronecker factors, and pure fp16 weights with dynamic loss scaling."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from singd_cuda.harness.data import mnist1d_mlp_task
from singd_cuda.harness.optimizers import OptimizerChoice
from singd_cuda.harness.precision import FACTOR_DTYPES, PRECISIONS, PureFP16GradScaler
from singd_cuda.harness.runner import RunSpec, train

CPU = torch.device("cpu")


def test_pure_fp16_scaler_unscales_fp16_gradients_exactly():
    torch.manual_seed(0)
    model = nn.Linear(5, 3).half()
    x, y = torch.randn(4, 5).half(), torch.randint(3, (4,))
    F.cross_entropy(model(x).float(), y).backward()
    reference = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = PRECISIONS["fp16-pure"].make_scaler(CPU)
    assert isinstance(scaler, PureFP16GradScaler)
    scaler.scale(F.cross_entropy(model(x).float(), y)).backward()
    scaler.unscale_(optimizer)  # torch.amp.GradScaler raises on fp16 gradients here
    for p, ref in zip(model.parameters(), reference, strict=True):
        assert p.grad.dtype == torch.float16
        torch.testing.assert_close(p.grad, ref)  # power-of-two scale: exact


@pytest.mark.parametrize(
    ("choice", "factor", "lr"),
    [
        (OptimizerChoice("sgd"), "-", 0.05),
        (OptimizerChoice("singd", "dense"), "fp16", 1e-3),
    ],
    ids=["sgd", "singd-dense-fp16-factors"],
)
def test_pure_fp16_runs_train(choice, factor, lr):
    spec = RunSpec("mnist1d_mlp", choice, "fp16-pure", factor, 0, 3, (("lr", lr),))
    result = train(mnist1d_mlp_task(), spec, CPU)
    assert result.stable, result.status
    assert len(result.step_ms) == 3


def test_adamw_in_pure_fp16_is_reported_non_finite():
    """torch's AdamW keeps fp16 state for fp16 weights: v = g² underflows and eps = 1e-8
    rounds to 0 in fp16, so the first step divides by zero; the run says so."""
    spec = RunSpec("mnist1d_mlp", OptimizerChoice("adamw"), "fp16-pure", "-", 0, 3, (("lr", 1e-3),))
    result = train(mnist1d_mlp_task(), spec, CPU)
    assert result.status == "nan@1" and result.final_loss is None


def test_fp16_factors_reach_the_optimizer():
    choice = OptimizerChoice("singd", "dense")
    task = mnist1d_mlp_task()
    runs = {
        factor: train(
            task, RunSpec("mnist1d_mlp", choice, "fp32", factor, 0, 2, (("lr", 1e-3),)), CPU
        )
        for factor in ("fp32", "fp16")
    }
    assert FACTOR_DTYPES["fp16"] == torch.float16
    assert all(r.stable for r in runs.values())
    assert runs["fp16"].state_bytes < runs["fp32"].state_bytes
