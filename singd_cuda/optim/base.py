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

Under torch.distributed a :class:`~singd_cuda.distributed.Synchronizer` averages
gradients (plain models) and statistics once per step, before any decision, and
with ``distribute_factors`` each rank steps only the layers it owns (see
:mod:`singd_cuda.distributed.synchronizer`).
"""

from __future__ import annotations

import math
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from .. import ops
from ..curvature.capture import CurvatureCapture
from ..curvature.layers import (
    LOSS_AVERAGES,
    SUPPORTED_LAYERS,
    Layer,
    bypassed_modules,
    grad_output_matrix,
    grad_output_sum_squares,
    gradient_matrix,
    input_matrix,
    input_sum_squares,
    is_supported,
)
from ..distributed import comm as dist_comm
from ..distributed import norm_fisher, recipe
from ..distributed.ownership import layer_cost
from ..distributed.synchronizer import DEFAULT_BUCKET_CAP_MB, Synchronizer
from ..structures.base import accumulation_dtype, upcast
from . import summary
from .fallback import adamw_update_

Schedule = float | Callable[[int], float]


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


class KroneckerOptimizer(Optimizer):
    """Base class; subclasses provide defaults and pick a :class:`LayerRule` per group."""

    _step_supports_amp_scaling = True  # GradScaler hands us grad_scale / found_inf
    common_defaults: ClassVar[dict[str, Any]] = dict(
        loss_average="batch",
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
        model, ddp_wrapped = dist_comm.unwrap(model)  # hooks go on the inner module
        self.model = model
        self.grad_scaler = grad_scaler
        self.nonfinite = nonfinite
        if params is None:
            params = [p for p in model.parameters() if p.requires_grad]
        super().__init__(params, {**self.common_defaults, **defaults, "step": 0})
        self._pending: dict[Layer, dict] = {}
        self._created: list[Tensor] = []  # states first created by this step's statistics
        self._finite_buffers: dict[torch.device, tuple[Tensor, Tensor]] = {}
        self._capture: CurvatureCapture | None = None
        self._index_model()
        self._sync: Synchronizer | None = None
        if dist_comm.is_active(process_group):
            costs = [
                layer_cost(self.rule_for(g).factor_structures(g), layer.dim_in, layer.dim_out)
                for layer in self._layers
                for g in [self.group_of(layer)]
            ]
            self._sync = Synchronizer(
                model,
                self._layers,
                costs,
                process_group=process_group,
                distribute_factors=distribute_factors,
                bucket_cap_mb=bucket_cap_mb,
                ddp_wrapped=ddp_wrapped,
            )

    # ---------------------------------------------------------------- set-up
    @abstractmethod
    def rule_for(self, group: dict) -> LayerRule:
        """The layer rule of a parameter group."""

    def validate_group(self, group: dict) -> None:
        """Raise ValueError for invalid hyperparameters of a group (extended by subclasses)."""
        for key in ("lr", "weight_decay", "fallback_weight_decay", "fallback_eps"):
            value = group[key]
            if not callable(value) and not (isinstance(value, int | float) and value >= 0):
                raise ValueError(f"{key} must be a number >= 0, got {value!r}")
        if group["fallback_lr"] is not None and group["fallback_lr"] < 0:
            raise ValueError(f"fallback_lr must be >= 0 or None, got {group['fallback_lr']!r}")
        betas = group["fallback_betas"]
        if not (
            isinstance(betas, tuple | list)
            and len(betas) == 2
            and all(isinstance(b, int | float) and 0.0 <= b < 1.0 for b in betas)
        ):
            raise ValueError(f"fallback_betas must be a pair of numbers in [0, 1), got {betas!r}")
        if group["loss_average"] not in LOSS_AVERAGES:
            raise ValueError(
                f"loss_average must be one of {LOSS_AVERAGES}, got {group['loss_average']!r}"
            )
        dtype = group["factor_dtype"]
        if dtype is not None and dtype not in (
            torch.float64,
            torch.float32,
            torch.bfloat16,
            torch.float16,
        ):
            raise ValueError(
                f"factor_dtype must be None or one of torch.float64, float32, bfloat16, float16; "
                f"got {dtype!r}"
            )
        check_positive(group, "norm_damping")
        ratio = group["momentum_lr_ratio"]
        if ratio is not None and not (isinstance(ratio, int | float) and ratio >= 0):
            raise ValueError(f"momentum_lr_ratio must be None or a number >= 0, got {ratio!r}")

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
        self._norm_layers = norm_fisher.find_norm_layers(model, lambda p: id(p) in norm_params)
        self._norm_set = set(self._norm_layers)
        self._layer_group = {
            layer: self._param_group[id(layer.weight)] for layer in self._layers + self._norm_layers
        }
        self._statistics_groups = sorted(set(self._layer_group.values()))
        in_layers = {id(p) for layer in self._layers + self._norm_layers for p in layer.params}
        self._fallback_params = [
            p for g in self.param_groups for p in g["params"] if id(p) not in in_layers
        ]
        if self._capture is not None:
            self._capture.remove()
        self._capture = CurvatureCapture(
            model,
            self._layers + self._norm_layers,
            self._wants_statistics,
            self._on_statistics,
            self._any_wants_statistics,
        )
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
        trained = {id(p) for g in self.param_groups for p in g["params"]}
        bypassed = bypassed_modules(model)
        layers = []
        for name, module in model.named_modules():
            if not is_supported(module) or id(module.weight) not in trained:
                continue
            if id(module) in bypassed:  # its forward never runs: the fallback trains it
                continue
            bias = module.bias if module.bias is not None and id(module.bias) in trained else None
            layer = Layer(name or type(module).__name__, module, module.weight, bias)
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
                f"the model has no supported layer ({supported}) "
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
        return self.param_groups[self._layer_group[layer]]

    # ---------------------------------------------------------- statistics
    def _wants_statistics(self, layer: Layer) -> bool:
        return self._group_wants_statistics(self.group_of(layer))

    def _any_wants_statistics(self) -> bool:
        """Whether some layer takes statistics this step (one check per group with layers)."""
        groups = map(self.param_groups.__getitem__, self._statistics_groups)
        return any(map(self._group_wants_statistics, groups))

    def _group_wants_statistics(self, group: dict) -> bool:
        return group["step"] % self.update_period(group) == 0

    def update_period(self, group: dict) -> int:
        """T for the group's current step (T may be a callable of the step)."""
        period = int(scheduled(group["T"], group["step"]))
        if period < 1:
            raise ValueError(f"T must be >= 1, got {period}")
        return period

    def _on_statistics(
        self, layer: Layer, layer_input: Tensor, grad_output: Tensor, with_input: bool = True
    ) -> None:
        group = self.group_of(layer)
        dtype = accumulation_dtype(layer.weight.dtype)
        pending = self._pending.setdefault(layer, {})
        if layer in self._norm_set:
            F = norm_fisher.norm_statistic(
                layer, layer_input, grad_output, group["loss_average"], dtype
            )
            pending["out"] = pending["out"].add_(F) if "out" in pending else F
            return
        rule = self.rule_for(group)
        if (
            with_input
            and rule.diagonal_statistics(group)
            and not (self._sync is not None and self._sync.distribute_factors)
        ):
            h = input_sum_squares(layer, layer_input, dtype)
            s = grad_output_sum_squares(layer, grad_output, group["loss_average"], dtype)
            rule.accumulate_diagonal(layer, group, self._layer_state(layer, group), pending, h, s)
            return
        a = input_matrix(layer, layer_input, dtype) if with_input else None
        g = grad_output_matrix(layer, grad_output, group["loss_average"], dtype)
        self._accumulate(layer, group, pending, a, g)

    def _layer_state(self, layer: Layer, group: dict) -> dict:
        state = self.state[layer.weight]
        if not state:
            self.rule_for(group).init_state(layer, group, state)
            self._created.append(layer.weight)  # a skipped step removes it again
        return state

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
            return {"out": norm_fisher.empty_norm_statistic(layer, dtype, device)}
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
        if self._pending:
            raise ValueError(
                "scaler.unscale_(optimizer) was called before step, so the optimizer cannot "
                "see the loss scale its curvature statistics carry; pass grad_scaler=scaler "
                f"to {type(self).__name__}(...)"
            )
        return None, None, found_inf

    def _grads_finite(self) -> bool:
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        if not grads:
            return True
        groups: dict[tuple, list[Tensor]] = {}
        for g in grads:
            groups.setdefault((g.device, g.dtype, g.is_sparse), []).append(g)
        found_on: dict[torch.device, Tensor] = {}
        for (device, _, sparse), tensors in groups.items():
            if sparse:
                if not all(bool(torch.isfinite(g.coalesce().values()).all()) for g in tensors):
                    return False
                continue
            if device not in found_on:
                found_on[device] = self._found_buffer(device)
            # one fused pass, no gradient-sized temporaries (multiplies by exactly 1)
            found, one = found_on[device]
            torch._amp_foreach_non_finite_check_and_unscale_(tensors, found, one)
        return not any(bool(found) for found, _ in found_on.values())

    def _found_buffer(self, device: torch.device) -> tuple[Tensor, Tensor]:
        """Reused (found_inf, 1.0) pair of :meth:`_grads_finite` (no allocation per step)."""
        buffers = self._finite_buffers
        if device not in buffers:
            buffers[device] = (torch.zeros(1, device=device), torch.ones(1, device=device))
        found, one = buffers[device]
        found.zero_()
        return found, one

    def _skip(self, reason: str) -> None:
        """Drop this step's statistics (and any state they created); change nothing else."""
        for param in self._created:
            self.state.pop(param, None)
        self._created.clear()
        self._pending.clear()
        self._capture.reset()
        if reason:
            if self.nonfinite == "raise":
                raise FloatingPointError(reason)
            warnings.warn(reason, RuntimeWarning, stacklevel=3)

    # ---------------------------------------------------------------- step
    @torch.no_grad()
    def step(self, closure: Callable[[], Tensor] | None = None) -> Tensor | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_scale, stats_scale, found_inf = self._loss_scale()
        if self._sync is not None:  # average first, so that every rank decides alike
            self._normalise_statistics(stats_scale)
            stats_scale = None
            grad_scale, found_inf = self._synchronise(grad_scale, found_inf)
        if found_inf is not None and bool(found_inf.item()):
            self._skip("")  # the GradScaler skips and backs off; that is routine
            return loss
        if found_inf is None and not self._grads_finite():
            self._skip(
                f"{type(self).__name__}: non-finite gradient, step skipped and statistics "
                "dropped (use torch.amp.GradScaler for fp16; nonfinite='raise' to raise)"
            )
            return loss
        if self._sync is None:
            self._normalise_statistics(stats_scale)
        for group in self.param_groups:
            recipe.momentum_from_ratio(group)
        fused: dict[int, list[Layer]] = {}
        for layer in self._layers:
            if self._sync is None or self._sync.owns(layer):
                self._layer_step(layer, grad_scale, fused)
        self._fused_apply(fused, grad_scale)
        if self._sync is not None:
            self._sync.share_parameters()
        self._norm_step(grad_scale)
        self._fallback_step(grad_scale)
        for group in self.param_groups:
            group["step"] += 1
        self._created.clear()
        self._pending.clear()
        self._capture.reset()
        return loss

    def _normalise_statistics(self, stats_scale: Tensor | None) -> None:
        """Sum over k micro-batches → the statistics of one batch of k times the size;
        remove the loss scale from the output-gradient side."""
        micro_batches = max(1, self._capture.micro_batches)
        out_factor = float(micro_batches)
        if stats_scale is not None:
            out_factor = out_factor / float(stats_scale) ** 2
        for pending in self._pending.values():
            if "in" in pending and micro_batches != 1:  # norm layers have no input side
                pending["in"].mul_(1.0 / micro_batches)
            if out_factor != 1.0:
                pending["out"].mul_(out_factor)

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
            self._pending, stat_layers, self._empty_statistics, params, grad_scale, found_inf
        )

    def _layer_step(
        self, layer: Layer, grad_scale: Tensor | None, fused: dict[int, list[Layer]]
    ) -> None:
        """Update the layer's factors; update its parameters now, or queue it in ``fused``
        (by group index) when its rule updates many layers in one pass."""
        if layer.weight.grad is None:
            return  # unused in this step
        group = self.group_of(layer)
        rule = self.rule_for(group)
        state = self.state[layer.weight]
        if not state:
            rule.init_state(layer, group, state)
        pending = self._pending.get(layer)
        if pending is not None:
            if self._sync is not None and self._sync.distribute_factors:
                rule.finish_shared(layer, group, state, pending)
            rule.update_factors(layer, group, state, pending, group["step"])
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
        for layer in self._norm_layers:
            group = self.group_of(layer)
            states = [self.state[p] for p in layer.params]
            pending = self._pending.get(layer)
            if pending is not None:
                norm_fisher.store_fisher(layer, states, pending["out"])
            damping = scheduled(group["norm_damping"], group["step"])
            directions = [
                None
                if param.grad is None
                else norm_fisher.preconditioned(_unscaled(param.grad, grad_scale), state, damping)
                for param, state in zip(layer.params, states, strict=True)
            ]
            sgd_update_(layer.params, directions, states, group, self._seed(group, layer.weight))

    def _fallback_step(self, grad_scale: Tensor | None) -> None:
        """AdamW on the fallback parameters that have a gradient, one write per group."""
        by_group: dict[int, list[Tensor]] = {}
        for p in self._fallback_params:
            if p.grad is not None:
                by_group.setdefault(self._param_group[id(p)], []).append(p)
        for index, params in by_group.items():
            group = self.param_groups[index]
            adamw_update_(
                params,
                [_unscaled(p.grad, grad_scale) for p in params],
                [self.state[p] for p in params],
                lr=group["lr"] if group["fallback_lr"] is None else group["fallback_lr"],
                betas=group["fallback_betas"],
                eps=group["fallback_eps"],
                weight_decay=group["fallback_weight_decay"],
                stochastic_rounding=group["stochastic_rounding"],
                seed=self._seed(group, params[0]),
            )

    # ---------------------------------------------------------- checkpoints
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state; unlike torch.optim, every state tensor keeps its own dtype."""
        saved = state_dict["state"]
        super().load_state_dict(state_dict)
        params = [p for g in self.param_groups for p in g["params"]]
        for index, param_state in saved.items():
            param = params[index]
            self.state[param] = _keep_dtypes(
                saved_value=param_state, loaded=self.state[param], device=param.device
            )
        if self._sync is not None:  # distribute_factors: keep only this rank's layers
            for param in self._sync.foreign_params():
                self.state.pop(param, None)

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

    def remove_hooks(self) -> None:
        """Detach the optimizer from the model (no more statistics are captured)."""
        self._capture.remove()
        if self._sync is not None:
            self._sync.remove()


def _unscaled(grad: Tensor, grad_scale: Tensor | None) -> Tensor:
    """grad / grad_scale in the accumulation dtype of grad's dtype (float32 for half types)."""
    grad = upcast(grad)
    return grad if grad_scale is None else grad / grad_scale.to(grad.device, grad.dtype)


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


def check_positive(group: dict, *keys: str, allow_zero: bool = True) -> None:
    """ValueError unless every key of ``group`` is a (scheduled) number in range."""
    for key in keys:
        value = group[key]
        if callable(value):
            continue
        ok = (
            isinstance(value, int | float)
            and math.isfinite(value)
            and (value >= 0 if allow_zero else value > 0)
        )
        if not ok:
            bound = ">= 0" if allow_zero else "> 0"
            raise ValueError(f"{key} must be a number {bound}, got {value!r}")


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


def validate_common(group: dict, *unit_interval: str) -> None:
    """Damping >= 0, each of ``unit_interval`` in [0, 1), T an integer >= 1 or a callable."""
    check_positive(group, "damping")
    for key in unit_interval:
        if not callable(group[key]) and not 0.0 <= group[key] < 1.0:
            raise ValueError(f"{key} must be in [0, 1), got {group[key]!r}")
    period = group["T"]
    if not callable(period) and not (isinstance(period, int) and period >= 1):
        raise ValueError(f"T must be an integer >= 1 or a callable of the step, got {period!r}")
