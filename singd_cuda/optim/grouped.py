"""Layers of equal shapes, structures and dtypes handled as one stack.

A transformer repeats identical blocks, so its layers fall into a few groups of equal
(d_C, d_K, structures, dtypes, device). Per group the optimizers stack the gradients into
one (L, d_C, d_K) tensor and the cached K Kᵀ and C Cᵀ into stacked forms, and
precondition with a few batched products: the number of op calls per step does not grow
with the number of layers, only their size does. The state stays per parameter (the
checkpoint layout does not change); stacking copies are made on the fly.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

import torch
from torch import Tensor

from ..curvature.layers import Layer
from ..structures.block_diagonal import BlockDiagonal
from ..structures.dense import Dense
from ..structures.hierarchical import SymmetricArrow


def partition(items: Sequence, key: Callable[[object], Hashable]) -> list[list]:
    """``items`` split by ``key``, each part in the original order, parts in order of
    first appearance."""
    parts: dict[Hashable, list] = {}
    for item in items:
        parts.setdefault(key(item), []).append(item)
    return list(parts.values())


def stacked_gradients(layers: Sequence[Layer], dtype: torch.dtype) -> Tensor:
    """G of every layer (:func:`~singd_cuda.curvature.layers.gradient_matrix`), stacked:
    (L, d_C, d_K) in ``dtype``, the bias gradient as the last column; zeros for a
    parameter without a gradient. One foreach copy for all layers."""
    first = layers[0]
    out = torch.empty(
        len(layers), first.dim_out, first.dim_in, dtype=dtype, device=first.weight.device
    )
    targets, sources = [], []
    for i, layer in enumerate(layers):
        weight_cols = out[i, :, :-1] if layer.bias is not None else out[i]
        for param, target in ((layer.weight, weight_cols), (layer.bias, out[i, :, -1])):
            if param is None:
                continue
            if param.grad is None:
                target.zero_()
                continue
            grad = param.grad.detach()
            targets.append(target)
            sources.append(layer.kind.weight_matrix(grad) if param is layer.weight else grad)
    if targets:
        torch._foreach_copy_(targets, sources)
    return out


class StackedProduct:
    """L matrices P_l (the cached K Kᵀ or C Cᵀ of L layers) in one stacked form, with
    ``matmul(X)`` = (P_l X_l)_l for X of shape (L, d, n), in promote(P, X).

    Built by :meth:`stack` from the per-layer forms that ``times_transpose`` returns:
    :class:`Dense` (stacked (L, d, d), one bmm), :class:`BlockDiagonal` (blocks
    (L·n, b, b), one bmm over every block of every layer, plus the trailing blocks) and
    :class:`SymmetricArrow` (border rows (L, k, d) and middle diagonals (L, m)).
    """

    KINDS = (Dense, BlockDiagonal, SymmetricArrow)

    def __init__(self, kind: type, parts: dict[str, Tensor], k1: int = 0) -> None:
        self.kind, self.parts, self.k1 = kind, parts, k1

    @classmethod
    def stackable(cls, product: object) -> bool:
        return isinstance(product, cls.KINDS)

    @classmethod
    def stack(cls, products: Sequence[object]) -> StackedProduct:
        first = products[0]
        kind = next(k for k in cls.KINDS if isinstance(first, k))
        parts = {name: torch.stack([p.parts[name] for p in products]) for name in first.parts}
        return cls(kind, parts, first.k1 if kind is SymmetricArrow else 0)

    def matmul(self, X: Tensor) -> Tensor:
        dtype = torch.promote_types(next(iter(self.parts.values())).dtype, X.dtype)
        X = X.to(dtype)
        parts = {name: part.to(dtype) for name, part in self.parts.items()}
        if self.kind is Dense:
            return torch.bmm(parts["mat"], X)
        if self.kind is BlockDiagonal:
            return _block_diagonal_matmul(parts["blocks"], parts["last"], X)
        return _arrow_matmul(self.k1, parts["border"], parts["middle"], X)

    def matmul_transposed(self, X: Tensor) -> Tensor:
        """(P_l X_lᵀ)ᵀ = X_l P_lᵀ for X of shape (L, n, d) (row-major, like the gradients):
        the same products as :meth:`matmul` on X.mT without a transposing copy of X."""
        dtype = torch.promote_types(next(iter(self.parts.values())).dtype, X.dtype)
        X = X.to(dtype)
        parts = {name: part.to(dtype) for name, part in self.parts.items()}
        if self.kind is Dense:
            return torch.bmm(X, parts["mat"].mT)
        if self.kind is SymmetricArrow:
            return _arrow_matmul_transposed(self.k1, parts["border"], parts["middle"], X)
        blocks, last = parts["blocks"], parts["last"]
        n, b = blocks.shape[1], blocks.shape[2]
        # column block j of X times block jᵀ: a product over (layer, block), reading X in
        # rows of b contiguous entries
        head = torch.matmul(X[:, :, : n * b].unflatten(2, (n, b)).transpose(1, 2), blocks.mT)
        out = X.new_empty(X.shape)
        out[:, :, : n * b].unflatten(2, (n, b)).copy_(head.transpose(1, 2))
        if last.shape[1]:
            torch.bmm(X[:, :, n * b :], last.mT, out=out[:, :, n * b :])
        return out


def _block_diagonal_matmul(blocks: Tensor, last: Tensor, X: Tensor) -> Tensor:
    """blockdiag(blocks_l, last_l) X_l for blocks (L, n, b, b), last (L, r, r), X (L, d, m)."""
    L, n, b, _ = blocks.shape
    m = X.shape[2]
    head = X[:, : n * b].reshape(L * n, b, m)  # a view when X is contiguous and r = 0
    if last.shape[1] == 0:
        return torch.bmm(blocks.reshape(L * n, b, b), head).view(L, n * b, m)
    out = X.new_empty(X.shape)
    out[:, : n * b] = torch.bmm(blocks.reshape(L * n, b, b), head).view(L, n * b, m)
    out[:, n * b :] = torch.bmm(last, X[:, n * b :])
    return out


def _arrow_matmul(k1: int, border: Tensor, middle: Tensor, X: Tensor) -> Tensor:
    """:meth:`SymmetricArrow.matmul` of every layer: border (L, k1 + k2, d), middle (L, m),
    X (L, d, n)."""
    s = k1 + middle.shape[1]
    rows = torch.bmm(border, X)
    out = X.new_empty(X.shape)
    out[:, :k1], out[:, s:] = rows[:, :k1], rows[:, k1:]
    X_border = torch.cat([X[:, :k1], X[:, s:]], dim=1)
    middle_rows = torch.mul(middle[:, :, None], X[:, k1:s], out=out[:, k1:s])
    middle_rows.baddbmm_(border[:, :, k1:s].mT, X_border)
    return out


def _arrow_matmul_transposed(k1: int, border: Tensor, middle: Tensor, X: Tensor) -> Tensor:
    """X_l P_lᵀ = X_l P_l (P symmetric) for X (L, n, d): the products of
    :func:`_arrow_matmul` on X.mT, transposed, on row-major X."""
    s = k1 + middle.shape[1]
    rows = torch.bmm(X, border.mT)  # the border columns
    out = X.new_empty(X.shape)
    out[:, :, :k1], out[:, :, s:] = rows[:, :, :k1], rows[:, :, k1:]
    X_border = torch.cat([X[:, :, :k1], X[:, :, s:]], dim=2)
    middle_cols = torch.mul(X[:, :, k1:s], middle[:, None, :], out=out[:, :, k1:s])
    middle_cols.baddbmm_(X_border, border[:, :, k1:s])
    return out
