"""The thin layer over ``torch.distributed``: when to synchronise, the DDP wrapper,
and the two collectives this package issues.

Collectives are looked up on ``torch.distributed`` at call time (``dist.all_reduce``,
``dist.all_gather_single`` or ``dist.all_gather_into_tensor``), so a test can wrap
them and count what one optimizer step sends.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel


def is_active(process_group=None) -> bool:
    """True when torch.distributed is initialised and the group has more than one rank."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(process_group) > 1


def sharded(model: nn.Module) -> bool:
    """Whether any parameter of ``model`` is a DTensor (FSDP2's ``fully_shard``)."""
    return any(isinstance(p, DTensor) for p in model.parameters())


def unwrap(model: nn.Module) -> tuple[nn.Module, bool]:
    """(the module the hooks go on, whether ``model`` is a DistributedDataParallel)."""
    if isinstance(model, DistributedDataParallel):
        return model.module, True
    return model, False


def inside_ddp_forward(module: nn.Module) -> bool:
    """Whether ``module`` is running as the inner module of a DDP forward right now.

    Lets the optimizer see that gradients are averaged by DDP even when it was given
    ``ddp_model.module`` rather than the wrapper.
    """
    active = getattr(DistributedDataParallel, "_active_ddp_module", None)
    return active is not None and getattr(active, "module", None) is module


def all_reduce_sum_(buffer: Tensor, group=None) -> None:
    """In-place sum over the ranks of ``group``."""
    dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=group)


def all_gather_(output: Tensor, chunk: Tensor, group=None) -> None:
    """``output`` (world x chunk) ← every rank's ``chunk``, in rank order."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, chunk, group=group)


def all_gather_objects(obj, group=None) -> list:
    """Every rank's picklable ``obj``, in rank order (checkpoints only, not per step)."""
    out: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def rank_and_world(group=None) -> tuple[int, int]:
    return dist.get_rank(group), dist.get_world_size(group)
