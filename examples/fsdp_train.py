"""Sharded training (FSDP2) of a Hugging Face LLaMA with SINGD, checkpointed with DCP.

CPU, 2 processes (gloo):
    torchrun --standalone --nproc_per_node=2 examples/fsdp_train.py
GPUs, one process per GPU (NCCL):
    torchrun --standalone --nproc_per_node=8 examples/fsdp_train.py --device cuda --hidden 2048

The model is built from a ``LlamaConfig`` (random weights, nothing is downloaded); every
decoder layer and the root are ``fully_shard``-ed, so each rank holds 1/world of every
parameter. It trains on a synthetic next-token task (a fixed random bigram table), saves
the model and optimizer with ``torch.distributed.checkpoint`` halfway, restores both into
a fresh model and optimizer, and finishes training. ``--distribute-factors`` lets each
rank hold the factors of its own layers only.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import LlamaConfig, LlamaForCausalLM

from singd_cuda import SINGD


def build(args, device: str, mesh) -> tuple[torch.nn.Module, SINGD]:
    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=int(args.hidden * 8 / 3) // 8 * 8,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        max_position_embeddings=args.seq,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(device)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = SINGD(
        model,
        lr=args.lr,
        structures=args.structures,
        T=5,
        lr_cov=0.05,
        distribute_factors=args.distribute_factors,
    )
    return model, opt


def batches(args, steps: int, rank: int, world: int, device: str):
    """Each rank's shard of every global batch of a bigram language (seeded alike)."""
    gen = torch.Generator().manual_seed(1)
    table = torch.randint(0, args.vocab, (args.vocab,), generator=gen)
    per_rank = args.batch // world
    for _ in range(steps):
        start = torch.randint(0, args.vocab, (args.batch, 1), generator=gen)
        tokens = [start]
        for _ in range(args.seq - 1):
            noise = torch.rand(args.batch, 1, generator=gen) < 0.1
            random = torch.randint(0, args.vocab, (args.batch, 1), generator=gen)
            tokens.append(torch.where(noise, random, table[tokens[-1]]))
        tokens = torch.cat(tokens, dim=1)
        yield tokens[rank * per_rank : (rank + 1) * per_rank].to(device)


def train(model, opt, data, log_from: int) -> float:
    loss = float("nan")
    for step, tokens in enumerate(data, start=log_from):
        opt.zero_grad()
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        opt.step()
        if dist.get_rank() == 0 and step % 5 == 0:
            print(f"step {step:3d}  loss {loss.item():.4f}", flush=True)
    return loss.item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--structures", default="block_diagonal:32")
    parser.add_argument("--distribute-factors", action="store_true")
    parser.add_argument("--checkpoint", default=None, help="DCP directory (default: a temp dir)")
    args = parser.parse_args()

    backend = "nccl" if args.device == "cuda" else "gloo"
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = args.device
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        device = f"cuda:{torch.cuda.current_device()}"
    mesh = init_device_mesh(args.device, (world,))
    path = args.checkpoint
    if path is None:
        path = [tempfile.mkdtemp(prefix="fsdp_ckpt_") if rank == 0 else None]
        dist.broadcast_object_list(path)
        path = path[0]

    model, opt = build(args, device, mesh)
    data = list(batches(args, args.steps, rank, world, device))
    half = args.steps // 2
    train(model, opt, data[:half], 0)

    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.save(state, checkpoint_id=path)
    if rank == 0:
        print(f"saved model and optimizer with DCP to {path}", flush=True)
    del model, opt, state

    model, opt = build(args, device, mesh)  # fresh; any world size could load it
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])
    final = train(model, opt, data[half:], half)
    if rank == 0:
        print(f"restored and finished: final loss {final:.4f} on {world} rank(s)", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
