"""statistics_tensors: the floating-point tensors of a step's {layer: statistics}, the same
ones (in the same order) as the general walk ``tensors_of`` finds, by its fast paths for
plain tensors, for structured matrices only, and for a mix."""

from __future__ import annotations

import pytest
import torch

from singd_cuda.optim.finite import statistics_tensors, tensors_of
from singd_cuda.structures import get


def _pending(kind: str) -> dict:
    block = get("block_diagonal:4")
    if kind == "plain":
        return {i: {"in": torch.ones(3), "out": torch.ones(2, 2)} for i in range(3)}
    if kind == "structured":  # a block-diagonal side with an empty trailing block
        return {i: {"in": block.eye(8), "out": get("diagonal").eye(3)} for i in range(3)}
    return {  # a norm layer's plain statistic beside structured ones
        0: {"in": block.eye(6), "out": block.eye(5)},
        1: {"out": torch.ones(4)},
        2: {"in": torch.ones(2, dtype=torch.int64), "out": torch.ones(2)},
    }


@pytest.mark.parametrize("kind", ["plain", "structured", "mixed"])
def test_statistics_tensors_are_the_walks(kind):
    pending = _pending(kind)
    found, expected = statistics_tensors(pending), tensors_of(pending)
    assert len(found) == len(expected) > 0
    assert all(a is b for a, b in zip(found, expected, strict=True))
    assert all(t.is_floating_point() for t in found)
