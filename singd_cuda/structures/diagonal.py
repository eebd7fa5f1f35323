"""Placeholder being replaced by its implementation (work in progress)."""

from .base import StructuredMatrix


class Diagonal(StructuredMatrix):
    name = "diagonal"
