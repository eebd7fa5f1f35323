"""Hypothesis property tests over every registered structure family, in float64.

Each example draws the family's parameters (block size, rank, k1/k2, ...) from
1..90 and the size d from 1..80, so parameters both fit inside and exceed d.
Random matrices come from a torch generator seeded by hypothesis.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from singd_cuda.structures import FAMILIES

from .conftest import assert_close_normwise

F64 = torch.float64
PROPERTY_SETTINGS = settings(max_examples=40, deadline=None)


@st.composite
def cases(draw, family):
    """(S, d, seed): a bound structure class, a size and a generator seed."""
    values = draw(st.tuples(*(st.integers(1, 90) for _ in family.parameters)))
    return family.bind(*values), draw(st.integers(1, 80)), draw(st.integers(0, 2**32 - 1))


def draw_case(data, family):
    """Draw (S, d, seed) (hypothesis reports it on failure); return S, d and a generator."""
    S, d, seed = data.draw(cases(family))
    return S, d, torch.Generator().manual_seed(seed)


def randn(*shape, gen):
    return torch.randn(*shape, dtype=F64, generator=gen)


def symmetric(d, gen):
    A = randn(d, d, gen=gen)
    return A + A.T


families = pytest.mark.parametrize("family", list(FAMILIES.values()), ids=list(FAMILIES))


@families
@PROPERTY_SETTINGS
@given(data=st.data(), beta=st.floats(-2.0, 2.0))
def test_closed_under_factor_update(family, data, beta):
    """K(I - βm) = K - β K m is computed in the family and equals the dense update."""
    S, d, gen = draw_case(data, family)
    K, m = S.from_dense(randn(d, d, gen=gen)), S.from_dense(randn(d, d, gen=gen))
    Kd, md = K.to_dense(), m.to_dense()
    expected = Kd - beta * Kd @ md
    updated = K.clone().add_(K @ m, alpha=-beta)
    assert type(updated) is S
    assert_close_normwise(updated.to_dense(), expected, F64)
    assert_close_normwise(S.from_dense(expected).to_dense(), expected, F64)


@families
@PROPERTY_SETTINGS
@given(data=st.data())
def test_project_preserves_trace(family, data):
    S, d, gen = draw_case(data, family)
    M = symmetric(d, gen)
    error = (S.project(M).trace() - M.trace()).abs()
    assert error <= 1e-10 * M.diagonal().abs().sum().clamp_min(1e-30)


@families
@PROPERTY_SETTINGS
@given(data=st.data())
def test_project_is_idempotent(family, data):
    """Projecting the symmetrised projection gives the projection back."""
    S, d, gen = draw_case(data, family)
    P = S.project(symmetric(d, gen)).to_dense()
    assert_close_normwise(S.project((P + P.T) / 2).to_dense(), P, F64)


@families
@PROPERTY_SETTINGS
@given(data=st.data(), n=st.integers(1, 20))
def test_project_gram_is_projected_gram(family, data, n):
    S, d, gen = draw_case(data, family)
    Y = randn(n, d, gen=gen)
    P = S.project_gram(Y)
    assert type(P) is S and P.dtype == F64
    assert_close_normwise(P.to_dense(), S.project(Y.T @ Y).to_dense(), F64)
