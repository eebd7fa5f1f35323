"""Gathering a step's statistics: the committed captures as the statistics of one batch.

The capture keeps raw sums per layer (the input side weighted by each call's loss
terms w, the output side without √L) and the total w of the calls it committed
(:class:`~singd_cuda.curvature.capture.Committed`). Normalising divides the input side
by w, multiplies the output side by w (for a loss averaged over its terms) and removes
the loss scale, with one multi-tensor multiply per (factor, device, dtype).

A diagonal statistic may arrive *unscaled* (:class:`UnscaledDiagonal`): SINGD's diagonal
statistic of a call is k² ⊙ diag(aᵀa) (c² ⊙ diag(gᵀg)), and the factor k² depends only on
the layer's factors, not on the live activations, so a layer's first call stores the
sums alone and the normaliser multiplies the factors in as it gathers the statistics: one
multiply per stack, before any other use, the same products as each call's.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping, Sequence
from itertools import repeat

import torch
from torch import Tensor

from ..curvature.layers import Layer
from ..structures.base import ACCUMULATES_IN, HALF_DTYPES, PLAIN, StructuredMatrix, parts_of
from ..structures.diagonal import Diagonal
from .grouped import GatheredRows, KnownStacks

_DEVICE_DTYPE = operator.attrgetter("device", "dtype")
_DTYPE = operator.attrgetter("dtype")
_TERMS = operator.attrgetter("terms")
_STATISTICS = operator.attrgetter("statistics")
_IN, _OUT = operator.itemgetter("in"), operator.itemgetter("out")
_PARTS = operator.attrgetter("parts")

# factors(layers) -> (input side, output side): the elementwise factor of each layer's
# unscaled statistic of that side, in the order of ``layers``: a list, or a stack of them
# as rows
Factors = Callable[[Sequence[Layer]], tuple[Sequence[Tensor], Sequence[Tensor]]]
_SIDE = {"in": 0, "out": 1}  # a side's place in a Factors answer


class UnscaledDiagonal(Diagonal):
    """A diagonal statistic diag(h) still to be multiplied elementwise by its factor
    (what its owner's :data:`Factors` gives: SINGD's k² on the input side, c² on the
    output side, in the accumulation dtype). Made by the capture of a layer's first call;
    multiplying the factor in (:func:`scale_unscaled`) makes it a :class:`Diagonal` (its
    class is set to that), so that it is multiplied once, and before any sum of calls."""


def scale_unscaled(statistics: Sequence, factors: Sequence[Tensor]) -> None:
    """Multiply each :class:`UnscaledDiagonal` of ``statistics`` by its factor (the one at
    its position, of a list or the rows of a stack; others are left alone), in place,
    and make it a :class:`Diagonal`."""
    picked = [i for i, s in enumerate(statistics) if type(s) is UnscaledDiagonal]
    if not picked:
        return
    vectors = [statistics[i].parts["diag"] for i in picked]
    torch._foreach_mul_(vectors, _in_dtypes([factors[i] for i in picked], vectors))
    _now_scaled([statistics[i] for i in picked])


def _now_scaled(statistics: Sequence[UnscaledDiagonal]) -> None:
    """Make each of ``statistics``, its factor multiplied in, a :class:`Diagonal` (C calls
    alone)."""
    list(map(setattr, statistics, repeat("__class__"), repeat(Diagonal)))


def _in_dtypes(factors: Sequence[Tensor], vectors: Sequence[Tensor]) -> list[Tensor]:
    """Each factor in its vector's dtype (a copy only where they differ): the product
    is taken in the statistic's dtype."""
    return [
        f if f.dtype is v.dtype else f.to(v.dtype) for f, v in zip(factors, vectors, strict=True)
    ]


class StatisticsNormaliser:
    """Normalises committed statistics in place; keeps its 0-dim scalars between steps."""

    def __init__(self) -> None:
        self._known = KnownStacks()  # the factors' stack, when they are the rows of one
        self._scalars: dict[tuple, Tensor] = {}
        self._rows = GatheredRows()
        # after a call: stacks whose rows are every statistic it returned (None: not all)
        self.stacks: list[Tensor] | None = None

    def __call__(
        self,
        committed: dict,
        loss_averages: Mapping[Layer, str | None],
        loss_scale,
        factors: Factors | None = None,
    ) -> dict[Layer, dict]:
        """{layer: statistics} of the layers whose committed calls held a sample (w > 0),
        normalised in place, in the order of ``loss_averages`` (the optimizer's layers:
        that of the factor stacks, not the backward pass's). ``committed``: the
        capture's {layer: Committed}; ``loss_averages``: each layer's group's
        ``loss_average``; ``loss_scale``: the factor on the captured output gradients (a
        tensor, or None); ``factors``: those of :class:`UnscaledDiagonal` statistics
        (none may come without it)."""
        self.stacks = None
        order = list(filter(committed.__contains__, loss_averages))
        if len(order) != len(committed):  # (layers it does not know: as committed)
            order = list(committed)
        pending = self._uniform(committed, order, loss_averages, loss_scale, factors)
        if pending is not None:
            return pending
        pending = {}
        for side in ("in", "out"):
            holding = [layer for layer in order if side in committed[layer].statistics]
            values = [committed[layer].statistics[side] for layer in holding]
            _scale_each(side, holding, values, factors)
        # (factor, scaled by the loss scale) -> statistics: one multiply per group below
        scaled: dict[tuple[float, bool], list] = {}
        for layer in order:
            entry = committed[layer]
            statistics = entry.statistics
            if entry.terms <= 0 or not statistics:
                continue
            terms = entry.terms
            if "in" in statistics:  # norm layers have no input side
                scaled.setdefault((1.0 / terms, False), []).append(statistics["in"])
            out_factor = 1.0 if loss_averages[layer] is None else terms
            scaled.setdefault((out_factor, loss_scale is not None), []).append(statistics["out"])
            pending[layer] = statistics
        for (factor, by_loss_scale), group in scaled.items():
            if factor != 1.0 or by_loss_scale:
                self._scale_(group, factor, loss_scale if by_loss_scale else None)
        return pending

    def _uniform(
        self,
        committed: dict,
        order: list[Layer],
        loss_averages: Mapping[Layer, str | None],
        loss_scale,
        factors: Factors | None = None,
    ) -> dict[Layer, dict] | None:
        """:meth:`__call__` by C calls, no loop over the layers, in the common case: every
        layer committed the same w > 0, has both sides and has one ``loss_average``; None
        (nothing done) otherwise. Each side's statistics are first gathered into stacks
        (:meth:`_gathered`), so that a multiply per stack scales them."""
        entries = list(map(committed.__getitem__, order))
        terms = list(map(_TERMS, entries))
        if not terms or terms[0] <= 0 or terms.count(terms[0]) != len(terms):
            return None
        statistics = list(map(_STATISTICS, entries))
        averages = set(map(loss_averages.__getitem__, order))
        if len(averages) != 1 or not all(map(operator.contains, statistics, repeat("in"))):
            return None
        found: list[tuple] = []  # factors(order), asked once for both sides
        in_stacks = self._gathered("in", order, statistics, factors, found)
        out_stacks = self._gathered("out", order, statistics, factors, found)
        terms = terms[0]
        if terms != 1.0:
            self._scale_(in_stacks or list(map(_IN, statistics)), 1.0 / terms, None)
        out_factor = 1.0 if None in averages else terms
        if out_factor != 1.0 or loss_scale is not None:
            self._scale_(out_stacks or list(map(_OUT, statistics)), out_factor, loss_scale)
        if in_stacks and out_stacks and set(map(len, statistics)) == {2}:
            self.stacks = in_stacks + out_stacks
        return dict(zip(order, statistics, strict=True))

    def _gathered(
        self,
        side: str,
        layers: list[Layer],
        statistics: list[dict],
        factors: Factors | None,
        found: list[tuple],
    ) -> list[Tensor]:
        """The stacks (:class:`~.grouped.GatheredRows`) now holding the ``side`` of every
        layer's ``statistics``, each layer's tensor replaced by its row (a view, equal
        values): for plain tensors (K-FAC's Gram matrices and AdaFisher's vectors, which
        only elementwise EMAs read) and for structured matrices of one structure whose one
        part is a vector (the diagonal: its consumers are elementwise and sums, which a
        row computes as a vector); not for SINGD's matrix parts, which meet GEMMs that may
        round differently at a row's offset. Empty (nothing changed) for other
        statistics. Unscaled statistics come out scaled either way (each stack of them by
        one multiply where their factors are the rows of one stack); ``found`` keeps
        ``factors(layers)`` for the other side."""
        values = list(map(operator.itemgetter(side), statistics))
        kinds = set(map(type, values))
        unscaled = kinds == {UnscaledDiagonal}
        if kinds == PLAIN:
            tensors, holders, key = values, statistics, side
        elif len(kinds) == 1 and _one_part(next(iter(kinds))):
            key = next(iter(kinds)).part_names[0]
            holders = list(map(_PARTS, values))
            tensors = list(map(operator.itemgetter(key), holders))
            if set(map(Tensor.dim, tensors)) != {1}:
                return _scaled_alone(side, layers, values, kinds, factors)
        else:
            return _scaled_alone(side, layers, values, kinds, factors)
        layer_factors = None
        if unscaled:
            if not found:
                found.append(factors(layers))
            layer_factors = found[0][_SIDE[side]]
        stacks = []
        for positions, stack, rows in self._rows(f"{side}.{key}", tensors):
            everyone = len(positions) == len(holders)
            members = holders if everyone else [holders[i] for i in positions]
            list(map(operator.setitem, members, repeat(key), rows))
            if layer_factors is not None:
                own = layer_factors if everyone else [layer_factors[i] for i in positions]
                self._scale_stack(stack, rows, own)
            stacks.append(stack)
        if unscaled:
            _now_scaled(values)
        return stacks

    def _scale_stack(self, stack: Tensor, rows: list[Tensor], factors: Sequence[Tensor]) -> None:
        """stack (its ``rows``) ⊙= the factors: one multiply when they are a stack, or the
        rows of one, of the same shape, else one multi-tensor multiply."""
        known = factors if isinstance(factors, Tensor) else self._known(factors)
        if known is not None and known.shape == stack.shape:
            stack.mul_(known if known.dtype is stack.dtype else known.to(stack.dtype))
        else:
            torch._foreach_mul_(rows, _in_dtypes(list(factors), rows))

    def _scale_(self, statistics: list, factor: float, loss_scale: Tensor | None) -> None:
        """statistic *= factor / loss_scale² for each of ``statistics`` (tensors or
        structured matrices): one multi-tensor multiply per (device, dtype) for those
        held in their accumulation dtype (one call, no grouping, when all are plain tensors
        of one device and dtype), by a 0-dim tensor kept between steps (a Python scalar
        would allocate one per call; the loss scale stays on the device, unread)."""
        kinds = set(map(type, statistics))
        # the common cases: plain tensors, or structured matrices of one structure, of
        # one device and accumulation dtype: one call, no grouping
        tensors = statistics if kinds == PLAIN else None
        if tensors is None and len(kinds) == 1 and issubclass(next(iter(kinds)), StructuredMatrix):
            tensors = list(parts_of(statistics))
        if tensors is not None:
            keys = list(map(_DEVICE_DTYPE, tensors))
            if keys.count(keys[0]) == len(keys) and keys[0][1] not in HALF_DTYPES:
                torch._foreach_mul_(tensors, self._scalar(keys[0], factor, loss_scale))
                return
        fused: dict[tuple, list[Tensor]] = {}
        for statistic in statistics:
            structured = getattr(statistic, "parts", None)  # a StructuredMatrix's parts
            parts = [statistic] if structured is None else list(structured.values())
            dtype = ACCUMULATES_IN.get(parts[0].dtype, parts[0].dtype)
            if set(map(_DTYPE, parts)) == {dtype}:
                fused.setdefault((parts[0].device, dtype), []).extend(parts)
            else:  # low-precision parts: their own rounding on store
                statistic.mul_(self._scalar((parts[0].device, dtype), factor, loss_scale))
        for key, tensors in fused.items():
            torch._foreach_mul_(tensors, self._scalar(key, factor, loss_scale))

    def _scalar(self, key: tuple, factor: float, loss_scale: Tensor | None) -> Tensor:
        """factor / loss_scale² as a 0-dim tensor of ``key`` = (device, dtype), reused."""
        if len(self._scalars) > 64:  # many distinct loss-term counts: start over
            self._scalars.clear()
        full_key = (*key, factor, loss_scale is not None)
        scalar = self._scalars.get(full_key)
        if scalar is None:
            scalar = torch.full((), factor, dtype=key[1], device=key[0])
            self._scalars[full_key] = scalar
        if loss_scale is None:
            return scalar  # (its key holds its value, which nothing writes)
        return scalar.copy_(loss_scale.reshape(())).reciprocal_().square_().mul_(factor)


def _scaled_alone(
    side: str, layers: list[Layer], values: list, kinds: set, factors: Factors | None
) -> list:
    """:meth:`StatisticsNormaliser._gathered`'s empty answer: nothing gathered, the
    unscaled ``values`` (if any) scaled one by one."""
    if UnscaledDiagonal in kinds:
        _scale_each(side, layers, values, factors)
    return []


def _scale_each(side: str, layers: list[Layer], values: list, factors: Factors | None) -> None:
    """Scale the unscaled ones of ``values`` (the ``side`` statistics of ``layers``), with
    the factors of their layers alone."""
    picked = [i for i, value in enumerate(values) if type(value) is UnscaledDiagonal]
    if picked:
        found = factors([layers[i] for i in picked])[_SIDE[side]]
        scale_unscaled([values[i] for i in picked], found)


def _one_part(kind: type) -> bool:
    """Whether ``kind`` is a structure of one part (the diagonal)."""
    return issubclass(kind, StructuredMatrix) and len(kind.part_names) == 1
