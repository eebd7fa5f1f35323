"""The structure registry: names to bound classes, caching, defaults and errors."""

from __future__ import annotations

import pytest
import torch

from singd_cuda import structures
from singd_cuda.structures import FAMILIES, BlockDiagonal, Dense, get


def test_parametrised_name_binds_its_parameters():
    S = get("block_diagonal:32")
    assert issubclass(S, BlockDiagonal)
    assert S.block_size == 32
    assert S.bound_values() == (32,)
    assert S.spec() == "block_diagonal:32"


def test_equal_specs_give_the_same_class():
    assert get("block_diagonal:32") is get("block_diagonal:32")
    assert get("block_diagonal:7") is BlockDiagonal.bind(7)
    assert get("block_diagonal:7") is not get("block_diagonal:8")


@pytest.mark.parametrize("name", list(FAMILIES))
def test_plain_name_binds_the_defaults(name):
    S = get(name)
    assert S.bound_values() == FAMILIES[name].default_values
    assert S is get(S.spec())


def test_plain_block_diagonal_is_block_size_32():
    assert get("block_diagonal") is get("block_diagonal:32")


def test_a_class_passes_through():
    S = get("block_diagonal:5")
    assert get(S) is S
    assert get(Dense) is Dense
    assert get(BlockDiagonal) is get("block_diagonal:32")


@pytest.mark.parametrize(
    "spec",
    [
        "no_such_structure",
        "blockdiagonal:32",
        "block_diagonal:x",
        "block_diagonal:3.5",
        "block_diagonal:0",
        "block_diagonal:-4",
        "block_diagonal:4,4",
        "dense:3",
        3,
    ],
)
def test_bad_specs_raise_listing_the_valid_names(spec):
    with pytest.raises(ValueError) as error:
        get(spec)
    message = str(error.value)
    assert all(f"'{name}" in message for name in FAMILIES), message
    assert structures.valid_names() in message


@pytest.mark.parametrize("d", [1, 2, 7, 31, 64, 129])
@pytest.mark.parametrize("extra", [0, 1, 200])
def test_block_size_at_least_d_is_exactly_dense(d, extra):
    S = get(f"block_diagonal:{d + extra}")
    gen = torch.Generator().manual_seed(d)
    M, N, Y, X = (
        torch.randn(*s, dtype=torch.float64, generator=gen)
        for s in [(d, d), (d, d), (9, d), (d, 5)]
    )
    K, D = S.from_dense(M), Dense.from_dense(M)
    L, E = S.from_dense(N), Dense.from_dense(N)
    assert torch.equal(K.to_dense(), M)
    assert torch.equal(
        S.eye(d, dtype=torch.float64).to_dense(), Dense.eye(d, dtype=torch.float64).to_dense()
    )
    assert torch.equal(S.project(M + M.T).to_dense(), M + M.T)
    # products may run as a batched matmul here and a plain one there: equal up to the
    # float64 summation order, which differs between BLAS builds
    close = dict(rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(
        S.project_gram(Y).to_dense(), Dense.project_gram(Y).to_dense(), **close
    )
    torch.testing.assert_close(K.matmul(X), D.matmul(X), **close)
    torch.testing.assert_close(K.rmatmul(X), D.rmatmul(X), **close)
    torch.testing.assert_close((K @ L).to_dense(), (D @ E).to_dense(), **close)
    torch.testing.assert_close(K.project_inner().to_dense(), D.project_inner().to_dense(), **close)
    torch.testing.assert_close(
        K.times_transpose().to_dense(), D.times_transpose().to_dense(), **close
    )
    torch.testing.assert_close(K.trace(), D.trace(), **close)
