"""What an optimizer step does under torch.distributed.

Per step, at most three collectives (more only when a bucket cap splits them):

1. one bucketed all-reduce (sum) of a packed buffer holding, in this order,
   a few flags (found_inf; which ranks hold each layer's statistics and each
   parameter's gradient), the gradients (plain models only: a DDP model has averaged
   them in the backward already) and, on update steps, the curvature statistics of
   every layer, each rank's normalised (micro-batch and loss-scale free) means over
   its shard. Sums are divided by the number of ranks that contributed, so equal
   shards give exactly the full-batch statistics. No step that needs no statistics
   and no gradients (DDP, between update steps) sends this one.
2. one all-reduce of the step's non-finite flags (four numbers: the GradScaler's
   found_inf, gradients, statistics, factor updates), after the factor updates and
   before anything is written (:meth:`Synchronizer.agree`): a skip is decided by every
   rank or by none. A rank's flags can differ from the others': DDP has averaged the
   gradients before a rank-local hook or edit, only the owner updates a layer's factors
   (``distribute_factors``), an FSDP2 rank checks its shards only.
3. with ``distribute_factors=True``, one bucketed all-gather of the updated
   parameters of each rank's own layers (see :meth:`Synchronizer.share_parameters`).

Every rank runs the same code on the same reduced values, so the other decisions
(which statistics exist) agree everywhere without further messages.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ..curvature.layers import Layer
from ..optim.scale_out import DEFAULT_BUCKET_CAP_MB
from ..structures.base import accumulation_dtype
from . import comm
from .fsdp import SHARDED_KEYS, RowShards, full_state, local, localise_state_
from .ownership import assign_owners
from .packing import (
    Segment,
    all_gather_tensors,
    all_reduce_segments,
    pack_tensor,
    packed_numel,
    statistic_tensors,
    unpack_tensor_,
)


class Synchronizer:
    """Collectives, ownership and full checkpoints for one optimizer (see module doc)."""

    def __init__(
        self,
        model: nn.Module,
        layers: Sequence[Layer],
        costs: Sequence[float],
        *,
        process_group=None,
        distribute_factors: bool = False,
        bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
        ddp_wrapped: bool = False,
        row_local: Sequence[bool] = (),
    ) -> None:
        if not bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb!r}")
        self.group = process_group
        self.rank, self.world_size = comm.rank_and_world(process_group)
        self.distribute_factors = distribute_factors
        self.cap_bytes = int(bucket_cap_mb * 2**20)
        # FSDP2: parameters sharded by rows, gradients averaged by its reduce-scatter
        self.shards = RowShards(model, layers, process_group) if comm.sharded(model) else None
        self.grads_averaged = ddp_wrapped or self.shards is not None  # or a DDP forward seen
        self._hook = model.register_forward_pre_hook(self._note_ddp)
        owners = assign_owners(costs, self.world_size) if distribute_factors else None
        self.owner: dict[Layer, int | None] = (
            dict(zip(layers, owners, strict=True)) if owners else dict.fromkeys(layers, self.rank)
        )
        if self.shards is not None:
            self._check_sharded_ownership()
            for layer, local in zip(layers, row_local or [False] * len(layers), strict=True):
                if local:  # elementwise on shards: every rank keeps the (vector) factors
                    self.owner[layer] = None
        self._layers = list(layers)
        # where the flags are agreed: a device the group's backend reaches (the model's)
        self._device = next((p.device for p in model.parameters()), torch.device("cpu"))

    def _check_sharded_ownership(self) -> None:
        if self.distribute_factors and self.shards.world != self.world_size:
            raise NotImplementedError(
                "distribute_factors=True needs the FSDP shard group to be the optimizer's "
                f"process group ({self.shards.world} shard ranks, {self.world_size} in the "
                "group): with HSDP use distribute_factors=False"
            )

    def _note_ddp(self, module: nn.Module, inputs) -> None:
        if comm.inside_ddp_forward(module):
            self.grads_averaged = True

    def owns(self, layer: Layer) -> bool:
        """Whether this rank updates the factors of ``layer`` (always, unless
        distribute_factors; under FSDP2 every rank does for row-local layers)."""
        return self.owner[layer] in (self.rank, None)

    def owner_of(self, layer: Layer) -> int | None:
        """The rank updating the factors of ``layer``; None: every rank."""
        return self.owner[layer] if self.distribute_factors else None

    def local_tensors(self, tensors: Sequence[Tensor]) -> list[Tensor]:
        """This rank's parts of ``tensors`` (its shards under FSDP2), for finite checks."""
        if self.shards is None:
            return list(tensors)
        return [local(t) for t in tensors]

    def agree(self, check) -> None:
        """Every rank's non-finite flags in ``check`` (a ``FiniteCheck``) raised on every
        rank (collective 2, one all-reduce; every rank calls it at every step, also one
        that raised nothing)."""
        if self.shards is not None:
            self.shards.agree(check)
            return
        flags = check.merged(self._device)
        comm.all_reduce_sum_(flags, self.group)
        check.raise_(flags)

    def refusals(self, refused: bool) -> int:
        """How many ranks of the group refused the checkpoint being loaded (one
        all-reduce of a flag; every rank calls it in every ``load_state_dict``): a rank
        checks only its part of a sharded or owned state, and a rank that loads while
        another refuses would leave the ranks in different states."""
        flag = torch.tensor([float(refused)], device=self._device)
        comm.all_reduce_sum_(flag, self.group)
        return int(flag.item())

    def remove(self) -> None:
        """Remove the hook the synchroniser put on the model."""
        self._hook.remove()

    # ------------------------------------------------------------ collective 1
    def synchronise(
        self,
        statistics: dict[Layer, dict],
        stat_layers: Sequence[Layer],
        empty_statistics,
        params: Sequence[Tensor],
        grad_scale: Tensor | None,
        found_inf: Tensor | None,
        saw_samples: bool = True,
    ) -> tuple[Tensor | None, Tensor | None]:
        """Average gradients (unless DDP did) and the statistics of ``stat_layers``.

        Each is averaged over the ranks that contributed one: a rank with no gradient, or
        whose forwards since the last step held no sample (``saw_samples`` False: an empty
        batch), counts for nothing, exactly like a rank with no statistics.

        ``statistics`` maps layers to their pending statistics and is updated in place:
        a layer no rank captured is dropped, one only others captured is added.
        ``empty_statistics(layer)`` builds a zero statistic of the right layout.
        Returns (grad_scale, found_inf) as they hold afterwards: the gradients averaged
        here are unscaled, so their grad_scale becomes None; found_inf is the logical
        or over the ranks.
        """
        grads = [] if self.grads_averaged else [p for p in params if p.requires_grad]
        if not grads and not stat_layers:
            return grad_scale, found_inf
        device = (grads[0] if grads else stat_layers[0].weight).device
        dtypes = [p.dtype for p in grads] + [layer.weight.dtype for layer in stat_layers]
        wire = accumulation_dtype(*dtypes)
        # flags: [found_inf, has statistics (per layer), has a gradient (per parameter)]
        values = [0.0 if found_inf is None else float(found_inf)]
        local = {}
        for layer in stat_layers:
            present = layer in statistics
            values.append(float(present))
            local[layer] = statistics[layer] if present else empty_statistics(layer)
        first_grad = len(values)
        values += [float(p.grad is not None and saw_samples) for p in grads]
        flags = torch.tensor(values, dtype=wire, device=device)
        counts: list[float] = []  # the summed flags, on the host (one device sync)

        def unpack_flags(flat: Tensor) -> None:
            counts[:] = flat.tolist()

        segments = [Segment(flags.numel(), flags.to, unpack_flags)]
        scale = 1.0 if grad_scale is None else 1.0 / float(grad_scale)
        for j, p in enumerate(grads):
            contributes = saw_samples and p.grad is not None
            segments.append(self._grad_segment(p, contributes, counts, first_grad + j, scale))
        for i, layer in enumerate(stat_layers):
            for key in sorted(local[layer]):
                for tensor, symmetric in statistic_tensors(local[layer][key]):
                    segments.append(self._stat_segment(tensor, symmetric, counts, 1 + i))
        all_reduce_segments(
            segments, dtype=wire, device=device, cap_bytes=self.cap_bytes, group=self.group
        )
        for i, layer in enumerate(stat_layers):
            if counts[1 + i] > 0:
                statistics[layer] = local[layer]
            else:
                statistics.pop(layer, None)
        if counts[0] > 0:
            found_inf = torch.ones((), dtype=torch.float32, device=device)
        elif found_inf is not None:
            found_inf = torch.zeros((), dtype=torch.float32, device=device)
        return (None if grads else grad_scale), found_inf

    @staticmethod
    def _grad_segment(
        p: Tensor, contributes: bool, counts: list[float], flag: int, scale: float
    ) -> Segment:
        def pack(dtype: torch.dtype) -> Tensor:
            if not contributes:
                return torch.zeros(p.numel(), dtype=dtype, device=p.device)
            return p.grad.detach().reshape(-1).to(dtype) * scale

        def unpack(flat: Tensor) -> None:
            if counts[flag] > 0:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                p.grad.copy_(flat.view(p.shape) / counts[flag])

        return Segment(p.numel(), pack, unpack)

    @staticmethod
    def _stat_segment(tensor: Tensor, symmetric: bool, counts: list[float], flag: int) -> Segment:
        def unpack(flat: Tensor) -> None:
            if counts[flag] > 0:
                unpack_tensor_(tensor, symmetric, flat / counts[flag])

        numel = packed_numel(tensor, symmetric)
        return Segment(numel, lambda dtype: pack_tensor(tensor, symmetric, dtype), unpack)

    # ------------------------------------------------------------ collective 2
    def share_parameters(self) -> int:
        """Send each rank's updated layer parameters to the other ranks (an all-gather).

        The owner sends the parameters it has just updated, not the preconditioned
        gradient or the factors: the same bytes as the gradient, so the momentum buffers
        can stay with the owner too, and bitwise-equal replicas on every rank; the
        factors would be larger (d_K² + d_C² for dense) and would have to be replicated.
        """
        if not self.distribute_factors or self.shards is not None:
            return 0  # FSDP2: each rank wrote its own rows
        by_rank: list[list[Tensor]] = [[] for _ in range(self.world_size)]
        for layer in self._layers:
            by_rank[self.owner[layer]].extend(p.data for p in layer.params)
        device = self._layers[0].weight.device
        return all_gather_tensors(
            by_rank, self.rank, device=device, cap_bytes=self.cap_bytes, group=self.group
        )

    # ------------------------------------------------------------ checkpoints
    def owned_param_ids(self) -> set[int]:
        """``id()`` of the parameters of the layers this rank owns (all of them unless
        ``distribute_factors``)."""
        return {id(p) for layer in self._layers if self.owns(layer) for p in layer.params}

    def foreign_params(self) -> list[Tensor]:
        """Parameters of layers other ranks own (no state here under distribute_factors)."""
        if not self.distribute_factors:
            return []
        return [p for layer in self._layers if not self.owns(layer) for p in layer.params]

    def keep_own_state(self, state: dict[Tensor, dict]) -> None:
        """After a load: drop the factors of layers other ranks own and, under FSDP2,
        keep only this rank's rows of the entries shaped like the parameters."""
        if self.shards is None:
            for param in self.foreign_params():
                state.pop(param, None)
            return
        for param, param_state in state.items():
            localise_state_(param, param_state)
        for param in self.foreign_params():
            if param in state:
                state[param] = {k: v for k, v in state[param].items() if k in SHARDED_KEYS}

    def full_state_dict(self, local: dict[str, Any], index_of: dict[int, int]) -> dict[str, Any]:
        """Merge every rank's own layer states into ``local`` (this rank's state_dict);
        under FSDP2 its sharded entries are gathered whole first."""
        if self.shards is not None:  # the same DTensors, in the same order, on every rank
            states = local["state"]
            local = {**local, "state": {i: full_state(states[i]) for i in sorted(states)}}
        if not self.distribute_factors:
            return local
        owned = {index_of[pid] for pid in self.owned_param_ids()}
        mine = {i: _to_cpu(s) for i, s in local["state"].items() if i in owned}
        state = dict(local["state"])
        for part in comm.all_gather_objects(mine, self.group):
            state.update(part)
        return {"state": dict(sorted(state.items())), "param_groups": local["param_groups"]}


def _to_cpu(value: Any) -> Any:
    if isinstance(value, Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    return value
