"""Placeholder being replaced by its implementation (work in progress)."""

from .base import StructuredMatrix


class LowRank(StructuredMatrix):
    name = "low_rank"
