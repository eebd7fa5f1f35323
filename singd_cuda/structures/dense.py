"""Dense factors: the unstructured baseline (d² storage)."""

from __future__ import annotations

import torch
from torch import Tensor

from .base import ACCUMULATES_IN, StructuredMatrix, store_, upcast


class Dense(StructuredMatrix):
    """A general d x d matrix. Part ``mat``: (d, d); (L, d, d) for a stack (``batched``)."""

    name = "dense"
    part_names = ("mat",)
    structured_times_transpose = True
    batched = True

    @classmethod
    def from_dense(cls, M: Tensor) -> Dense:
        return cls(M.shape[0], mat=M.clone())

    @classmethod
    def project(cls, M: Tensor) -> Dense:
        return cls.from_dense(M)

    @classmethod
    def project_gram(cls, Y: Tensor) -> Dense:
        Y32 = upcast(Y)  # (N, d), or (L, N, d) for a stack
        return cls(Y.shape[-1], mat=(Y32.mT @ Y32).to(Y.dtype))

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

    def gram_of_product(self, X: Tensor) -> Dense:
        """P Pᵀ of P = Mᵀ Xᵀ (d, N) rounded to promote(M, X) as :meth:`rmatmul` returns
        it: bitwise :meth:`project_gram` of ``rmatmul(X.T).T`` (the same two products on
        the same operands) without its no-op casts and intermediate calls."""
        M = self.parts["mat"]
        out_dtype = torch.promote_types(M.dtype, X.dtype)
        acc = ACCUMULATES_IN.get(out_dtype, out_dtype)
        P = (M if M.dtype is acc else M.to(acc)).T @ (X if X.dtype is acc else X.to(acc)).T
        if acc is not out_dtype:  # half M and X: P is rounded as rmatmul's is
            P = P.to(out_dtype).to(acc)
        gram = P @ P.T
        return type(self)(self.dim, mat=gram if acc is out_dtype else gram.to(out_dtype))

    def __matmul__(self, other: StructuredMatrix) -> Dense:
        self._check_same_structure(other)
        return type(self)(self.dim, mat=self.matmul(other.parts["mat"]).to(self.dtype))

    def project_inner(self) -> Dense:
        return type(self).project_gram(self.parts["mat"])

    def trace(self) -> Tensor:
        return upcast(self.parts["mat"]).diagonal(dim1=-2, dim2=-1).sum(-1)

    def add_identity_(self, alpha: float = 1.0) -> Dense:
        diag = self.parts["mat"].diagonal(dim1=-2, dim2=-1)
        store_(diag, upcast(diag).add_(alpha))
        return self

    def times_transpose(self) -> Dense:
        mat = upcast(self.parts["mat"])
        return type(self)(self.dim, mat=mat @ mat.mT)
