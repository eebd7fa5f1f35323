"""Congruence Π̂(Kᵀ M K) of structured factors, from statistics that need no factor state.

SINGD's statistic H_K = Π̂(Kᵀ aᵀa K) reads the factor K, which only the owner of a
layer holds in that mode. It is linear in aᵀa, so every rank can send instead a
statistic M of its shard that fixes Π̂(Kᵀ aᵀa K) for every K of the structure, and
the owner applies its K after the ranks' M are averaged:

* dense, diagonal and block-diagonal are closed under congruence: Π̂(Kᵀ M K) depends
  only on Π̂(M) (the diagonal blocks of M for block-diagonal K), so M = Π̂(aᵀa),
  as small as the factor itself;
* other structures (low-rank, Toeplitz, hierarchical) need the whole aᵀa, so M is
  the dense d x d Gram matrix (sent as its upper triangle).
"""

from __future__ import annotations

from torch import Tensor

from .base import StructuredMatrix, upcast

CONGRUENCE_CLOSED = ("dense", "diagonal", "block_diagonal")


def shared_statistic(structure: type[StructuredMatrix], rows: Tensor) -> StructuredMatrix | Tensor:
    """The K-independent statistic of ``rows`` (N x d, a or g) for factors of ``structure``."""
    if structure.name in CONGRUENCE_CLOSED:
        return structure.project_gram(rows)
    Y = upcast(rows)
    return (Y.T @ Y).to(rows.dtype)


def _transpose(K: StructuredMatrix) -> StructuredMatrix:
    """Kᵀ for the congruence-closed families (every part a square matrix, batch, or vector)."""
    parts = {n: p.transpose(-2, -1) if p.dim() >= 2 else p for n, p in K.parts.items()}
    return type(K).from_parts(K.dim, parts)


def congruence(K: StructuredMatrix, statistic: StructuredMatrix | Tensor) -> StructuredMatrix:
    """Π̂(Kᵀ M K), in the statistic's dtype, for M from :func:`shared_statistic`."""
    if isinstance(statistic, StructuredMatrix):
        K = K.to(dtype=statistic.dtype)
        return (_transpose(K) @ statistic) @ K
    KtM = K.rmatmul(statistic)  # Kᵀ M
    KtMK = K.rmatmul(KtM.T)  # Kᵀ (Kᵀ M)ᵀ = Kᵀ M K, as M is symmetric
    return type(K).project(0.5 * (KtMK + KtMK.T))
