"""A construction-time warning for factors that would take more memory than a threshold.

One factor (one state entry of one layer, e.g. SINGD's K or K-FAC's A⁻¹) above
:data:`FACTOR_WARNING_BYTES` (64 MiB: a dense side above 4096 in float32, above 5792 in
bfloat16) warns once per optimizer, naming the layers and a structure that would fit.
The sizes come from the rule's own ``init_state`` on the meta device: nothing is allocated.
"""

from __future__ import annotations

import warnings

from torch import Tensor
from torch.optim import Optimizer

from .. import structures as structure_registry
from .hyperparameters import factor_keys

FACTOR_WARNING_BYTES = 64 * 2**20
SUGGESTED_STRUCTURE = "block_diagonal:32"
MiB = 2**20


class LargeFactorWarning(UserWarning):
    """A factor above :data:`FACTOR_WARNING_BYTES`."""


def entry_bytes(value) -> int:
    """Bytes of a state entry: a tensor, a dict of tensors (structure parts), or 0."""
    if isinstance(value, Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(entry_bytes(v) for v in value.values())
    return 0


def structure_bytes(spec: str, dim: int, itemsize: int) -> int:
    """Bytes of one factor of structure ``spec`` and side ``dim``."""
    parts = structure_registry.get(spec).zeros(dim, device="meta").parts
    return sum(part.numel() for part in parts.values()) * itemsize


def warn_large_factors(optimizer: Optimizer, suggestion: str) -> None:
    """Warn (:class:`LargeFactorWarning`) about the layers with a factor above the
    threshold; ``suggestion`` tells how to choose a structure (e.g. "pass structures=...")."""
    large = []
    for layer in optimizer.layers:
        state = factor_keys(optimizer, layer, optimizer.group_of(layer))
        largest = max((entry_bytes(v) for v in state.values()), default=0)
        if largest > FACTOR_WARNING_BYTES:
            large.append((largest, layer))
    if not large:
        return
    large.sort(key=lambda item: -item[0])
    largest, layer = large[0]
    itemsize = (optimizer.group_of(layer)["factor_dtype"] or layer.weight.dtype).itemsize
    side = max(layer.dim_in, layer.dim_out)
    fits = structure_bytes(SUGGESTED_STRUCTURE, side, itemsize)
    names = ", ".join(f"'{lay.name}' {tuple(lay.weight.shape)}" for _, lay in large[:3])
    more = f" and {len(large) - 3} more" if len(large) > 3 else ""
    warnings.warn(
        f"{type(optimizer).__name__}: {len(large)} layer(s) have a factor above "
        f"{FACTOR_WARNING_BYTES // MiB} MiB ({names}{more}; the largest {largest / MiB:.0f} "
        f"MiB, and the state holds several per layer). {suggestion}: '{SUGGESTED_STRUCTURE}' "
        f"stores {fits / MiB:.2f} MiB for a side of {side}, 'diagonal' "
        f"{side * itemsize / MiB:.2f} MiB.",
        LargeFactorWarning,
        stacklevel=3,
    )
