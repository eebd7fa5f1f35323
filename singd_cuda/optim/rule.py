"""The math of one method for one layer: what a new method, structure or layer kind
implements.

A :class:`LayerRule` needs four methods: :meth:`~LayerRule.init_state` (create the
factors), :meth:`~LayerRule.accumulate` (add one backward pass's statistics),
:meth:`~LayerRule.update_factors` (from the normalised statistics) and
:meth:`~LayerRule.apply` (precondition and write one layer; a rule that updates a
whole group in one fused pass implements :meth:`~LayerRule.fuses_apply` and
:meth:`~LayerRule.apply_many` instead). Every other method has a
default that suits a dense, per-layer rule; a rule overrides them to stack layers
(:meth:`~LayerRule.group_key`), to fuse a group's update (:meth:`~LayerRule.fuses_apply`),
to take diagonal statistics without materialising a and g, or to support layer
ownership and FSDP2 shards.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Sequence

import torch
from torch import Tensor

from ..curvature.layers import Layer, SquareSums, gradient_matrix, split_matrix
from ..structures.base import accumulation_dtype
from .write import sgd_update_

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

    def open_step(self) -> None:
        """An optimizer step starts. Until :meth:`close_step` only the optimizer's code
        runs, so a rule may trust for the rest of the step what it checked in it (the
        stacked layouts of :class:`~.grouped.ResidentStacks`)."""
        return None

    def close_step(self) -> None:
        """The step ended (or raised): nothing checked in it is trusted any more."""
        return None

    def group_key(self, layer: Layer, group: dict, state: dict) -> Hashable | None:
        """Layers of one parameter group with equal keys update their factors (and, in
        :meth:`apply_many`, precondition) as one stack (:mod:`.grouped`); None: alone."""
        return None

    def group_keys(self, layers: list[Layer], group: dict, states: list[dict]) -> list:
        """:meth:`group_key` of each of ``layers`` (a rule may answer for all at once)."""
        pairs = zip(layers, states, strict=True)
        return [self.group_key(layer, group, state) for layer, state in pairs]

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
        self,
        layer: Layer,
        group: dict,
        states: list[dict],
        G: Tensor,
        step: int,
        seed: int,
        found_inf: Tensor | None = None,
    ) -> None:
        """Precondition G (d_C x d_K, unscaled) and update the layer's parameters.

        ``states`` are the states of ``layer.params`` in order; ``seed`` seeds the
        stochastic rounding of the parameter write (:func:`singd_cuda.ops.sgd_epilogue_`);
        ``found_inf``: None, or a one-element tensor that, when > 0, makes the write
        change nothing (decided on the device, :func:`~.write.sgd_update_` takes it).
        """
        raise NotImplementedError

    def grafts(self, group: dict) -> bool:
        """True when the rule's writes apply the group's ``graft`` (:mod:`.graft`; the
        optimizer refuses a graft the rule does not apply, instead of ignoring it). A rule
        whose :meth:`apply` writes the parameters grafts its directions there with
        ``graft_(layer.params, directions, states, group, found_inf=found_inf,
        grads=split_matrix(layer, G))`` before the write. Under FSDP2 the optimizer grafts
        the rows of :meth:`natural_rows` itself, before :meth:`apply_direction`."""
        return False

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

    def accumulate_diagonal_sums(
        self,
        layer: Layer,
        group: dict,
        state: dict,
        pending: dict,
        sums: SquareSums,
        layer_input: Tensor,
        grad_output: Tensor,
        dtype: torch.dtype,
        weight: float,
    ) -> None:
        """:meth:`accumulate_diagonal` of one layer call, h and s taken by the layer's
        ``sums`` (:class:`~singd_cuda.curvature.layers.SquareSums`) from its input (with
        the call's ``weight``) and raw output gradient, in ``dtype``. A rule that
        multiplies them elementwise may fold that into the two reductions instead."""
        h = sums.inputs(layer_input, dtype, weight)
        self.accumulate_diagonal(layer, group, state, pending, h, sums.outputs(grad_output, dtype))

    def statistic_factors(
        self, layers: list[Layer], group: dict, states: list[dict]
    ) -> tuple[Sequence[Tensor], Sequence[Tensor]]:
        """The elementwise factors of each layer's unscaled statistics
        (:class:`~.statistics.UnscaledDiagonal`), input side and output side, for rules
        that capture them: each a list, or a stack whose rows they are."""
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
        found_inf: Tensor | None = None,
    ) -> None:
        """Precondition and update every layer of ``layers`` (gradients still scaled by
        1/``inv_scale``) in one pass; ``seed`` seeds stochastic rounding; ``found_inf``
        as in :meth:`apply`."""
        raise NotImplementedError

    def start_factors(self, layer: Layer, group: dict, state: dict, pending: dict) -> bool | None:
        """Before each :meth:`update_factors`: a rule whose factors start from the first
        statistics (SINGD's warm start) sets them here; False skips this update (the
        statistics cannot start the factors yet), None skips the whole step as a
        non-finite factor update does (the factors cannot hold the start the statistics
        ask for), both with nothing changed. The default starts nothing."""
        return True

    def started(self, group: dict, states: list[dict]) -> bool:
        """Whether :meth:`start_factors` has nothing to do for any of ``states`` (it would
        return True for each, changing nothing), so a step need not call it per layer.
        The default starts nothing."""
        return True

    def untouched(self, group: dict, states: list[dict], step: int) -> tuple[str, ...]:
        """State entries (top-level keys) that :meth:`update_factors_many` of ``states``
        at ``step`` leaves as they are, so that the step neither saves them for an undo
        nor checks them. The default: none (every entry may change)."""
        return ()

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


def add_statistics(pending: dict, H_in, H_out) -> None:
    """Add one call's statistics of the two sides to a layer's ``pending`` ({"in": H_in,
    "out": H_out}, set by its first call; later calls add in place)."""
    if "in" in pending:
        pending["in"].add_(H_in)
        pending["out"].add_(H_out)
    else:
        pending["in"], pending["out"] = H_in, H_out
