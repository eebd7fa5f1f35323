"""Multi-process runs (gloo, CPU) against one process on the full batch.

Every job of a world size runs in one launch (one process group, spawned once), so the
whole file costs two launches. Each rank trains on its shard of every batch; the
single-process reference trains on the whole batch. SINGD runs in float32 and must
match within 1e-6; K-FAC's explicit inverses, AdaFisher's 1/F̃ and the norm Fisher's
1/(F + λ) amplify float32 rounding far beyond that in 10 steps, so those run in
float64 and must match within 1e-9 (a wrong scaling shows up at 1e-3 either way).
"""

from __future__ import annotations

import pytest
import torch

from . import scenarios as sc
from .jobs import CHECKPOINTS, F64, JOBS

_references: dict[str, dict] = {}


def reference(key: str, config: dict) -> dict:
    if key not in _references:
        _references[key] = sc.run(config)
    return _references[key]


def max_diff(first: list[torch.Tensor], second: list[torch.Tensor]) -> float:
    return max((a - b).abs().max().item() for a, b in zip(first, second, strict=True))


def tolerance(config: dict) -> float:
    return 1e-9 if config.get("dtype") == F64 else 1e-6


@pytest.mark.parametrize("key", list(JOBS))
def test_matches_single_process_full_batch(world, key):
    world_size, results = world
    kind, config = JOBS[key]
    ranks = results[key] if kind != "subgroup" else results[key][:2]  # the others idle
    for rank, result in enumerate(ranks[1:], start=1):  # replicas bitwise equal
        for a, b in zip(ranks[0]["params"], result["params"], strict=True):
            assert torch.equal(a, b), f"rank {rank} differs from rank 0"
    ref = reference(key, config)
    diff = max_diff(ref["params"], ranks[0]["params"])
    assert diff <= tolerance(config), f"{key}, world {world_size}: max |Δθ| = {diff:.3g}"


def expected_owners(world_size: int, names: list[str], costs: list[int]) -> list[list[str]]:
    loads = [0] * world_size
    owned: list[list[str]] = [[] for _ in range(world_size)]
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        loads[rank] += costs[i]
        owned[rank].append(names[i])
    return [sorted(o) for o in owned]


def test_distributed_ranks_hold_only_their_own_layers(world):
    world_size, results = world
    names = [name for name, _, _ in sc.LAYER_DIMS]
    dense_costs = [d_k**3 + d_c**3 for _, d_k, d_c in sc.LAYER_DIMS]
    ranks = results["singd-dense-distributed-plain"]
    assert [r["layers_with_state"] for r in ranks] == expected_owners(
        world_size, names, dense_costs
    )
    replicated = results["singd-dense-replicated-plain"]
    assert all(r["layers_with_state"] == sorted(names) for r in replicated)


@pytest.mark.parametrize("key", list(CHECKPOINTS))
def test_checkpoint_restore_continue_equals_uninterrupted(world, key):
    """full_state_dict mid-run → torch.save/load(weights_only) → fresh optimizer →
    load_full_state_dict → continue: the uninterrupted distributed run, bitwise.

    With DDP only up to rounding: a new DDP wrapper rebuilds its gradient buckets after
    its first backward, so on 3 ranks its all-reduce sums in another order once.
    """
    _, results = world
    config = CHECKPOINTS[key]
    uninterrupted = results[key]
    restored = results[f"checkpoint:{key}"]
    for rank, (a, b) in enumerate(zip(uninterrupted, restored, strict=True)):
        if config.get("ddp"):
            # a few float32 ulps of entries near 1 (one ulp there is 1.2e-7)
            assert max_diff(a["params"], b["params"]) <= tolerance(config) / 4
            continue
        for p, q in zip(a["params"], b["params"], strict=True):
            assert torch.equal(p, q), f"rank {rank}: max diff {(p - q).abs().max()}"
    full = restored[0]["full_state"]
    layer_params = {0, 1, 2, 3, 6}  # conv.w, conv.b, fc1.w, fc1.b, fc2.w
    assert layer_params <= set(full["state"]), "full_state_dict lacks a layer's state"
    if config["kwargs"].get("distribute_factors"):
        assert all(r["shard_state_sizes"] < len(full["state"]) for r in restored)


@pytest.mark.parametrize("key", list(CHECKPOINTS))
def test_full_state_restores_in_a_single_process(world, key):
    """The gathered state is the single-process state: restore it in one process and
    continue on full batches; equal to the single-process uninterrupted run."""
    _, results = world
    config = CHECKPOINTS[key]
    restored = results[f"checkpoint:{key}"][0]
    dtype = config.get("dtype", torch.float32)
    model = sc.make_model(seed=7, dtype=dtype)
    with torch.no_grad():
        for p, value in zip(model.parameters(), restored["half_params"], strict=True):
            p.copy_(value)
    opt = sc.OPTIMIZERS[config["optimizer"]](model, **config["kwargs"])
    opt.load_state_dict(restored["full_state"])
    data = sc.batches(dtype=dtype)
    sc.train_steps(model, opt, data[len(data) // 2 :], 0, 1)
    ref = reference(key, JOBS.get(key, ("run", config))[1])
    assert max_diff(ref["params"], sc.params_of(model)) <= tolerance(config)


@pytest.mark.parametrize("key", ["singd-grad-scaler-inf-on-one-rank", "singd-inf-on-one-rank"])
def test_an_inf_on_one_rank_skips_the_step_on_every_rank(world, key):
    """found_inf (GradScaler) and non-finite gradients are or-ed over the ranks."""
    _, results = world
    ref = reference(key, JOBS[key][1])
    assert ref["steps"] == sc.STEPS - 1
    assert [r["steps"] for r in results[key]] == [sc.STEPS - 1] * len(results[key])
    if "scaler" not in JOBS[key][1]:
        assert all(any("non-finite" in w for w in r["warnings"]) for r in results[key])
