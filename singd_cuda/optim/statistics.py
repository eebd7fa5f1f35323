"""Gathering a step's statistics: the committed captures as the statistics of one batch.

The capture keeps raw sums per layer (the input side weighted by each call's loss
terms w, the output side without √L) and the total w of the calls it committed
(:class:`~singd_cuda.curvature.capture.Committed`). Normalising divides the input side
by w, multiplies the output side by w (for a loss averaged over its terms) and removes
the loss scale, with one multi-tensor multiply per (factor, device, dtype).
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from itertools import repeat

import torch
from torch import Tensor

from ..curvature.layers import Layer
from ..structures.base import ACCUMULATES_IN, HALF_DTYPES, PLAIN, StructuredMatrix, parts_of
from .grouped import GatheredRows

_DEVICE_DTYPE = operator.attrgetter("device", "dtype")
_DTYPE = operator.attrgetter("dtype")
_TERMS = operator.attrgetter("terms")
_STATISTICS = operator.attrgetter("statistics")
_IN, _OUT = operator.itemgetter("in"), operator.itemgetter("out")
_PARTS = operator.attrgetter("parts")


class StatisticsNormaliser:
    """Normalises committed statistics in place; keeps its 0-dim scalars between steps."""

    def __init__(self) -> None:
        self._scalars: dict[tuple, Tensor] = {}
        self._rows = GatheredRows()
        # after a call: stacks whose rows are every statistic it returned (None: not all)
        self.stacks: list[Tensor] | None = None

    def __call__(
        self, committed: dict, loss_averages: Mapping[Layer, str | None], loss_scale
    ) -> dict[Layer, dict]:
        """{layer: statistics} of the layers whose committed calls held a sample (w > 0),
        normalised in place, in the order of ``loss_averages`` (the optimizer's layers:
        that of the factor stacks, not the backward pass's). ``committed``: the
        capture's {layer: Committed}; ``loss_averages``: each layer's group's
        ``loss_average``; ``loss_scale``: the factor on the captured output gradients (a
        tensor, or None)."""
        self.stacks = None
        order = list(filter(committed.__contains__, loss_averages))
        if len(order) != len(committed):  # (layers it does not know: as committed)
            order = list(committed)
        pending = self._uniform(committed, order, loss_averages, loss_scale)
        if pending is not None:
            return pending
        pending = {}
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
        in_stacks, out_stacks = self._gathered("in", statistics), self._gathered("out", statistics)
        terms = terms[0]
        if terms != 1.0:
            self._scale_(in_stacks or list(map(_IN, statistics)), 1.0 / terms, None)
        out_factor = 1.0 if None in averages else terms
        if out_factor != 1.0 or loss_scale is not None:
            self._scale_(out_stacks or list(map(_OUT, statistics)), out_factor, loss_scale)
        if in_stacks and out_stacks and set(map(len, statistics)) == {2}:
            self.stacks = in_stacks + out_stacks
        return dict(zip(order, statistics, strict=True))

    def _gathered(self, side: str, statistics: list[dict]) -> list[Tensor]:
        """The stacks (:class:`~.grouped.GatheredRows`) now holding the ``side`` of every
        layer's ``statistics``, each layer's tensor replaced by its row (a view, equal
        values): for plain tensors (K-FAC's Gram matrices and AdaFisher's vectors, which
        only elementwise EMAs read) and for structured matrices of one structure whose one
        part is a vector (the diagonal: its consumers are elementwise and sums, which a
        row computes as a vector); not for SINGD's matrix parts, which meet GEMMs that may
        round differently at a row's offset. Empty (nothing changed) for other
        statistics."""
        values = list(map(operator.itemgetter(side), statistics))
        kinds = set(map(type, values))
        if kinds == PLAIN:
            tensors, holders, key = values, statistics, side
        elif len(kinds) == 1 and _one_part(next(iter(kinds))):
            key = next(iter(kinds)).part_names[0]
            holders = list(map(_PARTS, values))
            tensors = list(map(operator.itemgetter(key), holders))
            if set(map(Tensor.dim, tensors)) != {1}:
                return []
        else:
            return []
        stacks = []
        for positions, stack, rows in self._rows(f"{side}.{key}", tensors):
            members = holders if len(positions) == len(holders) else [holders[i] for i in positions]
            list(map(operator.setitem, members, repeat(key), rows))
            stacks.append(stack)
        return stacks

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


def _one_part(kind: type) -> bool:
    """Whether ``kind`` is a structure of one part (the diagonal)."""
    return issubclass(kind, StructuredMatrix) and len(kind.part_names) == 1
