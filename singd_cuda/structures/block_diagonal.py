"""Placeholder being replaced by its implementation (work in progress)."""

from .base import StructuredMatrix


class BlockDiagonal(StructuredMatrix):
    name = "block_diagonal"
