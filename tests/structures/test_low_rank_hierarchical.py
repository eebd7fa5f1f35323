"""Structure-specific checks for ``low_rank`` and ``hierarchical``: the part layout,
the clamping of the block sizes for small d, and the exact reduction to ``dense``."""

from __future__ import annotations

import pytest
import torch

from .conftest import DTYPES, assert_close_normwise, get, random_member
from .test_contract import reference_projection


def test_low_rank_layout():
    S = get("low_rank:2")
    A = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    B = torch.tensor([[5.0, 6.0], [7.0, 8.0], [9.0, 10.0]])
    D = torch.tensor([11.0, 12.0, 13.0])
    expected = torch.tensor(
        [
            [1.0, 2.0, 0.0, 0.0, 0.0],
            [3.0, 4.0, 0.0, 0.0, 0.0],
            [5.0, 6.0, 11.0, 0.0, 0.0],
            [7.0, 8.0, 0.0, 12.0, 0.0],
            [9.0, 10.0, 0.0, 0.0, 13.0],
        ]
    )
    K = S.from_parts(5, {"A": A, "B": B, "D": D})
    assert torch.equal(K.to_dense(), expected)
    parts = S.from_dense(expected).parts
    assert all(torch.equal(parts[n], p) for n, p in {"A": A, "B": B, "D": D}.items())


def test_hierarchical_layout():
    S = get("hierarchical:2,3")
    A = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    B = torch.arange(10.0, 20.0).reshape(2, 5)  # [B1 B2], B1: 2 x 2, B2: 2 x 3
    c = torch.tensor([5.0, 6.0])
    D = torch.arange(20.0, 26.0).reshape(3, 2)
    E = torch.arange(30.0, 39.0).reshape(3, 3)
    expected = torch.tensor(
        [
            [1.0, 2.0, 10.0, 11.0, 12.0, 13.0, 14.0],
            [3.0, 4.0, 15.0, 16.0, 17.0, 18.0, 19.0],
            [0.0, 0.0, 5.0, 0.0, 0.0, 0.0, 0.0],
            [0.0, 0.0, 0.0, 6.0, 0.0, 0.0, 0.0],
            [0.0, 0.0, 20.0, 21.0, 30.0, 31.0, 32.0],
            [0.0, 0.0, 22.0, 23.0, 33.0, 34.0, 35.0],
            [0.0, 0.0, 24.0, 25.0, 36.0, 37.0, 38.0],
        ]
    )
    given = {"A": A, "B": B, "c": c, "D": D, "E": E}
    assert torch.equal(S.from_parts(7, given).to_dense(), expected)
    parts = S.from_dense(expected).parts
    assert all(torch.equal(parts[n], p) for n, p in given.items())


@pytest.mark.parametrize(
    ("spec", "d", "sizes"),
    [
        ("hierarchical:2,3", 1, (1, 0, 0)),
        ("hierarchical:2,3", 2, (2, 0, 0)),
        ("hierarchical:2,3", 3, (2, 0, 1)),
        ("hierarchical:2,3", 5, (2, 0, 3)),
        ("hierarchical:2,3", 6, (2, 1, 3)),
        ("hierarchical:15,15", 20, (15, 0, 5)),
        ("hierarchical:15,15", 31, (15, 1, 15)),
        ("hierarchical:200,5", 129, (129, 0, 0)),
    ],
)
def test_hierarchical_clamping(spec, d, sizes):
    S = get(spec)
    assert S.block_sizes(d) == sizes
    k1, m, k2 = sizes
    shapes = {n: tuple(p.shape) for n, p in S.eye(d).parts.items()}
    assert shapes == {"A": (k1, k1), "B": (k1, m + k2), "c": (m,), "D": (k2, m), "E": (k2, k2)}


@pytest.mark.parametrize(("rank", "d", "k"), [(8, 1, 1), (8, 3, 3), (8, 8, 8), (3, 7, 3)])
def test_low_rank_clamping(rank, d, k):
    S = get(f"low_rank:{rank}")
    assert S.block_size(d) == k
    shapes = {n: tuple(p.shape) for n, p in S.eye(d).parts.items()}
    assert shapes == {"A": (k, k), "B": (d - k, k), "D": (d - k,)}


@pytest.mark.parametrize(
    ("spec", "d"),
    [
        ("hierarchical:2,3", 3),
        ("hierarchical:2,3", 4),
        ("hierarchical:2,3", 5),
        ("hierarchical:15,15", 20),
    ],
)
def test_hierarchical_without_middle_block_matches_dense(spec, d, gen):
    """Empty middle block (d <= k1 + k2), sizes the shared contract tests do not reach."""
    S, dtype = get(spec), torch.float64
    K, M = random_member(S, d, dtype, gen), random_member(S, d, dtype, gen)
    Kd, Md = K.to_dense(), M.to_dense()
    X = torch.randn(d, 3, dtype=dtype, generator=gen)
    Y = torch.randn(6, d, dtype=dtype, generator=gen)
    assert_close_normwise(K.matmul(X), Kd @ X, dtype)
    assert_close_normwise(K.rmatmul(X), Kd.T @ X, dtype)
    assert_close_normwise((K @ M).to_dense(), Kd @ Md, dtype)
    gram = reference_projection(S, Y.T @ Y)
    assert_close_normwise(S.project_gram(Y).to_dense(), gram, dtype)
    assert_close_normwise(S.project(Y.T @ Y).to_dense(), gram, dtype)
    assert_close_normwise(K.project_inner().to_dense(), reference_projection(S, Kd.T @ Kd), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d", [1, 7, 31])
@pytest.mark.parametrize("spec", ["low_rank:200", "hierarchical:200,5", "hierarchical:31,4"])
def test_reduces_to_dense_exactly(spec, d, dtype, gen):
    """rank >= d / k1 >= d: the same storage and bit-identical results as ``dense``."""
    S, Dense = get(spec), get("dense")
    M0 = torch.randn(d, d, dtype=torch.float64, generator=gen).to(dtype)
    M1 = torch.randn(d, d, dtype=torch.float64, generator=gen).to(dtype)
    X = torch.randn(d, 4, dtype=torch.float64, generator=gen).to(dtype)
    Y = torch.randn(9, d, dtype=torch.float64, generator=gen).to(dtype)
    K, M, KD, MD = S.from_dense(M0), S.from_dense(M1), Dense.from_dense(M0), Dense.from_dense(M1)
    assert K.nbytes == KD.nbytes
    assert torch.equal(K.to_dense(), M0)
    assert torch.equal(K.matmul(X), KD.matmul(X))
    assert torch.equal(K.rmatmul(X), KD.rmatmul(X))
    assert torch.equal((K @ M).to_dense(), (KD @ MD).to_dense())
    assert torch.equal(K.project_inner().to_dense(), KD.project_inner().to_dense())
    assert torch.equal(S.project_gram(Y).to_dense(), Dense.project_gram(Y).to_dense())
    sym = M0 + M0.T
    assert torch.equal(S.project(sym).to_dense(), Dense.project(sym).to_dense())
    assert torch.equal(K.trace(), KD.trace())
    K.add_(M, alpha=-0.5).mul_(3.0)
    KD.add_(MD, alpha=-0.5).mul_(3.0)
    assert torch.equal(K.to_dense(), KD.to_dense())


@pytest.mark.parametrize("spec", ["low_rank:3", "hierarchical:2,3"])
@pytest.mark.parametrize(
    ("k_dtype", "x_dtype"),
    [
        (torch.bfloat16, torch.float32),
        (torch.float32, torch.float64),
        (torch.float16, torch.bfloat16),
    ],
)
def test_mixed_dtypes_promote(spec, k_dtype, x_dtype, gen):
    S, d = get(spec), 9
    K, M = random_member(S, d, k_dtype, gen), random_member(S, d, x_dtype, gen)
    X = torch.randn(d, 2, generator=gen).to(x_dtype)
    out_dtype = torch.promote_types(k_dtype, x_dtype)
    Kd, Xd = K.to_dense().double(), X.double()
    assert K.matmul(X).dtype == out_dtype and K.rmatmul(X).dtype == out_dtype
    assert_close_normwise(K.matmul(X), Kd @ Xd, k_dtype)
    assert_close_normwise(K.rmatmul(X), Kd.T @ Xd, k_dtype)
    KM = K @ M
    assert KM.dtype == k_dtype
    assert_close_normwise(KM.to_dense(), Kd @ M.to_dense().double(), k_dtype)


@pytest.mark.parametrize("spec", ["low_rank:3", "hierarchical:2,3"])
def test_wrong_part_shapes_are_rejected(spec):
    S = get(spec)
    parts = {n: p.clone() for n, p in S.eye(7).parts.items()}
    with pytest.raises(ValueError, match="must have shape"):
        S.from_parts(8, parts)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("spec", ["hierarchical:2,3", "hierarchical:15,15", "hierarchical:200,5"])
@pytest.mark.parametrize("d", [7, 64, 129])
def test_times_transpose_of_a_transposed_view(spec, d, dtype, gen):
    """K Kᵀ Gᵀ with Gᵀ a transposed view (the preconditioner's layout) takes the row-wise
    path: the same result as dense, returned as the transposed view of a contiguous tensor."""
    K = random_member(get(spec), d, dtype, gen)
    G = torch.randn(9, d, dtype=torch.float64, generator=gen).to(dtype)
    Kd = K.to_dense().double()
    out = K.times_transpose().matmul(G.T)
    assert out.T.is_contiguous()
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    assert out.dtype == acc
    assert_close_normwise(out, Kd @ Kd.T @ G.double().T, acc)
