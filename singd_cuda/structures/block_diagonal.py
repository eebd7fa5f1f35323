"""Block-diagonal factors: general b x b blocks, ≈ b·d storage, Π̂ = the diagonal blocks."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor

from .base import ACCUMULATES_IN, StructuredMatrix, accumulation_dtype, store_, upcast


class BlockDiagonal(StructuredMatrix):
    """blockdiag(K_1, ..., K_n, L) of dimension d, general (non-symmetric) blocks.

    With b = min(block_size, d), n = d // b full blocks and r = d - n·b:

    * part ``blocks``: (n, b, b), the full blocks K_1..K_n in order;
    * part ``last``: (r, r), the smaller trailing block L (shape (0, 0) when b divides d).

    A block size >= d gives one d x d block, i.e. the dense family. All products
    are batched matmuls over ``blocks`` plus one matmul with ``last``. A stack of L
    matrices (``batched``) has parts (L, n, b, b) and (L, r, r).
    """

    name = "block_diagonal"
    parameters = ("block_size",)
    default_values = (32,)
    part_names = ("blocks", "last")
    structured_times_transpose = True
    batched = True
    block_size: ClassVar[int]

    @classmethod
    def layout(cls, d: int) -> tuple[int, int, int]:
        """(n, b, r): n full blocks of size b = min(block_size, d), then an r x r block."""
        if cls.bound_values() is None:
            raise ValueError(
                f"'{cls.name}' needs a block size; use structures.get('{cls.name}:<block_size>')"
            )
        b = min(cls.block_size, max(d, 1))
        n = d // b
        return n, b, d - n * b

    # ------------------------------------------------------------- constructors
    @classmethod
    def from_dense(cls, M: Tensor) -> BlockDiagonal:
        """The diagonal blocks of M (d, d), copied; no d x d temporary."""
        d = M.shape[0]
        n, b, _ = cls.layout(d)
        grid = M[: n * b, : n * b].unflatten(0, (n, b)).unflatten(2, (n, b))  # (n, b, n, b) view
        blocks = grid.diagonal(dim1=0, dim2=2).permute(2, 0, 1).clone()
        return cls(d, blocks=blocks, last=M[n * b :, n * b :].clone())

    @classmethod
    def project(cls, M: Tensor) -> BlockDiagonal:
        return cls.from_dense(M)

    @classmethod
    def project_gram(cls, Y: Tensor) -> BlockDiagonal:
        """Per-block Gram matrices Y_kᵀ Y_k for Y (N, d), one batched matmul."""
        N, d = Y.shape
        n, b, _ = cls.layout(d)
        Y32 = upcast(Y)
        Yb = Y32[:, : n * b].reshape(N, n, b).permute(1, 0, 2)  # (n, N, b)
        Yl = Y32[:, n * b :]
        return cls(
            d,
            blocks=torch.bmm(Yb.transpose(1, 2), Yb).to(Y.dtype),
            last=(Yl.T @ Yl).to(Y.dtype),
        )

    @classmethod
    def eye(cls, d: int, dtype: torch.dtype = torch.float32, device=None) -> BlockDiagonal:
        n, b, r = cls.layout(d)
        blocks = torch.eye(b, dtype=dtype, device=device).expand(n, b, b).clone()
        return cls(d, blocks=blocks, last=torch.eye(r, dtype=dtype, device=device))

    # ---------------------------------------------------------------- instance
    def to_dense(self) -> Tensor:
        blocks, last = self.parts["blocks"], self.parts["last"]
        n, b, _ = blocks.shape
        out = blocks.new_zeros(self.dim, self.dim)
        grid = out[: n * b, : n * b].unflatten(0, (n, b)).unflatten(2, (n, b))
        grid.diagonal(dim1=0, dim2=2).copy_(blocks.permute(1, 2, 0))
        out[n * b :, n * b :] = last
        return out

    def _apply(self, X: Tensor, transpose: bool) -> Tensor:
        """K @ X (or Kᵀ @ X) for X (d, m), in dtype promote(K, X)."""
        out_dtype = torch.promote_types(self.dtype, X.dtype)
        blocks = upcast(self.parts["blocks"], out_dtype)
        last = upcast(self.parts["last"], out_dtype)
        if transpose:
            blocks, last = blocks.transpose(1, 2), last.T
        n, b, _ = blocks.shape
        m = X.shape[1]
        X = upcast(X, out_dtype)
        out = X.new_empty(X.shape)  # both products write into it: no concatenation pass
        torch.bmm(blocks, X[: n * b].reshape(n, b, m), out=out[: n * b].view(n, b, m))
        torch.mm(last, X[n * b :], out=out[n * b :])
        return out.to(out_dtype)

    def gram_of_product(self, X: Tensor) -> BlockDiagonal:
        """The blockwise Gram matrices P_k P_kᵀ of P = Kᵀ Xᵀ (d, N), P rounded to
        promote(K, X) as :meth:`rmatmul` returns it: bitwise :meth:`project_gram` of
        ``rmatmul(X.T).T``, whose products take these very operands (the blocks' rows of
        P as one contiguous (n, b, N) stack), without the (d, N) P, its structure
        object and views, or the trailing block's products when there is none."""
        blocks, last = self.parts["blocks"], self.parts["last"]
        out_dtype = torch.promote_types(blocks.dtype, X.dtype)
        acc = ACCUMULATES_IN.get(out_dtype, out_dtype)
        if blocks.dtype is not acc:
            blocks, last = blocks.to(acc), last.to(acc)
        Xt = (X if X.dtype is acc else X.to(acc)).T  # (d, N)
        n, b, _ = blocks.shape
        if n:
            rows = Xt if n * b == self.dim else Xt[: n * b]
            P = torch.bmm(blocks.transpose(1, 2), rows.reshape(n, b, Xt.shape[1]))
            if acc is not out_dtype:  # half K and X: P is rounded as rmatmul's is
                P = P.to(out_dtype).to(acc)
            grams = torch.bmm(P, P.transpose(1, 2))
        else:  # no full block (d < b): no products
            grams = Xt.new_empty((0, b, b))
        if n * b < self.dim:
            P = last.T @ Xt[n * b :]
            if acc is not out_dtype:
                P = P.to(out_dtype).to(acc)
            trailing = P @ P.T
        else:
            trailing = _no_block(grams)
        if acc is not out_dtype:
            grams, trailing = grams.to(out_dtype), trailing.to(out_dtype)
        return type(self).from_parts(self.dim, {"blocks": grams, "last": trailing})

    def matmul(self, X: Tensor) -> Tensor:
        return self._apply(X, transpose=False)

    def rmatmul(self, X: Tensor) -> Tensor:
        return self._apply(X, transpose=True)

    def __matmul__(self, other: StructuredMatrix) -> BlockDiagonal:
        """Blockwise products K_k M_k; storage dtype of self."""
        self._check_same_structure(other)
        acc = accumulation_dtype(self.dtype, other.dtype)
        mine, theirs = self.parts, other.parts
        return type(self)(
            self.dim,
            blocks=torch.matmul(mine["blocks"].to(acc), theirs["blocks"].to(acc)).to(self.dtype),
            last=(mine["last"].to(acc) @ theirs["last"].to(acc)).to(self.dtype),
        )

    def project_inner(self) -> BlockDiagonal:
        """KᵀK is block diagonal already: the blockwise K_kᵀ K_k."""
        blocks, last = upcast(self.parts["blocks"]), upcast(self.parts["last"])
        return type(self)(
            self.dim,
            blocks=torch.matmul(blocks.mT, blocks).to(self.dtype),
            last=(last.mT @ last).to(self.dtype),
        )

    def trace(self) -> Tensor:
        blocks, last = upcast(self.parts["blocks"]), upcast(self.parts["last"])
        blocks_trace = blocks.diagonal(dim1=-2, dim2=-1).sum((-2, -1))
        return blocks_trace + last.diagonal(dim1=-2, dim2=-1).sum(-1)

    def times_transpose(self) -> BlockDiagonal:
        """The blockwise K_k K_kᵀ."""
        blocks, last = upcast(self.parts["blocks"]), upcast(self.parts["last"])
        return type(self)(self.dim, blocks=torch.matmul(blocks, blocks.mT), last=last @ last.mT)

    @classmethod
    def row_width(cls, d: int) -> int:
        return cls.layout(d)[1]

    def add_identity_(self, alpha: float = 1.0) -> BlockDiagonal:
        for part in self.parts.values():
            diag = part.diagonal(dim1=-2, dim2=-1)
            store_(diag, upcast(diag).add_(alpha))
        return self


# (dtype, device) -> the one (0, 0) tensor the Gram matrices of factors without a trailing
# block share as their part "last": one allocation less on every layer call
_EMPTY_LAST: dict[tuple, Tensor] = {}


def _no_block(like: Tensor) -> Tensor:
    """A (0, 0) tensor of ``like``'s dtype and device, made once for plain tensors
    (outside inference mode, so that in-place ops on it stay legal); a new one for a
    tensor subclass (a fake tensor of a trace must not be kept)."""
    if type(like) is not Tensor:
        return like.new_empty((0, 0))
    key = (like.dtype, like.device)
    empty = _EMPTY_LAST.get(key)
    if empty is None:
        with torch.inference_mode(False):
            empty = _EMPTY_LAST[key] = torch.empty((0, 0), dtype=like.dtype, device=like.device)
    return empty
