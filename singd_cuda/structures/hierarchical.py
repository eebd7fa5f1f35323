"""Placeholder being replaced by its implementation (work in progress)."""

from .base import StructuredMatrix


class Hierarchical(StructuredMatrix):
    name = "hierarchical"
