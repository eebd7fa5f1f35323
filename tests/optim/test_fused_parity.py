"""The optimizers give the same trajectory with the fused ops and with the pure-PyTorch
reference (``SINGD_CUDA_FUSED=0``), and the diagonal paths update every layer in one call.

Tolerances: the fused diagonal/AdaFisher step is bitwise equal to its reference; what
differs is the summation order of the statistics (column sums of squares). SINGD's
diagonal rule is insensitive to that (float32: rtol 1e-5). AdaFisher divides by
s′ ⊗ h′ + λ with min-max normalised statistics, which amplifies a last-bit difference of
the statistics by up to 1/λ: in float32 it is compared at λ = 0.1 (rtol 1e-5), and at the
default λ = 1e-3 in float64 (rtol 1e-10).
"""

from __future__ import annotations

import pytest
import torch

import singd_cuda.ops as ops
from singd_cuda import KFAC, SINGD, AdaFisher

from ..loops import backward_and_step
from .conftest import (
    MODELS,
    assert_models_equal,
    count_diagonal_steps,
    loss_fn,
    random_batches,
    train,
)
from .test_checkpoint import model_with_fallback

pytestmark = pytest.mark.skipif(not ops.fused_available("cpu"), reason="fused ops not built")

STEPS = 6
CASES = {
    "singd-diagonal": (SINGD, dict(lr=0.01, lr_cov=0.05, T=2, structures="diagonal")),
    "singd-diagonal-wd": (
        SINGD,
        dict(lr=0.01, lr_cov=0.05, T=1, structures="diagonal", weight_decay=1e-2, alpha1=0.3),
    ),
    "ikfac-diagonal": (
        SINGD,
        dict(lr=0.01, lr_cov=0.05, T=1, structures="diagonal", kfac_like=True),
    ),
    "adafisher": (AdaFisher, dict(lr=0.01, T=1, damping=0.1, weight_decay=1e-2)),
    "adafisher-decoupled": (
        SINGD,
        dict(
            lr=0.01,
            T=2,
            damping=0.1,
            structures="adafisher",
            weight_decay=1e-2,
            decoupled_weight_decay=True,
        ),
    ),
}


def run(kind, name, fused, monkeypatch, dtype=torch.float32, scaler=None, **extra):
    monkeypatch.setenv("SINGD_CUDA_FUSED", "1" if fused else "0")
    model = MODELS[kind](dtype=dtype)
    cls, kwargs = CASES[name]
    opt = cls(model, **{**kwargs, **extra}, grad_scaler=scaler)
    for x, y in random_batches(kind, STEPS, dtype=dtype):
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        backward_and_step(loss, opt, scaler)
    return model, opt


def assert_close(fused, reference, rtol, atol):
    for p, q in zip(fused.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=rtol, atol=atol)


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("kind", ["mlp", "cnn"])
def test_fused_matches_reference_float32(kind, name, monkeypatch):
    fused, _ = run(kind, name, True, monkeypatch)
    reference, _ = run(kind, name, False, monkeypatch)
    assert_close(fused, reference, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["mlp", "cnn"])
def test_adafisher_default_damping_float64(kind, monkeypatch):
    fused, _ = run(kind, "adafisher", True, monkeypatch, dtype=torch.float64, damping=1e-3)
    reference, _ = run(kind, "adafisher", False, monkeypatch, dtype=torch.float64, damping=1e-3)
    assert_close(fused, reference, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", ["singd-diagonal", "adafisher"])
def test_fused_matches_reference_with_loss_scale(name, monkeypatch):
    def scaler():
        return torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=10**6)

    fused, _ = run("mlp", name, True, monkeypatch, scaler=scaler())
    reference, _ = run("mlp", name, False, monkeypatch, scaler=scaler())
    assert_close(fused, reference, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["singd-diagonal", "adafisher"])
def test_bf16_stochastic_rounding_matches_reference(name, monkeypatch):
    """Stochastic rounding draws the same bits on both paths (a function of the seed);
    equal here, compared within one bf16 ulp to allow another summation order."""
    kwargs = dict(dtype=torch.bfloat16, stochastic_rounding=True, factor_dtype=torch.bfloat16)
    fused, _ = run("mlp", name, True, monkeypatch, **kwargs)
    reference, _ = run("mlp", name, False, monkeypatch, **kwargs)
    assert_close(fused, reference, rtol=2**-7, atol=1e-3)


@pytest.mark.parametrize("name", ["singd-diagonal", "adafisher"])
def test_one_update_call_per_step_whatever_the_depth(name, monkeypatch):
    """The diagonal paths update all layers of a group in one op call (the op, or the
    one a kept batch resolved once)."""
    calls = count_diagonal_steps(monkeypatch)
    run("mlp", name, True, monkeypatch)
    assert calls == [6] * STEPS  # 3 layers x (weight, bias), one call per step


@pytest.mark.parametrize(
    ("cls", "kwargs"),
    [
        (SINGD, dict(structures="dense", lr=0.05, T=2)),
        (SINGD, dict(lr=0.05, T=1, structures="tril_toeplitz", norm_fisher=True)),
        (KFAC, dict(lr=0.05, T=2)),
    ],
    ids=["singd-dense", "singd-toeplitz-norm-fisher", "kfac"],
)
def test_bf16_stochastic_rounding_dense_paths_are_bitwise_equal(cls, kwargs, monkeypatch):
    """The per-layer paths, the norm Fisher and the AdamW fallback write through
    sgd_epilogue_, whose rounding bits are the same on the fused and the reference
    path: a pure-bf16 model trained with stochastic rounding ends bitwise equal."""
    models = []
    for fused in (True, False):
        monkeypatch.setenv("SINGD_CUDA_FUSED", "1" if fused else "0")
        model = model_with_fallback(torch.bfloat16)
        opt = cls(model, stochastic_rounding=True, factor_dtype=torch.bfloat16, **kwargs)
        train(model, opt, random_batches("mlp", STEPS, dtype=torch.bfloat16))
        models.append(model)
    assert_models_equal(*models)
