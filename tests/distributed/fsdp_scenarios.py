"""FSDP2 runs (``fully_shard`` on every Linear and on the root) against one process.

The MLP's layers have 7, 5, 3 and 1 output rows: on 2 ranks the shards are uneven and
rank 1 holds no row of ``shift``; on 4 the last rank holds no row of fc2, fc3 and
``shift`` (torch.chunk's sharding). Rank r of N trains
on samples [r·B/N, (r+1)·B/N) of each batch with a mean loss (FSDP averages the
gradients over the ranks), a single process on all of them with the plain model.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from singd_cuda import KFAC, SINGD, AdaFisher
from singd_cuda.optim.finite import tensors_of

BATCH, STEPS = 8, 6
F64 = torch.float64
OPTIMIZERS = {"singd": SINGD, "kfac": KFAC, "adafisher": AdaFisher}


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 7)
        self.norm = nn.LayerNorm(7)
        self.fc2 = nn.Linear(7, 5)
        self.fc3 = nn.Linear(5, 3, bias=False)
        self.shift = nn.Linear(5, 1)  # fewer rows than ranks

    def forward(self, x):
        h = torch.tanh(self.fc2(torch.tanh(self.norm(self.fc1(x)))))
        return self.fc3(h) + self.shift(h)


def make_model(dtype=torch.float32, seed: int = 0) -> MLP:
    torch.manual_seed(seed)
    return MLP().to(dtype)


def shard_model(model: nn.Module, mesh=None) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for module in model.modules():
        if isinstance(module, nn.Linear):
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def batches(dtype, steps: int = STEPS, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(BATCH, 6, generator=gen, dtype=dtype),
            torch.randint(0, 3, (BATCH,), generator=gen),
        )
        for _ in range(steps)
    ]


def full_params(model: nn.Module) -> list[torch.Tensor]:
    """Every parameter as a whole tensor (DTensors gathered: a collective)."""
    out = []
    for p in model.parameters():
        value = p.full_tensor() if hasattr(p, "full_tensor") else p
        out.append(value.detach().clone())
    return out


COUNTED = ("all_reduce", "all_gather_single", "all_gather_into_tensor", "all_to_all_single")


def train(model, opt, data, rank: int, world: int, start: int = 0) -> list[list[str]]:
    """Train on ``data`` from step ``start``; the collectives each ``opt.step()`` issued."""
    size = BATCH // world
    log: list[str] = []
    originals = {name: getattr(dist, name) for name in COUNTED}

    def counting(name, fn):
        def wrapper(*args, **kwargs):
            log.append(name)
            return fn(*args, **kwargs)

        return wrapper

    per_step = []
    for x, y in data[start:]:
        x, y = x[rank * size : (rank + 1) * size], y[rank * size : (rank + 1) * size]
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        log.clear()
        for name, fn in originals.items():
            setattr(dist, name, counting(name, fn))
        try:
            opt.step()
        finally:
            for name, fn in originals.items():
                setattr(dist, name, fn)
        per_step.append(list(log))
    return per_step


def run(config: dict, rank: int = 0, world: int = 1) -> dict[str, Any]:
    """Train ``STEPS`` steps (sharded when world > 1 or ``config["shard"]``)."""
    dtype = config.get("dtype", torch.float32)
    model = make_model(dtype)
    if world > 1 or config.get("shard"):
        mesh = None
        if "mesh" in config:  # HSDP: (replicas, shards)
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh("cpu", config["mesh"], mesh_dim_names=("replicate", "shard"))
        shard_model(model, mesh)
    try:
        opt = OPTIMIZERS[config["optimizer"]](model, **config["kwargs"])
        collectives = train(model, opt, batches(dtype), rank, world)
    except NotImplementedError as error:
        if not config.get("expect_error"):
            raise
        return {"error": str(error)}
    factor_bytes = sum(
        t.numel() * t.element_size()
        for layer in opt.layers
        for key, value in opt.state.get(layer.weight, {}).items()
        if key not in ("momentum_buffer", "exp_avg")  # shaped like the (local) parameter
        for t in tensors_of(value)
    )
    return {"params": full_params(model), "factor_bytes": factor_bytes, "collectives": collectives}


def run_many(rank: int, world: int, jobs: list[dict]) -> list[dict]:
    """Entry point for the launcher: every job in one process group."""
    return [run(config, rank, world) for config in jobs]


def build(config: dict, world: int):
    dtype = config.get("dtype", torch.float32)
    model = make_model(dtype, seed=config.get("seed", 0))
    if world > 1:
        shard_model(model)
    return model, OPTIMIZERS[config["optimizer"]](model, **config["kwargs"])


def save_checkpoint(config: dict, rank: int, world: int) -> dict[str, Any]:
    """Train half the steps, save model and optimizer with DCP (sharded) and, from rank
    0, the full optimizer state of ``get_optimizer_state_dict(full_state_dict=True)``
    and of ``opt.full_state_dict()`` (only the latter under ``distribute_factors``, where
    the ranks hold different layers' factors); then train on (the uninterrupted run)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    data = batches(config.get("dtype", torch.float32))
    model, opt = build(config, world)
    train(model, opt, data[: STEPS // 2], rank, world)
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.save(state, checkpoint_id=config["path"])
    full = None
    if not config["kwargs"].get("distribute_factors"):  # else keys differ between ranks
        full_options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        full = get_optimizer_state_dict(model, opt, options=full_options)
    own_full = opt.full_state_dict()
    if rank == 0:
        torch.save({"torch": full, "own": own_full}, f"{config['path']}/full.pt")
    train(model, opt, data, rank, world, start=STEPS // 2)
    return {"params": full_params(model)}


def load_checkpoint(config: dict, rank: int, world: int) -> dict[str, Any]:
    """A fresh model and optimizer (another seed) restored as ``config["load"]`` says
    ("dcp", "torch-full" or "own-full"), then the second half of the steps."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    data = batches(config.get("dtype", torch.float32))
    model, opt = build({**config, "seed": 123}, world)
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=config["path"])
    set_model_state_dict(model, state["model"])
    if config["load"] == "dcp":
        set_optimizer_state_dict(model, opt, state["optim"])
    else:
        full = torch.load(f"{config['path']}/full.pt", weights_only=True)
        if config["load"] == "torch-full":
            options = StateDictOptions(full_state_dict=True)
            set_optimizer_state_dict(model, opt, full["torch"], options=options)
        else:
            opt.load_full_state_dict(full["own"])
    train(model, opt, data, rank, world, start=STEPS // 2)
    return {"params": full_params(model)}


def run_checkpoint_jobs(rank: int, world: int, jobs: list[tuple[str, dict]]) -> list[dict]:
    """Entry point for the launcher: ("save" | "load", config) jobs in order."""
    from singd_cuda.optim.checkpoint import CheckpointMismatchError

    kinds = {"save": save_checkpoint, "load": load_checkpoint}
    results = []
    for kind, config in jobs:
        try:
            results.append(kinds[kind](config, rank, world))
        except CheckpointMismatchError as error:
            if not config.get("expect_error"):
                raise
            results.append({"error": str(error)})
    return results
