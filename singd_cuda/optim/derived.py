"""Values derived from a layer's factors, kept between factor updates.

The diagonal paths precondition with vectors computed from the factors (SINGD's c² and
k², AdaFisher's normalised s′ and h′); the dense paths with K Kᵀ and C Cᵀ. They change
only when the factors do, so a step without a factor update reuses them, and the step
after an update recomputes them into the same buffers: no step allocates.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from itertools import count, repeat
from operator import is_

from torch import Tensor

from ..curvature.layers import Layer

# derive(*sources, out=previous values or None) -> values; with ``out`` it writes into
# those buffers and returns them (a derive that cannot may ignore ``out``)
Derive = Callable[..., tuple]


class DerivedCache:
    """One entry per layer: (sources, values), fresh while the layer is in ``_fresh``.

    An entry is valid while the source tensors are the same objects (a loaded checkpoint
    brings new ones) and until :meth:`forget` (called by every factor update of the
    layer); a stale entry with the same sources lends its buffers to the recomputation.
    """

    def __init__(self) -> None:
        self._entries: dict[int, tuple] = {}
        self._fresh: set[int] = set()  # ids of the layers whose entries are fresh

    def get(self, layer: Layer, sources: tuple[Tensor, ...], derive: Derive) -> tuple:
        entry = self._entries.get(id(layer))
        # map(operator.is_): the same test as a generator, without a Python call per source
        same = entry is not None and all(map(is_, entry[0], sources))
        if same and id(layer) in self._fresh:
            return entry[1]
        values = derive(*sources, out=entry[1] if same else None)
        self.put(layer, sources, values)
        return values

    def get_many(
        self, layers: list[Layer], sources: list[tuple[Tensor, ...]], create: Callable[..., tuple]
    ) -> tuple[list[tuple], list[int]]:
        """:meth:`get` of many layers (``sources[i]`` those of ``layers[i]``) with the
        recomputation left to the caller, to do for all at once: (the values of every
        layer, the positions of those to recompute). A value to recompute is its stale
        buffers where its sources are the same objects, else ``create(i, *sources[i])``'s
        new ones; either way it counts as fresh from here on."""
        entries = self._entries
        values, stale = [], []
        for position, (layer, layer_sources) in enumerate(zip(layers, sources, strict=True)):
            entry = entries.get(id(layer))
            same = entry is not None and all(map(is_, entry[0], layer_sources))
            if same and id(layer) in self._fresh:
                values.append(entry[1])
                continue
            buffers = entry[1] if same else create(position, *layer_sources)
            self.put(layer, layer_sources, buffers)
            values.append(buffers)
            stale.append(position)
        return values, stale

    def put(self, layer: Layer, sources: tuple[Tensor, ...], values: tuple) -> None:
        """Hold ``values``, fresh, as derived from ``sources`` (computed for many layers
        at once by the caller)."""
        self._entries[id(layer)] = (sources, values)
        self._fresh.add(id(layer))

    def put_many(
        self, layers: list[Layer], sources: Iterable[tuple[Tensor, ...]], values: list[tuple]
    ) -> None:
        """:meth:`put` of each of ``layers`` (``sources`` and ``values`` in their order),
        by C calls alone."""
        ids = list(map(id, layers))
        self._entries.update(zip(ids, zip(sources, values, strict=True), strict=True))
        self._fresh.update(ids)

    def values(self) -> list[tuple]:
        """The derived values held (stale ones included: they keep their buffers)."""
        return [entry[1] for entry in self._entries.values()]

    def forget(self, *layers: Layer) -> None:
        """Mark the layers' values stale (their factors changed): one C call."""
        self._fresh.difference_update(map(id, layers))


class GroupCache:
    """Values derived from the factors of a group of layers (stacked K Kᵀ, C Cᵀ), kept
    between factor updates: one entry per group, valid while its source tensors are the
    same objects and no layer of the group had its factors updated since (:meth:`forget`).
    A new entry drops the entries of other groups that share a layer with it, so that a
    layer's values are held once."""

    def __init__(self) -> None:
        self._entries: dict[tuple[int, ...], tuple] = {}
        # id of a layer -> the stamp of its last forget (a new one each forget)
        self._versions: dict[int, int] = {}
        self._stamps = count(1)

    def get(
        self,
        layers: list[Layer],
        sources: tuple[Tensor, ...],
        derive: Callable[..., tuple],
        into: bool = False,
    ) -> tuple:
        """The values of ``layers`` from ``sources``: kept ones, or ``derive()``'s. With
        ``into``, ``derive(previous)`` gets the stale values of the same sources (their
        buffers, to write into) or None."""
        # C calls alone (no generator): this runs per group of layers every step
        key = tuple(map(id, layers))
        versions = tuple(map(self._versions.get, key, repeat(0, len(key))))
        entry = self._entries.get(key)
        same = (
            entry is not None and len(entry[0]) == len(sources) and all(map(is_, entry[0], sources))
        )
        if same and entry[1] == versions:
            return entry[2]
        members = set(key)
        for other in [k for k in self._entries if k != key and members.intersection(k)]:
            del self._entries[other]
        values = derive(entry[2] if same else None) if into else derive()
        self._entries[key] = (sources, versions, values)
        return values

    def values(self) -> list[tuple]:
        """The derived values held, one tuple per group."""
        return [entry[2] for entry in self._entries.values()]

    def forget(self, *layers: Layer) -> None:
        """Mark the values of every group holding one of ``layers`` stale (their factors
        changed): each layer's stamp becomes a new one, C calls alone."""
        self._versions.update(zip(map(id, layers), repeat(next(self._stamps))))
