"""The diagonal SINGD and AdaFisher steps allocate nothing once warm: neither a step without
a factor update nor an update step (every step at T = 1). Derived vectors (c², k², s′, h′)
are recomputed into their buffers and no Python-scalar arithmetic wraps a 0-dim tensor."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import singd_cuda.ops as ops
from singd_cuda import SINGD, AdaFisher

from .conftest import MODELS, loss_fn, random_batches

CASES = {
    "singd-diagonal": (SINGD, dict(structures="diagonal", lr_cov=0.05)),
    "ikfac-diagonal": (SINGD, dict(structures="diagonal", kfac_like=True)),
    "adafisher": (AdaFisher, dict()),
}


def allocated_bytes(fn) -> int:
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return sum(max(e.self_cpu_memory_usage, 0) for e in prof.events())


@pytest.mark.skipif(not ops.fused_available("cpu"), reason="fused ops not built")
@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("kind", ["mlp", "cnn"])
@pytest.mark.parametrize("case", list(CASES))
def test_warm_steps_allocate_nothing(case, kind, T):
    cls, hyper = CASES[case]
    model = MODELS[kind]()
    opt = cls(model, lr=0.01, T=T, **hyper)
    batches = random_batches(kind, 2 * T + 3)
    for step, (x, y) in enumerate(batches):
        opt.zero_grad(set_to_none=False)
        loss_fn(model(x), y).backward()
        if step < 2 * T:
            opt.step()  # warm-up: states, buffers and derived vectors exist now
            continue
        assert allocated_bytes(opt.step) == 0, f"step {step} (update: {step % T == 0})"


def normalised_vector(v: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """ops.min_max_normalise_rows_ of a vector, into a new buffer of ``dtype``."""
    out = torch.empty(v.shape, dtype=dtype)
    ops.min_max_normalise_rows_(out, v)
    return out


def test_min_max_normalise():
    v = torch.tensor([3.0, -1.0, 1.0, 7.0])
    torch.testing.assert_close(normalised_vector(v), (v + 1) / 8)
    torch.testing.assert_close(normalised_vector(torch.full((3,), 2.5)), torch.ones(3))
    half = torch.tensor([1.0, 3.0], dtype=torch.bfloat16)  # into float32, from bfloat16
    torch.testing.assert_close(normalised_vector(half), torch.tensor([0.0, 1.0]))


@pytest.mark.parametrize(
    ("source", "dtype"),
    [
        (torch.float32, torch.float32),
        (torch.float64, torch.float64),
        (torch.bfloat16, torch.float32),
    ],
    ids=str,
)
@pytest.mark.parametrize("length", [1, 5, 16, 17])
def test_rows_normalise_as_one_vector_at_a_time(source, dtype, length):
    """Each row of the stacked normalisation is bitwise the normalisation of that row
    alone, constant rows included, also from the padded rows of a resident stack."""
    torch.manual_seed(0)
    padded = torch.randn(6, 32).to(source)
    V = padded[:, :length]  # rows 64-byte aligned, as ResidentStacks lays them out
    V[2] = 0.5  # a constant row
    V[4] = -V[4].abs()
    out = torch.empty(V.shape, dtype=dtype)
    ops.min_max_normalise_rows_(out, V)
    for row, normalised in zip(V, out, strict=True):
        expected = normalised_vector(row, dtype)
        torch.testing.assert_close(normalised, expected, rtol=0, atol=0)


@pytest.mark.parametrize("factor_dtype", [torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_factor_dtype_other_than_the_weights(case, factor_dtype):
    """The cached buffers follow the factors' accumulation dtype, the statistics the
    weights': float64 or bfloat16 factors on a float32 model train (and stay finite)."""
    cls, hyper = CASES[case]
    model = MODELS["mlp"]()
    opt = cls(model, lr=0.01, T=1, factor_dtype=factor_dtype, **hyper)
    for x, y in random_batches("mlp", 3):
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    state = opt.state[model[0].weight]
    factors = [state["K"]["diag"], state["C"]["diag"]] if cls is SINGD else [state["h"], state["s"]]
    assert all(f.dtype == factor_dtype for f in factors)
