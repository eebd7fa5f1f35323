"""The model, data and training runs shared by the distributed tests.

A run trains a small model (a strided Conv2d, a Linear followed by LayerNorm, and a
bias-free Linear head) for ``STEPS`` steps on batches of ``BATCH`` samples; rank r of
N trains on samples [r·B/N, (r+1)·B/N) of each batch, a single process on all of them.
"""

from __future__ import annotations

import io
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from singd_cuda import KFAC, SINGD, AdaFisher

BATCH, STEPS = 12, 10
OPTIMIZERS = {"singd": SINGD, "kfac": KFAC, "adafisher": AdaFisher}
# (name, d_K, d_C) of the preconditioned layers, in model order
LAYER_DIMS = [("conv", 2 * 9 + 1, 3), ("fc1", 12 + 1, 9), ("fc2", 9, 4)]


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, stride=2, padding=1)  # (2, 4, 4) -> (3, 2, 2)
        self.fc1 = nn.Linear(12, 9)
        self.norm = nn.LayerNorm(9)
        self.fc2 = nn.Linear(9, 4, bias=False)

    def forward(self, x):
        h = torch.tanh(self.conv(x)).flatten(1)
        h = torch.tanh(self.norm(self.fc1(h)))
        return self.fc2(h)


def make_model(seed: int = 0, dtype=torch.float32) -> Net:
    torch.manual_seed(seed)
    return Net().to(dtype)


def batches(steps: int = STEPS, seed: int = 1, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(BATCH, 2, 4, 4, generator=gen, dtype=dtype),
            torch.randint(0, 4, (BATCH,), generator=gen),
        )
        for _ in range(steps)
    ]


def shard(tensor, rank: int, world: int):
    size = tensor.shape[0] // world
    return tensor[rank * size : (rank + 1) * size]


def build(config: dict, model: nn.Module, ddp: bool):
    wrapped = DistributedDataParallel(model) if ddp else model
    target = model if (ddp and config.get("pass_inner")) else wrapped
    opt = OPTIMIZERS[config["optimizer"]](target, **config.get("kwargs", {}))
    return wrapped, opt


def train_steps(
    wrapped, opt, data, rank: int, world: int, config: dict | None = None, on_step=None, start=0
) -> None:
    """Train on ``data`` (the steps numbered from ``start``). ``config`` may ask for
    ``micro`` micro-batches, a GradScaler (``scaler``: its initial scale), an inf
    written into the last rank's fc1 gradient at step ``inf_step``, a last rank that is
    ``starved`` ("empty": a batch of 0 samples; "idle": no forward or backward), and for
    a single process only the first ``samples`` samples of each batch."""
    config = config or {}
    micro = config.get("micro", 1)
    scaler = config.get("_scaler")
    starved = config.get("starved") if rank == world - 1 and world > 1 else None
    for t, (x, y) in enumerate(data, start=start):
        x, y = shard(x, rank, world), shard(y, rank, world)
        if "samples" in config:
            x, y = x[: config["samples"]], y[: config["samples"]]
        if starved == "empty":
            x, y = x[:0], y[:0]
        opt.zero_grad()
        for xm, ym in zip(x.chunk(micro), y.chunk(micro), strict=True):
            if starved == "idle":
                break
            loss = F.cross_entropy(wrapped(xm), ym, reduction="sum") / max(len(ym), 1) / micro
            (scaler.scale(loss) if scaler else loss).backward()
        if t == config.get("inf_step") and rank == world - 1:
            opt.model.fc1.weight.grad[0, 0] = float("inf")
        if on_step is not None:
            on_step(opt)
        elif scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()


def params_of(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def run(config: dict, rank: int = 0, world: int = 1) -> dict[str, Any]:
    """Train ``STEPS`` steps as ``config`` says; the parameters and a few facts after."""
    ddp = config.get("ddp", False) and world > 1
    dtype = config.get("dtype", torch.float32)
    model = make_model(dtype=dtype)
    wrapped, opt = build(config, model, ddp)
    if "scaler" in config:
        config = {**config, "_scaler": torch.amp.GradScaler("cpu", init_scale=config["scaler"])}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train_steps(wrapped, opt, batches(dtype=dtype), rank, world, config)
    owned_state = sorted(layer.name for layer in opt.layers if opt.state.get(layer.weight))
    return {
        "params": params_of(model),
        "layers_with_state": owned_state,
        "warnings": [str(w.message) for w in caught],
        "steps": opt.param_groups[0]["step"],
    }


def run_checkpointed(config: dict, rank: int = 0, world: int = 1) -> dict[str, Any]:
    """Train half the steps, save the full state (torch.save, weights_only load), build a
    fresh model and optimizer, restore both, train the other half."""
    dtype = config.get("dtype", torch.float32)
    data = batches(dtype=dtype)
    half = len(data) // 2
    ddp = config.get("ddp", False) and world > 1
    model = make_model(dtype=dtype)
    wrapped, opt = build(config, model, ddp)
    train_steps(wrapped, opt, data[:half], rank, world)
    half_params = params_of(model)
    full = opt.full_state_dict()
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": full}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    restored = make_model(seed=123, dtype=dtype)
    restored.load_state_dict(saved["model"])
    wrapped, opt = build(config, restored, ddp)
    opt.load_full_state_dict(saved["opt"])
    train_steps(wrapped, opt, data[half:], rank, world, start=half)
    return {
        "params": params_of(restored),
        "half_params": half_params,
        "full_state": full if rank == 0 else None,
        "shard_state_sizes": len(opt.state_dict()["state"]),
    }


def count_collectives(config: dict, rank: int, world: int) -> dict[str, Any]:
    """Per step, the collectives torch.distributed saw: [(name, bytes of the input)]."""
    names = [
        "all_reduce",
        "all_gather_single",
        "all_gather_into_tensor",
        "all_gather",
        "broadcast",
        "reduce",
        "reduce_scatter_single",
        "reduce_scatter_tensor",
        "all_gather_object",
        "broadcast_object_list",
        "all_to_all_single",
    ]
    log: list[tuple[str, int]] = []
    originals = {n: getattr(dist, n) for n in names if hasattr(dist, n)}

    def counting(name, fn):
        def wrapper(*args, **kwargs):
            tensor = args[1] if name.startswith(("all_gather_", "reduce_scatter_")) else args[0]
            size = tensor.numel() * tensor.element_size() if torch.is_tensor(tensor) else -1
            log.append((name, size))
            return fn(*args, **kwargs)

        return wrapper

    for name, fn in originals.items():
        setattr(dist, name, counting(name, fn))
    try:
        ddp = config.get("ddp", False)
        model = make_model()
        wrapped, opt = build(config, model, ddp)
        per_step: list[list[tuple[str, int]]] = []

        def step(opt) -> None:
            log.clear()
            opt.step()
            per_step.append(list(log))

        train_steps(wrapped, opt, batches(), rank, world, on_step=step)
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    return {"per_step": per_step, "params": params_of(model)}


def run_in_subgroup(config: dict, rank: int, world: int) -> dict[str, Any]:
    """Ranks 0 and 1 train together in a new group (``process_group=``); others idle."""
    group = dist.new_group([0, 1])  # every rank must call new_group
    if rank > 1:
        return {}
    config = {**config, "kwargs": {**config.get("kwargs", {}), "process_group": group}}
    return run(config, rank, 2)


def run_many(rank: int, world: int, jobs: list[tuple[str, dict]]) -> list[dict]:
    """Entry point for :func:`launch`: every (kind, config) job in one process group."""
    kinds = {
        "run": run,
        "checkpoint": run_checkpointed,
        "count": count_collectives,
        "subgroup": run_in_subgroup,
    }
    return [kinds[kind](config, rank, world) for kind, config in jobs]
