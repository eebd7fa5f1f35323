"""Every multi-process job of the distributed tests, run in one launch per world size.

A launch spawns its processes once (importing torch costs seconds per process), so the
equivalence, checkpoint and collective-count jobs of a world size share one process
group; ``conftest.world`` runs them and the test files read the results by key.
"""

from __future__ import annotations

import torch

from singd_cuda.distributed import Piecewise, Warmup

F64 = torch.float64
SINGD_STRUCTURES = ["dense", "diagonal", "block_diagonal:4"]


def singd(structures: str, **kwargs) -> dict:
    # lr suits the warm-started factors (at 0.1 float32 rounding grows past the tolerance)
    return dict(structures=structures, lr=0.01, lr_cov=0.1, T=3, **kwargs)


def _jobs() -> dict[str, tuple[str, dict]]:
    jobs: dict[str, tuple[str, dict]] = {}
    for structures in SINGD_STRUCTURES:
        for mode in ("replicated", "distributed"):
            for ddp in (True, False):
                key = f"singd-{structures}-{mode}-{'ddp' if ddp else 'plain'}"
                kwargs = singd(structures, distribute_factors=mode == "distributed")
                jobs[key] = ("run", dict(optimizer="singd", ddp=ddp, kwargs=kwargs))
    jobs["singd-dense-distributed-ddp-inner"] = (
        "run",
        dict(
            optimizer="singd",
            ddp=True,
            pass_inner=True,
            kwargs=singd("dense", distribute_factors=True),
        ),
    )
    for structures in ("low_rank:2", "hierarchical:2,2", "tril_toeplitz"):  # dense Gram path
        jobs[f"singd-{structures}-distributed-plain"] = (
            "run",
            dict(optimizer="singd", kwargs=singd(structures, distribute_factors=True)),
        )
    jobs["singd-dense-distributed-microbatches"] = (
        "run",
        dict(optimizer="singd", micro=2, kwargs=singd("dense", distribute_factors=True)),
    )
    jobs["singd-schedules"] = (
        "run",
        dict(
            optimizer="singd",
            ddp=True,
            kwargs=dict(
                structures="block_diagonal:4",
                lr=0.01,
                lr_cov=0.1,
                T=Piecewise([1, 3], [4]),
                damping=Warmup(start=0.1, target=1e-3, steps=6),
                distribute_factors=True,
            ),
        ),
    )
    for mode in ("replicated", "distributed"):
        for name in ("kfac", "adafisher"):
            jobs[f"{name}-{mode}-plain"] = (
                "run",
                dict(
                    optimizer=name,
                    dtype=F64,
                    kwargs=dict(lr=0.05, T=3, distribute_factors=mode == "distributed"),
                ),
            )
    jobs["kfac-distributed-ddp"] = (
        "run",
        dict(
            optimizer="kfac",
            ddp=True,
            dtype=F64,
            kwargs=dict(lr=0.05, T=2, distribute_factors=True),
        ),
    )
    jobs["singd-recipe-ddp-inner"] = (
        "run",
        dict(
            optimizer="singd",
            ddp=True,
            pass_inner=True,
            dtype=F64,
            kwargs=singd("dense", norm_fisher=True, weight_rescale=True, momentum_lr_ratio=5.0),
        ),
    )
    jobs["singd-grad-scaler-inf-on-one-rank"] = (
        "run",
        dict(optimizer="singd", scaler=2.0**10, inf_step=3, kwargs=singd("diagonal")),
    )
    jobs["singd-inf-on-one-rank"] = (
        "run",
        dict(optimizer="singd", inf_step=3, kwargs=singd("dense", distribute_factors=True)),
    )
    jobs["singd-dense-reduce-distributed-ddp"] = (  # K-FAC-reduce: one row per image
        "run",
        dict(
            optimizer="singd",
            ddp=True,
            kwargs=singd("dense", kfac_approx="reduce", distribute_factors=True),
        ),
    )
    jobs["singd-dense-graft-distributed-ddp"] = (  # the owner grafts, the others receive
        "run",
        dict(
            optimizer="singd",
            ddp=True,
            kwargs=singd("dense", graft="adam", distribute_factors=True),
        ),
    )
    jobs["kfac-graft-replicated-plain"] = (
        "run",
        dict(optimizer="kfac", dtype=F64, kwargs=dict(lr=0.05, T=3, graft="rms")),
    )
    jobs["adafisher-graft-distributed-ddp"] = (  # the grafted, unfused AdaFisher step
        "run",
        dict(
            optimizer="adafisher",
            ddp=True,
            dtype=F64,
            kwargs=dict(lr=0.05, T=2, graft="adam", weight_decay=1e-2, distribute_factors=True),
        ),
    )
    jobs["adafisher-graft-replicated-plain"] = (
        "run",
        dict(optimizer="adafisher", dtype=F64, kwargs=dict(lr=0.05, T=2, graft="rms")),
    )
    jobs["kfac-reduce-replicated-plain"] = (
        "run",
        dict(optimizer="kfac", dtype=F64, kwargs=dict(lr=0.05, T=3, kfac_approx="reduce")),
    )
    jobs["singd-block_diagonal:4-distributed-subgroup"] = (
        "subgroup",
        dict(optimizer="singd", kwargs=singd("block_diagonal:4", distribute_factors=True)),
    )
    return jobs


JOBS = _jobs()
CHECKPOINTS = {
    "singd-block_diagonal:4-distributed-plain": dict(
        optimizer="singd", kwargs=singd("block_diagonal:4", distribute_factors=True)
    ),
    "singd-dense-replicated-ddp": dict(optimizer="singd", ddp=True, kwargs=singd("dense")),
    "kfac-distributed-ddp": JOBS["kfac-distributed-ddp"][1],
}


def _counts() -> dict[str, dict]:
    """Collective-count jobs: SINGD block_diagonal:4 and K-FAC, T = 3, 10 steps."""
    counts = {}
    for mode in ("replicated", "distributed"):
        for ddp in (True, False):
            counts[f"count-block-{mode}-{'ddp' if ddp else 'plain'}"] = dict(
                optimizer="singd",
                ddp=ddp,
                kwargs=singd("block_diagonal:4", distribute_factors=mode == "distributed"),
            )
    counts["count-block-replicated-ddp-inner"] = dict(  # DDP seen through .module
        optimizer="singd", ddp=True, pass_inner=True, kwargs=singd("block_diagonal:4")
    )
    counts["count-kfac-distributed-plain"] = dict(
        optimizer="kfac", kwargs=dict(lr=0.05, T=3, distribute_factors=True)
    )
    for mode in ("replicated", "distributed"):
        counts[f"count-block-{mode}-plain-tinycap"] = dict(
            optimizer="singd",
            kwargs=singd(
                "block_diagonal:4",
                distribute_factors=mode == "distributed",
                bucket_cap_mb=256 / 2**20,  # 256-byte buckets
            ),
        )
    return counts


COUNTS = _counts()
# The last rank gets an empty batch (a summed loss: zero gradients) or sits the steps out
# (no forward, no backward): both must equal training without that rank.
STARVED = {
    f"{name}-{starved}-rank": dict(optimizer=name, starved=starved, dtype=F64, kwargs=kwargs)
    for name, kwargs in (
        ("singd", singd("dense")),
        ("adafisher", dict(lr=0.05, T=3)),
        ("kfac", dict(lr=0.05, T=3, distribute_factors=True)),
    )
    for starved in ("empty", "idle")
}
ALL = (
    [(key, job) for key, job in JOBS.items()]
    + [(key, ("run", c)) for key, c in STARVED.items()]
    + [(f"checkpoint:{key}", ("checkpoint", c)) for key, c in CHECKPOINTS.items()]
    + [(key, ("count", c)) for key, c in COUNTS.items()]
)
