"""FSDP2 (``fully_shard``) runs on gloo ranks against one process on the full batch.

One launch per world size runs every job (fsdp_scenarios.py). float32 runs must match
within 1e-5, float64 runs within 1e-10; ownership (``distribute_factors=True``) must
split the factors over the ranks without changing the result.
"""

from __future__ import annotations

import pytest
import torch

from . import fsdp_scenarios as sc
from .launch import launch

STRUCTURES = [
    "dense",
    "diagonal",
    "block_diagonal:4",
    "low_rank:2",
    "hierarchical:2,2",
    "tril_toeplitz",
    "triu_toeplitz",
    ("dense", "diagonal"),  # diagonal C: rows update alone, dense K
]


def _singd(structures, **kwargs) -> dict:
    return dict(structures=structures, lr=0.01, lr_cov=0.1, T=2, **kwargs)


def _jobs() -> dict[str, dict]:
    jobs = {}
    for owned in (False, True):
        suffix = "-owned" if owned else ""
        for structures in STRUCTURES:
            kwargs = _singd(structures, distribute_factors=owned)
            jobs[f"singd-{structures}{suffix}"] = dict(optimizer="singd", kwargs=kwargs)
        jobs[f"ikfac-dense{suffix}"] = dict(
            optimizer="singd", kwargs=_singd("dense", kfac_like=True, distribute_factors=owned)
        )
        jobs[f"singd-f64-norm-fisher{suffix}"] = dict(
            optimizer="singd",
            dtype=sc.F64,
            kwargs=_singd("block_diagonal:4", norm_fisher=True, distribute_factors=owned),
        )
        for name in ("kfac", "adafisher"):
            jobs[f"{name}{suffix}"] = dict(
                optimizer=name, dtype=sc.F64, kwargs=dict(lr=0.05, T=2, distribute_factors=owned)
            )
    return jobs


JOBS = _jobs()


@pytest.fixture(
    scope="module",
    params=[2, pytest.param(4, marks=pytest.mark.slow)],
    ids=lambda w: f"world{w}",
)
def fsdp_world(request) -> tuple[int, dict[str, list[dict]]]:
    per_rank = launch(request.param, sc.run_many, list(JOBS.values()), timeout=300)
    return request.param, {key: [r[i] for r in per_rank] for i, key in enumerate(JOBS)}


_references: dict[str, dict] = {}


def reference(key: str) -> dict:
    if key not in _references:
        _references[key] = sc.run(JOBS[key])
    return _references[key]


def max_diff(first, second) -> float:
    return max((a - b).abs().max().item() for a, b in zip(first, second, strict=True))


@pytest.mark.parametrize("key", list(JOBS))
def test_fsdp_matches_single_process_full_batch(fsdp_world, key):
    world, results = fsdp_world
    ranks = results[key]
    for rank, result in enumerate(ranks[1:], start=1):  # the gathered parameters agree
        assert max_diff(ranks[0]["params"], result["params"]) == 0.0, f"rank {rank}"
    tolerance = 1e-10 if JOBS[key].get("dtype") == sc.F64 else 1e-5
    diff = max_diff(reference(key)["params"], ranks[0]["params"])
    assert diff <= tolerance, f"{key}, world {world}: max |Δθ| = {diff:.3g}"


@pytest.mark.parametrize("key", ["singd-dense", "kfac", "singd-block_diagonal:4"])
def test_ownership_splits_the_factors_over_the_ranks(fsdp_world, key):
    """Replicated: every rank holds all factors; owned: each holds its layers' only."""
    _, results = fsdp_world
    single = reference(key)["factor_bytes"]
    assert [r["factor_bytes"] for r in results[key]] == [single] * len(results[key])
    owned = [r["factor_bytes"] for r in results[f"{key}-owned"]]
    assert sum(owned) == single
    assert max(owned) < single


SINGLE_RANK = [
    dict(optimizer="singd", shard=True, kwargs=_singd("dense")),
    dict(
        optimizer="singd",
        shard=True,
        expect_error=True,
        kwargs=_singd("dense", weight_rescale=True),
    ),
]


@pytest.fixture(scope="module")
def single_rank() -> list[dict]:
    return launch(1, sc.run_many, SINGLE_RANK)[0]


def test_a_single_rank_mesh_equals_the_plain_model(single_rank):
    """fully_shard on one rank (the parameters are DTensors all the same)."""
    plain = sc.run({**SINGLE_RANK[0], "shard": False})
    assert max_diff(plain["params"], single_rank[0]["params"]) <= 1e-6


def test_weight_rescale_is_refused_with_a_clear_error(single_rank):
    assert "weight_rescale=True is not supported" in single_rank[1]["error"]


HSDP = {
    "hsdp-singd-dense": dict(optimizer="singd", mesh=(2, 2), kwargs=_singd("dense")),
    "hsdp-adafisher": dict(
        optimizer="adafisher", mesh=(2, 2), dtype=sc.F64, kwargs=dict(lr=0.05, T=2)
    ),
    "hsdp-owned": dict(
        optimizer="singd",
        mesh=(2, 2),
        expect_error=True,
        kwargs=_singd("dense", distribute_factors=True),
    ),
}


@pytest.mark.slow
def test_hsdp_replicate_x_shard_mesh():
    """A 2 x 2 mesh (2 replicas of 2 shards): equal to one process; ownership is refused."""
    per_rank = launch(4, sc.run_many, list(HSDP.values()), timeout=300)
    for i, (key, config) in enumerate(HSDP.items()):
        if config.get("expect_error"):
            assert all("with HSDP use distribute_factors=False" in r[i]["error"] for r in per_rank)
            continue
        tolerance = 1e-10 if config.get("dtype") == sc.F64 else 1e-5
        ref = sc.run({k: v for k, v in config.items() if k != "mesh"})
        assert max_diff(ref["params"], per_rank[0][i]["params"]) <= tolerance, key


def test_reference_runs_are_not_trivial():
    """The runs move the parameters (a test of equality must be able to fail)."""
    start = sc.full_params(sc.make_model())
    moved = max_diff(start, reference("singd-dense")["params"])
    assert moved > 1e-3
    assert torch.isfinite(torch.tensor(moved))
