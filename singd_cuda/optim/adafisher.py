"""AdaFisher (Gomes et al., ICLR 2025) as a structure: diagonal Kronecker factors.

The paper's update. Per layer: h (d_K) and s (d_C), exponential moving averages
(h ← γh + (1−γ)h_new, γ = ``ema_decay``) of the mean squared layer input and
the mean squared (loss-scaled) output gradient, refreshed every T steps. The
preconditioner F̃ = s′ ⊗ h′ + λ uses the min–max normalised EMAs, as in the
paper. The update is Adam-style momentum with bias correction and no square
root: m ← βm + (1−β)g; θ ← θ − lr · (m / (1−βᵗ)) / F̃, t the layer's own update count.

Departures from the official code, on purpose: its EMA (0.1γ·H + 0.01γ·H_new)
makes F̃ ≈ λ everywhere, so the paper's EMA is used; and parameters are paired
with their modules by identity, not by index.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from itertools import chain, compress, repeat
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from .. import ops
from ..curvature.layers import Layer, gradient_matrix, split_matrix
from ..structures.base import accumulation_dtype
from . import hyperparameters as hp
from .base import KroneckerOptimizer, checked_fallback
from .derived import DerivedCache, GroupCache
from .graft import graft_
from .grouped import ResidentStacks, count_up, positions_by, update_in_stacks
from .rule import LayerRule, add_statistics, scheduled
from .scale_out import DEFAULT_BUCKET_CAP_MB
from .write import adam_update_

ADAFISHER = "adafisher"


class _Queued(NamedTuple):
    """How one parameter is queued, kept between steps while its sources are the same
    objects: the parameter, its buffer and the layer's scale vectors (the sources), their
    matrices and slices, and where the gradient's matrix lies within a gradient strided
    like the parameter (``grad_view``: shape, stride, offset from the tensor's start;
    None when the matrices are copies, which are made anew every step)."""

    param: Tensor
    buf_source: Tensor | None
    row_source: Tensor
    col_source: Tensor
    matrix: Tensor
    buf: Tensor | None
    rows: Tensor
    cols: Tensor
    grad_view: tuple[tuple[int, ...], tuple[int, ...], int] | None


class DiagonalViews:
    """The :class:`_Queued` entries of the parameters a rule queues every step, so that a
    warm step queues each parameter with a few identity checks instead of rebuilding its
    views (a parameter that must be copied, e.g. channels_last, is never kept)."""

    def __init__(self) -> None:
        self._entries: dict[int, _Queued] = {}

    def get(self, param: Tensor, buf: Tensor | None, row: Tensor, col: Tensor) -> _Queued | None:
        entry = self._entries.get(id(param))
        if (
            entry is None
            or entry.param is not param
            or entry.matrix.data_ptr() != param.data_ptr()  # (``param.data`` replaced)
            or entry.buf_source is not buf
            or entry.row_source is not row
            or entry.col_source is not col
        ):
            return None
        return entry

    def keep(self, entry: _Queued) -> None:
        self._entries[id(entry.param)] = entry


class DiagonalBatch:
    """The lists of one :func:`singd_cuda.ops.diag_precond_step_` call: each layer's
    weight as its (d_C, n) weight matrix (:meth:`LayerKind.weight_matrix`) and its bias as
    a (d_C, 1) matrix, with the row scales (d_C) and the matching slice of the column
    scales (d_K = n [+ 1]).

    The matrices are views where the memory layout allows. A weight stored transposed
    (Hugging Face ``Conv1D``: (n, d_C) in memory) is queued as that (n, d_C) view with
    its row and column scales swapped: the op's scale is the outer product of the two,
    elementwise the same. A tensor that cannot be viewed (e.g. a channels_last conv
    weight) is queued as a contiguous copy, and :meth:`write_back` copies the updated
    parameters and buffers back after the op. With ``views`` given, the views of a
    parameter are kept there for the next step's batch.
    """

    def __init__(self, views: DiagonalViews | None = None) -> None:
        self.params: list[Tensor] = []
        self.grads: list[Tensor] = []
        self.bufs: list[Tensor] = []
        self.rows: list[Tensor] = []
        self.cols: list[Tensor] = []
        self._views = views
        # (tensor, its updated matrix copy, (matrix, tensor) -> shaped like tensor, transposed)
        self._copies: list[tuple[Tensor, Tensor, Callable, bool]] = []
        self.grad_views: list[tuple | None] = []  # each grad's _Queued.grad_view, or None
        # the op to run on the lists: ops.diag_precond_step_, or a kept batch's resolved
        # ops.diag_precond_step_for (no environment read a step)
        self.step_op: Callable[..., None] = ops.diag_precond_step_

    def _matrix(
        self, tensor: Tensor, as_matrix, from_matrix, transposed: bool, updated: bool
    ) -> tuple[Tensor, bool]:
        """(``as_matrix(tensor)`` (transposed if ``transposed``) as a contiguous view of
        ``tensor``, True), else (a copy, written back through ``from_matrix`` if
        ``updated``, False)."""
        matrix = as_matrix(tensor)
        if transposed:
            matrix = matrix.T
        shares = matrix.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr()
        if shares and matrix.is_contiguous():
            return matrix, True
        # as_matrix copied already (a layout reshape cannot view), or a strided view
        copy = matrix.clone(memory_format=torch.contiguous_format) if shares else matrix
        copy = copy.contiguous()
        if updated:
            self._copies.append((tensor, copy, from_matrix, transposed))
        return copy, False

    def add(
        self, layer: Layer, states: list[dict], row: Tensor, col: Tensor, buf_key: str | None
    ) -> None:
        """Queue the layer's parameters that have a gradient, with their buffers
        ``state[buf_key]`` (created as zeros in the parameter's dtype; none when
        ``buf_key`` is None)."""
        start = 0
        for param, state in zip(layer.params, states, strict=True):
            width = param.numel() // max(layer.dim_out, 1)
            start += width
            grad = param.grad
            if grad is None:
                continue  # e.g. a bias frozen after construction: leave it alone
            buf = None
            if buf_key is not None:
                if buf_key not in state:
                    state[buf_key] = torch.zeros_like(param)
                buf = state[buf_key]
            entry = None if self._views is None else self._views.get(param, buf, row, col)
            if entry is None:
                entry = self._queue(layer, param, buf, row, col, start - width, width)
                if self._views is not None and entry.grad_view is not None:
                    self._views.keep(entry)
            self.params.append(entry.matrix)
            if entry.buf is not None:
                self.bufs.append(entry.buf)
            self.rows.append(entry.rows)
            self.cols.append(entry.cols)
            if entry.grad_view is not None and grad.stride() == param.stride():
                self.grads.append(_grad_view(grad, entry.grad_view))  # (it has its shape)
                self.grad_views.append(entry.grad_view)
            else:  # copies, or a gradient laid out unlike its parameter
                self.grads.append(self._matrix(grad, *self._layout(layer, param), False)[0])
                self.grad_views.append(None)

    @staticmethod
    def _layout(layer: Layer, param: Tensor) -> tuple[Callable, Callable, bool]:
        """(as_matrix, from_matrix, transposed) of a parameter of ``layer``."""
        if param is layer.weight:
            view = layer.kind.weight_matrix(param)
            transposed = not view.is_contiguous() and view.T.is_contiguous()
            return layer.kind.weight_matrix, layer.kind.weight_from_matrix, transposed
        return _column, _like, False

    def _queue(
        self, layer: Layer, param: Tensor, buf, row: Tensor, col: Tensor, start: int, width: int
    ) -> _Queued:
        """The entry of a parameter: its matrices are views when the layout allows (then
        it can be kept between steps), else copies written back after the op."""
        as_matrix, from_matrix, transposed = self._layout(layer, param)
        cols = col[start : start + width]
        rows, cols = (cols, row) if transposed else (row, cols)
        matrix, viewed = self._matrix(param, as_matrix, from_matrix, transposed, True)
        buf_matrix = None
        if buf is not None:
            buf_matrix, buf_viewed = self._matrix(buf, as_matrix, from_matrix, transposed, True)
            viewed = viewed and buf_viewed
        grad_view = None
        if viewed:
            offset = matrix.storage_offset() - param.storage_offset()
            grad_view = (tuple(matrix.shape), matrix.stride(), offset)
        return _Queued(param, buf, row, col, matrix, buf_matrix, rows, cols, grad_view)

    def lists(self) -> tuple[list[Tensor], ...]:
        return self.params, self.grads, self.bufs, self.rows, self.cols

    def write_back(self) -> None:
        """Copy the updated matrix copies into the tensors they stand for (after the op)."""
        for tensor, copy, from_matrix, transposed in self._copies:
            tensor.copy_(from_matrix(copy.T if transposed else copy, tensor))


class KeptBatch:
    """The lists of a rule's last :class:`DiagonalBatch`, kept for the next step while
    it would queue the same: the same parameters, buffers and scale vectors (as objects),
    gradients for the same parameters, those viewed as a matrix strided as before, every
    matrix a view (no copies to write back). A warm step then only views the new
    gradients that are not taken as they are (:func:`_takes_as_is`, whatever their
    strides: the op reads any layout of a gradient of its matrix's shape, or of a bias's
    vector)."""

    def __init__(self) -> None:
        self._sources: list = []  # parameters, buffers, scale vectors of the kept batch
        self._present: list[bool] = []  # which parameters had a gradient
        self._viewed: list[int] = []  # positions of the queued gradients viewed as matrices
        self._strides: list[tuple[int, ...]] = []  # those gradients' strides
        self._lists: tuple[list[Tensor], ...] | None = None  # (params, bufs, rows, cols)
        self._grad_views: list[tuple | None] = []  # None: the gradient as it is (_takes_as_is)
        self._pointers: list[int] = []  # the parameters' data pointers
        self._step_op: Callable[..., None] = ops.diag_precond_step_  # resolved with the lists

    def batch(
        self,
        layers: list[Layer],
        states: list[list[dict]],
        rows: list[Tensor],
        cols: list[Tensor],
        buf_key: str | None,
        views: DiagonalViews,
    ) -> DiagonalBatch:
        """The batch of ``layers`` with the row and column scales of each (as
        :meth:`DiagonalBatch.add`), its lists kept from the last call where they hold."""
        params = list(chain.from_iterable(map(_PARAMS, layers)))
        grads = list(map(_GRAD, params))
        present = list(map(operator.is_not, grads, repeat(None)))
        bufs = [] if buf_key is None else self._bufs(states, buf_key)
        sources = [*params, *bufs, *rows, *cols]
        if (
            self._lists is not None
            and present == self._present
            and len(sources) == len(self._sources)
            and all(map(operator.is_, sources, self._sources))
            # the same objects may hold new data (``param.data = ...``, ``model.to(...)``):
            # the kept views would write into the old
            and list(map(Tensor.data_ptr, params)) == self._pointers
        ):
            queued = list(compress(grads, present))
            viewed = [queued[i] for i in self._viewed] if self._viewed else []
            if list(map(Tensor.stride, viewed)) == self._strides:
                batch = DiagonalBatch()
                batch.params, batch.bufs, batch.rows, batch.cols = self._lists
                batch.step_op = self._step_op
                batch.grads = queued
                if viewed:
                    batch.grads = [
                        # _grad_view, inline (a Python call per bias saved)
                        grad
                        if view is None
                        else grad.as_strided(*view[:2], grad.storage_offset() + view[2])
                        for grad, view in zip(queued, self._grad_views, strict=True)
                    ]
                return batch
        batch = DiagonalBatch(views)
        for layer, layer_states, row, col in zip(layers, states, rows, cols, strict=True):
            batch.add(layer, layer_states, row, col, buf_key)
        self._lists = None
        if not batch._copies and None not in batch.grad_views:  # views only: keep
            queued = list(compress(grads, present))
            bufs = [] if buf_key is None else self._bufs(states, buf_key)
            self._sources = [*params, *bufs, *rows, *cols]  # (the buffers add created)
            self._present = present
            self._pointers = list(map(Tensor.data_ptr, params))
            self._lists = (batch.params, batch.bufs, batch.rows, batch.cols)
            self._step_op = ops.diag_precond_step_for(params[0].device.type)
            self._grad_views = [
                None if _takes_as_is(grad, view) else view
                for grad, view in zip(queued, batch.grad_views, strict=True)
            ]
            self._viewed = [i for i, view in enumerate(self._grad_views) if view is not None]
            self._strides = [queued[i].stride() for i in self._viewed]
        return batch

    @staticmethod
    def _bufs(states: list[list[dict]], buf_key: str) -> list[Tensor | None]:
        """Every parameter's ``state[buf_key]`` (None where missing), by C calls."""
        return list(map(dict.get, chain.from_iterable(states), repeat(buf_key)))


def _takes_as_is(grad: Tensor, view: tuple) -> bool:
    """Whether :func:`singd_cuda.ops.diag_precond_step_` takes ``grad`` itself for its matrix
    at ``view`` = (shape, stride, offset): the matrix is the gradient, or the one column of a
    contiguous vector (a bias's gradient, which the op reads as its (d_C, 1) matrix)."""
    shape, stride, offset = view
    if offset != 0:
        return False
    if shape == tuple(grad.shape) and stride == grad.stride():
        return True
    return grad.dim() == 1 and grad.is_contiguous() and shape == (grad.numel(), 1)


def _grad_view(grad: Tensor, view: tuple) -> Tensor:
    """The matrix of ``grad`` at ``view`` = (shape, stride, offset from its start)."""
    shape, stride, offset = view
    return grad.as_strided(shape, stride, grad.storage_offset() + offset)


def _column(bias: Tensor) -> Tensor:
    """A bias (or a tensor shaped like it) as a (d_C, 1) matrix."""
    return bias.reshape(-1, 1)


def _like(matrix: Tensor, tensor: Tensor) -> Tensor:
    return matrix.reshape(tensor.shape)


def preconditioned(G: Tensor, s: Tensor, h: Tensor, damping: float) -> Tensor:
    """Ĝ = G / (s′ ⊗ h′ + λ): G (d_C, d_K) unscaled, s′ (d_C) and h′ (d_K) in G's dtype."""
    return G / torch.outer(s, h).add_(damping)


def _normalised(s: Tensor, h: Tensor, acc: torch.dtype, out: tuple | None) -> tuple:
    """(s′, h′, the normaliser): the min–max normalised EMAs in ``acc``, into ``out`` if
    given (the normaliser, :func:`~singd_cuda.ops.min_max_normalise_rows_for`, is
    resolved with the buffers)."""
    if out is None:
        normalise = ops.min_max_normalise_rows_for(s.device.type)
        out = (s.new_empty(s.shape, dtype=acc), h.new_empty(h.shape, dtype=acc), normalise)
    out[2](out[0], s)
    out[2](out[1], h)
    return out


def _normalised_rows(S: Tensor, H: Tensor, acc: torch.dtype, out: tuple | None) -> tuple:
    """(S′, H′, the rows of S′, the rows of H′, the normaliser): the min–max normalised
    rows of the stacked EMAs S (L, d_C) and H (L, d_K) in ``acc``, one op a stack, into
    ``out`` if given (as :func:`_normalised`)."""
    if out is None:
        S_norm = S.new_empty(S.shape, dtype=acc)
        H_norm = H.new_empty(H.shape, dtype=acc)
        normalise = ops.min_max_normalise_rows_for(S.device.type)
        out = (S_norm, H_norm, list(S_norm.unbind()), list(H_norm.unbind()), normalise)
    out[4](out[0], S)
    out[4](out[1], H)
    return out


def _stack_key(layer: Layer, state: dict) -> tuple:
    """Layers with equal keys keep their EMAs as the rows of one stack."""
    h, s = state["h"], state["s"]
    return (layer.dim_in, layer.dim_out, h.dtype, s.dtype, h.device, layer.weight.dtype)


_SIDES = (("h", "in"), ("s", "out"))  # (EMA, its statistics in ``pending``)
_FIRST, _STEP = operator.itemgetter(0), operator.itemgetter("step")
_PARAMS, _GRAD = operator.attrgetter("params"), operator.attrgetter("grad")


def _ema_each(states: list[dict], pendings: list[dict], weight: float) -> None:
    """The EMAs of each layer in one ``torch._foreach_lerp_`` (a low-precision EMA runs in
    its statistics' dtype, then is stored back)."""
    emas, news, targets, casts = [], [], [], []
    for state, pending in zip(states, pendings, strict=True):
        for key, side in _SIDES:
            ema, new = state[key], pending[side]
            if ema.dtype != new.dtype:  # a low-precision factor: the EMA in new's dtype
                targets.append(ema)
                ema = ema.to(new.dtype)
                casts.append(ema)
            emas.append(ema)
            news.append(new)
    # lerp_ takes its weight as a scalar; mul_(decay) would allocate a 0-dim tensor
    torch._foreach_lerp_(emas, news, weight)
    if casts:
        torch._foreach_copy_(targets, casts)


class AdaFisherRule(LayerRule):
    """AdaFisher's diagonal statistics, EMA and Adam-style preconditioned update."""

    def __init__(self) -> None:
        self._normalised = DerivedCache()  # (s′, h′) of a layer alone, between updates
        self._stacked = GroupCache()  # (S′, H′) of a stack of layers, between updates
        self._resident = ResidentStacks(("h", "s"), named=False)  # EMAs of equal shapes
        self._views = DiagonalViews()  # the parameters' views, between steps
        self._kept = KeptBatch()  # the last batch's lists, between steps

    def open_step(self) -> None:
        self._resident.open_step()

    def close_step(self) -> None:
        self._resident.close_step()

    def init_state(self, layer: Layer, group: dict, state: dict) -> None:
        dtype = group["factor_dtype"] or layer.weight.dtype
        device = layer.weight.device
        state["h"] = torch.zeros(layer.dim_in, dtype=dtype, device=device)
        state["s"] = torch.zeros(layer.dim_out, dtype=dtype, device=device)
        state["step"] = 0  # the layer's own update count (bias correction, as in Adam)

    def accumulate(self, layer, group, state, pending, a: Tensor, g: Tensor) -> None:
        """Column sums of a² and g² (a carries 1/√N, so these are means)."""
        h_new = ops.col_sum_squares(a, -1).to(a.dtype)
        s_new = ops.col_sum_squares(g, -1).to(g.dtype)
        self.accumulate_diagonal(layer, group, state, pending, h_new, s_new)

    def diagonal_statistics(self, group: dict) -> bool:
        return True

    def accumulate_diagonal(self, layer, group, state, pending, h_new, s_new) -> None:
        add_statistics(pending, h_new, s_new)

    def factor_structures(self, group: dict) -> tuple[str, str]:
        return (ADAFISHER, ADAFISHER)

    def update_factors(self, layer, group, state, pending, step: int) -> None:
        self.update_factors_many([layer], group, [state], [pending], step)

    def group_key(self, layer, group, state) -> str:
        """Every layer of a group: the EMA is elementwise, whatever the shapes."""
        return ADAFISHER

    def group_keys(self, layers, group, states) -> list[str]:
        return [ADAFISHER] * len(layers)  # (group_key of each, by no Python call)

    def update_factors_many(self, layers, group, states, pendings, step: int) -> None:
        """h ← γh + (1−γ)h_new and s ← γs + (1−γ)s_new of every layer: for layers of
        equal shapes and dtypes one lerp per EMA on the stack of their EMAs
        (:class:`~.grouped.ResidentStacks`), the others in one ``torch._foreach_lerp_``
        (elementwise, so bitwise the same as one lerp_ a vector)."""
        self._normalised.forget(*layers)
        self._stacked.forget(*layers)
        weight = 1.0 - group["ema_decay"]
        update_in_stacks(
            self._parts(layers, states),
            layers,
            states,
            pendings,
            lambda *part: self._ema_stacked(*part, weight),
            lambda *rest: _ema_each(*rest, weight),
        )

    def _parts(self, layers, states: list[dict]) -> list[list[int]]:
        """``layers``' positions by :func:`_stack_key`: one part when the layers are those
        of kept stacks whose rows the states still hold, with one weight dtype and device
        (the steady state: then no key is computed)."""
        if len(layers) > 1 and self._resident.kept_alike(layers, states) is not None:
            return [list(range(len(layers)))]
        return positions_by(list(map(_stack_key, layers, states)))

    def _ema_stacked(self, layers, states: list[dict], pendings: list[dict], weight: float):
        """The EMA of layers of equal shapes and dtypes on the stacks of their EMAs, when
        they hold their statistics' dtype; False (nothing done) otherwise. The statistics
        are copied into a stack kept for the next update (no allocation)."""
        first = pendings[0]
        if any(states[0][key].dtype != first[side].dtype for key, side in _SIDES):
            return False
        stacks = self._resident.of(layers, states)
        for key, side in _SIDES:
            ema = stacks[key]
            news = self._resident.gathered(ema, [pending[side] for pending in pendings])
            # lerp_ takes its weight as a scalar; mul_(decay) would allocate a 0-dim tensor
            ema.lerp_(news, weight)
        return True

    def fuses_apply(self, group: dict) -> bool:
        return True

    def grafts(self, group: dict) -> bool:
        return True

    def apply_many(self, layers, group, states, inv_scale, step: int, seed: int, found_inf=None):
        """:func:`singd_cuda.ops.diag_precond_step_` (mode "adafisher") over every layer:
        F̃ = s′ ⊗ h′ + λ is formed on the fly, never materialised.

        The bias correction 1/(1 − βᵗ) counts each layer's own updates (``state["step"]``),
        as Adam counts each parameter's: a layer first used late gets a normal first step.
        Layers with equal counts share one op call (one call when all started together).
        With ``graft`` the step is split instead (:meth:`_apply_grafted`).
        """
        if group["graft"] is not None:
            self._apply_grafted(layers, group, states, inv_scale, step, seed, found_inf)
            return
        rows, cols = self._counted_scales_many(layers, states)
        counts = list(map(_STEP, map(_FIRST, states)))
        by_count: dict[int, tuple[int, DiagonalBatch]] = {}
        if counts.count(counts[0]) == len(counts):  # the common case: one batch, kept
            by_count[counts[0]] = (
                0,
                self._kept.batch(layers, states, rows, cols, "exp_avg", self._views),
            )
        else:
            for position, (layer, layer_states, s, h, count) in enumerate(
                zip(layers, states, rows, cols, counts, strict=True)
            ):
                if count not in by_count:
                    by_count[count] = (position, DiagonalBatch(self._views))
                by_count[count][1].add(layer, layer_states, s, h, "exp_avg")
        for count, (position, batch) in by_count.items():
            # the first layer's position: distinct random bits
            self._step_batch(batch, group, inv_scale, step, count, seed + position, found_inf)

    def _apply_grafted(self, layers, group, states, inv_scale, step: int, seed: int, found_inf):
        """``graft`` (:mod:`.graft`): Ĝ = G / F̃ of every layer, each parameter's part
        rescaled to the graft's norm, then the Adam-style write of the grafted directions
        (:func:`~.write.adam_update_`): m ← βm + (1 − β)(graft(Ĝ) + γW), W ← W − lr·m̂.
        Not the fused op, which averages G before preconditioning: the graft sets the
        norm of the preconditioned gradient before the momentum, as for SINGD and K-FAC.
        No per-entry bound of the step by lr either: the graft sets the step's size."""
        params, directions, param_states = [], [], []
        by_count: dict[int, tuple[int, list[int]]] = {}  # count -> (first layer, parameters)
        damping = scheduled(group["damping"], step)
        for position, (layer, layer_states) in enumerate(zip(layers, states, strict=True)):
            s, h = self._counted_scales(layer, layer_states[0])
            G = gradient_matrix(layer, s.dtype)
            if inv_scale is not None:  # (never in place: G may be a view of the gradient)
                G = G * inv_scale.to(G.dtype)
            members = by_count.setdefault(layer_states[0]["step"], (position, []))[1]
            members.extend(range(len(params), len(params) + len(layer.params)))
            params += layer.params
            directions += split_matrix(layer, preconditioned(G, s, h, damping))
            param_states += layer_states
        graft_(params, directions, param_states, group, inv_scale, found_inf)
        for count, (position, members) in by_count.items():
            adam_update_(
                [params[i] for i in members],
                [directions[i] for i in members],
                [param_states[i] for i in members],
                group,
                count,
                seed + position,
                found_inf,
            )

    def _counted_scales(self, layer: Layer, state: dict) -> tuple[Tensor, Tensor]:
        """(s′, h′) of the layer, counting one more update of it (its bias correction)."""
        scales = self._scales(layer, state)
        state["step"] += 1
        return scales

    def _scales(self, layer: Layer, state: dict) -> tuple[Tensor, Tensor]:
        """(s′, h′) of one layer, kept between its factor updates."""
        acc = accumulation_dtype(layer.weight.dtype)
        s, h, _ = self._normalised.get(
            layer, (state["s"], state["h"]), lambda s, h, out: _normalised(s, h, acc, out)
        )
        return s, h

    def _counted_scales_many(self, layers, states) -> tuple[list[Tensor], list[Tensor]]:
        """(s′ of every layer, h′ of every layer) (``states``: each layer's parameter
        states), counting one more update of each. Layers of equal shapes and dtypes
        normalise the rows of their stacked EMAs at once
        (:func:`singd_cuda.ops.min_max_normalise_rows_` on
        :class:`~.grouped.ResidentStacks`), into buffers kept between factor updates whose
        rows are the layers' s′ and h′; a layer alone has its own."""
        weight_states = list(map(_FIRST, states))
        parts = self._parts(layers, weight_states)
        if len(parts) == 1 and len(layers) > 1:  # the common case: one stack
            rows, cols = self._stacked_scales(layers, weight_states)
        else:
            rows, cols = [None] * len(layers), [None] * len(layers)
            for part in parts:
                if len(part) == 1:
                    (i,) = part
                    rows[i], cols[i] = self._scales(layers[i], weight_states[i])
                    continue
                part_rows, part_cols = self._stacked_scales(
                    [layers[i] for i in part], [weight_states[i] for i in part]
                )
                for i, s, h in zip(part, part_rows, part_cols, strict=True):
                    rows[i], cols[i] = s, h
        count_up(weight_states, "step")
        return rows, cols

    def _stacked_scales(self, layers, states: list[dict]) -> tuple[list[Tensor], list[Tensor]]:
        """(s′ of each layer, h′ of each layer) of layers of equal shapes and dtypes: the
        rows of S′ and H′, normalised from the stacks of their EMAs."""
        stacks = self._resident.of(layers, states)
        acc = accumulation_dtype(layers[0].weight.dtype)
        S, H = stacks["s"], stacks["h"]
        values = self._stacked.get(
            layers, (S, H), lambda out: _normalised_rows(S, H, acc, out), into=True
        )
        return values[2], values[3]

    @staticmethod
    def _step_batch(
        batch: DiagonalBatch, group, inv_scale, step: int, count: int, seed: int, found_inf=None
    ):
        batch.step_op(
            *batch.lists(),
            mode="adafisher",
            lr=group["lr"],
            momentum=group["momentum"],
            damping=scheduled(group["damping"], step),
            weight_decay=group["weight_decay"],
            decoupled=group["decoupled_weight_decay"],
            step=count,
            inv_scale=inv_scale,
            stochastic_rounding=group["stochastic_rounding"],
            seed=seed,
            found_inf=found_inf,
        )
        batch.write_back()

    def row_local(self, group: dict) -> bool:
        return True

    def shard_buffers(self, group: dict) -> tuple[str, ...]:
        return ("exp_avg",)

    def natural_rows(self, layer, group, state, G: Tensor, rows: slice, step: int) -> Tensor:
        """Rows ``rows`` of Ĝ = G / F̃ (G holds only those rows; the grafted FSDP2 step),
        counting one more update of the layer (called on every rank, rows or not)."""
        s, h = self._counted_scales(layer, state)
        return preconditioned(G, s[rows], h, scheduled(group["damping"], step))

    def apply_direction(self, shard, group, states, natural: Tensor, seed: int) -> None:
        """The Adam-style write along the shard's rows of the (grafted) Ĝ, with the
        layer's count that :meth:`natural_rows` advanced."""
        directions = split_matrix(shard, natural)
        adam_update_(shard.params, directions, states, group, states[0]["step"], seed)

    def apply_shard(self, layer, shard, group, states, inv_scale, step: int, seed: int):
        """This rank's rows: the same op with their slice of s′ (h′ whole)."""
        s, h = self._counted_scales(layer, states[0])
        if shard.rows.start == shard.rows.stop:
            return  # no rows here; the count above keeps every rank's state alike
        batch = DiagonalBatch()
        batch.add(shard, states, s[shard.rows], h, "exp_avg")
        self._step_batch(batch, group, inv_scale, step, states[0]["step"], seed)


class AdaFisher(KroneckerOptimizer):
    """AdaFisher: ``AdaFisher(model, lr=1e-2, momentum=0.9, damping=1e-2, ema_decay=0.8,
    T=1, weight_decay=0.0, decoupled_weight_decay=False, ...)``.

    ``momentum`` is the Adam-style β. Equivalent to ``SINGD(model, structures="adafisher")``
    with these defaults. Parameters of other modules train with AdamW (``fallback_*``).

    Args:
        model: the ``nn.Module`` to train (or a DistributedDataParallel wrapping it); its
            supported layers (``nn.Linear``, ``nn.Conv1d/2d/3d``, Hugging Face
            ``Conv1D``, registered kinds) are hooked to capture curvature.
        params: None (default: every parameter of ``model``, frozen ones included) or
            parameters / parameter groups drawn from ``model.parameters()``. A layer's
            weight and bias must be in the same group.
        lr: step size (default 1e-2).
        momentum: the Adam-style β of the first moment (default 0.9).
        damping: λ added to the min–max normalised F̃, > 0 (default 1e-2).
        ema_decay: γ of the curvature EMA, h ← γh + (1−γ)h_new (default 0.8).
        T: factor update period (default 1).
        weight_decay: weight decay (default 0.0).
        decoupled_weight_decay: decay the weights directly (AdamW-style) instead of adding
            the decay to the gradient (default False).
        loss_average: ``"batch"`` (default; the loss is a mean over the batch),
            ``"batch+sequence"`` (a mean over batch x sequence) or None (a sum); sets L in
            the √L scaling of the output gradients.
        batch_dim: the dimension of a layer's output that indexes samples (None, default:
            dimension 0, or 1 inside PyTorch's sequence-first transformer layers, with a
            check that warns once on a mismatch; 1 for sequence-first (T, B, C) code).
        kfac_approx: ``"expand"`` (default: a row of a and g per position of a layer
            that shares its weight over positions, tokens or patches) or ``"reduce"``
            (K-FAC-reduce: a row per sample, the mean of its inputs and the sum of its
            output gradients; [docs/concepts/curvature.md](../concepts/curvature.md)).
        graft: None (default), ``"adam"`` or ``"rms"``: rescale each parameter's
            preconditioned gradient G / F̃ to the norm of Adam's normalised gradient (one
            second-moment buffer per weight and bias) or to RMS 0.2, before the first
            moment and weight decay (the step then leaves the fused op, averages the
            grafted directions and is not bounded by lr per entry); see
            :mod:`singd_cuda.optim.graft`.
        factor_dtype: storage dtype of the factors (None, default: the parameter dtype);
            float64, float32, bfloat16 or float16. Arithmetic accumulates in float32.
        stochastic_rounding: round bf16 parameter writes stochastically (default False).
        maximize: maximise the objective: each update is the one for the negated loss
            (the gradients' sign flips; the curvature statistics do not depend on it;
            ``.grad`` is left as it is) (default False).
        grad_scaler: the ``torch.amp.GradScaler`` in use, needed only when
            ``scaler.unscale_(opt)`` runs before ``scaler.step(opt)`` (default None).
        nonfinite: ``"warn"`` (default) or ``"raise"`` (``FloatingPointError``) when a
            gradient or statistic is non-finite without a GradScaler; the step is skipped
            with every state unchanged either way (one device read per step decides it).
            ``"device"``: the skip is decided on the device without a read (every write
            consumes it; no tensor changes, the host counters count the step) and warned
            about at a later step ([docs/concepts/curvature.md](../concepts/curvature.md)).
        process_group: the torch.distributed group to synchronise over (default None: WORLD
            when torch.distributed is initialised).
        distribute_factors: each rank updates and holds the factors of the layers it owns
            only (default False).
        bucket_cap_mb: MiB per all-reduce bucket (default 64).
        **fallback: the AdamW fallback of parameters outside supported layers:
            ``fallback_lr`` (None, default: ``lr``), ``fallback_betas`` ((0.9, 0.999)),
            ``fallback_eps`` (1e-8), ``fallback_weight_decay`` (0.0). Any other keyword
            raises TypeError.
    """

    def __init__(
        self,
        model: nn.Module,
        params=None,
        lr: float = 1e-2,
        momentum: float = 0.9,
        damping: float = 1e-2,
        ema_decay: float = 0.8,
        T: int = 1,
        weight_decay: float = 0.0,
        decoupled_weight_decay: bool = False,
        loss_average: str | None = "batch",
        batch_dim: int | None = None,
        kfac_approx: str = "expand",
        graft: str | None = None,
        factor_dtype: torch.dtype | None = None,
        stochastic_rounding: bool = False,
        maximize: bool = False,
        grad_scaler: torch.amp.GradScaler | None = None,
        nonfinite: str = "warn",
        process_group=None,
        distribute_factors: bool = False,
        bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
        **fallback: Any,
    ) -> None:
        defaults = dict(
            lr=lr,
            momentum=momentum,
            damping=damping,
            ema_decay=ema_decay,
            T=T,
            weight_decay=weight_decay,
            decoupled_weight_decay=decoupled_weight_decay,
            loss_average=loss_average,
            batch_dim=batch_dim,
            kfac_approx=kfac_approx,
            graft=graft,
            factor_dtype=factor_dtype,
            stochastic_rounding=stochastic_rounding,
            maximize=maximize,
        )
        defaults.update(checked_fallback(fallback))
        self._rule = AdaFisherRule()
        super().__init__(
            model,
            params,
            defaults,
            grad_scaler=grad_scaler,
            nonfinite=nonfinite,
            process_group=process_group,
            distribute_factors=distribute_factors,
            bucket_cap_mb=bucket_cap_mb,
        )

    def hyperparameter_checks(self, group: dict) -> dict[str, hp.Check]:
        return {
            **super().hyperparameter_checks(group),
            "momentum": hp.number(below_one=True),
            "ema_decay": hp.number(below_one=True),
            # the min–max normalised F̃ has a zero entry: only the damping keeps it invertible
            "damping": hp.number(positive=True),
            "decoupled_weight_decay": hp.flag,
        }

    def rule_for(self, group: dict) -> LayerRule:
        return self._rule
