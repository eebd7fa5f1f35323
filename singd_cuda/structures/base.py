"""The contract every structured Kronecker factor keeps.

A structure is a family of d x d matrices closed under multiplication. A
``StructuredMatrix`` subclass holds one member of the family as a few named
storage tensors (``parts``), in the storage dtype (float64, float32, bfloat16
or float16). Every operation accumulates in float32 for the half types and
casts the result back to the storage dtype.

Structures with parameters (block size, rank, ...) are bound with
:meth:`StructuredMatrix.bind`, which returns a subclass with those parameters
as class attributes; ``singd_cuda.structures.get("block_diagonal:32")`` does
this from a string.

The projection Π̂ of a dense symmetric matrix M onto the family keeps M_ij
where the mirror entry (j, i) is free too, takes M_ij + M_ji where the mirror
is fixed at zero, and averages tied entries (Toeplitz). It preserves the trace.
"""

from __future__ import annotations

import operator
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from itertools import chain, repeat
from typing import ClassVar

import torch
from torch import Tensor

HALF_DTYPES = (torch.bfloat16, torch.float16)
# dtype -> the dtype arithmetic on it runs in (``ACCUMULATES_IN.get(dtype, dtype)``: one
# C call where a hot path needs the accumulation dtype of a single dtype)
ACCUMULATES_IN = dict.fromkeys(HALF_DTYPES, torch.float32)
# the types of a list of statistics that are all plain tensors (no structured matrix)
PLAIN = frozenset({Tensor})
_PARTS = operator.attrgetter("parts")
SMALL_DENSE_DIM = 128  # up to this dimension a dense d x d temporary is cheap


def accumulation_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """The dtype arithmetic runs in: float32 for half types, else the widest given."""
    widest = dtypes[0]
    for dtype in dtypes[1:]:
        widest = torch.promote_types(widest, dtype)
    return ACCUMULATES_IN.get(widest, widest)


def store_(part: Tensor, value: Tensor) -> None:
    """part ← value, rounded to part's dtype; nothing to do when ``value`` is ``part``
    (an in-place update of a part already in its accumulation dtype)."""
    if value is not part:
        part.copy_(value)


def parts_of(matrices: Iterable[StructuredMatrix]) -> Iterator[Tensor]:
    """The storage tensors of every matrix, matrix by matrix, by C calls alone (no Python
    call a matrix)."""
    return chain.from_iterable(map(dict.values, map(_PARTS, matrices)))


def upcast(tensor: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """``tensor`` in the accumulation dtype of its own dtype (or of ``dtype``)."""
    dtype = tensor.dtype if dtype is None else dtype
    return tensor.to(ACCUMULATES_IN.get(dtype, dtype))


class StructuredMatrix(ABC):
    """A d x d matrix of a structured family, stored as named tensors.

    Subclasses set ``name`` (the registry name), ``parameters`` (the names of
    their class-level structure parameters, in order) and ``part_names`` (the
    storage tensors), and implement the abstract methods below.
    """

    name: ClassVar[str]
    parameters: ClassVar[tuple[str, ...]] = ()
    default_values: ClassVar[tuple[int, ...]] = ()
    part_names: ClassVar[tuple[str, ...]]
    family: ClassVar[type[StructuredMatrix] | None] = None
    # K Kᵀ has a structured form at every size (the class overrides times_transpose)
    structured_times_transpose: ClassVar[bool] = False
    # the dense family (dense.py, which builds on this module, registers it on definition)
    _dense: ClassVar[type[StructuredMatrix] | None] = None
    # the parts may carry leading batch dimensions, one matrix per index (a stack of
    # layers' factors): the SINGD update's methods (project_inner, trace, average_trace,
    # add_, mul_, add_identity_, @, times_transpose, to) act per matrix, so a stack
    # updates in one call per operation, the same operations as one matrix at a time
    batched: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if cls.__dict__.get("name") == "dense":
            StructuredMatrix._dense = cls

    def __init__(self, dim: int, **parts: Tensor) -> None:
        names = self.part_names
        if len(parts) != len(names) or not parts.keys() >= set(names):
            raise ValueError(f"{type(self).__name__} needs parts {names}, got {tuple(parts)}")
        self.dim = dim
        # in part_names' order, by C calls alone (a structure is made per layer and pass)
        self.parts: dict[str, Tensor] = dict(zip(names, map(parts.__getitem__, names), strict=True))

    # ------------------------------------------------------------------ binding
    @classmethod
    def bind(cls, *args: int) -> type[StructuredMatrix]:
        """A subclass of ``cls`` with its structure parameters set to ``args``.

        With no ``args``, a parametrised family binds to its ``default_values``.
        """
        if not cls.parameters:
            if args:
                raise ValueError(f"structure '{cls.name}' takes no parameters, got {args}")
            return cls
        args = args or cls.default_values
        if len(args) != len(cls.parameters):
            raise ValueError(
                f"structure '{cls.name}' takes {len(cls.parameters)} parameter(s) "
                f"{cls.parameters}, got {args}"
            )
        for param, value in zip(cls.parameters, args, strict=True):
            if not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"structure '{cls.name}': {param} must be a positive integer, got {value!r}"
                )
        return _bound_subclass(cls.family or cls, tuple(args))

    @classmethod
    def bound_values(cls) -> tuple[int, ...] | None:
        """The parameters this class is bound to (None for an unbound family)."""
        if not cls.parameters:
            return ()
        params = cls.parameters  # (C calls alone: layout asks this per layer and pass)
        values = tuple(map(getattr, repeat(cls, len(params)), params, repeat(None)))
        return None if None in values else values

    @classmethod
    def spec(cls) -> str:
        """The registry string that rebuilds this class, e.g. ``"block_diagonal:32"``."""
        values = cls.bound_values()
        if not values:
            return cls.name
        return f"{cls.name}:{','.join(str(v) for v in values)}"

    # ------------------------------------------------------- constructors (abstract)
    @classmethod
    @abstractmethod
    def from_dense(cls, M: Tensor) -> StructuredMatrix:
        """The member holding M's entries on the pattern (tied entries averaged).

        M: (d, d), any float dtype, need not be symmetric. Storage dtype = M.dtype.
        """

    @classmethod
    @abstractmethod
    def project(cls, M: Tensor) -> StructuredMatrix:
        """Π̂(M) for a dense symmetric M of shape (d, d); storage dtype = M.dtype."""

    @classmethod
    @abstractmethod
    def project_gram(cls, Y: Tensor) -> StructuredMatrix:
        """Π̂(YᵀY) for Y of shape (N, d), without a d x d temporary (unless dense).

        Storage dtype = Y.dtype; accumulation in float32 for half dtypes.
        """

    @classmethod
    @abstractmethod
    def eye(cls, d: int, dtype: torch.dtype = torch.float32, device=None) -> StructuredMatrix:
        """The d x d identity."""

    # ---------------------------------------------------------- instance (abstract)
    @abstractmethod
    def to_dense(self) -> Tensor:
        """The (d, d) dense tensor, in the storage dtype."""

    @abstractmethod
    def matmul(self, X: Tensor) -> Tensor:
        """K @ X for a dense X of shape (d, n); result dtype promote(K, X)."""

    @abstractmethod
    def rmatmul(self, X: Tensor) -> Tensor:
        """Kᵀ @ X for a dense X of shape (d, n); result dtype promote(K, X)."""

    def gram_of_product(self, X: Tensor) -> StructuredMatrix:
        """Π̂((XK)ᵀ(XK)) = Π̂(Kᵀ XᵀX K) for X of shape (N, d): :meth:`project_gram` of
        XK = (Kᵀ Xᵀ)ᵀ (SINGD's statistic). Storage dtype promote(K, X)."""
        return type(self).project_gram(self.rmatmul(X.T).T)

    @abstractmethod
    def __matmul__(self, other: StructuredMatrix) -> StructuredMatrix:
        """K @ M for M of the same structure and dimension; storage dtype of K."""

    @abstractmethod
    def project_inner(self) -> StructuredMatrix:
        """Π̂(KᵀK), in the storage dtype."""

    @abstractmethod
    def trace(self) -> Tensor:
        """Scalar tensor: the trace, in the accumulation dtype (of the batch shape for a
        stack, ``batched``)."""

    # --------------------------------------------------------- K Kᵀ in a cheap form
    @classmethod
    def has_times_transpose(cls, d: int) -> bool:
        """Whether :meth:`times_transpose` is available for dimension d: always for the
        families with ``structured_times_transpose``, and for any family while a dense
        d x d K Kᵀ is small (d <= 128: at most 64 KiB in float32)."""
        return cls.structured_times_transpose or d <= SMALL_DENSE_DIM

    def times_transpose(self):
        """K Kᵀ, exactly, as an object with ``matmul(X)`` (a member of the family for
        families closed under transpose, else dense for small d), in the accumulation
        dtype (float32 for half storage, so that a large K Kᵀ cannot overflow float16).

        Only where :meth:`has_times_transpose`; the optimizers cache it between factor
        updates to precondition with one product per side instead of two.
        """
        if not self.has_times_transpose(self.dim):
            raise NotImplementedError(f"K Kᵀ of a {self.spec()} factor has no cheap form")
        K = upcast(self.to_dense())
        return self._dense(self.dim, mat=K @ K.T)

    @classmethod
    def row_width(cls, d: int) -> int:
        """Nonzeros per row of a d x d member (dense by default), so that K @ X costs
        about d · row_width · cols and :meth:`times_transpose` d · row_width²."""
        return d

    # ------------------------------------------------------------ shared concrete
    @classmethod
    def zeros(cls, d: int, dtype: torch.dtype = torch.float32, device=None) -> StructuredMatrix:
        """The d x d zero matrix."""
        eye = cls.eye(d, dtype=dtype, device=device)
        for part in eye.parts.values():
            part.zero_()
        return eye

    @classmethod
    def from_parts(cls, dim: int, parts: dict[str, Tensor]) -> StructuredMatrix:
        """Rebuild a matrix from its storage tensors (as in a state dict; the matrix holds
        a new dict of them). Parts named as ``part_names`` in that order, for a class
        that keeps this ``__init__``, are taken without its checks (the capture rebuilds
        a layer's factors at every call)."""
        if cls.__init__ is StructuredMatrix.__init__ and tuple(parts) == cls.part_names:
            matrix = object.__new__(cls)
            matrix.dim, matrix.parts = dim, dict(parts)
            return matrix
        return cls(dim, **parts)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the stored parts (all parts share it)."""
        return next(iter(self.parts.values())).dtype

    @property
    def device(self) -> torch.device:
        """The device of the stored parts."""
        return next(iter(self.parts.values())).device

    @property
    def nbytes(self) -> int:
        """Bytes of storage actually held."""
        return sum(p.numel() * p.element_size() for p in self.parts.values())

    @property
    def shape(self) -> torch.Size:
        """``(dim, dim)``: the shape of the dense matrix it represents."""
        return torch.Size((self.dim, self.dim))

    def _check_same_structure(self, other: StructuredMatrix) -> None:
        if type(other) is not type(self) or other.dim != self.dim:
            raise ValueError(
                f"expected a {self.spec()} matrix of dimension {self.dim}, "
                f"got {other.spec()} of dimension {other.dim}"
            )

    def add_(self, other: StructuredMatrix, alpha: float = 1.0) -> StructuredMatrix:
        """self += alpha * other, in place (other of the same structure)."""
        self._check_same_structure(other)
        for name, part in self.parts.items():
            update = upcast(part).add_(upcast(other.parts[name], part.dtype), alpha=alpha)
            store_(part, update)
        return self

    def mul_(self, scalar: float | Tensor) -> StructuredMatrix:
        """self *= scalar, in place; ``scalar``: a number, a 0-dim tensor or, for a stack
        of matrices (``batched``), a tensor of the batch shape (one scalar per matrix)."""
        per_matrix = isinstance(scalar, Tensor) and scalar.dim() > 0
        for part in self.parts.values():
            factor = scalar
            if per_matrix:  # (batch..., 1, ..., 1): broadcast over each matrix's part
                factor = scalar.reshape(*scalar.shape, *(1,) * (part.dim() - scalar.dim()))
            store_(part, upcast(part).mul_(factor))
        return self

    def add_identity_(self, alpha: float = 1.0) -> StructuredMatrix:
        """self += alpha * I, in place."""
        return self.add_(type(self).eye(self.dim, dtype=self.dtype, device=self.device), alpha)

    def abs_max(self) -> Tensor:
        """Scalar tensor: the largest absolute entry (0 for an empty matrix)."""
        maxima = [upcast(p).abs().max() for p in self.parts.values() if p.numel() > 0]
        if not maxima:
            return torch.zeros((), dtype=accumulation_dtype(self.dtype), device=self.device)
        return torch.stack(maxima).max()

    def average_trace(self) -> Tensor:
        """trace / d: the mean of the diagonal, tr̄ in the SINGD update."""
        return self.trace() / self.dim

    def clone(self) -> StructuredMatrix:
        """A copy with cloned parts (same structure, dim, dtype and device)."""
        return type(self)(self.dim, **{n: p.clone() for n, p in self.parts.items()})

    def to(self, dtype: torch.dtype | None = None, device=None) -> StructuredMatrix:
        """A copy (or self when nothing changes) in another dtype/device."""
        return type(self)(
            self.dim, **{n: p.to(dtype=dtype, device=device) for n, p in self.parts.items()}
        )

    def __repr__(self) -> str:
        return f"{self.spec()}(dim={self.dim}, dtype={self.dtype}, nbytes={self.nbytes})"


_BOUND: dict[tuple[type, tuple[int, ...]], type[StructuredMatrix]] = {}


def _bound_subclass(
    base: type[StructuredMatrix], values: tuple[int, ...]
) -> type[StructuredMatrix]:
    """One cached subclass per (family, parameters), so equal specs are the same class."""
    key = (base, values)
    if key not in _BOUND:
        attrs = dict(zip(base.parameters, values, strict=True), family=base)
        label = "_".join(str(v) for v in values)
        _BOUND[key] = type(f"{base.__name__}_{label}", (base,), attrs)
    return _BOUND[key]
