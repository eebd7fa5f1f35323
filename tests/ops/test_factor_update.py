"""diag_factor_update_ against the reference and the dense SINGD update it implements."""

from __future__ import annotations

import pytest
import torch

from singd_cuda.ops import reference

from .conftest import DTYPES, LAYOUTS, SHAPES, assert_bitwise, clones, make


@pytest.mark.parametrize(("traces", "fp32_companions"), [("singd", False), ("ikfac", True)])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_diag_factor_update(device, gen, dtype, layout, traces, fp32_companions):
    companion = torch.float32 if fp32_companions else dtype
    k = [make(s, dtype, device, gen, layout, low=0.5) for s in SHAPES]
    m = [make(s, companion, device, gen, layout) for s in SHAPES]
    h = [make(s, companion, device, gen, layout, low=0.0) for s in SHAPES]
    if traces == "singd":
        a = [make((), torch.float32, device, gen, low=0.5) for _ in SHAPES]
        b = [make((1,), dtype, device, gen, low=0.5) for _ in SHAPES]
        alpha1 = 0.5
    else:
        a, b, alpha1 = [], [], 0.0
    ref_k, ref_m = clones(k), clones(m)
    torch.ops.singd_cuda.diag_factor_update_(k, m, h, a, b, alpha1, 0.01, 1e-3)
    reference.diag_factor_update_(ref_k, ref_m, h, a, b, alpha1=alpha1, beta1=0.01, damping=1e-3)
    assert_bitwise(k, ref_k)
    assert_bitwise(m, ref_m)


def test_reference_matches_the_dense_update(gen):
    """m̂ = ½[a·diag(H) + λ·b·k² − 1], m ← α₁m + m̂, K ← K(I − β₁ m) for diagonal K."""
    d = 6
    k = make((d,), torch.float64, "cpu", gen, low=0.5)
    m = make((d,), torch.float64, "cpu", gen)
    h = make((d,), torch.float64, "cpu", gen, low=0.0)
    a, b = torch.tensor(1.3, dtype=torch.float64), torch.tensor(0.7, dtype=torch.float64)
    K, M = torch.diag(k), torch.diag(m)
    M_hat = 0.5 * (a * torch.diag(h) + 1e-3 * b * K.T @ K - torch.eye(d, dtype=torch.float64))
    M_new = 0.5 * M + M_hat
    K_new = K @ (torch.eye(d, dtype=torch.float64) - 0.01 * M_new)
    reference.diag_factor_update_([k], [m], [h], [a], [b], alpha1=0.5, beta1=0.01, damping=1e-3)
    torch.testing.assert_close(k, K_new.diagonal())
    torch.testing.assert_close(m, M_new.diagonal())


def test_invalid_traces_raise(cpu_ops):
    k = [torch.ones(3), torch.ones(2)]
    with pytest.raises(RuntimeError, match="a has 1 tensors, expected 0 or 2"):
        cpu_ops.diag_factor_update_(k, clones(k), k, [torch.ones(())], [], 0.5, 0.1, 0.0)
    with pytest.raises(RuntimeError, match="b must have one element"):
        cpu_ops.diag_factor_update_(k, clones(k), k, [], [torch.ones(2)] * 2, 0.5, 0.1, 0.0)
