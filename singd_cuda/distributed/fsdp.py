"""Parameters sharded by rows: FSDP2 (``torch.distributed.fsdp.fully_shard``).

``fully_shard`` turns every parameter into a DTensor sharded on dim 0 (``Shard(0)``; for
HSDP a 2-D mesh, ``(Replicate(), Shard(0))``): rank r of the shard group holds rows
[r·c, min((r+1)·c, d)) with c = ⌈d / world⌉ (the last ranks may hold fewer, or none).
Its backward reduce-scatters and averages the gradients, so each rank holds the
averaged gradient of its own rows. The optimizer then works on plain tensors that
share the shards' storage (:func:`local`), in three ways:

* elementwise updates (the AdamW fallback, the norm Fisher, AdaFisher, SINGD with a
  diagonal C — :meth:`LayerRule.row_local`): each rank updates its rows from its own
  gradient and its slice of the output-side vector; no communication;
* (C Cᵀ) G (K Kᵀ) and G_inv G A_inv mix rows: the layer's gradient matrix G is
  gathered, preconditioned, and each rank keeps its rows of Ĝ. Without ownership one
  all-gather of every such layer's padded rows per step, and every rank computes Ĝ;
  with ``distribute_factors=True`` one all-to-all sends each layer's rows to its
  owner, which alone holds the factors and computes Ĝ, and a second all-to-all
  returns each rank its rows of Ĝ;
* the momentum buffers (and AdamW moments) are shaped like the local shards.

The curvature statistics come from activations and output gradients, which FSDP does
not shard: the :class:`~singd_cuda.distributed.Synchronizer` averages them as under
DDP, one packed all-reduce per update step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from ..curvature.layers import Layer, gradient_matrix, split_matrix
from ..optim.graft import graft_
from ..optim.write import gradient_factor
from ..structures.base import accumulation_dtype
from . import comm


def is_sharded(tensor: Any) -> bool:
    return isinstance(tensor, DTensor)


def local(tensor: Tensor) -> Tensor:
    """This rank's shard of a DTensor as a plain tensor sharing its storage (in-place
    writes update the shard); any other tensor as it is."""
    return tensor.to_local().detach() if isinstance(tensor, DTensor) else tensor


def shard_mesh_dim(param: DTensor) -> int:
    """The mesh dimension sharding dim 0 of ``param``; NotImplementedError for layouts
    other than FSDP2's (Shard(0) on one mesh dimension, Replicate on any other)."""
    placements = tuple(param.placements)
    dims = [i for i, p in enumerate(placements) if p == Shard(0)]
    others = [p for i, p in enumerate(placements) if i not in dims]
    if len(dims) != 1 or not all(isinstance(p, Replicate) for p in others):
        raise NotImplementedError(
            f"a parameter of shape {tuple(param.shape)} is a DTensor with placements "
            f"{placements}; singd_cuda supports FSDP2's layouts only: Shard(0) on one mesh "
            "dimension (fully_shard), with Replicate on the others (HSDP)"
        )
    return dims[0]


def row_slice(param: DTensor) -> slice:
    """The rows of ``param`` (its dim 0) that this rank's shard holds."""
    dim = shard_mesh_dim(param)
    mesh = param.device_mesh
    world, rank = mesh.size(dim), mesh.get_local_rank(dim)
    rows = param.shape[0]
    chunk = -(-rows // world)
    start = min(rank * chunk, rows)
    stop = min(start + chunk, rows)
    if param.to_local().shape[0] != stop - start:
        raise NotImplementedError(
            f"a shard of {stop - start} rows was expected for a parameter of shape "
            f"{tuple(param.shape)} on {world} ranks, found {param.to_local().shape[0]}: only "
            "fully_shard's even chunking (torch.chunk) is supported"
        )
    return slice(start, stop)


# state entries shaped like the parameter: kept as this rank's rows, DTensors in state_dicts
SHARDED_KEYS = ("momentum_buffer", "exp_avg", "exp_avg_sq", "graft_sq")


def sharded_state(param: Tensor, state: dict) -> dict:
    """``state`` with its local-shard entries as DTensors laid out like ``param`` (views
    of the same storage), as ``torch.distributed.checkpoint`` expects them."""
    if not is_sharded(param):
        return state
    out = dict(state)
    for key in SHARDED_KEYS:
        value = state.get(key)
        if isinstance(value, Tensor) and not is_sharded(value):
            out[key] = DTensor.from_local(
                value,
                param.device_mesh,
                param.placements,
                run_check=False,
                shape=param.shape,
                stride=param.stride(),
            )
    return out


def localise_state_(param: Tensor, state: dict) -> None:
    """Inverse of :func:`sharded_state`, in place: DTensor entries become this rank's
    local tensors, whole ones (a full checkpoint) are cut to this rank's rows."""
    if not is_sharded(param):
        return
    for key in SHARDED_KEYS:
        value = state.get(key)
        if is_sharded(value):
            if tuple(value.placements) != tuple(param.placements):
                value = value.redistribute(param.device_mesh, param.placements)
            state[key] = value.to_local()
        elif isinstance(value, Tensor) and value.shape == param.shape:
            state[key] = value[row_slice(param)].clone()


def full_state(state: Any) -> Any:
    """A state with every DTensor gathered whole (a collective per DTensor)."""
    if is_sharded(state):
        return state.full_tensor()
    if isinstance(state, dict):
        return {key: full_state(value) for key, value in state.items()}
    return state


@dataclass(eq=False)
class RowShard(Layer):
    """A layer over this rank's rows: ``weight``/``bias`` are plain tensors sharing the
    shards' storage, with this rank's gradient rows as ``.grad``; ``dim_in`` is the full
    layer's d_K (a shard may hold no row)."""

    rows: slice = field(default_factory=lambda: slice(None))
    full_dim_in: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        self.dim_in = self.full_dim_in

    @property
    def empty(self) -> bool:
        return self.rows.stop == self.rows.start


def shard_of(layer: Layer) -> RowShard:
    """This step's :class:`RowShard` of a layer whose parameters are sharded by rows."""
    params = []
    for param in layer.params:
        view = local(param)
        view.grad = None if param.grad is None else local(param.grad)
        params.append(view)
    return RowShard(
        layer.name,
        layer.module,
        params[0],
        params[1] if len(params) > 1 else None,
        layer.modules,
        rows=row_slice(layer.weight),
        full_dim_in=0 if layer.kind is None else layer.dim_in,  # norm layers have no kind
    )


@dataclass
class ShardStep:
    """What :meth:`RowShards.step` needs of one layer: its rule (a LayerRule), group,
    parameter states (the weight's first), rounding seed and the rank that computes Ĝ
    (None: every rank; a rank of the shard group under ``distribute_factors``)."""

    layer: Layer
    rule: Any
    group: dict
    states: list[dict]
    seed: int
    owner: int | None


class RowShards:
    """The FSDP2 part of an optimizer step (see module doc)."""

    def __init__(self, model: nn.Module, layers: Sequence[Layer], process_group=None) -> None:
        params = [p for p in model.parameters() if p.requires_grad]
        plain = [tuple(p.shape) for p in params if not is_sharded(p)]
        if plain:
            raise NotImplementedError(
                f"parameters of shapes {plain[:4]} are not sharded while others are DTensors; "
                "apply fully_shard to the root module too, so that every parameter is sharded"
            )
        meshes = {p.device_mesh for p in params}
        if len(meshes) != 1:
            raise NotImplementedError("parameters on several device meshes are not supported")
        self.mesh = meshes.pop()
        self.dim = shard_mesh_dim(params[0])
        for p in params:
            if shard_mesh_dim(p) != self.dim:
                raise NotImplementedError("parameters sharded over different mesh dimensions")
        for layer in layers:
            if layer.kind.out_features(layer.weight) != layer.weight.shape[0]:
                raise NotImplementedError(
                    f"layer '{layer.name}' stores its weight transposed (Hugging Face Conv1D): "
                    "FSDP2 shards its input side; exclude it from fully_shard-ed SINGD layers "
                    "(params=) or use nn.Linear"
                )
        self.group = self.mesh.get_group(self.dim)
        self.rank, self.world = dist.get_rank(self.group), dist.get_world_size(self.group)
        self.optimizer_group = process_group

    local = staticmethod(local)
    view = staticmethod(shard_of)
    entry = ShardStep
    sharded_state = staticmethod(sharded_state)

    def owner_in_shard_group(self, owner: int) -> int:
        """The shard-group rank of a rank of the optimizer's process group."""
        return dist.get_group_rank(self.group, dist.get_global_rank(self._opt_group(), owner))

    def _opt_group(self):
        return self.optimizer_group or dist.group.WORLD

    # ------------------------------------------------------------------ step
    def step(self, entries: Sequence[ShardStep], inv_scale: Tensor | None) -> None:
        """Update this rank's rows of every layer of ``entries`` (gradients still scaled
        by 1/``inv_scale``). A grafted group's rows of Ĝ are computed first, rescaled by
        :meth:`_graft` (norms over every rank's rows), then written."""
        shards = {id(e.layer): shard_of(e.layer) for e in entries}
        gathered, by_owner, naturals = [], [], {}
        written = []  # the entries written here (not by apply_shard), in the same order
        for e in entries:
            shard = shards[id(e.layer)]
            for param, state in zip(shard.params, e.states, strict=True):
                if param.grad is not None:
                    for key in e.rule.shard_buffers(e.group):
                        if key not in state:
                            state[key] = torch.zeros_like(param)
            if e.rule.row_local(e.group):
                step = e.group["step"]
                factor = gradient_factor(inv_scale, e.group, e.layer.weight.device)
                if e.group["graft"] is None:
                    e.rule.apply_shard(e.layer, shard, e.group, e.states, factor, step, e.seed)
                    continue
                written.append(e)
                dtype = accumulation_dtype(e.layer.weight.dtype)
                if shard.empty:  # natural_rows still counts the step (AdaFisher)
                    G = torch.zeros(0, e.layer.dim_in, dtype=dtype, device=shard.weight.device)
                else:
                    G = gradient_matrix(shard, dtype)
                if factor is not None:
                    G = G * factor.to(G.dtype)
                naturals[id(e.layer)] = e.rule.natural_rows(
                    e.layer, e.group, e.states[0], G, shard.rows, step
                )
            else:
                (gathered if e.owner is None else by_owner).append(e)
                written.append(e)
        if self.world == 1:  # one shard holds every row: nothing to gather or send
            gathered, by_owner = gathered + by_owner, []
        naturals.update(self._gathered_naturals(gathered, shards, inv_scale))
        naturals.update(self._owned_naturals(by_owner, shards, inv_scale))
        self._graft(written, shards, naturals, inv_scale)
        for e in written:
            shard = shards[id(e.layer)]
            if not shard.empty:
                e.rule.apply_direction(shard, e.group, e.states, naturals[id(e.layer)], e.seed)

    def _graft(self, entries, shards, naturals: dict[int, Tensor], inv_scale) -> None:
        """:func:`~singd_cuda.optim.graft.graft_` of every grafted group's rows of Ĝ, in
        place: the partial squared norms of all of a group's parameters summed over the
        shard group in one all-reduce (a rank without rows of a layer adds zeros)."""
        groups: dict[int, list[ShardStep]] = {}
        for e in entries:
            if e.group["graft"] is not None:
                groups.setdefault(id(e.group), []).append(e)
        for members in groups.values():
            params, directions, states = [], [], []
            for e in members:
                shard = shards[id(e.layer)]
                if shard.empty:  # no rows here: zeros to the sums
                    dtype = accumulation_dtype(e.layer.weight.dtype)
                    directions += [torch.zeros_like(p, dtype=dtype) for p in shard.params]
                else:
                    directions += split_matrix(shard, naturals[id(e.layer)])
                params += shard.params
                states += e.states
            graft_(
                params,
                directions,
                states,
                members[0].group,
                inv_scale,
                reduce=lambda partial: dist.all_reduce(partial, group=self.group),
            )

    def _padded_rows(self, e: ShardStep, shard: RowShard, inv_scale) -> Tensor:
        """This rank's rows of G (unscaled; negated under ``maximize``), zero-padded to the
        chunk of ⌈d_C / world⌉."""
        dtype = accumulation_dtype(e.layer.weight.dtype)
        chunk = -(-e.layer.dim_out // self.world)
        out = torch.zeros(chunk, e.layer.dim_in, dtype=dtype, device=e.layer.weight.device)
        if not shard.empty:
            G = gradient_matrix(shard, dtype)
            factor = gradient_factor(inv_scale, e.group, G.device)  # maximize: negated
            out[: G.shape[0]] = G if factor is None else G * factor.to(G.device, dtype)
        return out

    def _gathered_naturals(self, entries, shards, inv_scale) -> dict[int, Tensor]:
        """Every rank gathers each layer's G (one all-gather) and keeps its rows of Ĝ."""
        if not entries:
            return {}
        chunks = [self._padded_rows(e, shards[id(e.layer)], inv_scale) for e in entries]
        flat = torch.cat([c.reshape(-1) for c in chunks])
        out = flat
        if self.world > 1:
            out = flat.new_empty(self.world * flat.numel())
            comm.all_gather_(out, flat, self.group)
        out = out.view(self.world, -1)
        naturals, offset = {}, 0
        for e, chunk in zip(entries, chunks, strict=True):
            rows = out[:, offset : offset + chunk.numel()].reshape(-1, chunk.shape[1])
            offset += chunk.numel()
            shard = shards[id(e.layer)]
            if not shard.empty:
                G = rows[: e.layer.dim_out]
                naturals[id(e.layer)] = e.rule.natural_rows(
                    e.layer, e.group, e.states[0], G, shard.rows, e.group["step"]
                )
        return naturals

    def _owned_naturals(self, entries, shards, inv_scale) -> dict[int, Tensor]:
        """Each layer's rows go to its owner (one all-to-all), which computes Ĝ and sends
        each rank its rows back (a second all-to-all)."""
        if not entries:
            return {}
        owners = [self.owner_in_shard_group(e.owner) for e in entries]
        chunks = [self._padded_rows(e, shards[id(e.layer)], inv_scale) for e in entries]
        sizes = [c.numel() for c in chunks]
        order = sorted(range(len(entries)), key=lambda i: (owners[i], i))  # by destination
        send = torch.cat([chunks[i].reshape(-1) for i in order])
        send_splits = [sum(sizes[i] for i in order if owners[i] == r) for r in range(self.world)]
        mine = [i for i in order if owners[i] == self.rank]
        own_size = sum(sizes[i] for i in mine)
        received = send.new_empty(self.world * own_size)
        dist.all_to_all_single(
            received, send, [own_size] * self.world, send_splits, group=self.group
        )
        received = received.view(self.world, own_size)
        back, offset = [], 0
        for i in mine:  # rows from every rank: G, then Ĝ cut into the same chunks
            e, chunk = entries[i], chunks[i]
            G = received[:, offset : offset + sizes[i]].reshape(-1, chunk.shape[1])
            offset += sizes[i]
            natural = e.rule.natural_rows(
                e.layer, e.group, e.states[0], G[: e.layer.dim_out], slice(None), e.group["step"]
            )
            padded = natural.new_zeros(G.shape)
            padded[: natural.shape[0]] = natural
            back.append(padded.view(self.world, -1))
        returned = send.new_empty(send.numel())
        own = torch.cat(back, dim=1).reshape(-1) if back else send.new_empty(0)
        dist.all_to_all_single(
            returned, own.to(send.dtype), send_splits, [own_size] * self.world, group=self.group
        )
        naturals, offset = {}, 0
        for i in order:
            e, shard = entries[i], shards[id(entries[i].layer)]
            rows = returned[offset : offset + sizes[i]].view(chunks[i].shape)
            offset += sizes[i]
            if not shard.empty:
                naturals[id(e.layer)] = rows[: shard.rows.stop - shard.rows.start]
        return naturals

    # ---------------------------------------------------------------- checks
    def agree(self, check) -> None:
        """Raise on every rank the non-finite flags any rank raised (one all-reduce of the
        flags over the optimizer's group; nothing is read to the host here)."""
        flags = check.merged(torch.device(self.mesh.device_type))
        dist.all_reduce(flags, group=self.optimizer_group)
        check.raise_(flags)
