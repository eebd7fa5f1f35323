"""Helpers shared by the block-partitioned factors (``low_rank``, ``hierarchical``).

These structures store a few dense or diagonal blocks of a d x d matrix and
compute every operation block by block, so nothing here allocates a d x d tensor.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .base import accumulation_dtype


def block_copy(block: Tensor) -> Tensor:
    """A contiguous copy of ``block`` (a view into a larger tensor), never aliasing it."""
    return block.clone(memory_format=torch.contiguous_format)


def upcast_all(parts: dict[str, Tensor], dtype: torch.dtype) -> list[Tensor]:
    """All parts, in storage order, in the accumulation dtype of ``dtype``."""
    acc = accumulation_dtype(dtype)
    return [part.to(acc) for part in parts.values()]


def column_sq_sum(Y: Tensor) -> Tensor:
    """diag(YᵀY) for Y of shape (N, n): shape (n,), in Y's dtype (callers upcast Y)."""
    return Y.square().sum(0)


def check_shapes(owner: str, parts: dict[str, Tensor], expected: dict[str, tuple[int, ...]]):
    """Raise ValueError when a part's shape differs from ``expected[name]``."""
    for name, shape in expected.items():
        if tuple(parts[name].shape) != shape:
            raise ValueError(
                f"{owner}: part '{name}' must have shape {shape}, got {tuple(parts[name].shape)}"
            )


def cast_parts(parts: dict[str, Tensor], dtype: torch.dtype) -> dict[str, Tensor]:
    """``parts`` cast to the storage dtype ``dtype`` (freshly computed blocks, not views)."""
    return {name: part.to(dtype) for name, part in parts.items()}
