"""Hierarchical factors: dense corners A (k1 x k1) and E (k2 x k2), a dense top
strip B, a diagonal middle and a dense strip D below it.

Storage ≈ (k1 + k2 + 1)·d; every operation works on the blocks (O((k1 + k2)² d)
at most), never on a d x d tensor.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor

from ._blocks import block_copy, cast_parts, check_shapes, column_sq_sum, upcast_all
from .base import StructuredMatrix, accumulation_dtype, store_, upcast


class Hierarchical(StructuredMatrix):
    """The d x d matrix [[A, B₁, B₂], [0, diag(c), 0], [0, D, E]].

    Row/column blocks have sizes k1, m = d − k1 − k2 and k2, where for small d
    k1 = min(k1, d) and k2 = min(k2, d − k1). Parts, all in the storage dtype:

    - ``A``: (k1, k1), general;
    - ``B``: (k1, d − k1) = [B₁ B₂], B₁ of shape (k1, m), B₂ of shape (k1, k2);
    - ``c``: (m,), the diagonal of the middle block;
    - ``D``: (k2, m);
    - ``E``: (k2, k2), general.

    Π̂(M): A = M₁₁, B = M₁,rest + M_rest,1ᵀ, c = diag(M₂₂), D = M₃₂ + M₂₃ᵀ,
    E = M₃₃ (B = 2 M₁,rest and D = 2 M₃₂ for a symmetric M).
    With k1 >= d every part but A is empty and A is the whole (dense) matrix.
    """

    name = "hierarchical"
    parameters = ("k1", "k2")
    default_values = (15, 15)
    part_names = ("A", "B", "c", "D", "E")
    structured_times_transpose = True
    k1: ClassVar[int]
    k2: ClassVar[int]

    def __init__(self, dim: int, **parts: Tensor) -> None:
        super().__init__(dim, **parts)
        k1, m, k2 = self.block_sizes(dim)
        expected = {"A": (k1, k1), "B": (k1, m + k2), "c": (m,), "D": (k2, m), "E": (k2, k2)}
        check_shapes(type(self).__name__, self.parts, expected)

    @classmethod
    def block_sizes(cls, d: int) -> tuple[int, int, int]:
        """(k1, m, k2): the sizes of the three row/column blocks for dimension d."""
        k1 = min(cls.k1, d)
        k2 = min(cls.k2, d - k1)
        return k1, d - k1 - k2, k2

    # ------------------------------------------------------------ constructors
    @classmethod
    def from_dense(cls, M: Tensor) -> Hierarchical:
        d = M.shape[0]
        k1, m, _ = cls.block_sizes(d)
        s = k1 + m
        return cls(
            d,
            A=block_copy(M[:k1, :k1]),
            B=block_copy(M[:k1, k1:]),
            c=block_copy(M[k1:s, k1:s].diagonal()),
            D=block_copy(M[s:, k1:s]),
            E=block_copy(M[s:, s:]),
        )

    @classmethod
    def project(cls, M: Tensor) -> Hierarchical:
        d = M.shape[0]
        k1, m, _ = cls.block_sizes(d)
        s = k1 + m
        return cls(
            d,
            A=block_copy(M[:k1, :k1]),
            B=(upcast(M[:k1, k1:]) + upcast(M[k1:, :k1]).T).to(M.dtype),
            c=block_copy(M[k1:s, k1:s].diagonal()),
            D=(upcast(M[s:, k1:s]) + upcast(M[k1:s, s:]).T).to(M.dtype),
            E=block_copy(M[s:, s:]),
        )

    @classmethod
    def project_gram(cls, Y: Tensor) -> Hierarchical:
        """Π̂(YᵀY) from Y's column blocks Y = [Y₁ Y₂ Y₃] of widths k1, m, k2."""
        d = Y.shape[1]
        k1, m, _ = cls.block_sizes(d)
        Y32 = upcast(Y)
        Y1, Y2, Y3 = Y32[:, :k1], Y32[:, k1 : k1 + m], Y32[:, k1 + m :]
        parts = {
            "A": Y1.T @ Y1,
            "B": 2 * (Y1.T @ Y32[:, k1:]),
            "c": column_sq_sum(Y2),
            "D": 2 * (Y3.T @ Y2),
            "E": Y3.T @ Y3,
        }
        return cls(d, **cast_parts(parts, Y.dtype))

    @classmethod
    def eye(cls, d: int, dtype: torch.dtype = torch.float32, device=None) -> Hierarchical:
        k1, m, k2 = cls.block_sizes(d)
        return cls(
            d,
            A=torch.eye(k1, dtype=dtype, device=device),
            B=torch.zeros(k1, m + k2, dtype=dtype, device=device),
            c=torch.ones(m, dtype=dtype, device=device),
            D=torch.zeros(k2, m, dtype=dtype, device=device),
            E=torch.eye(k2, dtype=dtype, device=device),
        )

    # ---------------------------------------------------------------- instance
    def to_dense(self) -> Tensor:
        A, B, c, D, E = self.parts.values()
        k1, s = A.shape[0], A.shape[0] + c.shape[0]
        out = torch.zeros(self.dim, self.dim, dtype=self.dtype, device=self.device)
        out[:k1, :k1] = A
        out[:k1, k1:] = B
        out[k1:s, k1:s].diagonal().copy_(c)
        out[s:, k1:s] = D
        out[s:, s:] = E
        return out

    def matmul(self, X: Tensor) -> Tensor:
        """[A X₁ + B [X₂; X₃]; c ⊙ X₂; D X₂ + E X₃] for X = [X₁; X₂; X₃]."""
        out_dtype = torch.promote_types(self.dtype, X.dtype)
        A, B, c, D, E = upcast_all(self.parts, out_dtype)
        X = upcast(X, out_dtype)
        k1, s = A.shape[0], A.shape[0] + c.shape[0]
        X1, X2, X3 = X[:k1], X[k1:s], X[s:]
        top = torch.addmm(A @ X1, B, X[k1:])
        bottom = torch.addmm(E @ X3, D, X2)
        return torch.cat([top, c[:, None] * X2, bottom]).to(out_dtype)

    def rmatmul(self, X: Tensor) -> Tensor:
        """[Aᵀ X₁; B₁ᵀ X₁ + c ⊙ X₂ + Dᵀ X₃; B₂ᵀ X₁ + Eᵀ X₃] for X = [X₁; X₂; X₃]."""
        out_dtype = torch.promote_types(self.dtype, X.dtype)
        A, B, c, D, E = upcast_all(self.parts, out_dtype)
        X = upcast(X, out_dtype)
        k1, m = A.shape[0], c.shape[0]
        X1, X2, X3 = X[:k1], X[k1 : k1 + m], X[k1 + m :]
        middle = torch.addmm(torch.addmm(c[:, None] * X2, B[:, :m].T, X1), D.T, X3)
        bottom = torch.addmm(E.T @ X3, B[:, m:].T, X1)
        return torch.cat([A.T @ X1, middle, bottom]).to(out_dtype)

    def __matmul__(self, other: StructuredMatrix) -> Hierarchical:
        """Blocks of K K': A A', A B' + [B₁ ⊙ c' + B₂ D', B₂ E'], c ⊙ c', D ⊙ c' + E D', E E'."""
        self._check_same_structure(other)
        acc = accumulation_dtype(self.dtype, other.dtype)
        A, B, c, D, E = upcast_all(self.parts, acc)
        A2, B2, c2, D2, E2 = upcast_all(other.parts, acc)
        m = c.shape[0]
        strip = B[:, m:] @ torch.cat([D2, E2], dim=1)  # B₂ [D' E']
        strip[:, :m] += B[:, :m] * c2
        parts = {
            "A": A @ A2,
            "B": torch.addmm(strip, A, B2),
            "c": c * c2,
            "D": torch.addmm(D * c2, E, D2),
            "E": E @ E2,
        }
        return type(self)(self.dim, **cast_parts(parts, self.dtype))

    def project_inner(self) -> Hierarchical:
        """Π̂(KᵀK) from KᵀK's blocks: AᵀA, AᵀB, colsum(B₁²) + c² + colsum(D²) on the
        middle diagonal, B₂ᵀB₁ + EᵀD below it and B₂ᵀB₂ + EᵀE in the corner."""
        A, B, c, D, E = upcast_all(self.parts, self.dtype)
        B1, B2 = B[:, : c.shape[0]], B[:, c.shape[0] :]
        parts = {
            "A": A.T @ A,
            "B": 2 * (A.T @ B),
            "c": column_sq_sum(B1) + c * c + column_sq_sum(D),
            "D": 2 * torch.addmm(E.T @ D, B2.T, B1),
            "E": torch.addmm(E.T @ E, B2.T, B2),
        }
        return type(self)(self.dim, **cast_parts(parts, self.dtype))

    def trace(self) -> Tensor:
        A, c, E = (upcast(self.parts[name]) for name in "AcE")
        return A.diagonal().sum() + c.sum() + E.diagonal().sum()

    def add_identity_(self, alpha: float = 1.0) -> Hierarchical:
        for diag in (self.parts["A"].diagonal(), self.parts["c"], self.parts["E"].diagonal()):
            store_(diag, upcast(diag).add_(alpha))
        return self

    def times_transpose(self) -> SymmetricArrow:
        """K Kᵀ: its border rows K_b Kᵀ (K_b the first k1 and last k2 rows of K) and c²."""
        k1, m, _ = self.block_sizes(self.dim)
        A, B, c, D, E = upcast_all(self.parts, self.dtype)
        border = A.new_zeros(k1 + E.shape[0], self.dim)
        border[:k1, :k1], border[:k1, k1:] = A, B
        border[k1:, k1 : k1 + m], border[k1:, k1 + m :] = D, E
        return SymmetricArrow(k1, self.matmul(border.T).T, c * c)

    @classmethod
    def row_width(cls, d: int) -> int:
        """k1 + k2 + 1: the average nonzeros per row, rounded up (border rows are dense)."""
        k1, _, k2 = cls.block_sizes(d)
        return min(d, k1 + k2 + 1)


class SymmetricArrow:
    """A symmetric d x d matrix that is dense on its first k1 and last k2 rows and columns
    and diagonal in between: K Kᵀ of a hierarchical K, in the accumulation dtype.

    ``border``: (k1 + k2, d), the dense rows (first k1, then last k2); ``middle``: (m,), the
    diagonal of the middle block. The middle columns of ``border`` are the middle rows'
    off-diagonal entries, by symmetry.
    """

    def __init__(self, k1: int, border: Tensor, middle: Tensor) -> None:
        self.k1, self.border, self.middle = k1, border, middle
        self.parts = {"border": border, "middle": middle}

    def matmul(self, X: Tensor) -> Tensor:
        """P @ X for X (d, n), in promote(P, X): one (k1+k2)-row product for the border rows
        and c² ⊙ X₂ plus a rank-(k1+k2) update for the middle."""
        out_dtype = torch.promote_types(self.border.dtype, X.dtype)
        X = upcast(X, out_dtype)
        if X.dim() == 2 and not X.is_contiguous() and X.T.is_contiguous():
            return self._transposed_matmul(X.T)
        k1, s = self.k1, self.k1 + self.middle.shape[0]
        X_border = torch.cat([X[:k1], X[s:]])
        rows = self.border.to(out_dtype) @ X
        out = X.new_empty(X.shape)
        out[:k1], out[s:] = rows[:k1], rows[k1:]
        middle = torch.mul(self.middle.to(out_dtype)[:, None], X[k1:s], out=out[k1:s])
        middle.addmm_(self.border[:, k1:s].to(out_dtype).T, X_border)
        return out

    def _transposed_matmul(self, Xt: Tensor) -> Tensor:
        """P @ Xtᵀ for a contiguous Xt (n, d) (P @ Gᵀ in the preconditioner), as the
        transposed view of Xt P (P symmetric): every operation reads and writes rows, where
        the layout of P @ X would make the elementwise middle stride through Xt's columns."""
        k1, s = self.k1, self.k1 + self.middle.shape[0]
        border = self.border.to(Xt.dtype)
        X_border = torch.cat([Xt[:, :k1], Xt[:, s:]], dim=1)  # (n, k1 + k2)
        rows = Xt @ border.T  # (n, k1 + k2): the border columns of Xt P
        out = Xt.new_empty(Xt.shape)
        out[:, :k1], out[:, s:] = rows[:, :k1], rows[:, k1:]
        middle = torch.mul(Xt[:, k1:s], self.middle.to(Xt.dtype), out=out[:, k1:s])
        middle.addmm_(X_border, border[:, k1:s])
        return out.T
