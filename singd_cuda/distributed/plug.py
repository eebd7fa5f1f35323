"""The distributed package's :class:`~singd_cuda.optim.scale_out.ScaleOutPlug`: a
:class:`~singd_cuda.distributed.Synchronizer` for an optimizer whenever a process group
of more than one rank is initialised or the model's parameters are FSDP2 shards."""

from __future__ import annotations

from torch import nn

from . import comm
from .ownership import layer_cost
from .synchronizer import Synchronizer


class TorchDistributed:
    """Plugs ``torch.distributed`` (DDP, FSDP2, layer ownership) into the optimizers."""

    def unwrap(self, model: nn.Module) -> tuple[nn.Module, bool]:
        """The module inside a DDP wrapper (the hooks go on it), and whether there was one."""
        return comm.unwrap(model)

    def attach(self, model, layers, factor_structures, row_local, **options) -> Synchronizer | None:
        """A :class:`Synchronizer` (layer costs from their factor structures; ``options``:
        ``process_group``, ``distribute_factors``, ``bucket_cap_mb``, ``ddp_wrapped``), or
        None when no process group of several ranks is active and nothing is
        FSDP2-sharded."""
        if not (comm.is_active(options["process_group"]) or comm.sharded(model)):
            return None
        costs = [
            layer_cost(specs, layer.dim_in, layer.dim_out)
            for layer, specs in zip(layers, factor_structures, strict=True)
        ]
        return Synchronizer(model, layers, costs, row_local=row_local, **options)
