"""Toeplitz-specific checks beyond the generic contract tests."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from singd_cuda.structures import TrilToeplitz, TriuToeplitz, get
from singd_cuda.structures import toeplitz as toeplitz_module

from .conftest import assert_close_normwise


def test_coefficient_layout_matches_hand_built_matrices():
    c = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64)
    lower = torch.tensor(
        [[1, 0, 0, 0], [2, 1, 0, 0], [3, 2, 1, 0], [4, 3, 2, 1]], dtype=torch.float64
    )
    assert torch.equal(TrilToeplitz(4, coeffs=c).to_dense(), lower)
    assert torch.equal(TriuToeplitz(4, coeffs=c).to_dense(), lower.T)
    assert get("tril_toeplitz") is TrilToeplitz and get("triu_toeplitz") is TriuToeplitz
    assert TrilToeplitz(4, coeffs=c).trace() == 4.0
    assert TrilToeplitz.eye(3).parts["coeffs"].tolist() == [1.0, 0.0, 0.0]


def test_from_dense_averages_each_diagonal():
    M = torch.tensor([[1.0, 2.0, 7.0], [3.0, 5.0, 4.0], [6.0, 9.0, 0.0]], dtype=torch.float64)
    # lower: diagonal (1, 5, 0), 1st sub-diagonal (3, 9), 2nd (6); upper: (2, 4), (7)
    assert TrilToeplitz.from_dense(M).parts["coeffs"].tolist() == [2.0, 6.0, 6.0]
    assert TriuToeplitz.from_dense(M).parts["coeffs"].tolist() == [2.0, 3.0, 7.0]

    gen = torch.Generator().manual_seed(1)
    for d in (1, 5, 40):
        M = torch.randn(d, d, dtype=torch.float64, generator=gen)
        tril = TrilToeplitz.from_dense(M).parts["coeffs"]
        triu = TriuToeplitz.from_dense(M).parts["coeffs"]
        expected_tril = torch.stack([M.diagonal(-j).mean() for j in range(d)])
        expected_triu = torch.stack([M.diagonal(j).mean() for j in range(d)])
        torch.testing.assert_close(tril, expected_tril, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(triu, expected_triu, rtol=1e-12, atol=1e-12)


def test_from_dense_keeps_constant_diagonals_exactly():
    c = torch.tensor([0.1, 1 / 3, -2.7, 1e-3, 5.5, 0.7], dtype=torch.float64)
    for S in (TrilToeplitz, TriuToeplitz):
        assert torch.equal(S.from_dense(S(6, coeffs=c).to_dense()).parts["coeffs"], c)


@pytest.mark.parametrize("d", [1, 3, 33, 100])
def test_triu_is_tril_transposed(d):
    gen = torch.Generator().manual_seed(d)
    a = torch.randn(d, dtype=torch.float64, generator=gen)
    b = torch.randn(d, dtype=torch.float64, generator=gen)
    X = torch.randn(d, 4, dtype=torch.float64, generator=gen)
    Y = torch.randn(6, d, dtype=torch.float64, generator=gen)
    L, U = TrilToeplitz(d, coeffs=a), TriuToeplitz(d, coeffs=a)
    assert torch.equal(U.to_dense(), L.to_dense().T)
    torch.testing.assert_close(U.matmul(X), L.rmatmul(X), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(U.rmatmul(X), L.matmul(X), rtol=1e-12, atol=1e-12)
    # U(a) U(b) = (L(b) L(a))ᵀ = U(a * b): the same coefficients as the lower product.
    product_u = (U @ TriuToeplitz(d, coeffs=b)).parts["coeffs"]
    product_l = (L @ TrilToeplitz(d, coeffs=b)).parts["coeffs"]
    torch.testing.assert_close(product_u, product_l, rtol=1e-12, atol=1e-12)
    # Π̂ of a symmetric matrix (and of KᵀK, whose diagonal sums agree) is the same vector.
    torch.testing.assert_close(
        TriuToeplitz.project_gram(Y).parts["coeffs"],
        TrilToeplitz.project_gram(Y).parts["coeffs"],
    )
    torch.testing.assert_close(U.project_inner().parts["coeffs"], L.project_inner().parts["coeffs"])


@pytest.mark.parametrize("S", [TrilToeplitz, TriuToeplitz], ids=lambda S: S.name)
@pytest.mark.parametrize("d", [257, 600])
def test_project_inner_closed_form_against_dense(S, d):
    """Π̂(KᵀK) from the weighted autocorrelation, at sizes beyond the contract's."""
    gen = torch.Generator().manual_seed(d)
    K = S(d, coeffs=torch.randn(d, dtype=torch.float64, generator=gen))
    Kd = K.to_dense()
    expected = S.project(Kd.T @ Kd).to_dense()
    assert_close_normwise(K.project_inner().to_dense(), expected, torch.float64)


def test_result_dtypes_promote():
    K = TrilToeplitz.eye(40, dtype=torch.bfloat16)
    assert K.matmul(torch.ones(40, 2)).dtype == torch.float32
    assert K.to(torch.float64).rmatmul(torch.ones(40, 2)).dtype == torch.float64
    assert TriuToeplitz.eye(40, dtype=torch.float16).matmul(torch.ones(40, 2)).dtype == (
        torch.float32
    )
    assert (K @ TrilToeplitz.eye(40)).dtype == torch.bfloat16


def test_large_d_against_float64_direct():
    """d = 4096, float32 FFT paths against direct float64 sums on a few columns / lags."""
    d = 4096
    gen = torch.Generator().manual_seed(0)
    c = torch.randn(d, generator=gen)
    X = torch.randn(d, 3, generator=gen)
    Y = torch.randn(8, d, generator=gen)
    c64, X64, Y64 = c.double().numpy(), X.double().numpy(), Y.double().numpy()

    lower, upper = TrilToeplitz(d, coeffs=c), TriuToeplitz(d, coeffs=c)
    out_lower, out_upper = lower.matmul(X), upper.matmul(X)
    for col in range(X.shape[1]):
        # L(c) x: causal convolution; U(c) x = L(c)ᵀ x: the correlation, reversed.
        causal = np.convolve(c64, X64[:, col])[:d]
        anticausal = np.convolve(c64, X64[::-1, col])[:d][::-1].copy()
        assert_close_normwise(out_lower[:, col], torch.from_numpy(causal), torch.float32)
        assert_close_normwise(out_upper[:, col], torch.from_numpy(anticausal), torch.float32)
    assert_close_normwise(lower.rmatmul(X), out_upper, torch.float32)

    coeffs = TrilToeplitz.project_gram(Y).parts["coeffs"]
    lags = [0, 1, 2, 17, 1000, 4094, 4095]
    expected = []
    for j in lags:
        lagged = float((Y64[:, : d - j] * Y64[:, j:]).sum())
        expected.append(lagged / d if j == 0 else 2 * lagged / (d - j))
    assert_close_normwise(coeffs[lags], torch.tensor(expected), torch.float32)


@pytest.mark.parametrize("S", [TrilToeplitz, TriuToeplitz], ids=lambda S: S.name)
def test_chunked_fft_paths(S, monkeypatch):
    """Rows split into several FFT batches (as for large d on the CPU) give the same result."""
    monkeypatch.setattr(toeplitz_module, "_CHUNK_ELEMENTS", 1)  # 8 rows per chunk
    d = 200
    gen = torch.Generator().manual_seed(3)
    K = S(d, coeffs=torch.randn(d, dtype=torch.float64, generator=gen))
    X = torch.randn(d, 70, dtype=torch.float64, generator=gen)
    Y = torch.randn(70, d, dtype=torch.float64, generator=gen)
    Kd = K.to_dense()
    assert_close_normwise(K.matmul(X), Kd @ X, torch.float64)
    assert_close_normwise(K.rmatmul(X), Kd.T @ X, torch.float64)
    assert_close_normwise(
        S.project_gram(Y).to_dense(), S.project(Y.T @ Y).to_dense(), torch.float64
    )


@pytest.mark.parametrize("S", [TrilToeplitz, TriuToeplitz], ids=lambda S: S.name)
@pytest.mark.parametrize("d", [129, 300, 513, 545, 1024])
@pytest.mark.parametrize("n", [19, 20])
def test_wrapped_outputs_and_times_transpose(S, d, n, monkeypatch):
    """FFT lengths below 2d - 1 (the outputs that wrap around computed directly, e of
    them: 57 at d = 129, 1 at 513, 9 at 545, none at 1024), in float64 against dense,
    over several chunks of rows (real rows for odd n, pairs of columns for even n);
    K Kᵀ as one operator, for both triangles."""
    monkeypatch.setattr(toeplitz_module, "_CHUNK_ELEMENTS", 1)  # 8 rows per chunk
    n_fft = toeplitz_module._fft_length(d)
    assert 2 * d - 1 - toeplitz_module._DIRECT_TAIL <= n_fft
    gen = torch.Generator().manual_seed(d)
    K = S(d, coeffs=torch.randn(d, dtype=torch.float64, generator=gen))
    M = S(d, coeffs=torch.randn(d, dtype=torch.float64, generator=gen))
    X = torch.randn(d, n, dtype=torch.float64, generator=gen)
    Y = torch.randn(19, d, dtype=torch.float64, generator=gen)
    Kd = K.to_dense()
    assert_close_normwise(K.matmul(X), Kd @ X, torch.float64)
    assert_close_normwise(K.rmatmul(X), Kd.T @ X, torch.float64)
    assert_close_normwise((K @ M).to_dense(), Kd @ M.to_dense(), torch.float64)
    assert_close_normwise(
        S.project_gram(Y).to_dense(), S.project(Y.T @ Y).to_dense(), torch.float64
    )
    P = K.times_transpose()
    out = P.matmul(X)
    assert out.dtype == torch.float64 and out.T.is_contiguous()
    assert_close_normwise(out, Kd @ Kd.T @ X, torch.float64)
    assert_close_normwise(P.matmul(X[:, 0]), Kd @ Kd.T @ X[:, 0], torch.float64)
    assert_close_normwise(P.to_dense(), Kd @ Kd.T, torch.float64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_times_transpose_low_precision(dtype):
    """Half storage: K Kᵀ X in float32 from the stored (rounded) coefficients, to the
    float32 bound; float32 X with a float64 factor promotes to float64."""
    d = 700
    gen = torch.Generator().manual_seed(7)
    c = torch.randn(d, generator=gen) / d**0.5
    c[0] = 1.0
    K = TrilToeplitz(d, coeffs=c.to(dtype))
    X = torch.randn(d, 6, generator=gen).to(dtype)
    Kd = K.to_dense().double()
    out = K.times_transpose().matmul(X)
    assert out.dtype == torch.float32
    assert_close_normwise(out, Kd @ Kd.T @ X.double(), torch.float32)
    wide = K.to(torch.float64).times_transpose().matmul(X.float())
    assert wide.dtype == torch.float64
    assert_close_normwise(wide, Kd @ Kd.T @ X.double(), torch.float64)


@pytest.mark.parametrize("S", [TrilToeplitz, TriuToeplitz], ids=lambda S: S.name)
@pytest.mark.parametrize("d", [130, 2048])
def test_products_in_every_layout(S, d, monkeypatch):
    """K X, Kᵀ X and K Kᵀ X in float64 against dense for the layouts that take different
    paths: row-major X with an even number of columns (pairs of columns as complex
    signals, over several chunks), odd, a column slice, a contiguous matrix at an odd
    storage offset (no complex view), the transposed
    view of a row-major matrix (real rows), a vector and no columns. Every matrix
    result is the transposed view of a contiguous (n, d) tensor."""
    monkeypatch.setattr(toeplitz_module, "_CHUNK_ELEMENTS", 1)  # 8 (pairs of) rows per chunk
    gen = torch.Generator().manual_seed(d)
    K = S(d, coeffs=torch.randn(d, dtype=torch.float64, generator=gen))
    Kd = K.to_dense()
    wide = torch.randn(d, 41, dtype=torch.float64, generator=gen)
    layouts = {
        "even": wide[:, :40].contiguous(),
        "odd": wide[:, :37].contiguous(),
        "column slice": wide[:, 1:39],
        "odd storage offset": torch.randn(d * 40 + 1, dtype=torch.float64, generator=gen)[1:].view(
            d, 40
        ),
        "transposed": torch.randn(34, d, dtype=torch.float64, generator=gen).T,
        "empty": wide[:, :0].contiguous(),
    }
    P = K.times_transpose()
    for name, X in layouts.items():
        for out, expected in (
            (K.matmul(X), Kd @ X),
            (K.rmatmul(X), Kd.T @ X),
            (P.matmul(X), Kd @ (Kd.T @ X)),
        ):
            assert out.shape == X.shape and out.T.is_contiguous(), name
            assert_close_normwise(out, expected, torch.float64)
    x = wide[:, 0]
    assert_close_normwise(K.matmul(x), Kd @ x, torch.float64)
    assert_close_normwise(P.matmul(x), Kd @ (Kd.T @ x), torch.float64)


def test_paired_columns_in_float32():
    """Pairs of float32 columns, one of them 1e4 times smaller: each result within the
    float32 bound of the larger column of its pair (the paired FFT's error bound)."""
    d = 1000
    gen = torch.Generator().manual_seed(11)
    c = torch.randn(d, generator=gen) / d**0.5
    X = torch.randn(d, 8, generator=gen)
    X[:, 1::2] *= 1e-4
    for S in (TrilToeplitz, TriuToeplitz):
        Kd = S(d, coeffs=c.double()).to_dense()
        out = S(d, coeffs=c).matmul(X)
        assert out.dtype == torch.float32
        expected = Kd @ X.double()
        for j in range(0, 8, 2):
            assert_close_normwise(out[:, j : j + 2], expected[:, j : j + 2], torch.float32)
