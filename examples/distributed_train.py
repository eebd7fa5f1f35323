"""Data-parallel training with SINGD under torchrun (CPU with gloo, GPUs with NCCL).

CPU, 2 processes:
    torchrun --standalone --nproc_per_node=2 examples/distributed_train.py
GPUs, one process per GPU (here 8 on one node):
    torchrun --standalone --nproc_per_node=8 examples/distributed_train.py --device cuda

Each rank trains on its own shard of every batch of a synthetic classification task.
``--ddp`` wraps the model in DistributedDataParallel (otherwise the optimizer averages
the gradients itself); ``--distribute-factors`` lets each rank update only the layers
it owns. ``--checkpoint PATH`` saves the full optimizer state halfway (gathered with
``full_state_dict``) and ``--resume`` continues from it.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from singd_cuda import SINGD
from singd_cuda.distributed import Piecewise, Warmup


def make_model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, 10),
    )


def synthetic_batches(steps: int, batch: int, seed: int = 0):
    """Noisy copies of 10 random class prototypes, identical on every rank."""
    gen = torch.Generator().manual_seed(seed)
    prototypes = torch.randn(10, 3, 8, 8, generator=gen)
    for _ in range(steps):
        y = torch.randint(0, 10, (batch,), generator=gen)
        yield prototypes[y] + 1.5 * torch.randn(batch, 3, 8, 8, generator=gen), y


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch", type=int, default=64, help="global batch size")
    parser.add_argument("--structures", default="block_diagonal:16")
    parser.add_argument("--ddp", action="store_true")
    parser.add_argument("--distribute-factors", action="store_true")
    parser.add_argument("--checkpoint", default=None)
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()

    if args.device == "cuda":  # one GPU per process, picked by torchrun's LOCAL_RANK
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.batch % world:
        raise SystemExit(f"--batch {args.batch} must be divisible by the world size {world}")

    torch.manual_seed(0)  # the same initial model on every rank
    model = make_model().to(device)
    if args.ddp:
        wrapped = DistributedDataParallel(
            model, device_ids=[device] if device.type == "cuda" else None
        )
    else:
        wrapped = model
    opt = SINGD(
        wrapped,
        lr=0.05,
        momentum=0.9,
        structures=args.structures,
        T=Piecewise([1, 5], [20]),  # refresh the factors every step at first, then every 5
        damping=Warmup(start=1e-1, target=1e-3, steps=30),
        norm_fisher=True,  # BatchNorm affine parameters: diagonal Fisher
        distribute_factors=args.distribute_factors,
    )
    start = 0
    if args.resume:
        saved = torch.load(args.checkpoint, map_location=device, weights_only=True)
        model.load_state_dict(saved["model"])
        opt.load_full_state_dict(saved["optimizer"])
        start = saved["step"]

    shard = args.batch // world
    for step, (x, y) in enumerate(synthetic_batches(args.steps, args.batch)):
        if step < start:
            continue
        x = x[rank * shard : (rank + 1) * shard].to(device)
        y = y[rank * shard : (rank + 1) * shard].to(device)
        opt.zero_grad()
        loss = F.cross_entropy(wrapped(x), y)
        loss.backward()
        opt.step()
        if step % 10 == 0 or step == args.steps - 1:
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            if rank == 0:
                print(f"step {step:4d}  loss {mean.item() / world:.4f}", flush=True)
        if args.checkpoint and not args.resume and step == args.steps // 2:
            full = opt.full_state_dict()  # a collective: every rank calls it
            if rank == 0:
                torch.save(
                    {"model": model.state_dict(), "optimizer": full, "step": step + 1},
                    args.checkpoint,
                )
                print(f"saved {args.checkpoint} after step {step}", flush=True)
    dist.barrier()  # nobody tears its connections down while another rank still talks
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
