"""Layer ownership under ``distribute_factors=True``: which rank updates which layer.

Every rank computes the same assignment from the model alone (no communication):
layers sorted by cost, largest first, each given to the least-loaded rank (ties to
the lower rank, then model order). The cost of a layer is the cost of its two
factors: d³ for a dense factor (the products and inversions are cubic), the number
of stored elements for a structured one (its products are about linear in storage).
"""

from __future__ import annotations

from collections.abc import Sequence

from .. import structures as structure_registry
from ..optim.adafisher import ADAFISHER


def factor_cost(spec: str, dim: int) -> int:
    """Cost of one d x d factor of structure ``spec`` (a registry name or "adafisher")."""
    if spec == ADAFISHER:
        return dim
    cls = structure_registry.get(spec)
    if cls.name == "dense":
        return dim**3
    eye = cls.eye(dim, device="meta")
    return sum(part.numel() for part in eye.parts.values())


def layer_cost(specs: tuple[str, str], dim_in: int, dim_out: int) -> int:
    """Cost of a layer with factors ``specs`` = (K side, C side) of sizes d_K, d_C."""
    return factor_cost(specs[0], dim_in) + factor_cost(specs[1], dim_out)


def assign_owners(costs: Sequence[float], world_size: int) -> list[int]:
    """The owning rank of each item: greedy largest-first onto the least-loaded rank."""
    loads = [0.0] * world_size
    owners = [0] * len(costs)
    for index in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        owners[index] = rank
        loads[rank] += costs[index]
    return owners
