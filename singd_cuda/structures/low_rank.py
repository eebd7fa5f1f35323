"""Low-rank factors: a dense k x k corner, k dense columns below it and a diagonal.

Storage k² + (d−k)k + (d−k) for k = min(rank, d); every operation works on the
blocks (O(k²d) at most), never on a d x d tensor.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor

from ._blocks import block_copy, cast_parts, check_shapes, column_sq_sum, upcast_all
from .base import StructuredMatrix, accumulation_dtype, upcast


class LowRank(StructuredMatrix):
    """The lower-triangular d x d matrix [[A, 0], [B, diag(D)]], k = min(rank, d).

    Parts, all in the storage dtype:

    - ``A``: (k, k), general;
    - ``B``: (d − k, k), the rows below A;
    - ``D``: (d − k,), the diagonal of the bottom-right block.

    Π̂(M): A = M₁₁, B = M₂₁ + M₁₂ᵀ (= 2 M₂₁ for a symmetric M), D = diag(M₂₂).
    With rank >= d, B and D are empty and A is the whole (dense) matrix.
    """

    name = "low_rank"
    parameters = ("rank",)
    default_values = (8,)
    part_names = ("A", "B", "D")
    rank: ClassVar[int]

    def __init__(self, dim: int, **parts: Tensor) -> None:
        super().__init__(dim, **parts)
        k = self.block_size(dim)
        expected = {"A": (k, k), "B": (dim - k, k), "D": (dim - k,)}
        check_shapes(type(self).__name__, self.parts, expected)

    @classmethod
    def block_size(cls, d: int) -> int:
        """k = min(rank, d), the size of the dense corner A."""
        return min(cls.rank, d)

    # ------------------------------------------------------------ constructors
    @classmethod
    def from_dense(cls, M: Tensor) -> LowRank:
        d = M.shape[0]
        k = cls.block_size(d)
        return cls(
            d,
            A=block_copy(M[:k, :k]),
            B=block_copy(M[k:, :k]),
            D=block_copy(M[k:, k:].diagonal()),
        )

    @classmethod
    def project(cls, M: Tensor) -> LowRank:
        d = M.shape[0]
        k = cls.block_size(d)
        B = (upcast(M[k:, :k]) + upcast(M[:k, k:]).T).to(M.dtype)
        return cls(d, A=block_copy(M[:k, :k]), B=B, D=block_copy(M[k:, k:].diagonal()))

    @classmethod
    def project_gram(cls, Y: Tensor) -> LowRank:
        """Π̂(YᵀY) from Y's column blocks Y = [Y₁ Y₂], Y₁ of shape (N, k)."""
        d = Y.shape[1]
        k = cls.block_size(d)
        Y32 = upcast(Y)
        Y1, Y2 = Y32[:, :k], Y32[:, k:]
        parts = {"A": Y1.T @ Y1, "B": 2 * (Y2.T @ Y1), "D": column_sq_sum(Y2)}
        return cls(d, **cast_parts(parts, Y.dtype))

    @classmethod
    def eye(cls, d: int, dtype: torch.dtype = torch.float32, device=None) -> LowRank:
        k = cls.block_size(d)
        return cls(
            d,
            A=torch.eye(k, dtype=dtype, device=device),
            B=torch.zeros(d - k, k, dtype=dtype, device=device),
            D=torch.ones(d - k, dtype=dtype, device=device),
        )

    # ---------------------------------------------------------------- instance
    def to_dense(self) -> Tensor:
        A, B, D = self.parts.values()
        k = A.shape[0]
        out = torch.zeros(self.dim, self.dim, dtype=self.dtype, device=self.device)
        out[:k, :k] = A
        out[k:, :k] = B
        out[k:, k:].diagonal().copy_(D)
        return out

    def matmul(self, X: Tensor) -> Tensor:
        """[A X₁; B X₁ + D ⊙ X₂] for X = [X₁; X₂], X₁ of shape (k, n)."""
        out_dtype = torch.promote_types(self.dtype, X.dtype)
        A, B, D = upcast_all(self.parts, out_dtype)
        X = upcast(X, out_dtype)
        X1, X2 = X[: A.shape[0]], X[A.shape[0] :]
        bottom = torch.addmm(D[:, None] * X2, B, X1)
        return torch.cat([A @ X1, bottom]).to(out_dtype)

    def rmatmul(self, X: Tensor) -> Tensor:
        """[Aᵀ X₁ + Bᵀ X₂; D ⊙ X₂] for X = [X₁; X₂], X₁ of shape (k, n)."""
        out_dtype = torch.promote_types(self.dtype, X.dtype)
        A, B, D = upcast_all(self.parts, out_dtype)
        X = upcast(X, out_dtype)
        X1, X2 = X[: A.shape[0]], X[A.shape[0] :]
        top = torch.addmm(A.T @ X1, B.T, X2)
        return torch.cat([top, D[:, None] * X2]).to(out_dtype)

    def __matmul__(self, other: StructuredMatrix) -> LowRank:
        """[[A A', 0], [B A' + D ⊙ B', diag(D D')]]."""
        self._check_same_structure(other)
        acc = accumulation_dtype(self.dtype, other.dtype)
        A, B, D = upcast_all(self.parts, acc)
        A2, B2, D2 = upcast_all(other.parts, acc)
        parts = {"A": A @ A2, "B": torch.addmm(D[:, None] * B2, B, A2), "D": D * D2}
        return type(self)(self.dim, **cast_parts(parts, self.dtype))

    def project_inner(self) -> LowRank:
        """KᵀK = [[AᵀA + BᵀB, Bᵀ diag(D)], [diag(D) B, diag(D)²]], projected."""
        A, B, D = upcast_all(self.parts, self.dtype)
        parts = {"A": torch.addmm(A.T @ A, B.T, B), "B": 2 * D[:, None] * B, "D": D * D}
        return type(self)(self.dim, **cast_parts(parts, self.dtype))

    def trace(self) -> Tensor:
        return upcast(self.parts["A"]).diagonal().sum() + upcast(self.parts["D"]).sum()
