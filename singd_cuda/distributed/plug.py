"""The distributed package's :class:`~singd_cuda.optim.scale_out.ScaleOutPlug`: a
:class:`~singd_cuda.distributed.Synchronizer` for an optimizer whenever a process group
of more than one rank is initialised or the model's parameters are FSDP2 shards."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from ..curvature.layers import Layer
from . import comm
from .ownership import layer_cost
from .synchronizer import Synchronizer


class TorchDistributed:
    """Plugs ``torch.distributed`` (DDP, FSDP2, layer ownership) into the optimizers."""

    def unwrap(self, model: nn.Module) -> tuple[nn.Module, bool]:
        """The module inside a DDP wrapper (the hooks go on it), and whether there was one."""
        return comm.unwrap(model)

    def attach(
        self,
        model: nn.Module,
        layers: Sequence[Layer],
        factor_structures: Sequence[tuple[str, str]],
        row_local: Sequence[bool],
        *,
        process_group,
        distribute_factors: bool,
        bucket_cap_mb: float,
        ddp_wrapped: bool,
    ) -> Synchronizer | None:
        """A :class:`Synchronizer` (layer costs from their factor structures), or None
        when no process group of several ranks is active and nothing is FSDP2-sharded."""
        if not (comm.is_active(process_group) or comm.sharded(model)):
            return None
        costs = [
            layer_cost(specs, layer.dim_in, layer.dim_out)
            for layer, specs in zip(layers, factor_structures, strict=True)
        ]
        return Synchronizer(
            model,
            layers,
            costs,
            process_group=process_group,
            distribute_factors=distribute_factors,
            bucket_cap_mb=bucket_cap_mb,
            ddp_wrapped=ddp_wrapped,
            row_local=row_local,
        )
