"""A fault on one rank only is a skip on every rank: the non-finite flags are agreed
(one all-reduce) before anything is written, so the ranks skip the same steps, keep
bitwise-equal parameters and equal step counters, and each warns.

The faults: an inf written into the last rank's gradient after DDP has averaged the
gradients, and a float16 factor that overflows where only its owner updates it
(``distribute_factors=True``: before, the owner skipped while the others waited in the
parameter all-gather until the timeout). Plain (optimizer-averaged) runs and FSDP2 are
checked with the same gradient fault. Every rank runs every job in one launch, whose
hard timeout turns a deadlock into a failure."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from singd_cuda import KFAC, SINGD

from . import fsdp_scenarios as fs
from . import scenarios as sc
from .launch import launch

STEPS, FAULT = 4, 2
SKIPPED = [1, 2, 2, 3]  # the step counter after each step: the fault step counts nothing

JOBS = {
    f"{name}-{fault}-{nonfinite}": dict(name=name, fault=fault, nonfinite=nonfinite)
    for nonfinite in ("warn", "device")
    for name, fault in [
        ("kfac-ddp", "gradient"),
        ("singd-ddp", "gradient"),
        ("singd-owned-ddp", "gradient"),
        ("kfac-owned", "gradient"),
        ("kfac-plain", "gradient"),
        ("singd-fsdp", "gradient"),
        ("kfac-owned", "overflow"),
        ("kfac-owned-ddp", "overflow"),
    ]
}
MESSAGES = {
    "gradient": "non-finite gradient",
    "overflow": "a factor update produced non-finite values",
}


def _build(job: dict, world: int):
    """(model to call, model to read, optimizer) of a job."""
    name, kwargs = job["name"], dict(lr=0.05, T=1, nonfinite=job["nonfinite"])
    if name.startswith("singd-fsdp"):
        model = fs.shard_model(fs.make_model())
        return model, model, SINGD(model, structures="dense", **kwargs)
    model = sc.make_model()
    wrapped = torch.nn.parallel.DistributedDataParallel(model) if "ddp" in name else model
    kwargs["distribute_factors"] = "owned" in name
    if name.startswith("kfac"):
        # float16 factors: large inputs overflow the conv layer's A on its owner only
        opt = KFAC(wrapped, factor_dtype=torch.float16, T_inv=1, **kwargs)
    else:
        opt = SINGD(wrapped, structures="dense", **kwargs)
    return wrapped, model, opt


def _data(job: dict, rank: int, world: int):
    if job["name"].startswith("singd-fsdp"):
        data = fs.batches(torch.float32, steps=STEPS)
    else:
        data = sc.batches(steps=STEPS)
    return [(sc.shard(x, rank, world), sc.shard(y, rank, world)) for x, y in data]


def _run(job: dict, rank: int, world: int) -> dict:
    wrapped, model, opt = _build(job, world)
    steps = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for t, (x, y) in enumerate(_data(job, rank, world)):
            if t == FAULT and job["fault"] == "overflow":
                x = 3000.0 * x  # (1 − ρ)·aᵀa/N of the conv layer beyond float16's 65504
            opt.zero_grad()
            F.cross_entropy(wrapped(x), y).backward()
            if t == FAULT and job["fault"] == "gradient" and rank == world - 1:
                grad = next(p.grad for p in model.parameters() if p.grad is not None)
                local = grad.to_local() if hasattr(grad, "to_local") else grad  # FSDP2
                local.view(-1)[0] = float("inf")  # after DDP's all-reduce: this rank only
            opt.step()
            steps.append(opt.param_groups[0]["step"])
    return {
        "params": [p.detach().clone() for p in fs.full_params(model)],
        "steps": steps,
        "warnings": [str(w.message) for w in caught],
    }


def _run_all(rank: int, world: int, jobs: list[dict]) -> list[dict]:
    return [_run(job, rank, world) for job in jobs]


@pytest.fixture(scope="module")
def results() -> dict[str, list[dict]]:
    per_rank = launch(2, _run_all, list(JOBS.values()), timeout=90)
    return {key: [r[i] for r in per_rank] for i, key in enumerate(JOBS)}


@pytest.mark.parametrize("key", list(JOBS))
def test_a_fault_on_one_rank_is_a_skip_on_every_rank(results, key):
    message = MESSAGES[JOBS[key]["fault"]]
    ranks = results[key]
    for rank, result in enumerate(ranks):
        assert result["steps"] == SKIPPED, f"rank {rank}"
        assert any(message in w for w in result["warnings"]), f"rank {rank}"
        assert all(torch.isfinite(p).all() for p in result["params"])
        for a, b in zip(ranks[0]["params"], result["params"], strict=True):
            assert torch.equal(a, b), f"rank {rank}"
