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
        jobs[f"singd-diagonal-reduce{suffix}"] = dict(
            optimizer="singd",
            kwargs=_singd("diagonal", kfac_approx="reduce", distribute_factors=owned),
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
        # maximize: the sharded rows, the fallback and the norm Fisher step up the gradient
        jobs[f"singd-dense-maximize{suffix}"] = dict(
            optimizer="singd",
            kwargs=_singd("dense", maximize=True, norm_fisher=True, distribute_factors=owned),
        )
        for name in ("kfac", "adafisher"):
            jobs[f"{name}-maximize{suffix}"] = dict(
                optimizer=name,
                dtype=sc.F64,
                kwargs=dict(lr=0.05, T=2, maximize=True, distribute_factors=owned),
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
    dict(optimizer="singd", shard=True, dtype=sc.F64, kwargs=_singd("dense", graft="adam")),
]


@pytest.fixture(scope="module")
def single_rank() -> list[dict]:
    return launch(1, sc.run_many, SINGLE_RANK)[0]


@pytest.mark.parametrize(
    ("key", "per_layer_step"),
    [
        ("singd-dense", ["all_gather_single"]),  # every row-mixing layer in one gather
        ("singd-dense-owned", ["all_to_all_single", "all_to_all_single"]),  # to and back
        ("adafisher", []),  # row-local: nothing beyond the flag and the statistics
    ],
)
def test_collectives_per_step(fsdp_world, key, per_layer_step):
    """Each opt.step(): the non-finite flag's all-reduce, on update steps (T = 2) the
    statistics all-reduce before it, and the layers' collectives, never one per layer."""
    _, results = fsdp_world
    for rank, result in enumerate(results[key]):
        for step, names in enumerate(result["collectives"]):
            statistics = ["all_reduce"] if step % 2 == 0 else []
            expected = [*statistics, "all_reduce", *per_layer_step]
            assert names == expected, f"{key}, rank {rank}, step {step}: {names}"


def test_a_single_rank_mesh_equals_the_plain_model(single_rank):
    """fully_shard on one rank (the parameters are DTensors all the same)."""
    plain = sc.run({**SINGLE_RANK[0], "shard": False})
    assert max_diff(plain["params"], single_rank[0]["params"]) <= 1e-6


def test_weight_rescale_is_refused_with_a_clear_error(single_rank):
    assert "weight_rescale=True is not supported" in single_rank[1]["error"]


def test_graft_on_a_single_rank_mesh_equals_the_plain_model(single_rank):
    """(``shift`` left out, as in the graft test below.)"""
    plain = sc.run({**SINGLE_RANK[2], "shard": False})
    assert max_diff(plain["params"][:-2], single_rank[2]["params"][:-2]) <= 1e-12


def _graft_jobs() -> dict[str, dict]:
    """Every way a row of Ĝ is made (gathered, at its owner, row-local SINGD, AdaFisher)
    with each graft; the MLP's ``shift`` has no row on rank 1 (a rank adds zeros)."""
    jobs = {}
    for graft in ("adam", "rms"):
        for structures in ("dense", ("dense", "diagonal"), "diagonal"):
            jobs[f"graft-{graft}-singd-{structures}"] = _singd(structures, graft=graft)
        jobs[f"graft-{graft}-singd-dense-owned"] = _singd(
            "dense", graft=graft, distribute_factors=True
        )
        for owned in (False, True):
            suffix = "-owned" if owned else ""
            kfac = dict(lr=0.05, T=2, graft=graft, distribute_factors=owned)
            jobs[f"graft-{graft}-kfac{suffix}"] = dict(kfac, weight_decay=1e-2)
        jobs[f"graft-{graft}-adafisher"] = dict(lr=0.05, T=2, graft=graft, weight_decay=1e-2)
    return {
        key: dict(optimizer=key.split("-")[2], dtype=sc.F64, kwargs=kwargs)
        for key, kwargs in jobs.items()
    }


GRAFT_JOBS = _graft_jobs()


@pytest.fixture(scope="module")
def graft_world() -> list[list[dict]]:
    return launch(2, sc.run_many, list(GRAFT_JOBS.values()), timeout=300)


@pytest.mark.parametrize("index", range(len(GRAFT_JOBS)), ids=list(GRAFT_JOBS))
def test_fsdp_graft_matches_single_process_full_batch(graft_world, index):
    """A sharded weight's graft norm sums every rank's rows: float64, within 1e-10.
    ``shift`` (the last two parameters) is left out: it adds one value to every logit,
    so its gradient is rounding noise, which a graft scales up (rms: to RMS 0.2); it
    changes no other parameter's gradient."""
    key, config = list(GRAFT_JOBS.items())[index]
    ranks = [per_rank[index]["params"] for per_rank in graft_world]
    assert max_diff(ranks[0], ranks[1]) == 0.0
    diff = max_diff(sc.run(config)["params"][:-2], ranks[0][:-2])
    assert diff <= 1e-10, f"{key}: max |Δθ| = {diff:.3g}"
    plain = sc.run({**config, "kwargs": {**config["kwargs"], "graft": None}})
    assert max_diff(plain["params"][:-2], ranks[0][:-2]) > 1e-4  # the graft acts


@pytest.mark.parametrize("index", range(len(GRAFT_JOBS)), ids=list(GRAFT_JOBS))
def test_fsdp_graft_adds_one_all_reduce_per_step(graft_world, index):
    """The norms of a grafted group: one all-reduce per step, after the layers' own
    collectives (the statistics' all-reduce on update steps, T = 2, and the flag's)."""
    for result in (per_rank[index] for per_rank in graft_world):
        for step, names in enumerate(result["collectives"]):
            assert names.count("all_reduce") == (3 if step % 2 == 0 else 2), names
            assert names[-1] == "all_reduce"


HSDP = {
    "hsdp-singd-dense": dict(optimizer="singd", mesh=(2, 2), kwargs=_singd("dense")),
    "hsdp-adafisher": dict(
        optimizer="adafisher", mesh=(2, 2), dtype=sc.F64, kwargs=dict(lr=0.05, T=2)
    ),
    "hsdp-adafisher-graft": dict(  # graft norms over the shard group of each replica
        optimizer="adafisher", mesh=(2, 2), dtype=sc.F64, kwargs=dict(lr=0.05, T=2, graft="rms")
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
        kept = -2 if "graft" in key else None  # shift's noise, as in the graft test above
        assert max_diff(ref["params"][:kept], per_rank[0][i]["params"][:kept]) <= tolerance, key


def test_reference_runs_are_not_trivial():
    """The runs move the parameters (a test of equality must be able to fail)."""
    start = sc.full_params(sc.make_model())
    moved = max_diff(start, reference("singd-dense")["params"])
    assert moved > 1e-3
    assert torch.isfinite(torch.tensor(moved))


# ------------------------------------------------------------------ checkpoints
CHECKPOINTED = {
    "singd": dict(optimizer="singd", dtype=sc.F64, kwargs=_singd("dense")),
    "singd-owned": dict(
        optimizer="singd", dtype=sc.F64, kwargs=_singd("dense", distribute_factors=True)
    ),
    "kfac-owned": dict(
        optimizer="kfac", dtype=sc.F64, kwargs=dict(lr=0.05, T=2, distribute_factors=True)
    ),
    "adafisher": dict(optimizer="adafisher", dtype=sc.F64, kwargs=dict(lr=0.05, T=2)),
    # graft="adam": each parameter's second moment (graft_sq) is sharded by rows as well
    "singd-graft": dict(optimizer="singd", dtype=sc.F64, kwargs=_singd("dense", graft="adam")),
    "adafisher-graft": dict(
        optimizer="adafisher", dtype=sc.F64, kwargs=dict(lr=0.05, T=2, graft="adam")
    ),
    "singd-norm-fisher": dict(
        optimizer="singd", dtype=sc.F64, kwargs=_singd("block_diagonal:4", norm_fisher=True)
    ),
}


def _loads(paths: dict[str, str]) -> list[tuple[str, dict]]:
    """Every way back: DCP's sharded load, torch's full state dict (not under ownership:
    the ranks hold different keys there), and opt.full_state_dict()."""
    jobs = []
    for key, config in CHECKPOINTED.items():
        owned = config["kwargs"].get("distribute_factors", False)
        for how in ("dcp", "own-full") if owned else ("dcp", "torch-full", "own-full"):
            expect_error = how == "dcp" and config["kwargs"].get("norm_fisher", False)
            load = {**config, "path": paths[key], "load": how, "expect_error": expect_error}
            jobs.append((f"{key}:{how}", ("load", load)))
    return jobs


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[dict[str, str], dict[str, list], dict[str, list]]:
    """Save on 2 ranks (then continue: the uninterrupted run), and load on 2 ranks, in
    one launch: (paths, uninterrupted results, loaded results on 2 ranks)."""
    paths = {key: str(tmp_path_factory.mktemp(key)) for key in CHECKPOINTED}
    saves = [("save", {**c, "path": paths[k]}) for k, c in CHECKPOINTED.items()]
    loads = _loads(paths)
    per_rank = launch(2, sc.run_checkpoint_jobs, saves + [job for _, job in loads], timeout=300)
    uninterrupted = {k: [r[i] for r in per_rank] for i, k in enumerate(CHECKPOINTED)}
    loaded = {key: [r[len(saves) + i] for r in per_rank] for i, (key, _) in enumerate(loads)}
    return paths, uninterrupted, loaded


def _check_resumed(uninterrupted, loaded, exact: bool) -> None:
    for key, ranks in loaded.items():
        kwargs = CHECKPOINTED[key.split(":")[0]]["kwargs"]
        if kwargs.get("norm_fisher") and key.endswith("dcp"):
            assert "lacks its norm Fisher" in ranks[0]["error"], key
            continue
        reference = uninterrupted[key.split(":")[0]][0]["params"]
        if exact:  # same world size, same reductions: bit for bit
            for a, b in zip(reference, ranks[0]["params"], strict=True):
                assert torch.equal(a, b), f"{key}: max diff {(a - b).abs().max():.3g}"
        else:  # a graft scales shift's rounding-noise gradient up (see the graft tests)
            kept = slice(None, -2) if kwargs.get("graft") else slice(None)
            assert max_diff(reference[kept], ranks[0]["params"][kept]) <= 1e-10, key


def test_dcp_checkpoint_from_2_ranks_continues_on_2_bitwise(saved):
    _, uninterrupted, loaded = saved
    _check_resumed(uninterrupted, loaded, exact=True)


def test_dcp_checkpoint_from_2_ranks_continues_on_1(saved):
    paths, uninterrupted, _ = saved
    loads = _loads(paths)
    (results,) = launch(1, sc.run_checkpoint_jobs, [job for _, job in loads], timeout=300)
    loaded = {key: [result] for (key, _), result in zip(loads, results, strict=True)}
    _check_resumed(uninterrupted, loaded, exact=False)


@pytest.mark.slow
def test_dcp_checkpoint_from_2_ranks_continues_on_4(saved):
    paths, uninterrupted, _ = saved
    loads = _loads(paths)
    per_rank = launch(4, sc.run_checkpoint_jobs, [job for _, job in loads], timeout=300)
    loaded = {key: [r[i] for r in per_rank] for i, (key, _) in enumerate(loads)}
    _check_resumed(uninterrupted, loaded, exact=False)
