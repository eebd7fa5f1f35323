"""How distributed training plugs into the optimizers, from above.

The optimizers know nothing of ``torch.distributed``. A package above them
(:mod:`singd_cuda.distributed`, imported by ``import singd_cuda``) registers a
:class:`ScaleOutPlug`; at construction an optimizer asks it for the model its hooks go
on (DDP unwrapped) and for a :class:`ScaleOut` of its layers, or None in one process.
The step then talks to that object alone: it averages the step's statistics and
gradients (:meth:`ScaleOut.synchronise`), says which layers this rank updates, and, for
parameters sharded by rows (FSDP2), steps the shards (:class:`Shards`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from torch import Tensor, nn

from ..curvature.layers import Layer

DEFAULT_BUCKET_CAP_MB = 64.0
"""Default ``bucket_cap_mb``: the MiB of one all-reduce bucket of the packed buffer."""


class Shards(Protocol):
    """The part of a step on parameters sharded by rows (FSDP2)."""

    def local(self, tensor: Tensor) -> Tensor:
        """This rank's rows of a sharded tensor, as a plain tensor sharing its storage."""

    def view(self, layer: Layer) -> Layer:
        """The layer over this rank's rows (``.rows``: the slice it holds)."""

    def entry(self, layer, rule, group, states, seed, owner) -> Any:
        """What :meth:`step` needs of one layer (the rank computing Ĝ: ``owner``)."""

    def step(self, entries: Sequence[Any], inv_scale: Tensor | None) -> None:
        """Update this rank's rows of every layer of ``entries``."""

    def sharded_state(self, param: Tensor, state: dict) -> dict:
        """``state`` with the parameter-shaped buffers as sharded tensors (for DCP)."""


class ScaleOut(Protocol):
    """What an optimizer step needs of distributed training (one object per optimizer)."""

    distribute_factors: bool
    shards: Shards | None

    def synchronise(
        self,
        statistics: dict[Layer, dict],
        stat_layers: Sequence[Layer],
        empty_statistics: Callable[[Layer], dict],
        params: Sequence[Tensor],
        grad_scale: Tensor | None,
        found_inf: Tensor | None,
        saw_samples: bool = True,
    ) -> tuple[Tensor | None, Tensor | None]:
        """Average the gradients and ``statistics`` (in place) over the ranks; returns
        (grad_scale, found_inf) as they hold afterwards."""

    def local_tensors(self, tensors: Sequence[Tensor]) -> list[Tensor]:
        """This rank's parts of ``tensors``, for the finite checks."""

    def owns(self, layer: Layer) -> bool:
        """Whether this rank updates the factors of ``layer``."""

    def owner_of(self, layer: Layer) -> int | None:
        """The rank updating the factors of ``layer``; None: every rank."""

    def agree(self, check) -> None:
        """Raise on every rank the non-finite flags any rank raised."""

    def refusals(self, refused: bool) -> int:
        """How many ranks refused the checkpoint being loaded (every rank calls it)."""

    def share_parameters(self) -> int:
        """Send every rank the parameters this rank updated (``distribute_factors``)."""

    def foreign_params(self) -> list[Tensor]:
        """The parameters whose factors other ranks hold."""

    def keep_own_state(self, state: dict[Tensor, dict]) -> None:
        """Drop the loaded state of what other ranks own."""

    def full_state_dict(self, local: dict[str, Any], index_of: dict[int, int]) -> dict[str, Any]:
        """Every rank's state gathered into one state dict (a collective)."""

    def remove(self) -> None:
        """Remove the hooks it put on the model."""


class ScaleOutPlug(Protocol):
    """What the optimizers ask of the distributed package at construction."""

    def unwrap(self, model: nn.Module) -> tuple[nn.Module, bool]:
        """(the module to hook, whether ``model`` was a DDP wrapper around it)."""

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
    ) -> ScaleOut | None:
        """The :class:`ScaleOut` of an optimizer of ``layers`` (their factor structures
        and :meth:`LayerRule.row_local`), or None when the run is one process."""


class OneProcess:
    """The plug without a distributed package: nothing to unwrap or synchronise."""

    def unwrap(self, model: nn.Module) -> tuple[nn.Module, bool]:
        """``model`` itself (nothing wraps it)."""
        return model, False

    def attach(self, model, layers, factor_structures, row_local, **options) -> None:
        """None: one process."""
        return None


_plug: ScaleOutPlug = OneProcess()


def register(plug: ScaleOutPlug) -> None:
    """Make ``plug`` the one every optimizer constructed from now on asks."""
    global _plug
    _plug = plug


def plug() -> ScaleOutPlug:
    """The registered plug."""
    return _plug
