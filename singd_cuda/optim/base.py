"""What every Kronecker-factored optimizer here shares.

:class:`KroneckerOptimizer` finds the supported layers of a model, captures
their curvature statistics on update steps, handles AMP (loss-scale unscaling
of gradients and statistics, skipped steps on inf), runs one :class:`LayerRule`
per layer (the math of one method for one layer, in one place) and trains every
other parameter with the built-in AdamW fallback.

Step schedule (as in the published SINGD code): steps count from 0; on a step
t with t % T == 0 the statistics of the forwards/backwards before it update
the factors, then the gradient is preconditioned with the new factors. A step
skipped for a non-finite gradient changes no state, not even the counter.

Under torch.distributed a :class:`~singd_cuda.optim.scale_out.ScaleOut` (plugged in by
:mod:`singd_cuda.distributed`) averages gradients (plain models) and statistics once per
step, before any decision, and with ``distribute_factors`` each rank steps only the
layers it owns.
"""

from __future__ import annotations

import math
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Iterable
from typing import Any, ClassVar

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from .. import ops
from ..curvature import norm_layers
from ..curvature.capture import CurvatureCapture, merge_statistics, take_over
from ..curvature.layers import (
    SUPPORTED_LAYERS,
    Layer,
    bypassed_modules,
    grad_output_matrix,
    grad_output_sum_squares,
    gradient_matrix,
    input_matrix,
    input_sum_squares,
    is_supported,
    loss_terms,
    misplaced_batch,
    samples,
    sequence_first_modules,
    split_matrix,
)
from ..structures.base import accumulation_dtype, upcast
from . import checkpoint, hyperparameters, norm_fisher, recipe, scale_out, summary
from .fallback import adamw_update_, in_fallback
from .finite import FactorUndo, FiniteCheck, tensors_of
from .scale_out import DEFAULT_BUCKET_CAP_MB, ScaleOut

Schedule = float | Callable[[int], float]


# the reasons of a skipped step, by priority (FiniteCheck flags)
_SCALER, _GRADIENT, _STATISTICS, _FACTORS = range(4)
STEP_NOT_COMPILED = (
    "singd_cuda optimizers step eagerly: compile the model, not optimizer.step (docs/compile.md)"
)


def scheduled(value: Schedule, step: int) -> float:
    """A hyperparameter that may be a callable of the step count."""
    return value(step) if callable(value) else value


class LayerRule(ABC):
    """The math of one method for one layer.

    ``pending`` holds the statistics captured since the last step under the
    keys "in" (input side, a) and "out" (output-gradient side, g); both are
    linear in aᵀa and gᵀg respectively and support ``mul_``.

    A rule updates the parameters through :meth:`apply` (one layer at a time) or, for
    the groups where :meth:`fuses_apply` holds, through :meth:`apply_many`.
    """

    @abstractmethod
    def init_state(self, layer: Layer, group: dict, state: dict) -> None:
        """Create the layer's factors in ``state`` (the weight's state)."""

    @abstractmethod
    def accumulate(
        self, layer: Layer, group: dict, state: dict, pending: dict, a: Tensor, g: Tensor
    ) -> None:
        """Add one backward pass's statistics (a: N x d_K, g: N x d_C) to ``pending``."""

    @abstractmethod
    def update_factors(
        self, layer: Layer, group: dict, state: dict, pending: dict, step: int
    ) -> None:
        """Update the factors from the normalised, unscaled ``pending`` statistics."""

    def group_key(self, layer: Layer, group: dict, state: dict) -> Hashable | None:
        """Layers of one parameter group with equal keys update their factors (and, in
        :meth:`apply_many`, precondition) as one stack (:mod:`.grouped`); None: alone."""
        return None

    def update_factors_many(
        self,
        layers: list[Layer],
        group: dict,
        states: list[dict],
        pendings: list[dict],
        step: int,
    ) -> None:
        """:meth:`update_factors` of layers of equal :meth:`group_key` (default: one by one)."""
        for layer, state, pending in zip(layers, states, pendings, strict=True):
            self.update_factors(layer, group, state, pending, step)

    def apply(
        self, layer: Layer, group: dict, states: list[dict], G: Tensor, step: int, seed: int
    ) -> None:
        """Precondition G (d_C x d_K, unscaled) and update the layer's parameters.

        ``states`` are the states of ``layer.params`` in order; ``seed`` seeds the
        stochastic rounding of the parameter write (:func:`singd_cuda.ops.sgd_epilogue_`).
        """
        raise NotImplementedError

    # Hooks for distributed training (singd_cuda.distributed); the defaults suit rules
    # whose statistics never read the layer state.
    # Fused diagonal paths (singd_cuda.ops): rules whose statistics are column sums of
    # squares and whose update is elementwise override these.
    def diagonal_statistics(self, group: dict) -> bool:
        """True when the layer statistics are diag(aᵀa) and diag(gᵀg) only, so that
        :meth:`accumulate_diagonal` can take them without materialising a and g."""
        return False

    def accumulate_diagonal(
        self, layer: Layer, group: dict, state: dict, pending: dict, h: Tensor, s: Tensor
    ) -> None:
        """Like :meth:`accumulate`, from h = diag(aᵀa) (d_K) and s = diag(gᵀg) (d_C)."""
        raise NotImplementedError

    def fuses_apply(self, group: dict) -> bool:
        """True when :meth:`apply_many` updates the group's layers (in one fused pass)."""
        return False

    def apply_many(
        self,
        layers: list[Layer],
        group: dict,
        states: list[list[dict]],
        inv_scale: Tensor | None,
        step: int,
        seed: int,
    ) -> None:
        """Precondition and update every layer of ``layers`` (gradients still scaled by
        1/``inv_scale``) in one pass; ``seed`` seeds stochastic rounding."""
        raise NotImplementedError

    def start_factors(self, layer: Layer, group: dict, state: dict, pending: dict) -> bool:
        """Before each :meth:`update_factors`: a rule whose factors start from the first
        statistics (SINGD's warm start) sets them here; False skips this update (the
        statistics cannot start the factors yet). The default starts nothing."""
        return True

    def factor_structures(self, group: dict) -> tuple[str, str]:
        """(K side, C side) structure names of the layer's factors, for the cost model."""
        return ("dense", "dense")

    def accumulate_shared(self, layer: Layer, group: dict, pending: dict, a, g) -> None:
        """Like :meth:`accumulate`, without the layer state (``distribute_factors``: only
        the owner of a layer holds it, every rank contributes statistics)."""
        self.accumulate(layer, group, {}, pending, a, g)

    def finish_shared(self, layer: Layer, group: dict, state: dict, pending: dict) -> None:
        """On the owner, turn averaged :meth:`accumulate_shared` statistics into the
        ``pending`` that :meth:`update_factors` expects (default: they are that already)."""
        return None

    # Hooks for parameters sharded by rows (FSDP2, singd_cuda.distributed.fsdp): a shard
    # is a Layer over this rank's rows of the weight and bias (plain tensors sharing the
    # shard's storage, with their local gradients), its ``rows`` the slice it holds.
    def row_local(self, group: dict) -> bool:
        """True when rows of the preconditioned gradient need only the same rows of G
        (a diagonal output-side factor): a shard then updates itself without gathering G."""
        return False

    def natural_rows(
        self, layer: Layer, group: dict, state: dict, G: Tensor, rows: slice, step: int
    ) -> Tensor:
        """Rows ``rows`` of the preconditioned gradient Ĝ (unscaled) of ``layer``; G
        (accumulation dtype, unscaled) holds every row, or only ``rows`` when
        :meth:`row_local`."""
        raise NotImplementedError(
            f"{type(self).__name__} does not support parameters sharded by rows (FSDP2)"
        )

    def apply_shard(
        self,
        layer: Layer,
        shard: Layer,
        group: dict,
        states: list[dict],
        inv_scale: Tensor | None,
        step: int,
        seed: int,
    ) -> None:
        """A :meth:`row_local` rule's update of this rank's rows (``shard``, gradients
        still scaled by 1/``inv_scale``); the default preconditions with
        :meth:`natural_rows` and takes a momentum SGD step (:meth:`apply_direction`).
        Called for a shard without rows too (``shard.rows`` empty), to count the step."""
        if shard.rows.start == shard.rows.stop:
            return
        G = gradient_matrix(shard, accumulation_dtype(layer.weight.dtype))
        if inv_scale is not None:
            G = G * inv_scale.to(G.device, G.dtype)
        natural = self.natural_rows(layer, group, states[0], G, shard.rows, step)
        self.apply_direction(shard, group, states, natural, seed)

    def shard_buffers(self, group: dict) -> tuple[str, ...]:
        """The state entries shaped like each parameter that a step creates (created as
        zeros for every shard up front, so that every rank holds them, rows or not)."""
        return ("momentum_buffer",) if group["momentum"] != 0.0 else ()

    def apply_direction(
        self, shard: Layer, group: dict, states: list[dict], natural: Tensor, seed: int
    ) -> None:
        """Momentum SGD with weight decay on the shard's parameters along its rows of Ĝ."""
        sgd_update_(shard.params, split_matrix(shard, natural), states, group, seed)


class KroneckerOptimizer(Optimizer):
    """Base class; subclasses provide defaults and pick a :class:`LayerRule` per group."""

    _step_supports_amp_scaling = True  # GradScaler hands us grad_scale / found_inf
    common_defaults: ClassVar[dict[str, Any]] = dict(
        loss_average="batch",
        batch_dim=None,
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
        if nonfinite not in ("warn", "raise"):
            raise ValueError(f"nonfinite must be 'warn' or 'raise', got {nonfinite!r}")
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
        self._scalars: dict[tuple, Tensor] = {}  # see _scalar
        self._undo = FactorUndo()
        self._capture: CurvatureCapture | None = None
        self._waiting_warned: set[int] = set()  # weights warned about waiting for statistics
        self._batch_checked: set[int] = set()  # weights whose batch dimension was checked
        self._seen_forward = False  # a grad-enabled model forward ran since construction
        self._index_model()
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
            self.param_groups.pop()  # leave the optimizer as it was
            if "_sync" in self.__dict__:
                self._index_model()
            raise

    def _index_model(self) -> None:
        """Find the preconditioned layers, the norm layers and the fallback parameters of
        the current groups, and hook the layers (again, after a later add_param_group)."""
        model = self.model
        self._check_params_in_model(model)
        self._param_group = {
            id(p): index for index, g in enumerate(self.param_groups) for p in g["params"]
        }
        self._layers = self._find_layers(model)
        norm_params = {id(p) for g in self.param_groups if g["norm_fisher"] for p in g["params"]}
        self._norm_layers = norm_layers.find_norm_layers(model, lambda p: id(p) in norm_params)
        self._norm_set = set(self._norm_layers)
        sequence_first = sequence_first_modules(model)  # their layers count dimension 1
        self._sequence_first = {x for x in self._layers if id(x.module) in sequence_first}
        self._layer_group = {
            layer: self._param_group[id(layer.weight)] for layer in self._layers + self._norm_layers
        }
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
        for group in self.param_groups:
            for p in group["params"]:
                if id(p) not in in_model:
                    raise ValueError(
                        f"a parameter of shape {tuple(p.shape)} is not a parameter of the model; "
                        "pass params drawn from model.parameters() (or params=None for all)"
                    )

    def _find_layers(self, model: nn.Module) -> list[Layer]:
        """One layer per trained weight of supported modules (several modules sharing a
        weight make one layer; an output head tied to an ``nn.Embedding`` is one layer of
        the head's calls). Weights that other modules hold too, or that a module uses
        without its forward, train with the fallback instead (and so does a layer until
        its first statistics)."""
        trained = {id(p) for g in self.param_groups for p in g["params"]}
        skipped = bypassed_modules(model)
        holders: dict[int, list[tuple[str, nn.Module]]] = {}
        for name, module in model.named_modules():
            for param in module._parameters.values():
                if param is not None:
                    holders.setdefault(id(param), []).append((name, module))
        layers, seen = [], set()
        for name, module in model.named_modules():
            weight = getattr(module, "weight", None)
            if not is_supported(module) or id(weight) not in trained:
                continue
            if weight.numel() == 0:  # no inputs or no outputs: nothing to precondition
                continue
            if id(weight) in seen or id(module) in skipped or id(weight) in skipped:
                continue
            seen.add(id(weight))
            sharing = holders[id(weight)]
            if any(type(m) is not type(module) and not _tied_embedding(m) for _, m in sharing):
                continue  # tied to another kind of module: the fallback trains it
            modules = tuple(m for _, m in sharing if type(m) is type(module))
            biases = {id(m.bias) if m.bias is not None else None for m in modules}
            bias = module.bias if len(biases) == 1 and id(module.bias) in trained else None
            if bias is not None and not bias.requires_grad:
                bias = None  # frozen now: outside the factor, the fallback if unfrozen
            layer = Layer(name or type(module).__name__, module, weight, bias, modules)
            if (
                bias is not None
                and self._param_group[id(bias)] != self._param_group[id(module.weight)]
            ):
                raise ValueError(
                    f"the weight and bias of layer '{layer.name}' are in different parameter "
                    "groups; a layer is preconditioned as one block, so put both in one group"
                )
            layers.append(layer)
        if not layers:
            supported = ", ".join(c.__name__ for c in SUPPORTED_LAYERS)
            raise ValueError(
                f"the model has no supported layer ({supported}, Hugging Face Conv1D, or a "
                "class given to singd_cuda.register_layer_kind) "
                f"whose weight is trained by this optimizer; {type(self).__name__} needs at least "
                "one (for a model without any, use torch.optim.AdamW)"
            )
        return layers

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
    def _wants_statistics(self, layer: Layer) -> bool:
        return self._group_wants_statistics(self.group_of(layer))

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

    def _loss_terms(self, layer: Layer, output: Tensor) -> int:
        """The loss terms one call's output covers (its samples along the batch dimension,
        or samples x positions).

        With ``batch_dim=None`` a layer of a sequence-first transformer layer counts
        dimension 1 and sets the capture's ``model_batch``; any other layer counts
        dimension 0 and warns once when its output looks sequence-first against
        ``model_batch`` (:func:`~singd_cuda.curvature.layers.misplaced_batch`)."""
        group = self.group_of(layer)
        loss_average = group["loss_average"]
        if layer in self._norm_set:
            return norm_layers.num_terms(layer.module, output, loss_average)
        batch_dim = group["batch_dim"]
        if batch_dim is not None:
            return loss_terms(layer, output, loss_average, batch_dim)
        capture = self._capture
        if layer in self._sequence_first:
            batch = samples(layer, output, 1)
            if capture.model_batch not in (None, batch) and -1 not in self._batch_checked:
                self._batch_checked.add(-1)  # once per optimizer
                warnings.warn(
                    f"{type(self).__name__}: the model input's dimension 0 "
                    f"({capture.model_batch}) is not the batch ({batch}) its sequence-first "
                    "transformer layers see; the other layers count dimension 0. If the "
                    "model's data is sequence-first, pass batch_dim=1 (README, 'What counts "
                    "as curvature')",
                    RuntimeWarning,
                    stacklevel=2,
                )
            capture.model_batch = batch
            return loss_terms(layer, output, loss_average, 1)
        if capture.model_batch is not None and id(layer.weight) not in self._batch_checked:
            self._batch_checked.add(id(layer.weight))  # the first call says it
            if misplaced_batch(layer, output, 0, capture.model_batch):
                self._warn_misplaced_batch(layer, output, capture.model_batch)
        return loss_terms(layer, output, loss_average, 0)

    def _warn_misplaced_batch(self, layer: Layer, output: Tensor, batch: int) -> None:
        warnings.warn(
            f"{type(self).__name__}: layer '{layer.name}' counts its samples along dimension "
            f"0 of its output {tuple(output.shape)}, but the model's batch is {batch}, the "
            "size of another dimension: if the layer's data is sequence-first (positions, "
            "batch, features), pass batch_dim=1 (for the optimizer, or in a parameter group "
            "of those layers); batch_dim=0 keeps dimension 0 without this check (README, "
            "'What counts as curvature')",
            RuntimeWarning,
            stacklevel=2,
        )

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
        √L). True: the call counts."""
        group = self.group_of(layer)
        dtype = accumulation_dtype(layer.weight.dtype)
        if layer in self._norm_set:
            loss_average = group["loss_average"]
            F = norm_layers.norm_statistic(layer, layer_input, grad_output, loss_average, dtype)
            if loss_average is not None:  # raw: without the √L the statistic carries
                F.mul_(1.0 / max(norm_layers.num_terms(layer.module, grad_output, loss_average), 1))
            merge_statistics(into, {"out": F})
            return True
        rule = self.rule_for(group)
        device = grad_output.device
        if rule.diagonal_statistics(group) and not (
            self._sync is not None and self._sync.distribute_factors
        ):
            if with_input:
                h = input_sum_squares(layer, layer_input, dtype).mul_(weight)
            else:
                h = torch.zeros(layer.dim_in, dtype=dtype, device=device)
            s = grad_output_sum_squares(layer, grad_output, dtype)
            rule.accumulate_diagonal(layer, group, self._layer_state(layer, group), into, h, s)
            return True
        if with_input:
            a = input_matrix(layer, layer_input, dtype).mul_(math.sqrt(weight))
        else:  # no rows: the rules add nothing to the input side
            a = torch.zeros(0, layer.dim_in, dtype=dtype, device=device)
        g = grad_output_matrix(layer, grad_output, dtype)
        self._accumulate(layer, group, into, a, g)
        return True

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
        for layer in layers:
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
        if self.grad_scaler is not None:
            return None, self.grad_scaler.get_scale() * torch.ones((), device="cpu"), found_inf
        if self._capture.committed:
            raise ValueError(
                "scaler.unscale_(optimizer) was called before step, so the optimizer cannot "
                "see the loss scale its curvature statistics carry; pass grad_scaler=scaler "
                f"to {type(self).__name__}(...)"
            )
        return None, None, found_inf

    # ---------------------------------------------------------------- step
    # torch.compile(opt.step) runs the step eagerly: its work is fused C++ ops and
    # bookkeeping in Python (tensor values decide what runs), which Dynamo would break up
    @torch.compiler.disable(reason=STEP_NOT_COMPILED)
    @torch.no_grad()
    def step(self, closure: Callable[[], Tensor] | None = None) -> Tensor | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        try:
            hyperparameters.check_step(self)  # param_groups edited since the last step
            self._step()
        except BaseException:
            # leave nothing stale behind: a GradScaler deletes its loss scale after a
            # step that returns, not after one that raises
            self.__dict__.pop("grad_scale", None)
            self.__dict__.pop("found_inf", None)
            self._skip("")
            raise
        return loss

    def _step(self) -> None:
        if self._capture.taken_over:
            raise RuntimeError(
                f"{type(self).__name__}: a newer optimizer on the same model took over its "
                "layers, so this one captures no curvature any more; use one optimizer per "
                "layer (remove_hooks() on an optimizer releases its layers)"
            )
        grad_scale, stats_scale, found_inf = self._loss_scale()
        self._pending = self._normalised_statistics(stats_scale)
        if self._sync is not None:  # average first, so that every rank decides alike
            grad_scale, found_inf = self._synchronise(grad_scale, found_inf)
        # states created by statistics that were discarded before the step (zero_grad)
        self._restore_created([layer for layer in self._created if layer not in self._pending])
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        if any(p.grad is not None and p.grad.is_sparse for p in self._fallback_params):
            raise RuntimeError(
                f"{type(self).__name__} does not support sparse gradients (an nn.Embedding "
                "or nn.EmbeddingBag with sparse=True): use sparse=False, or train those "
                "parameters with torch.optim.SparseAdam and leave them out of params="
            )
        # every check raises a flag on the device; the step reads them once, after the
        # factor updates (undone when a flag is raised), before any parameter is written
        self._finite.reset()
        if found_inf is not None:
            self._finite.flag(found_inf.device, _SCALER).copy_(found_inf.reshape(1))
        else:
            local = grads if self._sync is None else self._sync.local_tensors(grads)
            self._finite.check(local, _GRADIENT)
        self._finite.check(tensors_of(self._pending), _STATISTICS)
        with_grad = [  # those with a gradient (a frozen weight's trained bias counts)
            layer for layer in self._layers if any(p.grad is not None for p in layer.params)
        ]
        # Before any model forward no layer can have had statistics, so none waits for
        # them: torch.distributed.checkpoint builds a fresh optimizer's state template by one
        # step with zero gradients (_init_optim_state), and the layers then take the factor
        # state a checkpoint holds.
        waiting = [layer for layer in with_grad if self._seen_forward and not self._started(layer)]
        with_grad = [layer for layer in with_grad if layer not in waiting]
        layers = [layer for layer in with_grad if self._sync is None or self._sync.owns(layer)]
        if self._shards() is not None and any(g["weight_rescale"] for g in self.param_groups):
            raise NotImplementedError(  # before any state changes
                "weight_rescale=True is not supported with FSDP2-sharded parameters"
            )
        self._update_factors(layers)
        if self._sync is not None:
            self._sync.agree(self._finite)  # sharded tensors differ between ranks
        reason = self._finite.verdict()
        if reason is not None:
            self._undo.restore()
            return self._skip(self._skip_message(reason))
        self._undo.clear()
        if waiting:
            self._warn_waiting(waiting)
        for group in self.param_groups:
            recipe.momentum_from_ratio(group)
        if self._shards() is not None:  # every rank updates its rows of every layer
            self._sharded_layer_step(with_grad, grad_scale)
            self._fallback_step(grad_scale, [p for layer in waiting for p in layer.params])
        else:
            fused: dict[int, list[Layer]] = {}
            for layer in layers:
                self._layer_step(layer, grad_scale, fused)
            self._fused_apply(fused, grad_scale)
            owned = [layer for layer in waiting if self._sync is None or self._sync.owns(layer)]
            self._fallback_step(grad_scale, [p for layer in owned for p in layer.params])
            if self._sync is not None:
                self._sync.share_parameters()
        self._norm_step(grad_scale)
        self._fallback_step(grad_scale, self._fallback_params)
        for group in self.param_groups:
            group["step"] += 1
        self._forget_statistics()
        return None

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

    def _skip_message(self, reason: int) -> str:
        """The warning (or error) of a step skipped for ``reason`` ('' for the GradScaler's
        routine skip)."""
        name = type(self).__name__
        if reason == _SCALER:
            return ""  # the GradScaler skips and backs off; that is routine
        if reason == _GRADIENT:
            return (
                f"{name}: non-finite gradient, step skipped and statistics dropped (use "
                "torch.amp.GradScaler for fp16; nonfinite='raise' to raise)"
            )
        if reason == _STATISTICS:
            return (
                f"{name}: non-finite curvature statistics (an overflow in the layer inputs "
                "or output gradients), step skipped and no state changed; use a GradScaler "
                "or float32 statistics (nonfinite='raise' to raise)"
            )
        return (
            f"{name}: a factor update produced non-finite values, step skipped and every "
            "factor restored (use float32 factor_dtype or a larger damping; "
            "nonfinite='raise' to raise)"
        )

    def _forget_statistics(self) -> None:
        self._created.clear()
        self._pending = {}
        self._undo.clear()
        self._capture.reset()

    def _normalised_statistics(self, stats_scale: Tensor | None) -> dict[Layer, dict]:
        """The committed statistics as those of one batch: the input side divided by the
        loss terms w of every counted forward, the output side multiplied by them (for a
        loss averaged over its terms), and the loss scale removed. Layers whose forwards
        held no sample (w = 0) have none."""
        pending = {}
        # (factor, scaled by the loss scale) -> statistics: one multiply per group below
        scaled: dict[tuple[float, bool], list] = {}
        for layer, committed in self._capture.committed.items():
            statistics = committed.statistics
            if committed.terms <= 0 or not statistics:
                continue
            terms = committed.terms
            if "in" in statistics:  # norm layers have no input side
                scaled.setdefault((1.0 / terms, False), []).append(statistics["in"])
            out_factor = 1.0 if self.group_of(layer)["loss_average"] is None else terms
            scaled.setdefault((out_factor, stats_scale is not None), []).append(statistics["out"])
            pending[layer] = statistics
        for (factor, by_loss_scale), group in scaled.items():
            if factor != 1.0 or by_loss_scale:
                self._scale_(group, factor, stats_scale if by_loss_scale else None)
        return pending

    def _scale_(self, statistics: list, factor: float, loss_scale: Tensor | None) -> None:
        """statistic *= factor / loss_scale² for each of ``statistics`` (tensors or
        structured matrices): one multi-tensor multiply per (device, dtype) for those
        held in their accumulation dtype, by a 0-dim tensor kept between steps (a Python
        scalar would allocate one per call; the loss scale stays on the device, unread)."""
        fused: dict[tuple, list[Tensor]] = {}
        for statistic in statistics:
            parts = list(tensors_of(statistic))
            key = (statistic.device, accumulation_dtype(statistic.dtype))
            if all(part.dtype == key[1] for part in parts):
                fused.setdefault(key, []).extend(parts)
            else:  # low-precision parts: their own rounding on store
                statistic.mul_(self._scalar(key, factor, loss_scale))
        for key, tensors in fused.items():
            torch._foreach_mul_(tensors, self._scalar(key, factor, loss_scale))

    def _scalar(self, key: tuple, factor: float, loss_scale: Tensor | None) -> Tensor:
        """factor / loss_scale² as a 0-dim tensor of ``key`` = (device, dtype), reused."""
        if len(self._scalars) > 64:  # many distinct loss-term counts: start over
            self._scalars.clear()
        full_key = (*key, factor, loss_scale is not None)
        scalar = self._scalars.get(full_key)
        if scalar is None:
            scalar = self._scalars[full_key] = torch.zeros((), dtype=key[1], device=key[0])
        if loss_scale is None:
            return scalar.fill_(factor)
        return scalar.copy_(loss_scale.reshape(())).reciprocal_().square_().mul_(factor)

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
        """Update the factors of ``layers`` from this step's statistics, saving what they
        overwrite in ``self._undo``, and flag a non-finite result (the step restores)."""
        updated = [layer for layer in layers if layer in self._pending]
        states = [self._layer_state(layer, self.group_of(layer)) for layer in updated]
        self._undo.save(states)
        stacks: dict[tuple, list[tuple[Layer, dict, dict]]] = {}
        for layer, state in zip(updated, states, strict=True):
            pending = self._pending[layer]
            group = self.group_of(layer)
            rule = self.rule_for(group)
            if self._sync is not None and self._sync.distribute_factors:
                rule.finish_shared(layer, group, state, pending)
            if not rule.start_factors(layer, group, state, pending):
                continue  # the statistics cannot start this layer's factors yet
            key = rule.group_key(layer, group, state)
            key = (self._layer_group[layer], id(layer) if key is None else key)
            stacks.setdefault(key, []).append((layer, state, pending))
        for (index, _), members in stacks.items():
            group = self.param_groups[index]
            stacked_layers, states, pendings = (
                list(column) for column in zip(*members, strict=True)
            )
            self.rule_for(group).update_factors_many(
                stacked_layers, group, states, pendings, group["step"]
            )
        self._finite.check(self._undo.updated(), _FACTORS)

    def _layer_step(
        self, layer: Layer, grad_scale: Tensor | None, fused: dict[int, list[Layer]]
    ) -> None:
        """Update the layer's parameters now, or queue it in ``fused`` (by group index)
        when its rule updates many layers in one pass."""
        group = self.group_of(layer)
        rule = self.rule_for(group)
        state = self.state[layer.weight]
        if not state:
            rule.init_state(layer, group, state)
        if rule.fuses_apply(group):
            fused.setdefault(self._layer_group[layer], []).append(layer)
            return
        G = gradient_matrix(layer, accumulation_dtype(layer.weight.dtype))
        if grad_scale is not None:
            G = G / grad_scale.to(G.device, G.dtype)
        states = [self.state[p] for p in layer.params]
        rule.apply(layer, group, states, G, group["step"], self._seed(group, layer.weight))
        if group["weight_rescale"]:
            recipe.rescale_weight_(layer.weight)

    def _fused_apply(self, fused: dict[int, list[Layer]], grad_scale: Tensor | None) -> None:
        """One fused pass per parameter group over the queued layers (diagonal paths)."""
        inv_scale = None
        for index, layers in fused.items():
            group = self.param_groups[index]
            if grad_scale is not None and inv_scale is None:
                inv_scale = grad_scale.to(layers[0].weight.device, torch.float32).reciprocal()
            states = [[self.state[p] for p in layer.params] for layer in layers]
            seed = self._seed(group, layers[0].weight)
            self.rule_for(group).apply_many(layers, group, states, inv_scale, group["step"], seed)
            if group["weight_rescale"]:
                for layer in layers:
                    recipe.rescale_weight_(layer.weight)

    def _shards(self):
        """The FSDP2 part of the step (:class:`~singd_cuda.distributed.fsdp.RowShards`),
        or None when the parameters are not sharded."""
        return None if self._sync is None else self._sync.shards

    def _sharded_layer_step(self, layers: list[Layer], grad_scale: Tensor | None) -> None:
        """Every rank updates its rows of every layer (FSDP2; the owner of a layer, or
        every rank, preconditions)."""
        entries = []
        for layer in layers:
            group = self.group_of(layer)
            rule = self.rule_for(group)
            if self._sync.owns(layer) and not self.state[layer.weight]:
                rule.init_state(layer, group, self.state[layer.weight])
            states = [self.state[p] for p in layer.params]
            seed = self._seed(group, layer.weight)
            entries.append(
                self._shards().entry(layer, rule, group, states, seed, self._sync.owner_of(layer))
            )
        inv_scale = None
        if grad_scale is not None:
            inv_scale = grad_scale.to(self._layers[0].weight.device, torch.float32).reciprocal()
        self._shards().step(entries, inv_scale)

    def _seed(self, group: dict, param: Tensor) -> int:
        """Stochastic-rounding seed of an op call whose first tensor is ``param``.

        A pure function of (step, parameter), so a resumed checkpoint replays bit for bit;
        the op hashes it with each tensor's position in its list, so that every parameter
        draws its own random bits.
        """
        return group["step"] * 1_000_003 + self._param_index[id(param)]

    def _norm_step(self, grad_scale: Tensor | None) -> None:
        """Normalisation-layer affine parameters under ``norm_fisher``: momentum SGD on
        grad / (F + norm_damping), F the diagonal empirical Fisher of the last update step."""
        shards = self._shards()
        for layer in self._norm_layers:
            group = self.group_of(layer)
            states = [self.state[p] for p in layer.params]
            pending = self._pending.get(layer)
            if pending is not None:
                norm_fisher.store_fisher(layer, states, pending["out"])
            damping = scheduled(group["norm_damping"], group["step"])
            view = layer if shards is None else shards.view(layer)  # FSDP2: this rank's rows
            rows = None if shards is None else view.rows
            directions = [
                None
                if param.grad is None
                else norm_fisher.preconditioned(
                    _unscaled(param.grad, grad_scale), state, damping, rows
                )
                for param, state in zip(view.params, states, strict=True)
            ]
            sgd_update_(view.params, directions, states, group, self._seed(group, layer.weight))

    def _fallback_step(self, grad_scale: Tensor | None, params: list[Tensor]) -> None:
        """AdamW on those of ``params`` that have a gradient, one write per group."""
        by_group: dict[int, list[Tensor]] = {}
        for p in params:
            if p.grad is not None:
                by_group.setdefault(self._param_group[id(p)], []).append(p)
        shards = self._shards()
        for index, params in by_group.items():
            group = self.param_groups[index]
            states = [self.state[p] for p in params]
            seed = self._seed(group, params[0])
            grads = [p.grad for p in params]
            if shards is not None:  # FSDP2: the shards, as torch.optim.AdamW updates them
                params, grads = [shards.local(p) for p in params], [shards.local(g) for g in grads]
            grads = [_unscaled(g, grad_scale) for g in grads]
            adamw_update_(
                params,
                grads,
                states,
                lr=group["lr"] if group["fallback_lr"] is None else group["fallback_lr"],
                betas=group["fallback_betas"],
                eps=group["fallback_eps"],
                weight_decay=group["fallback_weight_decay"],
                stochastic_rounding=group["stochastic_rounding"],
                seed=seed,
            )

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
        (another optimizer, model, structure; :mod:`.checkpoint`).
        """
        state_dict = checkpoint.by_index(state_dict)  # DCP's set_optimizer_state_dict: names
        foreign = set()
        if self._shards() is not None:  # FSDP2: a rank holds the rows of layers it does not own
            foreign = {id(p) for p in self._sync.foreign_params()}
        checkpoint.check_fits(self, state_dict, buffers_only=foreign)
        self._check_norm_fisher_kept(state_dict)
        groups = state_dict["param_groups"]
        state_dict = {
            **state_dict,
            "param_groups": [
                checkpoint.with_added_hyperparameters(saved, group)
                for saved, group in zip(groups, self.param_groups, strict=True)
            ],
        }
        saved = state_dict["state"]
        super().load_state_dict({k: v for k, v in state_dict.items() if k != checkpoint.KIND_KEY})
        for group in self.param_groups:  # the loaded hyperparameters are the ones in use
            hyperparameters.accept(self, group)
        params = [p for g in self.param_groups for p in g["params"]]
        for index, param_state in saved.items():
            param = params[index]
            self.state[param] = _keep_dtypes(
                saved_value=param_state, loaded=self.state[param], device=param.device
            )
        if self._sync is not None:  # distribute_factors: this rank's layers; FSDP2: rows
            self._sync.keep_own_state(self.state)

    def _check_norm_fisher_kept(self, state_dict: dict[str, Any]) -> None:
        """A checkpoint past its first step holds the norm Fisher of every norm layer
        that has state; DCP's sharded load fills only the entries a fresh optimizer's
        state_dict has, which lack it."""
        params = [p for g in self.param_groups for p in g["params"]]
        index = {id(p): i for i, p in enumerate(params)}
        states = state_dict["state"]
        for layer in self._norm_layers:
            state = states.get(index[id(layer.weight)])
            if state and "fisher_diag" not in state and "momentum_buffer" in state:
                raise checkpoint.CheckpointMismatchError(
                    f"the state of norm layer '{layer.name}' lacks its norm Fisher "
                    "('fisher_diag'): torch.distributed.checkpoint's sharded load fills only "
                    "the entries of a fresh optimizer; load norm_fisher=True optimizers from "
                    "a full state (get_optimizer_state_dict(..., full_state_dict=True) or "
                    "opt.full_state_dict())"
                )

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


def _unscaled(grad: Tensor, grad_scale: Tensor | None) -> Tensor:
    """grad / grad_scale in the accumulation dtype of grad's dtype (float32 for half types)."""
    grad = upcast(grad)
    return grad if grad_scale is None else grad / grad_scale.to(grad.device, grad.dtype)


def _tied_embedding(module: nn.Module) -> bool:
    """An ``nn.Embedding`` whose weight a matmul layer may share (an input embedding tied
    to the output head): its dense row gradients add to the head's, and the head's calls
    give the statistics. Sparse gradients and ``max_norm`` (which rewrites the weight in
    the forward) keep the weight with the fallback."""
    return isinstance(module, nn.Embedding) and not module.sparse and module.max_norm is None


def sgd_update_(
    params: list[Tensor],
    directions: list[Tensor | None],
    states: list[dict],
    group: dict,
    seed: int,
) -> None:
    """Momentum SGD with coupled weight decay on the parameters that have a gradient (the
    others, e.g. a bias frozen after construction, are left alone), in one
    :func:`singd_cuda.ops.sgd_epilogue_` call with the group's ``lr``, ``momentum``,
    ``weight_decay`` and ``stochastic_rounding``.

    Args:
        params: the parameters, any shapes, float32/bfloat16/float16/float64.
        directions: the unscaled preconditioned gradients, shaped like ``params``, in
            any floating dtype (used in the parameter's accumulation dtype: float32 for
            half types); ignored (may be None) for parameters without a gradient.
        states: the parameters' states; the momentum buffer ``state["momentum_buffer"]``
            (the parameter's dtype) is created as zeros when missing and momentum != 0.
        seed: the stochastic-rounding seed of the call.
    """
    trained = [
        (p, upcast(d, p.dtype), s)
        for p, d, s in zip(params, directions, states, strict=True)
        if p.grad is not None
    ]
    if not trained:
        return
    momentum = group["momentum"]
    bufs = []
    if momentum != 0.0:
        for p, _, s in trained:
            if "momentum_buffer" not in s:
                s["momentum_buffer"] = torch.zeros_like(p)
            bufs.append(s["momentum_buffer"])
    ops.sgd_epilogue_(
        [p for p, _, _ in trained],
        [d for _, d, _ in trained],
        bufs,
        lr=group["lr"],
        momentum=momentum,
        weight_decay=group["weight_decay"],
        stochastic_rounding=group["stochastic_rounding"],
        seed=seed,
    )


def _keep_dtypes(saved_value: Any, loaded: Any, device: torch.device) -> Any:
    if isinstance(saved_value, Tensor):
        return (
            saved_value.to(device=device, copy=True) if saved_value.is_floating_point() else loaded
        )
    if isinstance(saved_value, dict):
        return {k: _keep_dtypes(v, loaded[k], device) for k, v in saved_value.items()}
    return loaded


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
