"""What every Kronecker-factored optimizer here shares.

:class:`KroneckerOptimizer` finds the supported layers of a model, captures
their curvature statistics on update steps, handles AMP (loss-scale unscaling
of gradients and statistics, skipped steps on inf), runs one :class:`LayerRule`
per layer (the math of one method for one layer, in one place) and trains every
other parameter with the built-in AdamW fallback.

Step schedule (as in the published SINGD code): steps count from 0; on a step
t with t % T == 0 the statistics of the forwards/backwards before it update
the factors, then the gradient is preconditioned with the new factors. A step
skipped for a non-finite gradient changes no state, not even the counter (with
``nonfinite='device'`` a steady-state skip is decided on the device: no tensor changes,
the counters count it).

Under torch.distributed a :class:`~singd_cuda.optim.scale_out.ScaleOut` (plugged in by
:mod:`singd_cuda.distributed`) averages gradients (plain models) and statistics once per
step, before any decision, and with ``distribute_factors`` each rank steps only the
layers it owns.
"""

from __future__ import annotations

import functools
import math
import operator
import warnings
from abc import abstractmethod
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Sequence
from itertools import chain, repeat
from typing import Any, ClassVar

import torch
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

from ..curvature import norm_layers
from ..curvature.capture import CurvatureCapture, merge_statistics, take_over
from ..curvature.discovery import find_layers
from ..curvature.layers import (
    Layer,
    RowMatrices,
    SquareSums,
    own_parameter,
    reduced_grad_output_matrix,
    reduced_input_matrix,
    sequence_first_modules,
)
from ..curvature.loss_terms import LossTermCounter
from ..structures.base import accumulation_dtype
from . import checkpoint, hyperparameters, recipe, scale_out, summary
from .factor_update import update_factors
from .fallback import all_preconditioned, fallback_step, in_fallback
from .finite import (
    GRADIENT,
    SCALER,
    STATISTICS,
    STATISTICS_OVERFLOW,
    FactorUndo,
    FiniteCheck,
    LateVerdict,
    skip_message,
    statistics_tensors,
)
from .grouped import positions_by
from .loss_scale import stepping_scaler
from .norm_fisher import norm_step
from .precondition import precondition_layers, precondition_shards
from .rule import LayerRule, scheduled
from .scale_out import DEFAULT_BUCKET_CAP_MB, ScaleOut, Shards
from .statistics import StatisticsNormaliser, UnscaledDiagonal, scale_unscaled

_LAYOUT = operator.attrgetter("layout")
_GRAD = operator.attrgetter("grad")
_WEIGHT = operator.attrgetter("weight")
# a statistics plan's (optimizer state, weight state) (:meth:`_plan_statistics`)
_PLAN_STATES, _PLAN_STATE = operator.itemgetter(4), operator.itemgetter(5)
_WEIGHT_GRAD = operator.attrgetter("weight.grad")
_PARAMS = operator.itemgetter("params")
_PRESENT = functools.partial(operator.is_not, None)  # x is not None, a C call
STEP_NOT_COMPILED = (
    "singd_cuda optimizers step eagerly: compile the model, not optimizer.step (docs/compile.md)"
)


class KroneckerOptimizer(Optimizer):
    """Base class; subclasses provide defaults and pick a :class:`LayerRule` per group."""

    _step_supports_amp_scaling = True  # GradScaler hands us grad_scale / found_inf
    # what overflows when a step's statistics are non-finite (its skip message says it)
    statistics_overflow: ClassVar[str] = STATISTICS_OVERFLOW
    common_defaults: ClassVar[dict[str, Any]] = dict(
        loss_average="batch",
        batch_dim=None,
        kfac_approx="expand",
        graft=None,
        factor_dtype=None,
        stochastic_rounding=False,
        fallback_lr=None,
        fallback_betas=(0.9, 0.999),
        fallback_eps=1e-8,
        fallback_weight_decay=0.0,
        norm_fisher=False,
        norm_damping=1e-3,
        weight_rescale=False,
        momentum_lr_ratio=None,
        maximize=False,
    )

    def __init__(
        self,
        model: nn.Module,
        params: Iterable[nn.Parameter] | Iterable[dict] | None,
        defaults: dict[str, Any],
        grad_scaler: torch.amp.GradScaler | None = None,
        nonfinite: str = "warn",
        process_group=None,
        distribute_factors: bool = False,
        bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(
                f"the first argument must be the model (an nn.Module), got {type(model).__name__}; "
                f"use {type(self).__name__}(model, lr=...) rather than passing parameters first"
            )
        if nonfinite not in ("warn", "raise", "device"):
            raise ValueError(f"nonfinite must be 'warn', 'raise' or 'device', got {nonfinite!r}")
        model, ddp_wrapped = scale_out.plug().unwrap(model)  # hooks go on the inner module
        self.model = model
        self.grad_scaler = grad_scaler
        self.nonfinite = nonfinite
        if params is None:  # frozen ones too: unfrozen later, they train (as torch.optim)
            params = list(model.parameters())
        super().__init__(params, {**self.common_defaults, **defaults, "step": 0})
        self._pending: dict[Layer, dict] = {}  # this step's normalised statistics
        # layer states first created by this step's statistics: (param, previous state)
        self._created: dict[Layer, list[tuple[Tensor, dict]]] = {}
        self._finite = FiniteCheck(reasons=4)
        self._late = LateVerdict()  # nonfinite='device': a skip's flags, reported late
        self._normalise = StatisticsNormaliser()
        self._kept_params_states: tuple | None = None  # (:meth:`_params_states`)
        self._counter = LossTermCounter(type(self).__name__)
        self._undo = FactorUndo()
        self._capture: CurvatureCapture | None = None
        self._waiting_warned: set[int] = set()  # weights warned about waiting for statistics
        self._seen_forward = False  # a grad-enabled model forward ran since construction
        self._index_model()
        summary.warn_unpreconditioned(self)
        groups = [self.group_of(layer) for layer in self._layers]
        self._sync: ScaleOut | None = scale_out.plug().attach(
            model,
            self._layers,
            [self.rule_for(g).factor_structures(g) for g in groups],
            [self.rule_for(g).row_local(g) for g in groups],
            process_group=process_group,
            distribute_factors=distribute_factors,
            bucket_cap_mb=bucket_cap_mb,
            ddp_wrapped=ddp_wrapped,
        )

    # ---------------------------------------------------------------- set-up
    @abstractmethod
    def rule_for(self, group: dict) -> LayerRule:
        """The layer rule of a parameter group."""

    def hyperparameter_checks(self, group: dict) -> dict[str, hyperparameters.Check]:
        """The check of each hyperparameter of ``group`` (extended by subclasses)."""
        return hyperparameters.common_checks()

    def validate_group(self, group: dict) -> None:
        """Raise ValueError for invalid hyperparameters of a group; remember its values so
        that :meth:`step` re-validates it when one changes (:mod:`.hyperparameters`)."""
        hyperparameters.accept(self, group)
        self._check_graft(group)

    def _check_graft(self, group: dict) -> None:
        """ValueError for a ``graft`` the group's rule would not apply (``rule.grafts``)."""
        rule = self.rule_for(group)
        if group["graft"] is None or rule.grafts(group):
            return
        raise ValueError(
            f"graft={group['graft']!r}: {type(rule).__name__} writes the parameters in apply() "
            "without grafting; graft its directions there with singd_cuda.optim.graft.graft_ "
            "(grads=split_matrix(layer, G)) and return True from its grafts(group), or use "
            "graft=None"
        )

    def add_param_group(self, param_group: dict) -> None:
        """Add a group; after construction its layers are found and hooked too (call it
        between steps). Not supported with distributed training."""
        super().add_param_group(param_group)
        try:
            self.validate_group(self.param_groups[-1])
            if "_sync" in self.__dict__:  # after construction
                if self._sync is not None:
                    raise NotImplementedError(
                        "add_param_group after construction is not supported with distributed "
                        f"training; pass every group to {type(self).__name__}(...)"
                    )
                self._index_model()
        except Exception:
            # leave the optimizer as it was: _index_model changes nothing when it fails, so
            # the hooks and the statistics captured since the last step stay
            self.param_groups.pop()
            raise

    def _index_model(self) -> None:
        """Find the preconditioned layers, the norm layers and the fallback parameters of
        the current groups, and hook the layers (again, after a later add_param_group)."""
        model = self.model
        self._check_params_in_model(model)
        param_group = {
            id(p): index for index, g in enumerate(self.param_groups) for p in g["params"]
        }
        layers = self._find_layers(model, param_group)
        norm_params = {id(p) for g in self.param_groups if g["norm_fisher"] for p in g["params"]}
        norm = norm_layers.find_norm_layers(model, lambda p: id(p) in norm_params)
        # all found: only now is anything replaced (a failure above leaves the optimizer)
        self._param_group, self._layers, self._norm_layers = param_group, layers, norm
        self._norm_set = set(self._norm_layers)
        sequence_first = sequence_first_modules(model)  # their layers count dimension 1
        self._counter.sequence_first = {
            x for x in self._layers + self._norm_layers if id(x.module) in sequence_first
        }
        self._counter.norm_layers = self._norm_set
        self._layer_group = {
            layer: self._param_group[id(layer.weight)] for layer in self._layers + self._norm_layers
        }
        self._square_sums = {layer: SquareSums(layer) for layer in self._layers}
        self._row_matrices = {layer: RowMatrices(layer) for layer in self._layers}
        self._wants: dict[int, tuple] = {}  # group index -> (step, T, wants statistics)
        self._call_plans: dict[Layer, tuple] = {}  # what decided a layer's last count
        self._statistics_plans: dict[Layer, tuple] = {}  # how its statistics accumulate
        in_layers = {id(p) for layer in self._layers + self._norm_layers for p in layer.params}
        self._fallback_params = [
            p for g in self.param_groups for p in g["params"] if id(p) not in in_layers
        ]
        if self._capture is not None:
            self._capture.remove()
        self._capture = CurvatureCapture(model, self._layers + self._norm_layers, self)
        take_over(model, self._capture)
        self._param_index = {  # new groups append: existing indices (rounding seeds) stay
            id(p): i for i, p in enumerate(p for g in self.param_groups for p in g["params"])
        }

    def _check_params_in_model(self, model: nn.Module) -> None:
        in_model = {id(p) for p in model.parameters()}
        constructed = "_sync" in self.__dict__
        for index, group in enumerate(self.param_groups):
            for position, p in enumerate(group["params"]):
                if id(p) in in_model:
                    continue
                where = f"param_groups[{index}]['params'][{position}] (shape {tuple(p.shape)})"
                if constructed and index < len(self.param_groups) - 1:
                    raise ValueError(
                        f"{where}, a parameter this optimizer already trains, is no longer a "
                        "parameter of the model (was it replaced, e.g. module.weight = "
                        f"nn.Parameter(...)?); create a new {type(self).__name__} for the "
                        "model as it is now"
                    )
                raise ValueError(
                    f"{where} is not a parameter of the model; pass params drawn from "
                    "model.parameters() (or params=None for all)"
                )
        # a sparse embedding's trained weight, unless another module holds it too (a tied
        # output head: the two gradients add up to a dense one)
        trained = {id(p) for group in self.param_groups for p in group["params"]}
        holders = Counter(id(p) for m in model.modules() for p in m._parameters.values())
        for name, module in model.named_modules():
            if not (isinstance(module, nn.Embedding | nn.EmbeddingBag) and module.sparse):
                continue
            weight = own_parameter(module, "weight")
            if id(weight) in trained and weight.requires_grad and holders[id(weight)] == 1:
                raise ValueError(
                    f"{type(self).__name__} does not support sparse gradients, which "
                    f"'{name or type(module).__name__}' ({type(module).__name__} with "
                    "sparse=True) gives: use sparse=False, or train it with "
                    "torch.optim.SparseAdam and leave its weight out of params="
                )

    def _find_layers(self, model: nn.Module, param_group: dict[int, int]) -> list[Layer]:
        return find_layers(model, param_group, type(self).__name__)

    @property
    def layers(self) -> list[Layer]:
        """The preconditioned layers, in model order."""
        return list(self._layers)

    def preconditioned(self) -> dict[str, tuple[str, str]]:
        """{qualified module name: (K side structure, C side structure)} of every
        preconditioned layer (:mod:`singd_cuda.optim.summary`)."""
        return summary.preconditioned(self)

    def summary(self) -> str:
        """A printable table of the preconditioned layers, their structures and state
        bytes, and the fraction of parameters that get curvature."""
        return summary.summary(self)

    def group_of(self, layer: Layer) -> dict:
        """The parameter group (an entry of ``param_groups``) that holds ``layer``."""
        return self.param_groups[self._layer_group[layer]]

    # ---------------------------------------------------------- statistics
    # What the capture asks (singd_cuda.curvature.capture.CaptureOwner).
    def _merge_statistics(self, layer: Layer, into: dict, new: dict) -> None:
        """into += new: a later pass's statistics of ``layer`` committed onto the earlier
        ones. Unscaled statistics (:class:`~.statistics.UnscaledDiagonal`) get their
        factors first, so that the sum is of products, as within a pass."""
        pairs = [[into.get(side), new.get(side)] for side in ("in", "out")]
        if any(None not in pair and UnscaledDiagonal in set(map(type, pair)) for pair in pairs):
            for pair, (factor,) in zip(pairs, self._statistic_factors([layer]), strict=True):
                if None not in pair:
                    scale_unscaled(pair, [factor, factor])
        merge_statistics(into, new)

    def _wants_statistics(self, layer: Layer) -> bool:
        index = self._layer_group[layer]
        group = self.param_groups[index]
        # a function of the group's step and T alone: decided once per step
        step, period = group["step"], group["T"]
        known = self._wants.get(index)
        if known is None or known[0] != step or known[1] is not period:
            known = self._wants[index] = (step, period, self._group_wants_statistics(group))
        return known[2]

    def _layer_call(self, layer: Layer, output: Tensor) -> int:
        """w of a grad-enabled call of ``layer`` (the loss terms its output covers,
        :mod:`singd_cuda.curvature.loss_terms`), -1 when it takes no statistics on this
        step. Whether the group takes statistics is decided once per step and ``T``
        (:meth:`_wants_statistics`); what decided the layer's last count is kept (the
        group, ``loss_average``, ``batch_dim``, the output's shape and the model's batch),
        and a call equal on all of them is answered from it: in steady state a layer call
        makes no Python call here."""
        index = self._layer_group[layer]
        group = self.param_groups[index]
        known = self._wants.get(index)  # as _wants_statistics, inline
        if known is None or known[0] != group["step"] or known[1] is not group["T"]:
            wants = self._wants_statistics(layer)
        else:
            wants = known[2]
        if not wants:
            return -1
        capture = self._capture
        plan = self._call_plans.get(layer)
        if (
            plan is None
            or plan[0] is not group
            or plan[1] is None
            or plan[2] != group["loss_average"]
            or plan[3] != group["batch_dim"]
            or plan[4] != output.shape
            or plan[5] != capture.model_batch
        ):
            return self._plan_layer_call(layer, group, output)
        if plan[1] and capture.batch_from_input:  # as LossTermCounter.count
            capture.counted_on_input = True
        return plan[6]

    def _plan_layer_call(self, layer: Layer, group: dict, output: Tensor) -> int:
        """The loss terms of a call of ``layer`` (:meth:`_layer_call`), counted in full;
        keeps what decided them."""
        loss_average, batch_dim = group["loss_average"], group["batch_dim"]
        model_batch = self._capture.model_batch  # before the count (which may set it)
        terms, on_input = self._counter.count(layer, output, loss_average, batch_dim, self._capture)
        terms = int(terms)
        self._call_plans[layer] = (
            group, on_input, loss_average, batch_dim, output.shape, model_batch, terms,
        )  # fmt: skip
        return terms

    def _group_wants_statistics(self, group: dict) -> bool:
        return group["step"] % self.update_period(group) == 0

    def update_period(self, group: dict) -> int:
        """T for the group's current step (T may be a callable of the step)."""
        period = int(scheduled(group["T"], group["step"]))
        if period < 1:
            raise ValueError(f"T must be >= 1, got {period}")
        return period

    def _before_forward(self) -> None:
        """Validate edited hyperparameters before the capture reads them."""
        self._seen_forward = True
        hyperparameters.check_step(self, scheduled=False)

    def _call_batch(self, batch: int) -> None:
        """A module that knows its batch dimension was called (the counting rule's model
        batch: :mod:`singd_cuda.curvature.loss_terms`)."""
        self._counter.told(self._capture, batch)

    def _accumulate_statistics(
        self,
        layer: Layer,
        layer_input: Tensor,
        grad_output: Tensor,
        weight: float,
        into: dict,
        with_input: bool = True,
    ) -> bool:
        """One call's statistics into ``into``: the input side (a carries 1/√N) weighted by
        ``weight`` (left out when ``with_input`` is False: a later backward pass through
        a call counted already), the output side from the raw output gradient (g without
        √L). True: the call counts.

        A layer's path (in one process, without ``kfac_approx="reduce"``) is decided
        once and kept while the group, its ``structures`` and ``kfac_approx``, the
        weight's dtype and the optimizer's state are the same objects (the rules decide
        ``rule_for`` and ``diagonal_statistics`` from ``structures``): then a call takes
        a and g and the rule's ``accumulate``, or the rule's ``accumulate_diagonal_sums``,
        only."""
        plan = self._statistics_plans.get(layer)
        if plan is not None and with_input:
            group, structures, kfac_approx, weight_dtype, states, state, rule, dtype, reader = plan
            if (
                self.param_groups[self._layer_group[layer]] is group
                and group.get("structures") is structures
                and group["kfac_approx"] is kfac_approx
                and layer.weight.dtype is weight_dtype
                and self.state is states
            ):
                if type(reader) is RowMatrices:  # the rows of a and g
                    a = reader.inputs(layer_input, dtype, weight)
                    g = reader.outputs(grad_output, dtype)
                    rule.accumulate(layer, group, state, into, a, g)
                    return True
                rule.accumulate_diagonal_sums(
                    layer, group, state, into, reader, layer_input, grad_output, dtype, weight
                )
                return True
        group = self.param_groups[self._layer_group[layer]]
        dtype = accumulation_dtype(layer.weight.dtype)
        if layer in self._norm_set:
            loss_average = group["loss_average"]
            batch_dim = self._counter.norm_batch_dim(layer, group["batch_dim"])
            F = norm_layers.norm_statistic(
                layer, layer_input, grad_output, loss_average, dtype, batch_dim
            )
            if loss_average is not None:  # raw: without the √L the statistic carries
                terms = norm_layers.num_terms(layer.module, grad_output, loss_average, batch_dim)
                F.mul_(1.0 / max(terms, 1))
            merge_statistics(into, {"out": F})
            return True
        rule = self.rule_for(group)
        device = grad_output.device
        reduced = group["kfac_approx"] == "reduce"
        if reduced:  # one row per sample (docs/concepts/curvature.md)
            batch_dim = self._counter.norm_batch_dim(layer, group["batch_dim"])
            a = reduced_input_matrix(layer, layer_input, grad_output, dtype, batch_dim)
            g = reduced_grad_output_matrix(layer, grad_output, dtype, batch_dim)
        else:
            a = g = None
        if rule.diagonal_statistics(group) and not (
            self._sync is not None and self._sync.distribute_factors
        ):
            sums = self._square_sums[layer]
            if not with_input:
                h = torch.zeros(layer.dim_in, dtype=dtype, device=device)
            elif a is not None:
                h = a.square().sum(0).mul_(weight)
            else:
                h = sums.inputs(layer_input, dtype, weight)
            s = g.square().sum(0) if g is not None else sums.outputs(grad_output, dtype)
            rule.accumulate_diagonal(layer, group, self._layer_state(layer, group), into, h, s)
            self._plan_statistics(layer, group, reduced, rule, dtype, sums)
            return True
        rows = self._row_matrices[layer]
        if not with_input:  # no rows: the rules add nothing to the input side
            a = torch.zeros(0, layer.dim_in, dtype=dtype, device=device)
        elif a is not None:
            a = a.mul_(math.sqrt(weight))
        else:
            a = rows.inputs(layer_input, dtype, weight)
        if g is None:
            g = rows.outputs(grad_output, dtype)
        self._accumulate(layer, group, into, a, g)
        self._plan_statistics(layer, group, reduced, rule, dtype, rows)
        return True

    def _plan_statistics(self, layer, group, reduced: bool, rule, dtype, reader) -> None:
        """Keep how ``layer``'s statistics accumulate (:meth:`_accumulate_statistics`) in
        one process without ``kfac_approx="reduce"``: ``reader`` is the layer's
        :class:`RowMatrices` (the rows of a and g) or its :class:`SquareSums` (their
        square sums)."""
        if self._sync is None and not reduced:
            self._statistics_plans[layer] = (
                group, group.get("structures"), group["kfac_approx"], layer.weight.dtype,
                self.state, self._layer_state(layer, group), rule, dtype, reader,
            )  # fmt: skip

    def _weights_states(self, layers: list[Layer]) -> list[dict]:
        """The weights' states of ``layers`` (created empty where missing, as a look-up of
        ``state`` does): as their statistics plans hold them, by C calls alone, where every
        layer has a plan made with this state dict (a state look-up hashes the weight by a
        Python call; a plan goes with a state restored by :meth:`_restore_created`)."""
        states = self._planned_states(layers)
        return list(map(self.state.__getitem__, map(_WEIGHT, layers))) if states is None else states

    def _planned_states(self, layers: list[Layer]) -> list[dict] | None:
        """The weights' states of ``layers`` as their statistics plans hold them, by C
        calls alone, where every layer has a plan made with this state dict; else None."""
        plans = list(map(self._statistics_plans.get, layers))
        if None in plans or not all(
            map(operator.is_, map(_PLAN_STATES, plans), repeat(self.state))
        ):
            return None
        return list(map(_PLAN_STATE, plans))

    def _params_states(self, layers: list[Layer]) -> list[list[dict]]:
        """The states of each layer's parameters (created empty where missing), kept for
        the next call with the same layers, by C calls alone then (a state look-up hashes
        the parameter by a Python call), while the state dict is the same object: the
        optimizer replaces a parameter's state only in a new one (``load_state_dict``)
        or when it restores a state (:meth:`_restore_created`, which forgets these)."""
        kept = self._kept_params_states
        if (
            kept is not None
            and kept[0] is self.state
            and len(kept[1]) == len(layers)
            and all(map(operator.is_, layers, kept[1]))
        ):
            return kept[2]
        found = [list(map(self.state.__getitem__, layer.params)) for layer in layers]
        self._kept_params_states = (self.state, list(layers), found)
        return found

    def _layer_state(self, layer: Layer, group: dict) -> dict:
        """The weight's state; at the layer's first statistics its factors are created
        (replacing the fallback state its parameters had while waiting for them; a
        skipped step, or statistics discarded before the step, restore that)."""
        state = self.state[layer.weight]
        if not state or in_fallback(state):
            previous = [(layer.weight, dict(state))]
            bias_state = self.state.get(layer.bias) if layer.bias is not None else None
            if bias_state is not None and in_fallback(bias_state):
                previous.append((layer.bias, dict(bias_state)))
                bias_state.clear()
            state.clear()
            self.rule_for(group).init_state(layer, group, state)
            self._created[layer] = previous
        return state

    def _started(self, layer: Layer) -> bool:
        """Whether the layer is preconditioned: it has factors, or statistics now."""
        state = self.state.get(layer.weight)
        return layer in self._pending or (bool(state) and not in_fallback(state))

    def _restore_created(self, layers: Iterable[Layer]) -> None:
        self._kept_params_states = None  # (a restored state is a new object)
        for layer in layers:
            self._statistics_plans.pop(layer, None)  # it holds the state replaced here
            for param, previous in self._created.pop(layer, ()):
                if previous:
                    self.state[param] = previous
                else:
                    self.state.pop(param, None)

    def _accumulate(self, layer: Layer, group: dict, pending: dict, a, g) -> None:
        rule = self.rule_for(group)
        if self._sync is not None and self._sync.distribute_factors:
            rule.accumulate_shared(layer, group, pending, a, g)  # no state off the owner
            return
        rule.accumulate(layer, group, self._layer_state(layer, group), pending, a, g)

    def _empty_statistics(self, layer: Layer) -> dict:
        """Zero statistics of ``layer`` in the layout its captured ones have (for a rank
        that captured none while others did)."""
        dtype = accumulation_dtype(layer.weight.dtype)
        device = layer.weight.device
        if layer in self._norm_set:
            return {"out": norm_layers.empty_norm_statistic(layer, dtype, device)}
        pending: dict = {}
        a = torch.zeros(0, layer.dim_in, dtype=dtype, device=device)
        g = torch.zeros(0, layer.dim_out, dtype=dtype, device=device)
        self._accumulate(layer, self.group_of(layer), pending, a, g)
        return pending

    # ----------------------------------------------------------------- AMP
    def _loss_scale(self) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        """(grad_scale, statistics_scale, found_inf) for this step.

        grad_scale: the factor still on the gradients (None: already unscaled).
        statistics_scale: the factor on the captured output gradients.
        """
        found_inf = getattr(self, "found_inf", None)
        grad_scale = getattr(self, "grad_scale", None)
        if grad_scale is not None:
            return grad_scale, grad_scale, found_inf
        if found_inf is None:  # no GradScaler involved in this step
            return None, None, None
        # scaler.unscale_(opt) ran before step: gradients are unscaled, statistics are not
        scaler = self.grad_scaler or stepping_scaler(self)
        if scaler is not None:
            # the scaler's scale tensor, unread (get_scale() would read it to the host)
            scale = scaler._get_scale_async()
            if scale is None:
                scale = torch.tensor(scaler.get_scale())
            return None, scale, found_inf
        if self._capture.committed:
            raise ValueError(
                "the gradients were unscaled before step, but not by a GradScaler's "
                "step(optimizer), so the optimizer cannot see the loss scale its curvature "
                f"statistics carry; pass grad_scaler=scaler to {type(self).__name__}(...)"
            )
        return None, None, found_inf

    # ---------------------------------------------------------------- step
    def step(self, closure: Callable[[], Tensor] | None = None) -> Tensor | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_enabled = torch.is_grad_enabled()
        torch.set_grad_enabled(False)  # torch.no_grad() in seven Python calls less
        stepping = False
        try:
            with_gradients = self._groups_with_gradients()  # before anything changes
            # edited hyperparameters: a ValueError before anything changes (the statistics
            # captured since the last step stay for the next try)
            hyperparameters.check_step(self)
            if self._sync is None and not any(with_gradients):
                return loss  # as torch.optim: no gradient, no step (nothing changes)
            stepping = True
            self._step_within_rules(with_gradients)
        except BaseException:
            if stepping:  # a refused edit keeps the statistics for the next try
                self._skip("")
            raise
        finally:
            torch.set_grad_enabled(grad_enabled)
        return loss

    @staticmethod
    def profile_hook_step(func: Callable) -> Callable:
        """torch.optim's wrapper of ``step`` (which runs the step pre- and post-hooks and
        opens the profiler's ``Optimizer.step#...`` range) when a step hook is registered
        or a profiler records, else ``step``'s body alone (:func:`_needs_torch_wrapper`),
        inside one that forgets a GradScaler's loss scale when the call raises: the
        scaler sets ``grad_scale`` and ``found_inf`` before ``scaler.step(opt)`` calls
        ``step`` and deletes them after a call that returns, not after one that raises
        (in a hook, where ``step``'s own body never runs, or in the body)."""
        hooked = Optimizer.profile_hook_step(func)

        # torch.compile(opt.step) runs the step eagerly: its work is fused C++ ops and
        # bookkeeping in Python (tensor values decide what runs), which Dynamo would break up
        @functools.wraps(hooked)
        @torch.compiler.disable(reason=STEP_NOT_COMPILED)
        def step(self, *args, **kwargs):
            try:
                if _needs_torch_wrapper(self):
                    return hooked(self, *args, **kwargs)
                return func(self, *args, **kwargs)
            except BaseException:
                self.__dict__.pop("grad_scale", None)
                self.__dict__.pop("found_inf", None)
                raise

        return step

    def _groups_with_gradients(self) -> list[bool]:
        """Per parameter group, whether any of its parameters has a gradient. RuntimeError
        for a sparse gradient (an embedding switched to ``sparse=True`` or unfrozen after
        construction, which refuses the ones it sees), so that the statistics stay."""
        found = []
        for group in self.param_groups:
            with_grad = list(filter(_PRESENT, map(_GRAD, group["params"])))
            if not set(map(_LAYOUT, with_grad)) <= {torch.strided}:  # (C-level, no loop)
                params = group["params"]
                p = next(p for p in params if p.grad is not None and p.grad.layout != torch.strided)
                raise RuntimeError(
                    f"{type(self).__name__} does not support sparse gradients (a "
                    f"parameter of shape {tuple(p.shape)} has one: an nn.Embedding or "
                    "nn.EmbeddingBag with sparse=True): use sparse=False, or train those "
                    "parameters with torch.optim.SparseAdam and leave them out of params="
                )
            found.append(bool(with_grad))
        return found

    def _step_within_rules(self, with_gradients: list[bool]) -> None:
        """:meth:`_step` between the open_step and close_step of every rule it uses."""
        rules = list({id(rule): rule for rule in map(self.rule_for, self.param_groups)}.values())
        for rule in rules:
            rule.open_step()
        try:
            self._step(with_gradients)
        finally:
            for rule in rules:
                rule.close_step()

    def _step(self, with_gradients: list[bool]) -> None:
        """One step; ``with_gradients``: per group, whether it has a gradient."""
        self._report_late()
        grad_scale, stats_scale, found_inf = self._loss_scale()
        # gather: the statistics as one batch's, averaged over the ranks before any decision
        # (none between statistics, T > 1)
        committed, self._pending = self._capture.committed, {}
        if committed:
            averages = [group["loss_average"] for group in self.param_groups]
            by_layer = map(averages.__getitem__, self._layer_group.values())
            loss_averages = dict(zip(self._layer_group, by_layer, strict=True))
            factors = self._statistic_factors
            self._pending = self._normalise(committed, loss_averages, stats_scale, factors)
        if self._sync is not None:
            grad_scale, found_inf = self._synchronise(grad_scale, found_inf)
        if self._created:  # states created by statistics discarded before the step (zero_grad)
            self._restore_created([layer for layer in self._created if layer not in self._pending])
        # validate: flags raised on the device, read once after the factor updates (or,
        # with nonfinite='device', consumed there by every write)
        self._check(found_inf)
        with_grad, waiting = self._layers_to_step()
        owned = with_grad if self._sync is None else list(filter(self._sync.owns, with_grad))
        # update factors, undone when a flag was raised
        self._update_factors(owned)
        skip = self._decided_on_device()
        if skip is not None:
            self._undo.restore_where(skip)
        else:
            reason = self._verdict()
            if reason is not None:
                self._undo.restore()
                return self._skip(self._skip_message(reason))
            self._undo.clear()
        if waiting:
            self._warn_waiting(waiting)
        # precondition and write
        for group in self.param_groups:
            recipe.momentum_from_ratio(group)
        if self._shards() is not None:
            precondition_shards(self, with_grad, grad_scale)  # every rank: its rows of each
        else:
            precondition_layers(self, owned, grad_scale, skip)
            waiting = [layer for layer in waiting if self._owns(layer)] if waiting else waiting
        if waiting:  # layers without statistics yet: AdamW
            self._fallback_step(grad_scale, [p for layer in waiting for p in layer.params], skip)
        if self._sync is not None and self._shards() is None:
            self._sync.share_parameters()  # distribute_factors: the owners' layers
        if self._norm_layers:
            norm_step(self, grad_scale)
        if self._fallback_params:
            self._fallback_step(grad_scale, self._fallback_params, skip)
        for group, has_gradients in zip(self.param_groups, with_gradients, strict=True):
            # a group without gradients sits the step out (as torch.optim.AdamW counts a
            # parameter's steps); under torch.distributed every rank counts every step
            if self._sync is not None or has_gradients:
                group["step"] += 1
        self._forget_statistics()
        return None

    def _check(self, found_inf: Tensor | None) -> None:
        """Refuse what the step cannot do (before any state changes), and raise the
        device-side flags of non-finite gradients (or the GradScaler's verdict) and
        statistics (:class:`~singd_cuda.optim.finite.FiniteCheck`)."""
        if self._capture.taken_over:
            raise RuntimeError(
                f"{type(self).__name__}: a newer optimizer on the same model took over its "
                "layers, so this one captures no curvature any more; use one optimizer per "
                "layer (remove_hooks() on an optimizer releases its layers)"
            )
        if self._shards() is not None and any(g["weight_rescale"] for g in self.param_groups):
            raise NotImplementedError(
                "weight_rescale=True is not supported with FSDP2-sharded parameters"
            )
        for group in self.param_groups:  # (a graft set since construction)
            self._check_graft(group)
        self._finite.reset()
        if found_inf is not None:
            self._finite.flag(found_inf.device, SCALER).copy_(found_inf.reshape(1))
        else:
            params = chain.from_iterable(map(_PARAMS, self.param_groups))
            grads = list(filter(_PRESENT, map(_GRAD, params)))
            local = grads if self._sync is None else self._sync.local_tensors(grads)
            self._finite.check(local, GRADIENT)
        if self._pending:  # the normaliser's stacks (of this step's call) hold every
            # statistic, unless a synchronisation replaced them
            stacks = self._normalise.stacks if self._sync is None else None
            self._finite.check(stacks or statistics_tensors(self._pending), STATISTICS)

    def _decided_on_device(self) -> Tensor | None:
        """With ``nonfinite='device'``: the step's skip flag as a one-element tensor on the
        device (> 0: skip), which every write of the step consumes, and its flags staged
        for a late warning (:meth:`_report_late`). None where the step reads its verdict
        instead: the other modes, and the steps it cannot predicate on the device:
        distributed training, a step that creates states (a layer's first statistics:
        dropping them is a host decision) or sets a host flag (a warm start), flags on
        several devices, ``norm_fisher`` or ``weight_rescale`` (writes outside the
        predicated ops)."""
        if (
            self.nonfinite != "device"
            or self._sync is not None
            or self._created
            or self._undo.sets_flags()
            or self._finite.device() is None
            or any(g["norm_fisher"] or g["weight_rescale"] for g in self.param_groups)
        ):
            return None
        flags = self._finite.flags()
        self._late.stage(flags)
        return flags.amax(0, keepdim=True)

    def _skip_message(self, reason: int) -> str:
        """The warning of a step skipped for ``reason`` (:func:`.finite.skip_message`)."""
        return skip_message(type(self).__name__, reason, self.statistics_overflow)

    def _report_late(self) -> None:
        """Warn about an earlier step skipped on the device, once its flags have reached
        the host (no synchronisation: a copy still in flight is looked at next step)."""
        for reason in self._late.landed():
            message = self._skip_message(reason)
            if not message:
                continue  # the GradScaler's routine skip
            warnings.warn(
                f"{message} [an earlier step, skipped on the device: nonfinite='device' "
                "reports a skip once its flags reach the host]",
                RuntimeWarning,
                stacklevel=4,
            )

    def _verdict(self) -> int | None:
        """The reason to skip this step (the one device-to-host read of a step), or None."""
        if self._sync is not None:
            self._sync.agree(self._finite)  # a rank's flags can differ from the others'
        return self._finite.verdict()

    def _layers_to_step(self) -> tuple[list[Layer], list[Layer]]:
        """(the layers with a gradient that are preconditioned, those with a gradient that
        wait for their first statistics: the fallback trains them until then)."""
        layers = self._layers
        if any(map(operator.is_, map(_WEIGHT_GRAD, layers), repeat(None))):
            with_grad = [  # a frozen weight's trained bias counts
                layer
                for layer in layers
                if layer.weight.grad is not None
                or (layer.bias is not None and layer.bias.grad is not None)
            ]
        else:  # every weight has a gradient (by C calls)
            with_grad = list(layers)
        # Before any model forward no layer can have had statistics, so none waits for
        # them: torch.distributed.checkpoint builds a fresh optimizer's state template by one
        # step with zero gradients (_init_optim_state), and the layers then take the factor
        # state a checkpoint holds.
        if not self._seen_forward:
            return with_grad, []
        pending = self._pending  # (started: the common case, asked first)
        if not pending:  # a step between statistics: the planned layers' states, if all are
            planned = self._planned_states(with_grad)
            if planned is not None and all_preconditioned(planned):
                return with_grad, []
        waiting = [
            layer for layer in with_grad if layer not in pending and not self._started(layer)
        ]
        if not waiting:
            return with_grad, waiting
        return [layer for layer in with_grad if layer not in waiting], waiting

    def _shards(self) -> Shards | None:
        """The FSDP2 part of the step, or None when the parameters are not sharded."""
        return None if self._sync is None else self._sync.shards

    def _owns(self, layer: Layer) -> bool:
        """Whether this rank updates the layer's factors (always in one process)."""
        return self._sync is None or self._sync.owns(layer)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As ``torch.optim``; the statistics captured since the last step go with the
        gradients (a batch thrown away after its backward counts for nothing)."""
        super().zero_grad(set_to_none)
        self._capture.discard()

    def _skip(self, reason: str) -> None:
        """Drop this step's statistics (and any state they created); change nothing else."""
        self._restore_created(list(self._created))
        self._forget_statistics()
        if reason:
            if self.nonfinite == "raise":
                raise FloatingPointError(reason)
            warnings.warn(reason, RuntimeWarning, stacklevel=4)

    def _statistic_factors(self, layers: list[Layer]) -> tuple[Sequence, Sequence]:
        """(input side, output side) elementwise factors of ``layers``' unscaled statistics,
        in their order (:meth:`~.rule.LayerRule.statistic_factors` of each group's rule)."""
        indices = list(map(self._layer_group.__getitem__, layers))
        states = self._weights_states(layers)
        parts = positions_by(indices)
        if len(parts) == 1:
            group = self.param_groups[indices[0]]
            return self.rule_for(group).statistic_factors(layers, group, states)
        sides: tuple[list, list] = ([None] * len(layers), [None] * len(layers))
        for part in parts:
            group = self.param_groups[indices[part[0]]]
            members, member_states = [layers[i] for i in part], [states[i] for i in part]
            found = self.rule_for(group).statistic_factors(members, group, member_states)
            for side, factors in zip(sides, found, strict=True):
                for i, factor in zip(part, factors, strict=True):
                    side[i] = factor
        return sides

    def _forget_statistics(self) -> None:
        self._created.clear()
        self._pending = {}
        self._undo.clear()
        self._capture.reset()

    def _warn_waiting(self, layers: list[Layer]) -> None:
        """Once per layer: a weight with a gradient but no statistics on a statistics step
        that never had any (``F.linear(x, module.weight)`` outside the module's forward,
        a head not yet called whose weight is in an L2 term) is trained by the fallback
        until its first statistics."""
        for layer in layers:
            if layer.weight.grad is None or id(layer.weight) in self._waiting_warned:
                continue  # a frozen weight's bias: no statistics are expected
            if not self._wants_statistics(layer):
                continue
            if not self._statistics_from_backward(self.group_of(layer)):
                continue
            self._waiting_warned.add(id(layer.weight))
            warnings.warn(
                f"{type(self).__name__}: the weight of layer '{layer.name}' received a "
                "gradient but no curvature statistics, and never had any: the AdamW "
                "fallback trains it until its first statistics (a weight used outside its "
                "module's forward, e.g. F.linear(x, module.weight), never gets any)",
                RuntimeWarning,
                stacklevel=4,
            )

    def _statistics_from_backward(self, group: dict) -> bool:
        """Whether the group's statistics come from the backward of the loss (not, as for
        K-FAC's GGN, from passes of their own)."""
        return True

    def _synchronise(
        self, grad_scale: Tensor | None, found_inf: Tensor | None
    ) -> tuple[Tensor | None, Tensor | None]:
        """Average gradients (plain models) and this step's statistics over the ranks."""
        assert self._sync is not None
        stat_layers = [
            layer for layer in self._layers + self._norm_layers if self._wants_statistics(layer)
        ]
        params = [p for group in self.param_groups for p in group["params"]]
        return self._sync.synchronise(
            self._pending,
            stat_layers,
            self._empty_statistics,
            params,
            grad_scale,
            found_inf,
            saw_samples=self._capture.saw_samples,
        )

    def _update_factors(self, layers: list[Layer]) -> None:
        update_factors(self, layers)

    def _seed(self, group: dict, param: Tensor) -> int:
        """Stochastic-rounding seed of an op call whose first tensor is ``param``.

        A pure function of (step, parameter), so a resumed checkpoint replays bit for bit;
        the op hashes it with each tensor's position in its list, so that every parameter
        draws its own random bits.
        """
        return group["step"] * 1_000_003 + self._param_index[id(param)]

    def _fallback_step(
        self, grad_scale: Tensor | None, params: list[Tensor], found_inf: Tensor | None
    ) -> None:
        fallback_step(self, grad_scale, params, found_inf)

    # ---------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """torch.optim's state dict, plus the optimizer kind under ``"optimizer"`` (its
        class name, so that :meth:`load_state_dict` can tell another optimizer's)."""
        state_dict = {**super().state_dict(), checkpoint.KIND_KEY: type(self).__name__}
        shards = self._shards()
        if shards is not None:  # FSDP2: the shards' buffers as DTensors (for DCP)
            params = [p for g in self.param_groups for p in g["params"]]
            state_dict["state"] = {
                i: shards.sharded_state(params[i], s) for i, s in state_dict["state"].items()
            }
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state; unlike torch.optim, every state tensor keeps its own dtype.

        Raises ValueError, before changing anything, when the checkpoint does not fit
        (another optimizer, model, structure, a non-finite or non-float state tensor;
        :mod:`.checkpoint`), checked after the load_state_dict pre-hooks (which may adapt
        it, as torch.optim says); any later failure (a post-hook) restores the old state.
        """
        hooks = self._optimizer_load_state_dict_pre_hooks
        state_dict = state_dict.copy() if isinstance(state_dict, dict) else state_dict
        for hook in hooks.values():  # as torch.optim; before the check: they may adapt it
            state_dict = hook(self, state_dict) or state_dict
        state_dict = checkpoint.prepared(self, state_dict)
        previous = self.state, self.param_groups, dict(self.defaults)
        self._optimizer_load_state_dict_pre_hooks = OrderedDict()  # they ran above
        try:
            super().load_state_dict(state_dict)  # replaces state and param_groups
            for group in self.param_groups:  # the loaded hyperparameters are the ones in use
                hyperparameters.accept(self, group)
            checkpoint.keep_saved_dtypes(self, state_dict["state"])
            if self._sync is not None:  # distribute_factors: this rank's layers; FSDP2: rows
                self._sync.keep_own_state(self.state)
        except BaseException:  # e.g. a load_state_dict post-hook: back to the old objects
            self.state, self.param_groups, self.defaults = previous
            for group in self.param_groups:
                hyperparameters.accept(self, group)
            raise
        finally:
            self._optimizer_load_state_dict_pre_hooks = hooks

    def full_state_dict(self) -> dict[str, Any]:
        """The whole optimizer state, on every rank (a collective: call it on all ranks).

        Under ``distribute_factors=True`` each rank holds the factors and momenta of its
        own layers only, so :meth:`state_dict` is this rank's shard; this gathers the
        shards into the state_dict a replicated or single-process optimizer would have.
        Save it from rank 0; restore with :meth:`load_full_state_dict` on every rank
        (any world size, either mode, or a single process with ``load_state_dict``).
        Without distribution or in the replicated mode it is :meth:`state_dict`.
        """
        local = self.state_dict()
        if self._sync is None:
            return local
        params = [p for g in self.param_groups for p in g["params"]]
        return self._sync.full_state_dict(local, {id(p): i for i, p in enumerate(params)})

    def load_full_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a :meth:`full_state_dict` (each rank keeps the layers it owns)."""
        self.load_state_dict(state_dict)

    # ------------------------------------------------------ copies and repr
    def __deepcopy__(self, memo: dict) -> KroneckerOptimizer:
        raise TypeError(
            f"{type(self).__name__} cannot be deep-copied: it is bound to its model (hooks "
            "on its layers). Copy the state instead: new = "
            f"{type(self).__name__}(model_copy, ...); "
            "new.load_state_dict(copy.deepcopy(opt.state_dict()))"
        )

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError(
            f"{type(self).__name__} cannot be pickled: it is bound to its model (hooks on "
            "its layers). Save its state instead: torch.save(opt.state_dict(), path), then "
            f"{type(self).__name__}(model, ...).load_state_dict(torch.load(path))"
        )

    def unused_hyperparameters(self, group: dict) -> set[str]:
        """Keys of ``group`` that its rule does not read (left out of ``repr``)."""
        unused = set() if group["norm_fisher"] else {"norm_damping"}
        if group["momentum_lr_ratio"] is None:
            unused.add("momentum_lr_ratio")
        return unused

    def __repr__(self) -> str:
        fallback = {id(p) for p in self._fallback_params}
        lines = [f"{type(self).__name__} ("]
        for index, group in enumerate(self.param_groups):
            layers = [layer for layer in self._layers if self.group_of(layer) is group]
            others = sum(id(p) in fallback for p in group["params"])
            lines.append(
                f"Parameter Group {index}: {len(layers)} preconditioned layer(s), "
                f"{others} parameter(s) with the AdamW fallback"
            )
            hidden = self.unused_hyperparameters(group) | {"params"}
            for key in sorted(k for k in group if k not in hidden):
                lines.append(f"    {key}: {group[key]!r}")
        lines.append(")")
        return "\n".join(lines)

    def remove_hooks(self) -> None:
        """Detach the optimizer from the model (no more statistics are captured)."""
        self._capture.remove()
        if self._sync is not None:
            self._sync.remove()


def checked_fallback(fallback: dict[str, Any]) -> dict[str, Any]:
    """The ``fallback_*`` keyword arguments; TypeError for any other unknown keyword."""
    valid = sorted(k for k in KroneckerOptimizer.common_defaults if k.startswith("fallback_"))
    unknown = sorted(set(fallback) - set(valid))
    if unknown:
        hints = [f"'fallback_{k}' for '{k}'" for k in unknown if f"fallback_{k}" in valid]
        hint = f" (did you mean {', '.join(hints)}?)" if hints else ""
        raise TypeError(
            f"unexpected keyword argument(s) {unknown}{hint}; besides the documented "
            f"arguments only the AdamW fallback's settings are accepted: {', '.join(valid)}"
        )
    return fallback


def _needs_torch_wrapper(opt: Optimizer) -> bool:
    """Whether a step needs torch.optim's wrapper: a step pre- or post-hook is registered
    (on ``opt`` or globally), or a profiler records on this thread (the wrapper's
    ``record_function`` range and its ``_optimizer_step_code`` marker are for it). Else
    the wrapper does nothing a caller can see, yet its range costs host time on every
    step: its enter and exit ops, called through ``torch.ops`` from Python. Without them
    and the ``no_grad`` decorator's calls, AdaFisher's step on the MLP of
    ``benchmarks/host_cost.py`` fell from 277 to 243 µs a layer. So it is left out, as
    ``torch.utils.data``'s datapipes open their ranges only when
    ``torch.autograd._profiler_enabled()``."""
    return bool(
        opt._optimizer_step_pre_hooks
        or opt._optimizer_step_post_hooks
        or _global_optimizer_pre_hooks
        or _global_optimizer_post_hooks
        or torch.autograd._profiler_enabled()
    )
