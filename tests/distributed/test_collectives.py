"""The collectives one optimizer step issues, counted by wrapping torch.distributed.

Expected layout (singd_cuda.distributed.synchronizer): per step at most one bucketed
all-reduce of [flags | gradients (plain models) | statistics (update steps)], one
all-reduce of the four non-finite flags (every step: a skip is agreed by every rank) and,
with distribute_factors, one bucketed all-gather of the owners' updated parameters.
Statistics travel compactly: n(n+1)/2 numbers per symmetric n x n block.
"""

from __future__ import annotations

import pytest
import torch

from . import scenarios as sc
from .jobs import COUNTS

T = 3
FP32 = 4
# trained parameters in model order: conv.w, conv.b, fc1.w, fc1.b, norm.w, norm.b, fc2.w
PARAM_NUMELS = [54, 3, 108, 9, 9, 9, 36]
LAYER_PARAM_NUMELS = {"conv": [54, 3], "fc1": [108, 9], "fc2": [36]}


def tri(n: int) -> int:
    return n * (n + 1) // 2


def factor_segments(optimizer: str, d: int) -> list[int]:
    """Wire elements of one side's statistic: block_diagonal:4 blocks (n·tri(b), then the
    trailing block) for SINGD, the dense upper triangle for K-FAC."""
    if optimizer == "kfac":
        return [tri(d)]
    b = min(4, d)
    n = d // b
    return [n * tri(b), tri(d - n * b)]


def factor_cost(optimizer: str, d: int) -> int:
    if optimizer == "kfac":
        return d**3
    b = min(4, d)
    n = d // b
    return n * b * b + (d - n * b) ** 2


def owners(optimizer: str, world_size: int) -> list[list[str]]:
    """Greedy largest-first onto the least-loaded rank (ties: lower rank, model order)."""
    costs = [factor_cost(optimizer, dk) + factor_cost(optimizer, dc) for _, dk, dc in sc.LAYER_DIMS]
    loads, owned = [0] * world_size, [[] for _ in range(world_size)]
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        loads[rank] += costs[i]
        owned[rank].append(sc.LAYER_DIMS[i][0])
    return owned


def greedy_buckets(sizes: list[int], cap: int) -> list[list[int]]:
    """Whole segments in order; a new bucket when the next one would overflow."""
    out: list[list[int]] = [[]]
    for size in sizes:
        if out[-1] and sum(out[-1]) + size > cap:
            out.append([])
        out[-1].append(size)
    return out


def expected_step(config: dict, world_size: int, step: int) -> list[tuple[str, int]]:
    optimizer = config["optimizer"]
    kwargs = config["kwargs"]
    cap = int(kwargs.get("bucket_cap_mb", 64) * 2**20)
    plain, update = not config.get("ddp"), step % T == 0
    calls = []
    if plain or update:
        segments = [1 + (len(sc.LAYER_DIMS) if update else 0) + (len(PARAM_NUMELS) if plain else 0)]
        if plain:
            segments += PARAM_NUMELS
        if update:
            for _, d_k, d_c in sc.LAYER_DIMS:
                segments += factor_segments(optimizer, d_k) + factor_segments(optimizer, d_c)
        calls += [("all_reduce", FP32 * sum(b)) for b in greedy_buckets(segments, cap // FP32)]
    calls.append(("all_reduce", FP32 * 4))  # the skip flags, agreed
    if kwargs.get("distribute_factors"):
        aligned = [
            [-(-FP32 * n // 8) * 8 for name in names for n in LAYER_PARAM_NUMELS[name]]
            for names in (
                sorted(o, key=[d[0] for d in sc.LAYER_DIMS].index)
                for o in owners(optimizer, world_size)
            )
        ]
        limit = max(8, cap // world_size)
        while any(aligned):
            chunk = 0
            for sizes in aligned:
                taken = 0
                while sizes and (taken == 0 or taken + sizes[0] <= limit):
                    taken += sizes.pop(0)
                chunk = max(chunk, taken)
            calls.append(("all_gather", chunk))
    return calls


def normalised(calls: list[tuple[str, int]]) -> list[tuple[str, int]]:
    names = {"all_gather_single": "all_gather", "all_gather_into_tensor": "all_gather"}
    return [(names.get(name, name), size) for name, size in calls]


@pytest.mark.parametrize("key", list(COUNTS))
def test_collectives_per_step_match_the_packed_layout(world, key):
    world_size, results = world
    config = COUNTS[key]
    for rank, result in enumerate(results[key]):
        for step, calls in enumerate(result["per_step"]):
            expected = expected_step(config, world_size, step)
            assert normalised(calls) == expected, f"rank {rank}, step {step}"


def test_counts_for_the_readme(world):
    """Collectives per step, as the docs state them (T = 3)."""
    _, results = world
    ddp = results["count-block-replicated-ddp"][0]["per_step"]
    assert [len(calls) for calls in ddp] == [2, 1, 1, 2, 1, 1, 2, 1, 1, 2]
    plain = results["count-block-distributed-plain"][0]["per_step"]
    assert [len(calls) for calls in plain] == [3] * sc.STEPS


@pytest.mark.parametrize("mode", ["replicated", "distributed"])
def test_bucketing_changes_nothing_but_the_count(world, mode):
    """Bitwise on 2 ranks; on 3, gloo's ring all-reduce splits a buffer by its length,
    so other buckets sum in another order (within rounding)."""
    world_size, results = world
    tiny = results[f"count-block-{mode}-plain-tinycap"][0]
    normal = results[f"count-block-{mode}-plain"][0]
    assert sum(len(c) for c in tiny["per_step"]) > sum(len(c) for c in normal["per_step"])
    for a, b in zip(tiny["params"], normal["params"], strict=True):
        if world_size == 2:
            assert torch.equal(a, b)
        else:
            assert (a - b).abs().max() <= 1e-6
