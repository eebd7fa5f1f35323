"""Diagonal factors: d storage, Π̂(M) = diag(M)."""

from __future__ import annotations

import torch
from torch import Tensor

from .base import StructuredMatrix, accumulation_dtype, store_, upcast


class Diagonal(StructuredMatrix):
    """diag(k) of dimension d. Part ``diag``: (d,), in the storage dtype."""

    name = "diagonal"
    part_names = ("diag",)
    structured_times_transpose = True

    @classmethod
    def from_dense(cls, M: Tensor) -> Diagonal:
        return cls(M.shape[0], diag=M.diagonal().clone())

    @classmethod
    def project(cls, M: Tensor) -> Diagonal:
        return cls.from_dense(M)

    @classmethod
    def project_gram(cls, Y: Tensor) -> Diagonal:
        """diag(YᵀY): the column sums of Y², for Y of shape (N, d)."""
        return cls(Y.shape[1], diag=upcast(Y).square().sum(0).to(Y.dtype))

    @classmethod
    def eye(cls, d: int, dtype: torch.dtype = torch.float32, device=None) -> Diagonal:
        return cls(d, diag=torch.ones(d, dtype=dtype, device=device))

    def to_dense(self) -> Tensor:
        return torch.diag(self.parts["diag"])

    def matmul(self, X: Tensor) -> Tensor:
        """diag(k) @ X: row i of X scaled by k_i; X of shape (d, n)."""
        out_dtype = torch.promote_types(self.dtype, X.dtype)
        return (upcast(self.parts["diag"], out_dtype)[:, None] * upcast(X, out_dtype)).to(out_dtype)

    def rmatmul(self, X: Tensor) -> Tensor:
        """diag(k)ᵀ @ X = diag(k) @ X."""
        return self.matmul(X)

    def __matmul__(self, other: StructuredMatrix) -> Diagonal:
        self._check_same_structure(other)
        acc = accumulation_dtype(self.dtype, other.dtype)
        product = self.parts["diag"].to(acc) * other.parts["diag"].to(acc)
        return type(self)(self.dim, diag=product.to(self.dtype))

    def project_inner(self) -> Diagonal:
        return type(self)(self.dim, diag=upcast(self.parts["diag"]).square().to(self.dtype))

    def trace(self) -> Tensor:
        return upcast(self.parts["diag"]).sum()

    def times_transpose(self) -> Diagonal:
        return type(self)(self.dim, diag=upcast(self.parts["diag"]).square())

    @classmethod
    def row_width(cls, d: int) -> int:
        return 1

    def add_identity_(self, alpha: float = 1.0) -> Diagonal:
        diag = self.parts["diag"]
        store_(diag, upcast(diag).add_(alpha))
        return self
