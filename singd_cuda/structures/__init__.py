"""Structured Kronecker factors and their registry.

``get("block_diagonal:32")`` returns the structure class bound to its
parameters; see :mod:`singd_cuda.structures.base` for the contract.
"""

from __future__ import annotations

from .base import StructuredMatrix
from .block_diagonal import BlockDiagonal
from .dense import Dense
from .diagonal import Diagonal
from .hierarchical import Hierarchical
from .low_rank import LowRank
from .toeplitz import TrilToeplitz, TriuToeplitz

FAMILIES: dict[str, type[StructuredMatrix]] = {
    cls.name: cls
    for cls in (Dense, Diagonal, BlockDiagonal, LowRank, TrilToeplitz, TriuToeplitz, Hierarchical)
}
"""The structure families by name (``"dense"``, ``"block_diagonal"``, ...); :func:`get` binds
their parameters (``"block_diagonal:32"``)."""


def valid_names() -> str:
    """A human-readable list of the accepted structure names with their parameters."""
    forms = []
    for cls in FAMILIES.values():
        if cls.parameters:
            example = ",".join(str(v) for v in cls.default_values)
            forms.append(f"'{cls.name}[:{','.join(cls.parameters)}]' (e.g. '{cls.name}:{example}')")
        else:
            forms.append(f"'{cls.name}'")
    return ", ".join(forms)


def get(structure: str | type[StructuredMatrix]) -> type[StructuredMatrix]:
    """The structure class for a name such as ``"dense"``, ``"block_diagonal:32"``,
    ``"hierarchical:15,15"`` or ``"low_rank:8"``; a structure class passes through.

    Raises ValueError naming the valid structures for anything else.
    """
    if isinstance(structure, type) and issubclass(structure, StructuredMatrix):
        return structure.bind(*(structure.bound_values() or ()))
    if not isinstance(structure, str):
        raise ValueError(
            f"a structure must be a name or a StructuredMatrix class, got {structure!r}; "
            f"valid names: {valid_names()}"
        )
    name, _, arg_text = structure.strip().partition(":")
    family = FAMILIES.get(name.strip())
    if family is None:
        raise ValueError(f"unknown structure '{structure}'; valid names: {valid_names()}")
    try:
        args = tuple(int(a) for a in arg_text.split(",")) if arg_text else ()
    except ValueError:
        raise ValueError(
            f"structure '{structure}': parameters must be integers; valid names: {valid_names()}"
        ) from None
    try:
        return family.bind(*args)
    except ValueError as error:
        raise ValueError(f"{error}; valid names: {valid_names()}") from None


__all__ = [
    "FAMILIES",
    "BlockDiagonal",
    "Dense",
    "Diagonal",
    "Hierarchical",
    "LowRank",
    "StructuredMatrix",
    "TrilToeplitz",
    "TriuToeplitz",
    "get",
    "valid_names",
]
