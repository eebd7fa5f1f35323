"""SINGD: structured inverse-free natural gradient descent (Lin et al., ICML 2024).

The paper's update. Per layer: structured factors K (d_K x d_K) and C
(d_C x d_C) with Riemannian momenta m_K, m_C; the preconditioner is
(K Kᵀ) ⊗ (C Cᵀ). No inversion or decomposition anywhere, so the factors can
live in bfloat16/float16 (``factor_dtype``) with float32 accumulation.
"""

from __future__ import annotations

import operator
from functools import lru_cache, partial
from itertools import chain, repeat
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from .. import ops
from .. import structures as structure_registry
from ..curvature.layers import Layer
from ..structures.base import StructuredMatrix, accumulation_dtype
from ..structures.congruence import congruence, shared_statistic
from ..structures.diagonal import Diagonal
from . import hyperparameters as hp
from . import warm_start
from .adafisher import ADAFISHER, AdaFisherRule, DiagonalViews, KeptBatch
from .base import KroneckerOptimizer, checked_fallback
from .derived import DerivedCache, GroupCache
from .factor_memory import warn_large_factors
from .graft import graft_
from .grouped import (
    KnownStacks,
    ResidentStacks,
    StackedProduct,
    StackedSums,
    interleaved,
    split_matrices,
    stack_parts,
    stacked_gradients,
)
from .rule import LayerRule, add_statistics, scheduled
from .scale_out import DEFAULT_BUCKET_CAP_MB
from .statistics import UnscaledDiagonal, scale_unscaled
from .write import sgd_update_

StructureSpec = str | type[StructuredMatrix]


def resolve_structures(spec: Any) -> tuple[str, str]:
    """(K side, C side) spec strings from a name, a pair, or structure classes.

    "adafisher" stands alone (both sides; the pair it resolves to is accepted too).
    Raises ValueError for anything unknown.
    """
    if spec == ADAFISHER or (isinstance(spec, list | tuple) and tuple(spec) == (ADAFISHER,) * 2):
        return (ADAFISHER, ADAFISHER)
    pair = tuple(spec) if isinstance(spec, list | tuple) else (spec, spec)
    if len(pair) != 2:
        raise ValueError(f"structures must be one name or a (K side, C side) pair, got {spec!r}")
    if ADAFISHER in pair:
        raise ValueError("'adafisher' applies to both sides: pass structures='adafisher'")
    try:
        return tuple(structure_registry.get(s).spec() for s in pair)  # type: ignore[return-value]
    except ValueError as error:
        raise ValueError(f"{error} (or '{ADAFISHER}')") from None


# multiply-adds a CPU does in about the time of one op dispatch (a few microseconds)
NEGLIGIBLE_FLOPS = 2**15


@lru_cache(maxsize=64)
def _structure_classes(K_spec, C_spec) -> tuple[type[StructuredMatrix], type[StructuredMatrix]]:
    """The structure classes of a group's ``structures`` (parsed once per pair)."""
    return structure_registry.get(K_spec), structure_registry.get(C_spec)


class SingdRule(LayerRule):
    """SINGD's factor update and preconditioning for one layer (the paper's update)."""

    def __init__(self) -> None:
        self._squares = DerivedCache()  # diagonal path: DiagonalSquares between factor updates
        self._outer = DerivedCache()  # (C Cᵀ or None, K Kᵀ or None) between factor updates
        self._stacked = GroupCache()  # the same of groups of layers, stacked
        self._stacked_squares = GroupCache()  # diagonal path: squares of stacked factors
        self._resident = ResidentStacks(_SIDES, named=True)  # groups' factors, as stacks
        self._views = DiagonalViews()  # diagonal path: the parameters' views, between steps
        self._kept = KeptBatch()  # diagonal path: the last batch's lists, between steps
        self._traces, self._means = StackedSums(), StackedSums()  # diagonal path: their sums
        self._statistics_stacks = KnownStacks()  # diagonal path: the statistics' stacks
        # diagonal path: id of kept stacks -> (the stacks, their squares, their _StackRows)
        self._stack_rows: dict[int, tuple[dict, _StackedSquares | None, _StackRows]] = {}

    def open_step(self) -> None:
        self._resident.open_step()

    def close_step(self) -> None:
        self._resident.close_step()

    def _classes(self, group: dict) -> tuple[type[StructuredMatrix], type[StructuredMatrix]]:
        return _structure_classes(*group["structures"])

    def _factors(self, layer: Layer, group: dict, state: dict) -> dict[str, StructuredMatrix]:
        S_K, S_C = self._classes(group)
        return {
            "K": S_K.from_parts(layer.dim_in, state["K"]),
            "m_K": S_K.from_parts(layer.dim_in, state["m_K"]),
            "C": S_C.from_parts(layer.dim_out, state["C"]),
            "m_C": S_C.from_parts(layer.dim_out, state["m_C"]),
        }

    def init_state(self, layer: Layer, group: dict, state: dict) -> None:
        S_K, S_C = self._classes(group)
        dtype = group["factor_dtype"] or layer.weight.dtype
        device = layer.weight.device
        state["K"] = S_K.eye(layer.dim_in, dtype=dtype, device=device).parts
        state["m_K"] = S_K.zeros(layer.dim_in, dtype=dtype, device=device).parts
        state["C"] = S_C.eye(layer.dim_out, dtype=dtype, device=device).parts
        state["m_C"] = S_C.zeros(layer.dim_out, dtype=dtype, device=device).parts
        warm_start.init_state(group, state)

    def started(self, group: dict, states: list[dict]) -> bool:
        """Every layer's warm start is done (or none is asked for): C calls alone."""
        return all(map(dict.get, states, repeat(warm_start.KEY), repeat(True)))

    def start_factors(self, layer, group, state, pending) -> bool | None:
        """The warm start (:mod:`.warm_start`) at the layer's first statistics step."""
        if state.get(warm_start.KEY, True):
            return True
        if not group["warm_start"]:  # turned off since the factors were created
            del state[warm_start.KEY]
            return True
        factors = self._factors(layer, group, state)
        damping = scheduled(group["damping"], group["step"])
        started = warm_start.start_(factors, pending, damping, group["kfac_like"])
        if not started:
            return started  # False: waits for other statistics; None: out of range
        self._forget(layer)
        state[warm_start.KEY] = True
        return True

    def accumulate(self, layer, group, state, pending, a: Tensor, g: Tensor) -> None:
        """H_K += Π̂(Kᵀ aᵀa K) and H_C += Π̂(Cᵀ gᵀg C), as Gram matrices of aK and gC."""
        S_K, S_C = self._classes(group)  # K and C alone (not _factors: the momenta too)
        K = S_K.from_parts(layer.dim_in, state["K"])
        C = S_C.from_parts(layer.dim_out, state["C"])
        add_statistics(pending, K.gram_of_product(a), C.gram_of_product(g))

    def factor_structures(self, group: dict) -> tuple[str, str]:
        return group["structures"]

    # ------------------------------------------- fused path: diagonal on both sides
    @staticmethod
    def _diagonal(group: dict) -> bool:
        return tuple(group["structures"]) == (Diagonal.name, Diagonal.name)

    def diagonal_statistics(self, group: dict) -> bool:
        return self._diagonal(group)

    def accumulate_diagonal(self, layer, group, state, pending, h: Tensor, s: Tensor) -> None:
        """H_K = k² ⊙ diag(aᵀa), H_C = c² ⊙ diag(gᵀg): Π̂(Kᵀ aᵀa K) for diagonal K."""
        squares = self._squares.get(layer, (state["C"]["diag"], state["K"]["diag"]), _squares)
        k2, c2 = squares.k2, squares.c2
        if k2.dtype is not h.dtype or c2.dtype is not s.dtype:  # (a no-op .to costs a call)
            k2, c2 = k2.to(h.dtype), c2.to(s.dtype)
        _scale_first_call(pending, k2, c2)
        _add_diagonals(pending, h.mul_(k2), s.mul_(c2))

    def accumulate_diagonal_sums(
        self, layer, group, state, pending, sums, layer_input, grad_output, dtype, weight
    ) -> None:
        """:meth:`accumulate_diagonal`; a pass's first call of the layer keeps the sums
        alone (:class:`~.statistics.UnscaledDiagonal`: the step multiplies k² and c² into
        the gathered stacks), later ones have them multiplied in by the reductions
        themselves (bitwise the same products), after the first call's."""
        if "in" not in pending:
            h = sums.inputs(layer_input, dtype, weight)
            s = sums.outputs(grad_output, dtype)
            # UnscaledDiagonal(d, diag=...) without its __init__ (which checks the part
            # names: two Python calls a matrix, on every layer call)
            H_K, H_C = object.__new__(UnscaledDiagonal), object.__new__(UnscaledDiagonal)
            H_K.dim, H_K.parts = h.shape[0], {"diag": h}
            H_C.dim, H_C.parts = s.shape[0], {"diag": s}
            pending["in"], pending["out"] = H_K, H_C
            return
        squares = self._squares.get(layer, (state["C"]["diag"], state["K"]["diag"]), _squares)
        k2, c2 = squares.k2, squares.c2
        if k2.dtype is not dtype or c2.dtype is not dtype:  # (a no-op .to costs a call)
            k2, c2 = k2.to(dtype), c2.to(dtype)
        _scale_first_call(pending, k2, c2)
        h = sums.inputs(layer_input, dtype, weight, k2)
        _add_diagonals(pending, h, sums.outputs(grad_output, dtype, c2))

    def statistic_factors(self, layers, group, states) -> tuple:
        """(k², c²) of each layer's factors, in the accumulation dtype: the stacks of them
        (rows in the order of ``layers``) where the factors are the rows of kept stacks,
        else lists."""
        kept = self._kept_squares(layers, states)
        if kept is not None:
            return kept.k2, kept.c2
        rows = self._diagonal_squares(layers, group, states)
        return list(map(_K2, rows)), list(map(_C2, rows))

    def fuses_apply(self, group: dict) -> bool:
        return True

    def grafts(self, group: dict) -> bool:
        return True

    def apply_many(self, layers, group, states, inv_scale, step: int, seed: int, found_inf=None):
        """Ĝ = (C Cᵀ) G (K Kᵀ) for every layer, then momentum SGD with weight decay on
        every parameter in one :func:`~singd_cuda.optim.write.sgd_update_` call; layers of
        equal :meth:`group_key` are preconditioned as one stack (:mod:`.grouped`)."""
        if self._diagonal(group) and group["graft"] is None:
            self._apply_diagonal(layers, group, states, inv_scale, seed, found_inf)
            return
        params, directions, param_states = [], [], []
        for part in self._parts(layers, group, [layer_states[0] for layer_states in states]):
            members = [layers[i] for i in part]
            member_states = [states[i] for i in part]
            naturals = self._natural_stacked(members, group, member_states, inv_scale, step)
            for layer, layer_states in zip(members, member_states, strict=True):
                params += layer.params
                param_states += layer_states
            directions += split_matrices(members, naturals)
        graft_(params, directions, param_states, group, inv_scale, found_inf)
        sgd_update_(params, directions, param_states, group, seed, found_inf)

    def _apply_diagonal(self, layers, group, states, inv_scale, seed: int, found_inf) -> None:
        """:func:`singd_cuda.ops.diag_precond_step_` (mode "singd") over every layer:
        Ĝ = c² ⊙ G ⊙ k² and momentum SGD, in one pass over W, G and the buffers."""
        momentum = group["momentum"]
        squares = self._diagonal_squares(layers, group, list(map(_FIRST, states)))
        buf_key = "momentum_buffer" if momentum != 0.0 else None
        rows, cols = list(map(_C2, squares)), list(map(_K2, squares))
        batch = self._kept.batch(layers, states, rows, cols, buf_key, self._views)
        batch.step_op(
            *batch.lists(),
            mode="singd",
            lr=group["lr"],
            momentum=momentum,
            weight_decay=group["weight_decay"],
            inv_scale=inv_scale,
            stochastic_rounding=group["stochastic_rounding"],
            seed=seed,
            found_inf=found_inf,
        )
        batch.write_back()

    def _diagonal_squares(self, layers, group, states: list[dict]) -> list[DiagonalSquares]:
        """The :class:`DiagonalSquares` of every layer, recomputed where stale. Layers
        whose factors are the rows of kept stacks (:class:`~.grouped.ResidentStacks`, a
        group of one :meth:`group_key`) have theirs as the rows of stacked buffers, filled
        a few calls for all (:func:`_fill_stacked_squares`); others as one batch."""
        kept = self._kept_squares(layers, states)
        if kept is not None:
            return kept.rows
        parts = [list(range(len(layers)))]
        if len(layers) > 1:  # a group's layers of several shapes: stacks per key
            parts = self._parts(layers, group, states)
        squares: list[DiagonalSquares | None] = [None] * len(layers)
        for part in parts:
            members, member_states = [layers[i] for i in part], [states[i] for i in part]
            kept = self._kept_squares(members, member_states)
            if kept is not None:
                found = kept.rows
            else:
                sources = [(state["C"]["diag"], state["K"]["diag"]) for state in member_states]
                found, positions = self._squares.get_many(
                    members, sources, lambda _, c, k: _square_buffers(c, k)
                )
                _fill_squares([(*sources[i], found[i]) for i in positions], self._traces)
            for i, value in zip(part, found, strict=True):
                squares[i] = value
        return squares

    def _kept_squares(self, layers, states) -> _StackedSquares | None:
        """The :class:`_StackedSquares` of two or more layers whose factors are the rows of
        kept stacks (:meth:`~.grouped.ResidentStacks.kept`), else None."""
        stacks = self._resident.kept(layers, states) if len(layers) > 1 else None
        return None if stacks is None else self._stacked_squares_of(layers, states, stacks)

    def _stacked_squares_of(self, layers, states, stacks: dict) -> _StackedSquares:
        """The :class:`_StackedSquares` of layers whose factors are the rows of
        ``stacks``, recomputed when stale."""
        C, K = stacks["C"]["diag"], stacks["K"]["diag"]

        def derive(out: _StackedSquares | None) -> _StackedSquares:
            out = _stacked_square_buffers(C, K) if out is None else out
            _fill_stacked_squares(C, K, out)
            # each layer's squares, as its own (c, k): C calls alone
            sources = zip(map(_DIAG, map(_C, states)), map(_DIAG, map(_K, states)), strict=True)
            self._squares.put_many(layers, sources, out.rows)
            return out

        return self._stacked_squares.get(layers, (C, K), derive, into=True)

    def _update_diagonal_factors(self, layers, states, pendings, group: dict, step: int) -> None:
        """The diagonal factor update of both sides of every layer (``layers``: of one
        :meth:`group_key`) in one :func:`diag_factor_update_`, its scalars in the layers'
        cached buffers (no allocation). The factors are rows of stacks
        (:class:`~.grouped.ResidentStacks`), so that the step saves and checks them as
        four tensors (:class:`~.finite.FactorUndo`)."""
        stacks = self._resident.of(layers, states)
        if not self._update_stacked_diagonal(layers, states, pendings, stacks, group, step):
            self._update_each_diagonal(layers, states, pendings, group, step)
        self._forget(*layers)  # the squares were read; the factors changed

    def _update_stacked_diagonal(self, layers, states, pendings, stacks, group, step) -> bool:
        """:meth:`_update_diagonal_factors` of layers whose factors are the rows of
        ``stacks``, with the lists of rows the op takes kept with the stacks and their
        squares (a warm call builds the statistics' lists alone, by C calls); the scaling
        of the means is one multiply of their stack. On the CPU, where the statistics are
        the rows of the step's gathered stacks (:class:`~.grouped.KnownStacks`), their sums
        are one row sum per side and the op takes each side as one stacked entry. False
        (nothing done) for a single layer."""
        if len(layers) < 2:
            return False
        K = stacks["K"]["diag"]
        acc = accumulation_dtype(K.dtype)
        h_K = list(map(_DIAG, map(_PARTS, map(_IN, pendings))))
        h_C = list(map(_DIAG, map(_PARTS, map(_OUT, pendings))))
        if set(map(_DTYPE, h_K)) != {acc} or set(map(_DTYPE, h_C)) != {acc}:
            h_K, h_C = [h.to(acc) for h in h_K], [h.to(acc) for h in h_C]
        kfac_like = group["kfac_like"]
        squares = None if kfac_like else self._stacked_squares_of(layers, states, stacks)
        lists = self._rows_of_stacks(stacks, squares)
        # the statistics as the rows of one stack per side (the step's gathered ones, in
        # the layers' order), on the CPU: the op then takes each side as one stack
        h_stacks = None
        if K.device.type == "cpu":
            h_stacks = (self._statistics_stacks(h_K), self._statistics_stacks(h_C))
            if h_stacks[0] is None or h_stacks[1] is None:
                h_stacks = None
        if squares is not None:
            if h_stacks is not None:  # each side's sums: one row sum of its stack
                # into the means' columns (the other side's a: C's sums are K's a)
                for stack, column in zip(h_stacks[::-1], lists.stacked[2], strict=True):
                    torch.sum(stack, 1, dtype=column.dtype, out=column)
            else:
                self._means(interleaved(h_C, h_K), lists.sum_outs)
            squares.means.mul_(squares.inv_dims)  # tr̄(H) of the other side
        # a, b: the means (scaled in place above) and tr̄(Π̂(otherᵀ other)) of each side
        if h_stacks is not None:
            factors, momenta, a, b = lists.stacked
            _diag_factor_update(factors, momenta, list(h_stacks), a, b, group, step)
        else:
            h = interleaved(h_K, h_C)
            _diag_factor_update(
                lists.factors, lists.momenta, h, lists.sum_outs, lists.traces, group, step
            )
        return True

    def _rows_of_stacks(self, stacks: dict, squares: _StackedSquares | None) -> _StackRows:
        """The per-layer lists of rows :func:`diag_factor_update_` takes, of the factor
        stacks and their squares, kept while both are the same objects."""
        kept = self._stack_rows.get(id(stacks))
        if kept is not None and kept[0] is stacks and kept[1] is squares:
            return kept[2]
        rows = {key: stacks[key]["diag"].unbind() for key in ("K", "C", "m_K", "m_C")}
        sum_outs, traces, a, b = [], [], [], []
        if squares is not None:
            sum_outs = [part for row in squares.rows for part in row.mean_parts]
            traces = [part for row in squares.rows for part in row.trace_parts]
            # K's a, b: column 0 (the C side's mean and trace), C's: column 1
            a, b = list(squares.means.unbind(1)), list(squares.traces.unbind(1))
        factors = [stacks["K"]["diag"], stacks["C"]["diag"]]
        momenta = [stacks["m_K"]["diag"], stacks["m_C"]["diag"]]
        lists = _StackRows(
            interleaved(rows["K"], rows["C"]),
            interleaved(rows["m_K"], rows["m_C"]),
            sum_outs,
            traces,
            (factors, momenta, a, b),
        )
        # entries of stacks no longer kept go (they would hold the stacks' memory)
        self._stack_rows = {
            i: entry for i, entry in self._stack_rows.items() if self._resident.holds(entry[0])
        }
        self._stack_rows[id(stacks)] = (stacks, squares, lists)
        return lists

    def _update_each_diagonal(self, layers, states, pendings, group: dict, step: int) -> None:
        """:meth:`_update_diagonal_factors` layer by layer (each layer's squares)."""
        factors, momenta, h, a, b, means, inv_dims = [], [], [], [], [], [], []
        sums, sum_outs = [], []  # H's vectors and where their sums go
        for layer, state, pending in zip(layers, states, pendings, strict=True):
            k, c = state["K"]["diag"], state["C"]["diag"]
            acc = torch.float64 if k.dtype == torch.float64 else torch.float32
            h_K, h_C = pending["in"].parts["diag"], pending["out"].parts["diag"]
            if h_K.dtype != acc:  # (a no-op .to still costs a dispatch)
                h_K, h_C = h_K.to(acc), h_C.to(acc)
            factors += [k, c]
            momenta += [state["m_K"]["diag"], state["m_C"]["diag"]]
            h += [h_K, h_C]
            if not group["kfac_like"]:
                squares = self._squares.get(layer, (c, k), _squares)
                sums += [h_C, h_K]
                sum_outs += squares.mean_parts
                means.append(squares.means)  # tr̄(H) of the other side, once scaled
                inv_dims.append(squares.inv_dims)
                a += squares.mean_parts
                b += squares.trace_parts  # tr̄(Π̂(otherᵀ other))
        if means:
            self._means(sums, sum_outs)
            torch._foreach_mul_(means, inv_dims)
        _diag_factor_update(factors, momenta, h, a, b, group, step)

    def accumulate_shared(self, layer, group, pending, a: Tensor, g: Tensor) -> None:
        """K-free statistics Π̂(aᵀa), Π̂(gᵀg) (dense Gram for structures that need it);
        H_K = Π̂(Kᵀ aᵀa K) is linear in aᵀa, so the owner applies K after averaging."""
        S_K, S_C = self._classes(group)
        add_statistics(pending, shared_statistic(S_K, a), shared_statistic(S_C, g))

    def finish_shared(self, layer, group, state, pending) -> None:
        f = self._factors(layer, group, state)
        pending["in"] = congruence(f["K"], pending["in"])
        pending["out"] = congruence(f["C"], pending["out"])

    # ------------------------------------------- layers of equal shapes as one stack
    def group_key(self, layer, group, state):
        """(d_K, d_C, dtypes, device) for structures with a stacked path, else None."""
        S_K, S_C = self._classes(group)
        if S_K.name not in _STACKED or S_C.name not in _STACKED:
            return None
        # the parts' dtypes, by C calls alone (this runs per layer every factor update)
        parts = chain.from_iterable(map(dict.values, map(state.__getitem__, _SIDES)))
        dtypes = tuple(map(_DTYPE, parts))
        return (layer.dim_in, layer.dim_out, layer.weight.dtype, layer.weight.device, dtypes)

    def group_keys(self, layers, group, states) -> list:
        """:meth:`group_key` of each layer; layers whose factors are the rows of kept
        stacks (made for layers of one key, whose states still hold the same parts) with
        one weight dtype and device share the first one's, computed once."""
        if len(layers) > 1 and self._resident.kept_alike(layers, states) is not None:
            return [self.group_key(layers[0], group, states[0])] * len(layers)
        return super().group_keys(layers, group, states)

    def _parts(self, layers, group, states) -> list[list[int]]:
        """``layers``' positions by :meth:`group_keys` (a layer without a key alone)."""
        return stack_parts(layers, self.group_keys(layers, group, states))

    def update_factors_many(self, layers, group, states, pendings, step: int) -> None:
        """Every layer's :meth:`update_factors`, as one stack: one op call per operation
        instead of one per layer (the per-layer math on stacked parts for ``batched``
        structures, else ``torch.func.vmap`` over it)."""
        if group["normalize_lr_cov"] or len(layers) == 1:  # normalize: a per-layer max
            super().update_factors_many(layers, group, states, pendings, step)
            return
        if self._diagonal(group):  # it reads the cached squares of the factors, then forgets
            self._update_diagonal_factors(layers, states, pendings, group, step)
            return
        self._forget(*layers)
        S_K, S_C = self._classes(group)
        update = partial(
            _stacked_factor_update,
            S_K,
            S_C,
            layers[0].dim_in,
            layers[0].dim_out,
            damping=scheduled(group["damping"], step),
            lr_cov=scheduled(group["lr_cov"], step),
            alpha1=0.0 if group["kfac_like"] else group["alpha1"],
            kfac_like=group["kfac_like"],
        )
        resident = self._resident.of(layers, states)  # the stacks of every layer's factors
        # contiguous, as the update's batched products take them (a copy of padded rows)
        factors = {side: _contiguous(parts) for side, parts in resident.items()}
        H_K = _stack([pending["in"].parts for pending in pendings])
        H_C = _stack([pending["out"].parts for pending in pendings])
        new = (update if S_K.batched and S_C.batched else torch.func.vmap(update))(
            factors, H_K, H_C
        )
        for side, parts in resident.items():
            for name, stack in parts.items():
                if new[side][name] is not stack:  # (the update was not on the stack itself)
                    stack.copy_(new[side][name])

    def _forget(self, *layers) -> None:
        """Mark every value derived from the layers' factors stale."""
        self._outer.forget(*layers)
        self._squares.forget(*layers)
        self._stacked.forget(*layers)
        self._stacked_squares.forget(*layers)

    def update_factors(self, layer, group, state, pending, step: int) -> None:
        if self._diagonal(group) and not group["normalize_lr_cov"]:
            self._update_diagonal_factors([layer], [state], [pending], group, step)
            return
        self._forget(layer)
        _factor_step(
            self._factors(layer, group, state),
            pending["in"],
            pending["out"],
            damping=scheduled(group["damping"], step),
            lr_cov=scheduled(group["lr_cov"], step),
            alpha1=0.0 if group["kfac_like"] else group["alpha1"],
            kfac_like=group["kfac_like"],
            normalize=group["normalize_lr_cov"],
        )

    def _derive_outer(self, layer, group, f, step: int) -> tuple:
        """(C Cᵀ, K Kᵀ), or None for a side :meth:`_formed_sides` leaves unformed."""
        formed = self._formed_sides(layer, group, f, step)
        return tuple(
            f[side].times_transpose() if form else None
            for side, form in zip(("C", "K"), formed, strict=True)
        )

    @staticmethod
    def _formed_sides(layer, group, f, step: int) -> tuple[bool, bool]:
        """Whether C Cᵀ and K Kᵀ are formed: not for a side whose structure has no cheap
        form of it, nor where forming it costs more than the T steps it would save: with
        w nonzeros per row, forming is d·w² and each step saves one d·w·d_other product,
        so a side is formed when 2w <= T·d_other, or when forming is negligible (d·w²
        below ``NEGLIGIBLE_FLOPS``: then the host time of the per-layer products decides,
        and formed products are preconditioned as one stack)."""
        period = scheduled(group["T"], step)
        formed = []
        for side, other_dim in (("C", layer.dim_in), ("K", layer.dim_out)):
            factor = f[side]
            width = type(factor).row_width(factor.dim)
            worth = 2 * width <= period * other_dim or factor.dim * width**2 <= NEGLIGIBLE_FLOPS
            formed.append(worth and type(factor).has_times_transpose(factor.dim))
        return formed[0], formed[1]

    def _outer_products(self, layer, group, state, f, step: int):
        """:meth:`_derive_outer`, cached until the next factor update."""

        def derive(*_, out):  # new structured matrices: the old ones are not reused
            return self._derive_outer(layer, group, f, step)

        sources = (*state["C"].values(), *state["K"].values())
        return self._outer.get(layer, sources, derive)

    def _stacked_outer(self, layers, group, states, step: int):
        """(C Cᵀ, K Kᵀ) of every layer as :class:`~.grouped.StackedProduct`, cached
        until the next factor update of any of them; (None, None) where a layer's side
        has no stackable form (those layers are preconditioned one by one)."""

        def derive():
            if len(layers) == 1 or self.group_key(layers[0], group, states[0][0]) is None:
                pairs = [
                    self._derive_outer(layer, group, self._factors(layer, group, s[0]), step)
                    for layer, s in zip(layers, states, strict=True)
                ]
                if not all(StackedProduct.stackable(p) for pair in pairs for p in pair):
                    return (None, None)
                return tuple(StackedProduct.stack(side) for side in zip(*pairs, strict=True))
            # a stack (vmap-safe structures, equal shapes): the first layer decides, and
            # each side's products are formed in one call over the stacked factors
            f = self._factors(layers[0], group, states[0][0])
            if not all(self._formed_sides(layers[0], group, f, step)):
                return (None, None)
            resident = self._resident.of(layers, [s[0] for s in states])
            products = tuple(
                _stacked_times_transpose(type(f[side]), f[side].dim, _contiguous(resident[side]))
                for side in ("C", "K")
            )
            return (None, None) if None in products else products

        sides = chain.from_iterable(map(_OUTER_SIDES, [s[0] for s in states]))
        sources = tuple(chain.from_iterable(map(dict.values, sides)))
        return self._stacked.get(layers, sources, derive)

    def _natural_stacked(self, layers, group, states, inv_scale, step: int) -> Tensor | list:
        """Ĝ = (C Cᵀ) G (K Kᵀ) (d_C x d_K, unscaled) of layers of equal group key: stacked
        (L, d_C, d_K) where their products stack, else a list."""
        dtype = accumulation_dtype(layers[0].weight.dtype)
        CCt, KKt = self._stacked_outer(layers, group, states, step)
        if CCt is None:
            G = stacked_gradients(layers, dtype, inv_scale=inv_scale)
            return [
                self._natural(layer, group, s[0], G_l, step)
                for layer, s, G_l in zip(layers, states, G.unbind(0), strict=True)
            ]
        # K side first (G K Kᵀ), C side last, in place: Ĝ comes out row-major like the
        # parameters
        return CCt.matmul_(KKt.gradients_times_transpose(layers, dtype, inv_scale))

    def row_local(self, group: dict) -> bool:
        """A diagonal C: rows of (C Cᵀ) G (K Kᵀ) need only the same rows of G."""
        return self._classes(group)[1].name == Diagonal.name

    def natural_rows(self, layer, group, state, G: Tensor, rows: slice, step: int) -> Tensor:
        """Rows ``rows`` of Ĝ = (C Cᵀ) G (K Kᵀ); for a diagonal C, G holds only those rows."""
        if not self.row_local(group):
            return self._natural(layer, group, state, G, step)[rows]
        f = self._factors(layer, group, state)
        K = f["K"]
        _, KKt = self._outer_products(layer, group, state, f, step)
        right = K.matmul(K.rmatmul(G.T)) if KKt is None else KKt.matmul(G.T)  # (G K Kᵀ)ᵀ
        c2 = f["C"].parts["diag"][rows].to(G.dtype).square()
        return right.T * c2[:, None]

    def _natural(self, layer, group, state, G: Tensor, step: int) -> Tensor:
        """Ĝ = (C Cᵀ) G (K Kᵀ) of one layer, for G (d_C, d_K)."""
        f = self._factors(layer, group, state)
        K, C = f["K"], f["C"]
        CCt, KKt = self._outer_products(layer, group, state, f, step)
        # K side first on Gᵀ, C side last: Ĝ comes out row-major like the parameters, so
        # the update epilogue reads it without a transposing copy
        right = K.matmul(K.rmatmul(G.T)) if KKt is None else KKt.matmul(G.T)  # (G K Kᵀ)ᵀ
        return C.matmul(C.rmatmul(right.T)) if CCt is None else CCt.matmul(right.T)


_SIDES = ("K", "m_K", "C", "m_C")
_DTYPE = operator.attrgetter("dtype")
_K2, _C2 = operator.attrgetter("k2"), operator.attrgetter("c2")
_FIRST = operator.itemgetter(0)
# a pending diagonal statistic's vector is pending[side].parts["diag"]
_IN, _OUT = operator.itemgetter("in"), operator.itemgetter("out")
_PARTS, _DIAG = operator.attrgetter("parts"), operator.itemgetter("diag")
_C, _K = operator.itemgetter("C"), operator.itemgetter("K")
_OUTER_SIDES = operator.itemgetter("C", "K")
_STACKED = ("dense", "block_diagonal", "hierarchical", "diagonal")  # vmap-safe structures


def _contiguous(parts: dict[str, Tensor]) -> dict[str, Tensor]:
    return {name: part.contiguous() for name, part in parts.items()}


def _stack(parts: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    """Per-layer parts stacked along a new leading dimension (one copy per part name)."""
    return {name: torch.stack([p[name] for p in parts]) for name in parts[0]}


def _stacked_times_transpose(S, d: int, parts: dict[str, Tensor]) -> StackedProduct | None:
    """F Fᵀ of the factors F (structure ``S``, dimension ``d``) whose parts are stacked in
    ``parts`` (a leading layer dimension), every layer's in one product (``batched``
    structures) or one vmapped product; None when the product has no stacked form."""
    if S.batched:
        P = S.from_parts(d, parts).times_transpose()
        return StackedProduct.like(P, P.parts) if StackedProduct.stackable(P) else None
    formed: list = []

    def product(layer_parts: dict[str, Tensor]) -> dict[str, Tensor]:
        P = S.from_parts(d, layer_parts).times_transpose()
        formed.append(P)  # its type and k1, read below (the values are batched)
        return P.parts

    stacked = torch.func.vmap(product)(parts)
    if not StackedProduct.stackable(formed[0]):
        return None
    return StackedProduct.like(formed[0], stacked)


def _stacked_factor_update(S_K, S_C, d_K: int, d_C: int, factors, H_K, H_C, **hyper):
    """SINGD's factor update as a function of the parts (stacked parts, a leading layer
    dimension, for ``batched`` structures; one layer's, vmapped over a stack by
    :meth:`SingdRule.update_factors_many`, for the others): :func:`_factor_step` on
    structured matrices over the parts. Returns the new parts {side: {name: tensor}}."""
    f = {
        side: (S_K if side.endswith("K") else S_C)(d_K if side.endswith("K") else d_C, **parts)
        for side, parts in factors.items()
    }
    _factor_step(f, S_K(d_K, **H_K), S_C(d_C, **H_C), **hyper)
    return {side: matrix.parts for side, matrix in f.items()}


def _factor_step(
    f: dict[str, StructuredMatrix],
    H_K: StructuredMatrix,
    H_C: StructuredMatrix,
    *,
    damping: float,
    lr_cov: float,
    alpha1: float,
    kfac_like: bool,
    normalize: bool = False,
) -> None:
    """SINGD's factor update of one layer, in place on f's "K", "C", "m_K", "m_C" (H_K and
    H_C are consumed): m̂ = ½[scale_H·H + λ·scale_inner·Π̂(FᵀF) − I], m ← α₁m + m̂,
    F ← F(I − β₁m). The trace scales stay tensors (no sync; vmap-safe), and so does
    β₁ / max(1, max|m|) with ``normalize`` (per layer only)."""
    K, C = f["K"], f["C"]
    dtype = accumulation_dtype(K.dtype, C.dtype, H_K.dtype)
    KtK = K.project_inner().to(dtype)
    CtC = C.project_inner().to(dtype)
    if kfac_like:
        scales = (1.0, 1.0, 1.0, 1.0)
    else:
        scales = (
            H_C.average_trace(),
            CtC.average_trace(),
            H_K.average_trace(),
            KtK.average_trace(),
        )
    for side, H, scale_H, inner, scale_inner in (
        ("K", H_K.to(dtype), scales[0], KtK, scales[1]),
        ("C", H_C.to(dtype), scales[2], CtC, scales[3]),
    ):
        # with normalize_lr_cov the reference scales m̂ by (1 − α₁) too, so that m is an
        # average and its largest entry (which divides β₁) does not grow with α₁
        half = 0.5 * (1.0 - alpha1 if normalize else 1.0)
        m_hat = H.mul_(scale_H * half).add_(inner.mul_(scale_inner * (half * damping)))
        m_hat.add_identity_(-half)
        m = f[f"m_{side}"].mul_(alpha1).add_(m_hat)
        factor = f[side]
        if normalize:  # -β₁ / max(1, max|m|) as a 0-dim tensor: no read to the host
            step = m.abs_max().clamp_min_(1.0).reciprocal_().mul_(-lr_cov)
            factor.add_((factor @ m).mul_(step))
        else:
            factor.add_(factor @ m, alpha=-lr_cov)


class DiagonalSquares(NamedTuple):
    """Buffers of one layer on the diagonal path, derived from its factors c (d_C) and k
    (d_K), all in the accumulation dtype: c² and k²; ``traces`` (2,): tr̄ of c² and k² as
    rounded to the storage dtype (Π̂(CᵀC), Π̂(KᵀK) as ``project_inner`` stores them);
    ``means`` (2,): scratch for tr̄(H_C), tr̄(H_K); ``inv_dims`` (2,): 1/d_C, 1/d_K;
    ``rounded``: storage-dtype scratch (half storage only); ``trace_parts`` and
    ``mean_parts``: the (1,) views of each entry of ``traces`` and ``means``. Averages
    are sums times ``inv_dims``: a Python-scalar division would allocate a 0-dim tensor."""

    c2: Tensor
    k2: Tensor
    traces: Tensor
    means: Tensor
    inv_dims: Tensor
    rounded: tuple[Tensor, Tensor] | None
    trace_parts: tuple[Tensor, Tensor]
    mean_parts: tuple[Tensor, Tensor]


def _scale_first_call(pending: dict, k2: Tensor, c2: Tensor) -> None:
    """Multiply k² and c² into a pass's first statistics of a layer where it kept them
    unscaled (:meth:`SingdRule.accumulate_diagonal_sums`), before a later call adds to
    them: the statistics are sums of each call's products."""
    if type(pending.get("in")) is UnscaledDiagonal:
        scale_unscaled([pending["in"], pending["out"]], [k2, c2])


def _add_diagonals(pending: dict, h: Tensor, s: Tensor) -> None:
    """Add H_K = Diagonal(h) (d_K) and H_C = Diagonal(s) (d_C) to a layer's ``pending``
    statistics ({"in": H_K, "out": H_C}, set by the first call)."""
    # Diagonal(d, diag=...) without its __init__ (which checks the part names: two
    # Python calls a matrix, on every layer call)
    H_K, H_C = object.__new__(Diagonal), object.__new__(Diagonal)
    H_K.dim, H_K.parts = h.shape[0], {"diag": h}
    H_C.dim, H_C.parts = s.shape[0], {"diag": s}
    add_statistics(pending, H_K, H_C)


def _squares(c: Tensor, k: Tensor, out: DiagonalSquares | None = None) -> DiagonalSquares:
    """:class:`DiagonalSquares` of the factors c and k, into ``out``'s buffers if given."""
    out = _square_buffers(c, k) if out is None else out
    _fill_squares([(c, k, out)])
    return out


def _square_buffers(c: Tensor, k: Tensor) -> DiagonalSquares:
    """New (unfilled) :class:`DiagonalSquares` buffers for the factors c and k."""
    acc = accumulation_dtype(c.dtype)
    new = partial(c.new_empty, dtype=acc)
    inv_dims = torch.tensor([1 / max(c.numel(), 1), 1 / max(k.numel(), 1)], dtype=acc)
    rounded = (torch.empty_like(c), torch.empty_like(k)) if c.dtype != acc else None
    traces, means = new(2), new(2)
    return DiagonalSquares(
        new(c.shape),
        new(k.shape),
        traces,
        means,
        inv_dims.to(c.device),
        rounded,
        (traces[0:1], traces[1:2]),
        (means[0:1], means[1:2]),
    )


class _StackedSquares(NamedTuple):
    """The :class:`DiagonalSquares` of L layers as the rows of stacked buffers: c² (L, d_C),
    k² (L, d_K), traces and means (L, 2), the shared inv_dims (2,), rounded (storage
    dtype; half storage only) and ``rows``, each layer's DiagonalSquares of row views."""

    c2: Tensor
    k2: Tensor
    traces: Tensor
    means: Tensor
    inv_dims: Tensor
    rounded: tuple[Tensor, Tensor] | None
    rows: list[DiagonalSquares]


def _diag_factor_update(factors, momenta, h, a, b, group: dict, step: int) -> None:
    """:func:`~singd_cuda.ops.diag_factor_update_` of the lists with the group's α₁ (0
    for ``kfac_like``), ``lr_cov`` and damping at ``step``."""
    ops.diag_factor_update_(
        factors,
        momenta,
        h,
        a,
        b,
        alpha1=0.0 if group["kfac_like"] else group["alpha1"],
        beta1=scheduled(group["lr_cov"], step),
        damping=scheduled(group["damping"], step),
    )


class _StackRows(NamedTuple):
    """The per-layer lists of rows :func:`~singd_cuda.ops.diag_factor_update_` takes for
    layers whose factors and squares are stacked: the factors k and c of each layer in
    turn, their momenta, the (1,) mean parts (where tr̄(H) of the other side is summed,
    then scaled) and trace parts (tr̄(Π̂(otherᵀ other))) of each layer's squares (empty
    for ``kfac_like``)."""

    factors: list[Tensor]
    momenta: list[Tensor]
    sum_outs: list[Tensor]
    traces: list[Tensor]
    # the op's lists in its stacked form (one entry per side: K, then C) but the
    # statistics': the factor stacks, their momenta, a and b
    stacked: tuple[list[Tensor], list[Tensor], list[Tensor], list[Tensor]]


def _stacked_square_buffers(C: Tensor, K: Tensor) -> _StackedSquares:
    """New (unfilled) :class:`_StackedSquares` for the stacked factors C (L, d_C) and K
    (L, d_K)."""
    acc = accumulation_dtype(C.dtype)
    c2, k2 = C.new_empty(C.shape, dtype=acc), K.new_empty(K.shape, dtype=acc)
    traces, means = c2.new_empty((2, C.shape[0], 2)).unbind()
    inv_dims = torch.tensor([1 / max(C.shape[1], 1), 1 / max(K.shape[1], 1)], dtype=acc)
    inv_dims = inv_dims.to(C.device)
    rounded = (C.new_empty(C.shape), K.new_empty(K.shape)) if C.dtype != acc else None
    rows = [
        DiagonalSquares(
            c2[i],
            k2[i],
            traces[i],
            means[i],
            inv_dims,
            None if rounded is None else (rounded[0][i], rounded[1][i]),
            (traces[i, 0:1], traces[i, 1:2]),
            (means[i, 0:1], means[i, 1:2]),
        )
        for i in range(C.shape[0])
    ]
    return _StackedSquares(c2, k2, traces, means, inv_dims, rounded, rows)


def _fill_stacked_squares(C: Tensor, K: Tensor, out: _StackedSquares) -> None:
    """:func:`_fill_squares` of every row at once, bitwise: the squares elementwise, the
    traces by row sums (on the CPU, where a row of a stack reduces as a vector does, as
    :class:`~.grouped.StackedSums` relies on; one sum per row elsewhere)."""
    for factor, square in ((C, out.c2), (K, out.k2)):
        if factor.dtype is square.dtype:  # (the copy's multiply, without the copy)
            torch.mul(factor, factor, out=square)
        else:
            square.copy_(factor).mul_(square)
    stored = (out.c2, out.k2)
    if out.rounded is not None:
        for rounded, square in zip(out.rounded, stored, strict=True):
            rounded.copy_(square)
        stored = out.rounded
    for side, vectors in enumerate(stored):
        column = out.traces[:, side : side + 1]
        if vectors.device.type == "cpu":
            torch.sum(vectors, 1, keepdim=True, dtype=column.dtype, out=column)
        else:
            for vector, trace in zip(vectors, column, strict=True):
                torch.sum(vector, 0, keepdim=True, dtype=trace.dtype, out=trace)
    out.traces.mul_(out.inv_dims)


def _fill_squares(
    entries: list[tuple[Tensor, Tensor, DiagonalSquares]], sums: StackedSums | None = None
) -> None:
    """Fill each (c, k, out) entry's :class:`DiagonalSquares` from its factors: the squares
    and the scalings by the dimensions as one multi-tensor call each, the traces by
    ``sums`` (one sum per vector when None)."""
    if not entries:
        return
    squares = [square for _, _, out in entries for square in (out.c2, out.k2)]
    torch._foreach_copy_(squares, [factor for c, k, _ in entries for factor in (c, k)])
    torch._foreach_mul_(squares, squares)
    rounded = [r for _, _, out in entries if out.rounded is not None for r in out.rounded]
    if rounded:
        torch._foreach_copy_(
            rounded, [sq for _, _, out in entries if out.rounded is not None for sq in out[:2]]
        )
    stored = [v for _, _, out in entries for v in (out.rounded or (out.c2, out.k2))]
    traces = [trace for _, _, out in entries for trace in out.trace_parts]
    if sums is not None:
        sums(stored, traces)
    else:
        for vector, trace in zip(stored, traces, strict=True):
            torch.sum(vector, 0, keepdim=True, dtype=trace.dtype, out=trace)
    torch._foreach_mul_(
        [out.traces for _, _, out in entries], [out.inv_dims for _, _, out in entries]
    )


class SINGD(KroneckerOptimizer):
    """Structured inverse-free natural gradient descent.

    ``SINGD(model, lr=1e-3, momentum=0.9, damping=1e-2, alpha1=0.5, weight_decay=0.0,
    T=10, lr_cov=1e-2, structures="block_diagonal:32", kfac_like=False, warm_start=True,
    ...)``: see [docs/optimizers/singd.md](../optimizers/singd.md).
    ``structures`` is a name ("dense", "diagonal", "block_diagonal:32", "low_rank:8",
    "tril_toeplitz", "triu_toeplitz", "hierarchical:15,15"), a (K side, C side) pair,
    structure classes, or "adafisher" ([AdaFisher's diagonal rule](../optimizers/adafisher.md)).
    ``kfac_like=True`` is IKFAC (alpha1 forced to 0). ``warm_start=True`` starts each
    layer's factors at the scale of its first statistics instead of K = C = I
    (:mod:`singd_cuda.optim.warm_start`). ``damping``, ``lr_cov`` and ``T``
    may be callables of the step. Parameters of other modules train with AdamW
    (``fallback_*`` settings).

    Large-batch recipe (Osawa et al., arXiv 1811.12019): ``norm_fisher=True`` trains
    BatchNorm/LayerNorm/GroupNorm affine parameters with a diagonal empirical Fisher
    (damping ``norm_damping``) instead of AdamW; ``weight_rescale=True`` rescales each
    preconditioned weight to norm √(2·d_out) after its update; ``momentum_lr_ratio=r``
    sets the momentum to r·lr at every step. Under torch.distributed (``process_group``,
    ``distribute_factors``, ``bucket_cap_mb``) see :mod:`singd_cuda.distributed`.

    Args:
        model: the ``nn.Module`` to train (or a DistributedDataParallel wrapping it); its
            supported layers (``nn.Linear``, ``nn.Conv1d/2d/3d``, Hugging Face
            ``Conv1D``, registered kinds) are hooked to capture curvature.
        params: None (default: every parameter of ``model``, frozen ones included) or
            parameters / parameter groups drawn from ``model.parameters()``. A layer's
            weight and bias must be in the same group.
        lr: step size β₂ (default 1e-3).
        momentum: heavy-ball momentum α₂ of the preconditioned step (default 0.9); with
            ``structures="adafisher"`` the Adam-style β.
        damping: λ, a number or a callable of the step (default 1e-2).
        alpha1: Riemannian momentum α₁ of the factor updates (default 0.5).
        weight_decay: γ, added to the preconditioned gradient (default 0.0).
        T: factor update period, a number or a callable of the step (default 10);
            statistics are captured only on steps with ``step % T == 0``.
        lr_cov: factor step size β₁, a number or a callable of the step (default 1e-2).
        structures: one structure name or class for both factors, a (K side, C side) pair,
            or ``"adafisher"`` (default ``"block_diagonal:32"``).
        kfac_like: IKFAC (default False).
        normalize_lr_cov: use β₁ / max(1, max|m|) and scale m̂ by (1 − α₁), as the
            published code does (default False).
        warm_start: start each layer's factors at the scale of its first statistics
            (default True); False starts at K = C = I, the published algorithm.
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
            preconditioned gradient (before weight decay and momentum) to the norm of
            Adam's normalised gradient G/(√v̂ + ε) (β₂ and ε of the fallback; one
            second-moment buffer per parameter) or to RMS 0.2 (Moonlight's rule);
            :mod:`singd_cuda.optim.graft`.
        factor_dtype: storage dtype of the factors (None, default: the parameter dtype);
            float64, float32, bfloat16 or float16. Arithmetic accumulates in float32.
        stochastic_rounding: round bf16 parameter writes stochastically (default False).
        ema_decay: AdaFisher's curvature EMA γ (``structures="adafisher"`` only; default 0.8).
        decoupled_weight_decay: AdaFisher's decoupled weight decay (``structures="adafisher"``
            only; default False).
        norm_fisher: train BatchNorm/LayerNorm/GroupNorm affine parameters with a
            diagonal empirical Fisher instead of the AdamW fallback (default False).
        norm_damping: the damping of ``norm_fisher`` (default 1e-3).
        weight_rescale: rescale each preconditioned weight to norm √(2·d_out) after its
            update (default False).
        momentum_lr_ratio: None (default) or r: the momentum is set to r·lr at every step.
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

    # its statistics are products with the factors (H_K = Kᵀ aᵀa K): a factor grown
    # large overflows them as well
    statistics_overflow = (
        "an overflow in the layer inputs or output gradients, or in their product with "
        "a factor K or C grown large: normalize_lr_cov=True or a smaller lr_cov bounds "
        "the factor updates"
    )

    def __init__(
        self,
        model: nn.Module,
        params=None,
        lr: float = 1e-3,
        momentum: float = 0.9,
        damping: float = 1e-2,
        alpha1: float = 0.5,
        weight_decay: float = 0.0,
        T: int = 10,
        lr_cov: float = 1e-2,
        structures: Any = "block_diagonal:32",
        kfac_like: bool = False,
        normalize_lr_cov: bool = False,
        warm_start: bool = True,
        loss_average: str | None = "batch",
        batch_dim: int | None = None,
        kfac_approx: str = "expand",
        graft: str | None = None,
        factor_dtype: torch.dtype | None = None,
        stochastic_rounding: bool = False,
        ema_decay: float = 0.8,
        decoupled_weight_decay: bool = False,
        norm_fisher: bool = False,
        norm_damping: float = 1e-3,
        weight_rescale: bool = False,
        momentum_lr_ratio: float | None = None,
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
            alpha1=alpha1,
            weight_decay=weight_decay,
            T=T,
            lr_cov=lr_cov,
            structures=structures,
            kfac_like=kfac_like,
            normalize_lr_cov=normalize_lr_cov,
            warm_start=warm_start,
            loss_average=loss_average,
            batch_dim=batch_dim,
            kfac_approx=kfac_approx,
            graft=graft,
            factor_dtype=factor_dtype,
            stochastic_rounding=stochastic_rounding,
            ema_decay=ema_decay,
            decoupled_weight_decay=decoupled_weight_decay,
            norm_fisher=norm_fisher,
            norm_damping=norm_damping,
            weight_rescale=weight_rescale,
            momentum_lr_ratio=momentum_lr_ratio,
            maximize=maximize,
        )
        defaults.update(checked_fallback(fallback))
        self._rules = {"singd": SingdRule(), ADAFISHER: AdaFisherRule()}
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
        warn_large_factors(self, "Pass structures= a structured choice")

    def hyperparameter_checks(self, group: dict) -> dict[str, hp.Check]:
        spec = group.get("structures")
        adafisher = spec == ADAFISHER or (isinstance(spec, tuple | list) and ADAFISHER in spec)
        return {
            **super().hyperparameter_checks(group),
            "structures": lambda key, value: resolve_structures(value),
            "momentum": hp.number(below_one=True),
            "alpha1": hp.number(below_one=True),
            "ema_decay": hp.number(below_one=True),
            # AdaFisher's normalised F̃ has a zero entry: only the damping keeps it invertible
            "damping": hp.number(positive=adafisher),
            "lr_cov": hp.number(),
            "kfac_like": hp.flag,
            "normalize_lr_cov": hp.flag,
            "warm_start": hp.flag,
            "decoupled_weight_decay": hp.flag,
        }

    def unused_hyperparameters(self, group: dict) -> set[str]:
        unused = super().unused_hyperparameters(group)
        if group["structures"][0] == ADAFISHER:
            return unused | {"alpha1", "lr_cov", "kfac_like", "normalize_lr_cov", "warm_start"}
        unused |= {"ema_decay", "decoupled_weight_decay"}
        return unused | ({"alpha1"} if group["kfac_like"] else set())

    def rule_for(self, group: dict) -> LayerRule:
        return self._rules[ADAFISHER if group["structures"][0] == ADAFISHER else "singd"]
