"""A checkpoint refused on one rank is refused on every rank.

A rank checks only the state it holds: its shards under FSDP2 (DCP's sharded load),
the factors of its own layers under ``distribute_factors``, its own copy under DDP. With
a non-finite value in the part of one rank only, that rank refused while the others
loaded, and the ranks went on in different states. The verdict is agreed (one all-reduce
of a flag): every rank raises, every rank's state is as it was, and the ranks train on
in step. Every rank runs every job in one launch, whose hard timeout turns a hang into a
failure."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from singd_cuda import KFAC, SINGD
from singd_cuda.optim.checkpoint import CheckpointMismatchError
from singd_cuda.optim.finite import tensors_of

from . import fsdp_scenarios as fs
from . import scenarios as sc
from .launch import launch

JOBS = {
    "fsdp-dcp": dict(fsdp=True, owned=False),
    "fsdp-owned-dcp": dict(fsdp=True, owned=True),
    "ddp": dict(fsdp=False, owned=False),
    "ddp-owned": dict(fsdp=False, owned=True),
}
BAD = 1  # the rank whose part of the checkpoint holds a NaN


def _build(job: dict):
    """(model to call, model to read, optimizer)."""
    if job["fsdp"]:
        model = fs.shard_model(fs.make_model())
        opt = SINGD(model, structures="dense", lr=0.05, T=1, distribute_factors=job["owned"])
        return model, model, opt
    model = sc.make_model()
    wrapped = torch.nn.parallel.DistributedDataParallel(model)
    return wrapped, model, KFAC(wrapped, lr=0.05, T=1, distribute_factors=job["owned"])


def _data(job: dict, rank: int, world: int, steps: int):
    data = fs.batches(torch.float32, steps=steps) if job["fsdp"] else sc.batches(steps=steps)
    return [(sc.shard(x, rank, world), sc.shard(y, rank, world)) for x, y in data]


def _train(wrapped, opt, data) -> None:
    for x, y in data:
        opt.zero_grad()
        F.cross_entropy(wrapped(x), y).backward()
        opt.step()


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor  # DTensor


def _snapshot(opt) -> list:
    """Every state tensor (this rank's part) and every group's step, copied."""
    tensors = [_local(t).clone() for state in opt.state.values() for t in tensors_of(state)]
    return [group["step"] for group in opt.param_groups] + tensors


def _spoilt(state_dict: dict) -> dict:
    """A copy of ``state_dict`` with a NaN in this rank's part: its first non-empty shard
    of a sharded tensor (DCP saves one copy of a replicated one, rank 0's), or else its
    first non-empty tensor (the tensors of a state_dict are the optimizer's own)."""
    state_dict = copy.deepcopy(state_dict)
    tensors = [t for state in state_dict["state"].values() for t in tensors_of(state)]
    tensors.sort(key=lambda t: not hasattr(t, "to_local"))  # stable: sharded ones first
    local = next(_local(t) for t in tensors if _local(t).numel())
    local.view(-1)[0] = float("nan")
    return state_dict


def _load(job: dict, wrapped, model, opt, rank: int, path: str) -> None:
    """Save this optimizer's state, NaN in rank BAD's part, and load it back: by DCP
    (sharded, the spoilt shard written by rank BAD) or, under DDP, from each rank's
    own copy."""
    if not job["fsdp"]:
        state_dict = opt.state_dict()
        opt.load_state_dict(_spoilt(state_dict) if rank == BAD else state_dict)
        return
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    saved = get_optimizer_state_dict(model, opt)
    dcp.save({"optim": _spoilt(saved) if rank == BAD else saved}, checkpoint_id=path)
    template = {"optim": copy.deepcopy(get_optimizer_state_dict(model, opt))}
    dcp.load(template, checkpoint_id=path)
    set_optimizer_state_dict(model, opt, template["optim"])


def _run(rank: int, world: int, config: tuple[str, dict]) -> dict:
    (key, job), root = config
    wrapped, model, opt = _build(job)
    data = _data(job, rank, world, steps=3)
    _train(wrapped, opt, data[:2])
    before = _snapshot(opt)
    error = None
    try:
        _load(job, wrapped, model, opt, rank, f"{root}/{key}")
    except CheckpointMismatchError as caught:
        error = str(caught)
    unchanged = all(
        a == b if isinstance(a, int) else torch.equal(a, b)
        for a, b in zip(before, _snapshot(opt), strict=True)
    )
    _train(wrapped, opt, data[2:])  # the ranks are still in step: no hang, equal params
    return {"error": error, "unchanged": unchanged, "params": fs.full_params(model)}


def _run_all(rank: int, world: int, config: tuple[list, str]) -> list[dict]:
    jobs, root = config
    return [_run(rank, world, (job, root)) for job in jobs]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, list[dict]]:
    root = str(tmp_path_factory.mktemp("dcp"))
    per_rank = launch(2, _run_all, (list(JOBS.items()), root), timeout=120)
    return {key: [r[i] for r in per_rank] for i, key in enumerate(JOBS)}


@pytest.mark.parametrize("key", list(JOBS))
def test_a_state_refused_on_one_rank_is_refused_on_every_rank(results, key):
    ranks = results[key]
    assert "non-finite" in ranks[BAD]["error"]
    for rank, result in enumerate(ranks):
        assert result["error"] is not None, f"rank {rank} loaded what rank {BAD} refused"
        assert result["unchanged"], f"rank {rank}"
    assert "1 other rank(s) of the process group refused" in ranks[1 - BAD]["error"]
    for a, b in zip(ranks[0]["params"], ranks[1]["params"], strict=True):
        assert torch.equal(a, b)
