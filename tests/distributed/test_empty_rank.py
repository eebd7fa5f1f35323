"""An empty batch on one rank contributes nothing and is not counted: gradients and
statistics are averaged over the ranks that had samples, so an empty rank equals an idle
rank equals training without it (one process on the other ranks' samples)."""

from __future__ import annotations

import pytest

from . import scenarios as sc
from .jobs import STARVED
from .test_equivalence import max_diff


@pytest.mark.parametrize("key", list(STARVED))
def test_starved_rank_counts_for_nothing(world, key):
    world_size, results = world
    config = STARVED[key]
    ranks = results[key]
    for result in ranks[1:]:
        for a, b in zip(ranks[0]["params"], result["params"], strict=True):
            assert (a == b).all()
    samples = (world_size - 1) * (sc.BATCH // world_size)
    reference = sc.run({k: v for k, v in config.items() if k != "starved"} | {"samples": samples})
    diff = max_diff(reference["params"], ranks[0]["params"])
    assert diff <= 1e-9, f"{key}, world {world_size}: max |Δθ| = {diff:.3g}"
