"""The dense K-FAC baseline (Martens & Grosse, 2015), with explicit inversion.

Per layer: dense factors A ≈ E[aaᵀ] (d_K x d_K) and G ≈ E[ggᵀ] (d_C x d_C),
exponential moving averages refreshed every T steps; at the first factor update
at least ``T_inv`` steps after the previous inversion (the first update inverts) the
damped inverses (A + √λ I)⁻¹ and (G + √λ I)⁻¹ are recomputed (by ``inverse``:
"inverse" = torch.linalg.inv, "eigen" = an eigendecomposition). The gradient is
preconditioned as G⁻¹ ∇W A⁻¹ and applied with momentum SGD.

It exists to show where explicit inversion breaks in low precision: factors and
inverses may be stored in bfloat16/float16 (``factor_dtype``); the inversion
itself is upcast to float32 because torch requires it, and the result is stored
back in the factor dtype.

``fisher="empirical"`` (default) uses the gradients of the loss; ``fisher="ggn"``
uses the generalised Gauss-Newton: call :meth:`KFAC.capture_ggn` on the model
output before ``loss.backward()`` on update steps.
"""

from __future__ import annotations

import math
import operator
from functools import partial
from itertools import chain
from typing import Any

import torch
from torch import Tensor, nn

from ..curvature.layers import Layer, gradient_matrix, split_matrix
from ..structures.base import ACCUMULATES_IN, accumulation_dtype
from . import hyperparameters as hp
from .base import KroneckerOptimizer, checked_fallback
from .derived import GroupCache
from .factor_memory import warn_large_factors
from .graft import graft_
from .grouped import (
    ResidentStacks,
    count_up,
    interleaved,
    positions_by,
    split_matrices,
    stacked_gradients,
    update_in_stacks,
)
from .rule import LayerRule, scheduled
from .scale_out import DEFAULT_BUCKET_CAP_MB
from .write import sgd_update_

INVERSE_METHODS = ("inverse", "eigen")
FISHER_TYPES = ("empirical", "ggn")
GGN_LOSSES = ("mse", "cross_entropy")


def invert_into(factors: list[Tensor], targets: list[Tensor], damping: float, method: str):
    """targets[i] <- (F_i + damping·I)⁻¹ for symmetric factors F_i of one shape (d, d),
    dtype and device, computed in float32 (float64 for float64) by ``method`` ("inverse":
    torch.linalg.inv_ex, "eigen": Q diag(1/(w + damping)) Qᵀ from eigh), written into
    ``targets`` (any float dtype) by one multi-tensor copy. One stack and one damping add
    for all, then one LAPACK call per matrix: a batched call is not bitwise the same as
    per-matrix calls for every size, and after some earlier workloads in a process (a
    full test run) a batched CPU inversion was seen to hang in its thread pool.

    ``inv_ex`` is ``torch.linalg.inv`` bit for bit without its error check: a singular
    damped factor (damping 0) gives a non-finite inverse, which the step's finite check
    turns into a skipped step with a warning naming the fix, instead of an exception
    raised halfway through the factor updates."""
    F = torch.stack(factors).to(accumulation_dtype(factors[0].dtype))
    d = F.shape[-1]
    if method == "inverse":
        F.add_(damping * torch.eye(d, dtype=F.dtype, device=F.device))
        inverses = list(map(_FIRST, map(torch.linalg.inv_ex, F)))
    else:  # a non-finite F (its step is skipped and F restored) must not make eigh raise
        F.nan_to_num_(0.0, 0.0, 0.0)
        inverses = [(Q / (w + damping)) @ Q.T for w, Q in map(torch.linalg.eigh, F)]
    torch._foreach_copy_(targets, inverses)


# values of the stacked inverses a group of small layers keeps between inversions
SMALL_STACK = 2**16
_INVERSE_KEYS = ("G_inv", "A_inv")
_INVERSES = operator.itemgetter(*_INVERSE_KEYS)
# layers whose factors can share a stack (the group holds one factor dtype, not one device)
_STACKABLE = operator.attrgetter("dim_in", "dim_out", "weight.device")
_FACTOR_UPDATES = operator.itemgetter("factor_updates")
_INVERTED_AT = operator.itemgetter("inverted_at")
_SIDES = (("A", "in"), ("G", "out"))  # (factor, its statistics in ``pending``)


_SHAPE_DTYPE = operator.attrgetter("dim_in", "dim_out", "weight.dtype")
_DTYPE_DEVICE = operator.attrgetter("dtype", "device")
_A, _A_INV = operator.itemgetter("A"), operator.itemgetter("A_inv")
_G, _G_INV = operator.itemgetter("G"), operator.itemgetter("G_inv")
_SHAPE_DTYPE_DEVICE = operator.attrgetter("shape", "dtype", "device")
_DTYPE, _WEIGHT_DTYPE = operator.attrgetter("dtype"), operator.attrgetter("weight.dtype")
_FIRST = operator.itemgetter(0)
_PARAMS = operator.attrgetter("params")


def _stack_keys(layers: list[Layer], states: list[list[dict]]) -> list[tuple]:
    """Layers with equal keys can be preconditioned as one stack: their shapes, weight
    dtype, and their inverses' dtype and device (``states[i]``: the states of layer i's
    parameters, the weight's first); by C calls alone (no Python call a layer)."""
    inverses = map(_A_INV, map(_FIRST, states))
    return list(zip(map(_SHAPE_DTYPE, layers), map(_DTYPE_DEVICE, inverses), strict=True))


def _stacked_inverses(layers: list[Layer], states: list[dict], dtype, previous=None) -> tuple:
    """(G_inv (L, d_C, d_C), A_inv (L, d_K, d_K)) of layers of equal shapes stacked in
    ``dtype``, the (L, d_C, d_K) buffer their preconditioned gradients go into, and its
    views split into the layers' parameters (:func:`~.grouped.split_matrices`); into
    ``previous`` (these four of the same layers and inverses) when given."""
    if previous is None:
        G_inv, A_inv = (torch.stack([s[key] for s in states]).to(dtype) for key in _INVERSE_KEYS)
        naturals = G_inv.new_empty((len(layers), G_inv.shape[1], A_inv.shape[2]))
        return G_inv, A_inv, naturals, split_matrices(layers, naturals)
    for stacked, key in zip(previous[:2], _INVERSE_KEYS, strict=True):
        rows = [s[key] for s in states]
        if rows[0].dtype is stacked.dtype:
            torch.stack(rows, out=stacked)
        else:
            stacked.copy_(torch.stack(rows))
    return previous


def _natural(state: dict, G: Tensor) -> Tensor:
    """G_inv G A_inv of one layer, in G's dtype."""
    return state["G_inv"].to(G.dtype) @ G @ state["A_inv"].to(G.dtype)


def _inverts_none(counts: list[int], states: list[dict], step: int, period: int) -> bool:
    """Whether the factor update at ``step`` inverts none of ``states`` (``counts``: their
    factor updates so far): none is a first update, and every last inversion is less
    than ``period`` steps back."""
    return min(counts) > 0 and step - min(map(_INVERTED_AT, states)) < period


def _ema_each(states: list[dict], pendings: list[dict], group: dict) -> None:
    """The factor EMA of each layer, one multi-tensor multiply and add per decay (a
    low-precision factor's EMA runs in its statistics' dtype, then is stored back)."""
    by_decay: dict[float, tuple[list[Tensor], list[Tensor]]] = {}
    casts: list[tuple[Tensor, Tensor]] = []  # (low-precision factor, its EMA)
    for state, pending in zip(states, pendings, strict=True):
        decay = group["stat_decay"] if state["factor_updates"] > 0 else 0.0
        emas, news = by_decay.setdefault(decay, ([], []))
        for key, side in _SIDES:
            ema, new = state[key], pending[side]
            if ema.dtype != new.dtype:
                casts.append((ema, ema := ema.to(new.dtype)))
            emas.append(ema)
            news.append(new)
    for decay, (emas, news) in by_decay.items():
        torch._foreach_mul_(emas, decay)
        torch._foreach_add_(emas, news, alpha=1.0 - decay)
    for factor, ema in casts:
        factor.copy_(ema)


class KfacRule(LayerRule):
    """K-FAC's factor EMA, damped inversion and preconditioning for one layer."""

    def __init__(self) -> None:
        self._stacked = GroupCache()  # stacked inverses of small layers, between inversions
        self._resident = ResidentStacks(("A", "G"), named=False)  # factors of equal shapes

    def open_step(self) -> None:
        self._resident.open_step()

    def close_step(self) -> None:
        self._resident.close_step()

    def init_state(self, layer: Layer, group: dict, state: dict) -> None:
        dtype = group["factor_dtype"] or layer.weight.dtype
        device = layer.weight.device
        for key, dim in (("A", layer.dim_in), ("G", layer.dim_out)):
            state[key] = torch.zeros(dim, dim, dtype=dtype, device=device)
            state[f"{key}_inv"] = torch.eye(dim, dtype=dtype, device=device)
        state["factor_updates"] = 0
        state["inverted_at"] = 0  # the step of the last inversion

    def accumulate(self, layer, group, state, pending, a: Tensor | None, g: Tensor) -> None:
        """Sums of aᵀa and gᵀg (a carries 1/√N and g √L, so these are averages).

        ``a`` is None on the extra backward passes of a GGN capture (one per output).
        Both are 2-D: ``torch.mm`` is the kernel ``@`` reaches, without its dispatch.
        """
        if a is not None:
            A_new = torch.mm(a.T, a)
            pending["in"] = pending["in"].add_(A_new) if "in" in pending else A_new
        G_new = torch.mm(g.T, g)
        pending["out"] = pending["out"].add_(G_new) if "out" in pending else G_new

    def update_factors(self, layer, group, state, pending, step: int) -> None:
        self.update_factors_many([layer], group, [state], [pending], step)

    def group_key(self, layer, group, state):
        """Layers whose factors hold their statistics' dtype update together (the EMA is
        elementwise, whatever the shapes); others (low-precision factors) one by one."""
        return self.group_keys([layer], group, [state])[0]

    def group_keys(self, layers, group, states) -> list:
        """:meth:`group_key` of each layer, by C calls alone (no Python call a layer)."""
        weight_dtypes = list(map(_WEIGHT_DTYPE, layers))
        accumulating = map(ACCUMULATES_IN.get, weight_dtypes, weight_dtypes)
        factor_dtypes = map(_DTYPE, map(_A, states))
        pairs = zip(factor_dtypes, accumulating, strict=True)
        return [("kfac", dtype) if dtype is acc else None for dtype, acc in pairs]

    def update_factors_many(self, layers, group, states, pendings, step: int) -> None:
        """A ← decay·A + (1 − decay)·A_new and G likewise for every layer (the first update
        of a layer takes its statistics as they are): for layers of equal shapes and
        device at the same decay one multiply and add per factor on the stack of their
        factors (:class:`~.grouped.ResidentStacks`), for the others one multi-tensor multiply and
        add per decay; then the inversions that are due, one :func:`invert_into` per
        factor shape."""
        update_in_stacks(
            positions_by(list(map(_STACKABLE, layers))),
            layers,
            states,
            pendings,
            lambda *part: self._ema_stacked(*part, group),
            lambda *rest: _ema_each(*rest, group),
        )
        period = group["T_inv"] or 1
        counts = count_up(states, "factor_updates")
        if _inverts_none(counts, states, step, period):  # (no loop over the layers)
            return
        due, inverting = [], []  # the states whose inversions are due, and their layers
        for layer, state, count in zip(layers, states, counts, strict=True):
            if count == 0 or step - state["inverted_at"] >= period:
                state["inverted_at"] = step
                due.append(state)
                inverting.append(layer)
        self._stacked.forget(*inverting)
        # A and G of each layer in turn, one invert_into per (shape, dtype, device)
        factors = interleaved(map(_A, due), map(_G, due))
        targets = interleaved(map(_A_INV, due), map(_G_INV, due))
        root = math.sqrt(scheduled(group["damping"], step))
        for part in positions_by(list(map(_SHAPE_DTYPE_DEVICE, factors))):
            invert_into(
                [factors[i] for i in part], [targets[i] for i in part], root, group["inverse"]
            )

    def _ema_stacked(self, layers, states: list[dict], pendings: list[dict], group: dict) -> bool:
        """The EMA of layers of equal shapes on the stacks of their factors, when every
        factor holds its statistics' dtype and every layer takes the same decay; False
        (nothing done) otherwise. Elementwise, so bitwise the same as one tensor at a time."""
        counts = list(map(_FACTOR_UPDATES, states))
        first = pendings[0]
        if (min(counts) > 0) != (max(counts) > 0) or any(
            states[0][key].dtype != first[side].dtype for key, side in _SIDES
        ):
            return False
        decay = group["stat_decay"] if counts[0] > 0 else 0.0
        stacks = self._resident.of(layers, states)
        for key, side in _SIDES:
            news = self._resident.gathered(stacks[key], [pending[side] for pending in pendings])
            stacks[key].mul_(decay).add_(news, alpha=1.0 - decay)
        return True

    def untouched(self, group: dict, states: list[dict], step: int) -> tuple[str, ...]:
        """The inverses, on a step that inverts none of ``states`` (as
        :meth:`update_factors_many` decides: a first update, or ``T_inv`` steps since
        the last inversion)."""
        counts = list(map(_FACTOR_UPDATES, states))
        return _INVERSE_KEYS if _inverts_none(counts, states, step, group["T_inv"] or 1) else ()

    def apply(self, layer, group, states, G: Tensor, step: int, seed: int, found_inf=None):
        """G_inv ∇W A_inv, grafted, then momentum SGD with weight decay."""
        directions = split_matrix(layer, _natural(states[0], G))
        graft_(
            layer.params,
            directions,
            states,
            group,
            found_inf=found_inf,
            grads=split_matrix(layer, G),
        )
        sgd_update_(layer.params, directions, states, group, seed, found_inf)

    def fuses_apply(self, group: dict) -> bool:
        return True

    def grafts(self, group: dict) -> bool:
        return True

    def apply_many(self, layers, group, states, inv_scale, step: int, seed: int, found_inf=None):
        """G_inv ∇W A_inv of every layer, then one momentum SGD write of them all; small
        layers of equal shapes are preconditioned as one stack (:meth:`_directions`)."""
        params, directions, param_states = [], [], []
        for part in positions_by(_stack_keys(layers, states)):
            members = [layers[i] for i in part]
            member_states = [states[i] for i in part]
            params += chain.from_iterable(map(_PARAMS, members))
            param_states += chain.from_iterable(member_states)
            directions += self._directions(members, member_states, inv_scale)
        graft_(params, directions, param_states, group, inv_scale, found_inf)
        sgd_update_(params, directions, param_states, group, seed, found_inf)

    def _directions(self, layers, states, inv_scale) -> list[Tensor]:
        """G_inv ∇W A_inv (unscaled) of layers of equal shapes, split into their
        parameters' shapes (weight, bias of each layer in turn): as batched products over
        their stacked gradients and inverses when the stacked inverses are small (at most
        ``SMALL_STACK`` values), into a buffer kept with them until the next inversion of
        any of the layers (its split views kept too), else one layer at a time."""
        first = layers[0]
        dtype = accumulation_dtype(first.weight.dtype)
        if len(layers) > 1 and len(layers) * (first.dim_in**2 + first.dim_out**2) <= SMALL_STACK:
            first_states = [s[0] for s in states]  # (a tuple of C calls: no generator)
            sources = tuple(chain.from_iterable(map(_INVERSES, first_states)))
            derive = partial(_stacked_inverses, layers, first_states, dtype)
            kept = self._stacked.get(layers, sources, derive, into=True)
            if kept[0].dtype is not dtype:  # the weights were cast since: new stacks
                self._stacked.forget(*layers)
                kept = self._stacked.get(layers, sources, derive)  # (not into the old)
            G_inv, A_inv, naturals, views = kept
            G = stacked_gradients(layers, dtype, inv_scale=inv_scale)
            torch.bmm(torch.bmm(G_inv, G), A_inv, out=naturals)
            return views
        naturals = []
        for layer, layer_states in zip(layers, states, strict=True):
            G = gradient_matrix(layer, dtype)
            if inv_scale is not None:
                G = G * inv_scale.to(G.dtype)  # G may be a view of the gradient
            naturals.append(_natural(layer_states[0], G))
        return split_matrices(layers, naturals)

    def natural_rows(self, layer, group, state, G: Tensor, rows: slice, step: int) -> Tensor:
        """Rows ``rows`` of G_inv ∇W A_inv (G holds every row)."""
        return state["G_inv"][rows].to(G.dtype) @ G @ state["A_inv"].to(G.dtype)


class KFAC(KroneckerOptimizer):
    """Dense K-FAC: ``KFAC(model, lr=1e-3, momentum=0.9, damping=1e-3, weight_decay=0.0,
    T=10, T_inv=None, stat_decay=0.95, inverse="inverse", fisher="empirical", ...)``.

    ``T_inv`` (None: at every factor update): the inverses are recomputed at the first
    factor update and then at the first factor update at least ``T_inv`` steps after the
    previous inversion (T=10, T_inv=3: every factor update; T=1, T_inv=3: steps 0, 3, 6, ...;
    T=3, T_inv=5: steps 0, 6, 12, ...), whatever T is, callables included.

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
        lr: step size (default 1e-3).
        momentum: heavy-ball momentum (default 0.9).
        damping: λ; the inverses are of A + √λI and G + √λI (default 1e-3).
        weight_decay: added to the preconditioned gradient (default 0.0).
        T: factor update period, a number or a callable of the step (default 10).
        T_inv: None (default: invert at every factor update) or the least number of steps
            between inversions.
        stat_decay: ρ of the factor EMA, A ← ρA + (1−ρ)A_new (default 0.95).
        inverse: ``"inverse"`` (default, ``torch.linalg.inv``) or ``"eigen"``.
        fisher: ``"empirical"`` (default) or ``"ggn"`` (call :meth:`capture_ggn` on update
            steps).
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

    def __init__(
        self,
        model: nn.Module,
        params=None,
        lr: float = 1e-3,
        momentum: float = 0.9,
        damping: float = 1e-3,
        weight_decay: float = 0.0,
        T: int = 10,
        T_inv: int | None = None,
        stat_decay: float = 0.95,
        inverse: str = "inverse",
        fisher: str = "empirical",
        loss_average: str | None = "batch",
        batch_dim: int | None = None,
        kfac_approx: str = "expand",
        graft: str | None = None,
        factor_dtype: torch.dtype | None = None,
        stochastic_rounding: bool = False,
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
            weight_decay=weight_decay,
            T=T,
            T_inv=T_inv,
            stat_decay=stat_decay,
            inverse=inverse,
            fisher=fisher,
            loss_average=loss_average,
            batch_dim=batch_dim,
            kfac_approx=kfac_approx,
            graft=graft,
            factor_dtype=factor_dtype,
            stochastic_rounding=stochastic_rounding,
            norm_fisher=norm_fisher,
            norm_damping=norm_damping,
            weight_rescale=weight_rescale,
            momentum_lr_ratio=momentum_lr_ratio,
            maximize=maximize,
        )
        defaults.update(checked_fallback(fallback))
        self._rule = KfacRule()
        self._capturing_ggn = False  # in the backward passes of capture_ggn
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
        warn_large_factors(self, "K-FAC's factors are dense; SINGD with structures= is lighter")

    def hyperparameter_checks(self, group: dict) -> dict[str, hp.Check]:
        return {
            **super().hyperparameter_checks(group),
            "momentum": hp.number(below_one=True),
            "stat_decay": hp.number(below_one=True),
            "damping": hp.number(),
            "T_inv": hp.optional_period,
            "inverse": hp.one_of(INVERSE_METHODS),
            "fisher": hp.one_of(FISHER_TYPES),
        }

    def rule_for(self, group: dict) -> LayerRule:
        return self._rule

    def _accumulate_statistics(
        self, layer, layer_input, grad_output, weight, into, with_input=True
    ) -> bool:
        # with fisher="ggn", only the backward passes of capture_ggn count; they are
        # several passes of one forward: the input side comes from the first only
        if (self.param_groups[self._layer_group[layer]]["fisher"] == "ggn") != self._capturing_ggn:
            return False
        return super()._accumulate_statistics(
            layer, layer_input, grad_output, weight, into, with_input=with_input
        )

    def _statistics_from_backward(self, group: dict) -> bool:
        return group["fisher"] != "ggn"

    def capture_ggn(self, output: Tensor, loss: str = "mse") -> None:
        """Capture GGN statistics by backpropagating the loss Hessian's square root.

        output: the model output, (B, ..., c) logits or predictions, still in the graph.
        loss: "mse" (per-term loss ½‖f − y‖², Hessian I) or "cross_entropy" (softmax
        over the last dim, Hessian diag(p) − ppᵀ). The per-term losses are averaged as
        ``loss_average`` says. One backward pass per output dimension; ``.grad`` is
        untouched, so call ``loss.backward()`` afterwards as usual.
        """
        if loss not in GGN_LOSSES:
            raise ValueError(f"loss must be one of {GGN_LOSSES}, got {loss!r}")
        flat = output.reshape(-1, output.shape[-1])
        group = self.param_groups[0]
        batch_dim = group["batch_dim"] or 0
        batch = output.shape[batch_dim if output.dim() - 1 > batch_dim else 0]
        terms = {"batch": batch, "batch+sequence": flat.shape[0], None: 1}
        num_terms = terms[group["loss_average"]]
        with torch.no_grad():
            if loss == "mse":
                root = torch.eye(flat.shape[1], dtype=flat.dtype, device=flat.device)
                root = root.expand(flat.shape[0], -1, -1)
            else:
                # float32 for half outputs, the output's own dtype otherwise
                p = torch.softmax(flat.to(accumulation_dtype(flat.dtype)), -1).to(flat.dtype)
                root = torch.diag_embed(p.sqrt()) - p.unsqueeze(2) * p.sqrt().unsqueeze(1)
        params = [p for layer in self._layers for p in layer.params]
        self._capturing_ggn = True
        try:
            with self._capture.direct():  # these passes accumulate no gradient, by design
                for column in range(flat.shape[1]):
                    vector = (root[:, :, column] / num_terms).reshape(output.shape)
                    torch.autograd.grad(
                        output, params, vector, retain_graph=True, allow_unused=True
                    )
        finally:
            self._capturing_ggn = False
