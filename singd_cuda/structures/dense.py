"""Dense factors: the unstructured baseline (d² storage)."""

from __future__ import annotations

import torch
from torch import Tensor

from .base import StructuredMatrix, store_, upcast


class Dense(StructuredMatrix):
    """A general d x d matrix. Part ``mat``: (d, d)."""

    name = "dense"
    part_names = ("mat",)
    structured_times_transpose = True

    @classmethod
    def from_dense(cls, M: Tensor) -> Dense:
        return cls(M.shape[0], mat=M.clone())

    @classmethod
    def project(cls, M: Tensor) -> Dense:
        return cls.from_dense(M)

    @classmethod
    def project_gram(cls, Y: Tensor) -> Dense:
        Y32 = upcast(Y)
        return cls(Y.shape[1], mat=(Y32.T @ Y32).to(Y.dtype))

    @classmethod
    def eye(cls, d: int, dtype: torch.dtype = torch.float32, device=None) -> Dense:
        return cls(d, mat=torch.eye(d, dtype=dtype, device=device))

    def to_dense(self) -> Tensor:
        return self.parts["mat"].clone()

    def matmul(self, X: Tensor) -> Tensor:
        out_dtype = torch.promote_types(self.dtype, X.dtype)
        return (upcast(self.parts["mat"], out_dtype) @ upcast(X, out_dtype)).to(out_dtype)

    def rmatmul(self, X: Tensor) -> Tensor:
        out_dtype = torch.promote_types(self.dtype, X.dtype)
        return (upcast(self.parts["mat"], out_dtype).T @ upcast(X, out_dtype)).to(out_dtype)

    def __matmul__(self, other: StructuredMatrix) -> Dense:
        self._check_same_structure(other)
        return type(self)(self.dim, mat=self.matmul(other.parts["mat"]).to(self.dtype))

    def project_inner(self) -> Dense:
        return type(self).project_gram(self.parts["mat"])

    def trace(self) -> Tensor:
        return upcast(self.parts["mat"]).diagonal().sum()

    def add_identity_(self, alpha: float = 1.0) -> Dense:
        diag = self.parts["mat"].diagonal()
        store_(diag, upcast(diag).add_(alpha))
        return self

    def times_transpose(self) -> Dense:
        mat = upcast(self.parts["mat"])
        return type(self)(self.dim, mat=mat @ mat.T)
