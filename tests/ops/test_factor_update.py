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


@pytest.mark.parametrize("traces", ["singd", "ikfac"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
def test_stacked_factors_update_as_their_rows(cpu_ops, gen, dtype, traces):
    """A 2-D (n, d) k[i] whose a[i] and b[i] hold n values is n factors, its rows: bitwise
    the update of each row alone, for rows padded apart in a wider buffer (as resident
    stacks lie), statistics of another row stride, and a, b as strided columns; the
    reference does the same."""
    n, d = 5, 7
    k = make((n, d + 9), dtype, "cpu", gen, low=0.5)[:, :d]  # rows 16 apart
    m = make((n, d + 3), torch.float32, "cpu", gen)[:, :d]
    h = make((n, d), torch.float32, "cpu", gen, low=0.0)
    means = make((n, 2), torch.float32, "cpu", gen, low=0.5)
    traces_ = make((n, 2), torch.float32, "cpu", gen, low=0.5)
    a, b = ([means[:, 0]], [traces_[:, 1:2]]) if traces == "singd" else ([], [])
    rows_k, rows_m = clones(list(k.unbind())), clones(list(m.unbind()))
    row_a = [means[r, 0:1] for r in range(n)] if a else []
    row_b = [traces_[r, 1:2] for r in range(n)] if b else []
    ref_k, ref_m = k.clone(), m.clone()
    cpu_ops.diag_factor_update_([k], [m], [h], a, b, 0.5, 0.01, 1e-3)
    cpu_ops.diag_factor_update_(rows_k, rows_m, list(h.unbind()), row_a, row_b, 0.5, 0.01, 1e-3)
    assert_bitwise(list(k.unbind()), rows_k)
    assert_bitwise(list(m.unbind()), rows_m)
    reference.diag_factor_update_([ref_k], [ref_m], [h], a, b, alpha1=0.5, beta1=0.01, damping=1e-3)
    assert_bitwise([k, m], [ref_k, ref_m])


def test_stacked_values_must_match_the_rows(cpu_ops):
    k = [torch.ones(3, 4)]
    with pytest.raises(RuntimeError, match=r"a\[0\] has 2 elements, expected 1"):
        cpu_ops.diag_factor_update_(k, clones(k), k, [torch.ones(2)], [], 0.5, 0.1, 0.0)
    with pytest.raises(RuntimeError, match=r"a\[0\] has 3 elements, expected 1"):
        cpu_ops.diag_factor_update_(
            k, clones(k), k, [torch.ones(3)], [torch.ones(1)], 0.5, 0.1, 0.0
        )


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
    with pytest.raises(RuntimeError, match=r"b\[0\] has 2 elements, expected 1"):
        cpu_ops.diag_factor_update_(k, clones(k), k, [], [torch.ones(2)] * 2, 0.5, 0.1, 0.0)
