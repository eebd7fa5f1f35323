"""Every structure, every operation, against its dense counterpart.

Members are random and non-symmetric (the published reference implementation's
block-diagonal bug hides behind symmetric test matrices). References are computed
in float64 from the same (rounded) inputs.
"""

from __future__ import annotations

import pytest
import torch

from singd_cuda.structures.base import accumulation_dtype

from .conftest import (
    DTYPES,
    SIZES,
    SPECS,
    assert_close_normwise,
    free_mask,
    get,
    random_member,
)

CASES = [(spec, d) for spec in SPECS for d in SIZES]
IDS = [f"{spec}-d{d}" for spec, d in CASES]


def symmetric(d, gen):
    A = torch.randn(d, d, dtype=torch.float64, generator=gen)
    return A + A.T


def reference_projection(S, M: torch.Tensor):
    """Π̂(M) from the rule: mirror free keeps M_ij, mirror fixed adds M_ji, ties average."""
    mask = free_mask(S, M.shape[0])
    return S.from_dense(M + (~mask.T) * M.T).to_dense()


@pytest.mark.parametrize(("spec", "d"), CASES, ids=IDS)
class TestFamily:
    def test_from_dense_is_orthogonal_projection_onto_family(self, spec, d, gen):
        S = get(spec)
        M = torch.randn(d, d, dtype=torch.float64, generator=gen)
        P = S.from_dense(M).to_dense()
        assert torch.equal(S.from_dense(P).to_dense(), P), "from_dense(P) must keep a member"
        Z = random_member(S, d, torch.float64, gen).to_dense()
        assert abs(((M - P) * Z).sum()) <= 1e-10 * M.abs().sum()
        assert torch.equal(P[~free_mask(S, d)], torch.zeros_like(P[~free_mask(S, d)]))

    def test_eye_and_zeros(self, spec, d):
        S = get(spec)
        assert torch.equal(
            S.eye(d, dtype=torch.float64).to_dense(), torch.eye(d, dtype=torch.float64)
        )
        assert torch.equal(S.zeros(d, dtype=torch.float64).to_dense(), torch.zeros(d, d).double())
        assert S.eye(d, dtype=torch.bfloat16).dtype == torch.bfloat16

    def test_project_matches_rule(self, spec, d, gen):
        S = get(spec)
        M = symmetric(d, gen)
        P = S.project(M)
        assert_close_normwise(P.to_dense(), reference_projection(S, M), torch.float64)
        torch.testing.assert_close(P.trace(), M.trace(), rtol=1e-10, atol=1e-10)

    def test_project_is_idempotent(self, spec, d, gen):
        S = get(spec)
        P = S.project(symmetric(d, gen)).to_dense()
        again = S.project((P + P.T) / 2).to_dense()
        assert_close_normwise(again, P, torch.float64)

    def test_closure_under_factor_update(self, spec, d, gen):
        S = get(spec)
        K, m = random_member(S, d, torch.float64, gen), random_member(S, d, torch.float64, gen)
        expected = K.to_dense() - 0.1 * K.to_dense() @ m.to_dense()
        updated = K.clone().add_(K @ m, alpha=-0.1)
        assert_close_normwise(updated.to_dense(), expected, torch.float64)

    def test_nbytes_counts_storage(self, spec, d):
        S = get(spec)
        K64, K16 = S.eye(d, dtype=torch.float64), S.eye(d, dtype=torch.bfloat16)
        assert K64.nbytes == 4 * K16.nbytes
        assert K64.nbytes == sum(p.numel() for p in K64.parts.values()) * 8
        if spec != "dense" and d >= 64 and not spec.endswith(":200") and not spec.endswith(",5"):
            assert K64.nbytes <= d * d * 8 // 2, "structured storage must be well below dense"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("spec", "d"), CASES, ids=IDS)
class TestOperations:
    def test_matmul_and_rmatmul(self, spec, d, dtype, gen):
        S = get(spec)
        K = random_member(S, d, dtype, gen)
        X = torch.randn(d, 5, dtype=torch.float64, generator=gen).to(dtype)
        Kd, Xd = K.to_dense().double(), X.double()
        out, rout = K.matmul(X), K.rmatmul(X)
        assert out.dtype == dtype and rout.dtype == dtype
        assert_close_normwise(out, Kd @ Xd, dtype)
        assert_close_normwise(rout, Kd.T @ Xd, dtype)

    def test_structured_product(self, spec, d, dtype, gen):
        S = get(spec)
        K, M = random_member(S, d, dtype, gen), random_member(S, d, dtype, gen)
        KM = K @ M
        assert type(KM) is type(K) and KM.dtype == dtype
        assert_close_normwise(KM.to_dense(), K.to_dense().double() @ M.to_dense().double(), dtype)

    def test_project_gram(self, spec, d, dtype, gen):
        S = get(spec)
        Y = torch.randn(16, d, dtype=torch.float64, generator=gen).to(dtype)
        P = S.project_gram(Y)
        assert P.dtype == dtype
        Yd = Y.double()
        assert_close_normwise(P.to_dense(), reference_projection(S, Yd.T @ Yd), dtype)

    def test_project_inner(self, spec, d, dtype, gen):
        S = get(spec)
        K = random_member(S, d, dtype, gen)
        Kd = K.to_dense().double()
        assert_close_normwise(
            K.project_inner().to_dense(), reference_projection(S, Kd.T @ Kd), dtype
        )

    def test_times_transpose(self, spec, d, dtype, gen):
        """K Kᵀ exactly, in the accumulation dtype, where the structure has a cheap form;
        a clear error for the others. ``row_width`` bounds the average nonzeros per row."""
        S = get(spec)
        K = random_member(S, d, dtype, gen)
        Kd = K.to_dense().double()
        assert float((Kd != 0).sum()) <= d * S.row_width(d)
        if not S.has_times_transpose(d):
            with pytest.raises(NotImplementedError, match="no cheap form"):
                K.times_transpose()
            return
        P = K.times_transpose()
        X = torch.randn(d, 5, dtype=torch.float64, generator=gen).to(dtype)
        acc = torch.float64 if dtype == torch.float64 else torch.float32
        out = P.matmul(X)
        assert out.dtype == acc
        # products of the stored (rounded) entries, accumulated in float32: the float32
        # bound, not the storage dtype's
        assert_close_normwise(out, Kd @ Kd.T @ X.double(), acc)

    def test_in_place_arithmetic_and_scalars(self, spec, d, dtype, gen):
        S = get(spec)
        K, M = random_member(S, d, dtype, gen), random_member(S, d, dtype, gen)
        Kd, Md = K.to_dense().double(), M.to_dense().double()
        K.add_(M, alpha=-0.5).mul_(3.0)
        assert K.dtype == dtype
        expected = 3.0 * (Kd - 0.5 * Md)
        assert_close_normwise(K.to_dense(), expected, dtype)
        Kd = K.to_dense().double()
        assert_close_normwise(K.trace().reshape(1), Kd.trace().reshape(1), dtype)
        assert_close_normwise(K.abs_max().reshape(1), Kd.abs().max().reshape(1), dtype)
        assert K.trace().dtype == (torch.float64 if dtype == torch.float64 else torch.float32)

    def test_add_identity(self, spec, d, dtype, gen):
        S = get(spec)
        K = random_member(S, d, dtype, gen)
        expected = K.to_dense().double() + 2.0 * torch.eye(d, dtype=torch.float64)
        assert_close_normwise(K.add_identity_(2.0).to_dense(), expected, dtype)


@pytest.mark.parametrize("spec", SPECS)
def test_from_parts_round_trip(spec, gen):
    S = get(spec)
    K = random_member(S, 31, torch.float32, gen)
    rebuilt = S.from_parts(K.dim, {n: p.clone() for n, p in K.parts.items()})
    assert torch.equal(rebuilt.to_dense(), K.to_dense())


def test_mixing_structures_is_an_error(gen):
    K = get("dense").eye(4)
    with pytest.raises(ValueError, match="expected a diagonal matrix"):
        get("diagonal").eye(4).add_(K)
    with pytest.raises(ValueError, match="dimension 4"):
        get("diagonal").eye(5).add_(get("diagonal").eye(4))


@pytest.mark.parametrize(
    "spec",
    [
        "diagonal",
        "block_diagonal:32",
        "low_rank:8",
        "tril_toeplitz",
        "triu_toeplitz",
        "hierarchical:15,15",
    ],
)
def test_no_dense_temporaries(spec, gen):
    """No allocation of a d x d matrix (or anything near it) in non-dense structures."""
    S, d = get(spec), 2048
    K = random_member(S, d, torch.float32, gen)
    M = random_member(S, d, torch.float32, gen)
    Y = torch.randn(64, d, generator=gen)
    X = torch.randn(d, 64, generator=gen)
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
    ) as prof:
        S.project_gram(Y)
        K.matmul(X)
        K.rmatmul(X)
        K @ M
        K.project_inner()
        K.clone().add_(M, alpha=0.5).mul_(2.0)
        K.trace()
    largest = max((e.cpu_memory_usage for e in prof.events()), default=0)
    assert largest < d * d * 4 // 8, (
        f"{spec}: an allocation of {largest} bytes (d*d*4 = {d * d * 4})"
    )


@pytest.mark.parametrize(("spec", "d"), CASES, ids=IDS)
def test_gram_of_product(spec, d, gen):
    """Π̂(Kᵀ XᵀX K), SINGD's statistic: bitwise the projected Gram of rmatmul's XK (the
    composition every structure's own form must equal), and close to the float64
    product, for K and X of every dtype pair and no, one or many rows."""
    S = get(spec)
    for dtype in DTYPES:
        K = random_member(S, d, dtype, gen)
        for x_dtype, n in [(dtype, 16), (torch.float32, 16), (torch.bfloat16, 1), (dtype, 0)]:
            X = torch.randn(n, d, dtype=torch.float64, generator=gen).to(x_dtype)
            H = K.gram_of_product(X)
            composed = S.project_gram(K.rmatmul(X.T).T)
            assert type(H) is type(composed) and H.dtype == composed.dtype
            for name, part in composed.parts.items():
                assert H.parts[name].shape == part.shape
                assert torch.equal(H.parts[name], part), (dtype, x_dtype, n, name)
            XK = X.double() @ K.to_dense().double()
            assert_close_normwise(H.to_dense(), reference_projection(S, XK.T @ XK), H.dtype)


BATCHED = [spec for spec in SPECS if get(spec).batched]


@pytest.mark.parametrize("spec", BATCHED)
@pytest.mark.parametrize("d", [1, 7, 31])
def test_a_stack_acts_per_matrix(spec, d, gen):
    """A ``batched`` structure over stacked parts (a leading layer dimension): each
    operation of SINGD's factor update gives bitwise what ``torch.func.vmap`` of the
    one-matrix operation gives over the same stack (the path of the other structures),
    per-matrix scalars included, and what each matrix alone gives up to rounding (a
    batched product may round differently from single ones)."""
    S = get(spec)
    for dtype in DTYPES:
        singles = [random_member(S, d, dtype, gen) for _ in range(3)]
        others = [random_member(S, d, dtype, gen) for _ in range(3)]
        scalars = torch.rand(3, dtype=torch.float64, generator=gen).to(accumulation_dtype(dtype))

        def stacked(members):
            return {name: torch.stack([m.parts[name] for m in members]) for name in S.part_names}

        def update(parts, other_parts, scalar):
            """The operations of SINGD's factor update (_factor_step) on one matrix."""
            M, N = S.from_parts(d, dict(parts)), S.from_parts(d, dict(other_parts))
            scale = M.project_inner().average_trace() * scalar
            inner = M.times_transpose()
            step = (M @ N).mul_(scale).add_(N, alpha=-0.5).add_identity_(0.25)
            return {"inner": inner.parts, "step": step.parts, "scale": scale}

        batched = update(stacked(singles), stacked(others), scalars)
        vmapped = torch.func.vmap(update)(stacked(singles), stacked(others), scalars)
        assert torch.equal(batched["scale"], vmapped["scale"])
        for key in ("inner", "step"):
            for name in S.part_names:
                assert torch.equal(batched[key][name], vmapped[key][name]), (dtype, key, name)
        for i, (single, other) in enumerate(zip(singles, others, strict=True)):
            alone = update(single.parts, other.parts, scalars[i])
            for key in ("inner", "step"):
                rows = {name: part[i] for name, part in batched[key].items()}
                assert_close_normwise(
                    S.from_parts(d, rows).to_dense(),
                    S.from_parts(d, alone[key]).to_dense(),
                    dtype,
                )
