"""Placeholder being replaced by its implementation (work in progress)."""

from .base import StructuredMatrix


class TrilToeplitz(StructuredMatrix):
    name = "tril_toeplitz"


class TriuToeplitz(StructuredMatrix):
    name = "triu_toeplitz"
