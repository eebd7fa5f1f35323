"""Sharded training (FSDP2) of a Hugging Face LLaMA with SINGD, checkpointed with DCP.

CPU, 2 processes (gloo):
    torchrun --standalone --nproc_per_node=2 examples/fsdp_train.py
GPUs, one process per GPU (NCCL):
    torchrun --standalone --nproc_per_node=8 examples/fsdp_train.py --device cuda --hidden 2048

The model is built from a ``LlamaConfig`` (random weights, nothing is downloaded); every
decoder layer and the root are ``fully_shard``-ed, so each rank holds 1/world of every
parameter. It trains on a synthetic next-token task (a fixed random bigram table) and
prints the loss of the whole global batch (averaged over the ranks). Halfway it saves
the model and optimizer with ``torch.distributed.checkpoint``, trains on to the end
(the uninterrupted run), then restores the checkpoint into a fresh model and optimizer,
trains the second half again and checks that its losses equal the uninterrupted run's.
The checkpoint goes to ``--checkpoint`` (kept) or to a temporary folder (removed).
``--distribute-factors`` lets each rank hold the factors of its own layers only.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
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


def train(model, opt, data, first_step: int, log: bool) -> list[float]:
    """Train on ``data``; every step's loss over the global batch (all ranks alike)."""
    losses = []
    for step, tokens in enumerate(data, start=first_step):
        opt.zero_grad()
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        opt.step()
        # Every rank's shard has as many tokens, so the mean of the ranks' means is the
        # global batch's mean (gloo has no ReduceOp.AVG).
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / dist.get_world_size())
        if log and dist.get_rank() == 0 and step % 5 == 0:
            print(f"step {step:3d}  loss {losses[-1]:.4f}", flush=True)
    return losses


def checkpoint_state(model, opt) -> dict:
    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}


def run(args, device: str, path: str) -> str | None:
    """Train, checkpoint, resume; the resume check's failure (None when it holds)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    say = print if rank == 0 else lambda *_, **__: None
    mesh = init_device_mesh(args.device, (world,))
    data = list(batches(args, args.steps, rank, world, device))
    half = args.steps // 2

    model, opt = build(args, device, mesh)
    first = train(model, opt, data[:half], 0, log=True)
    dcp.save(checkpoint_state(model, opt), checkpoint_id=path)
    say(f"saved model and optimizer with DCP to {path}", flush=True)
    uninterrupted = train(model, opt, data[half:], half, log=False)
    del model, opt

    model, opt = build(args, device, mesh)  # fresh; any world size could load it
    state = checkpoint_state(model, opt)
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])
    say(f"restored into a fresh model and optimizer; training steps {half}-{args.steps - 1}")
    resumed = train(model, opt, data[half:], half, log=True)

    if resumed != uninterrupted:
        worst = max(abs(a - b) for a, b in zip(resumed, uninterrupted, strict=True))
        return f"resume check failed: the losses after the restore differ by up to {worst:.3g}"
    say(
        f"resume check: the {len(resumed)} losses after the restore equal the "
        "uninterrupted run's, bit for bit"
    )
    head, tail = first[:5], resumed[-5:]
    say(
        f"mean loss {sum(head) / len(head):.4f} over steps 0-{len(head) - 1} -> "
        f"{sum(tail) / len(tail):.4f} over steps {args.steps - len(tail)}-{args.steps - 1} "
        f"(global batch of {args.batch} sequences over {world} rank(s))",
        flush=True,
    )
    return None


def release_process_group() -> None:
    """Destroy the process group so that its threads end while the interpreter is alive.

    ``destroy_process_group()`` only forgets the group; gloo's threads end when the last
    reference to it goes. DTensor's sharding caches hold it through the device mesh (cleared
    here), and the sharded modules and the caches' planners in reference cycles
    (``gc.collect`` frees them).
    Left to the interpreter's exit, a gloo thread still running while the interpreter
    finalises can abort the process ("terminate called without an active exception").
    The caches are torch's private ones (2.14); tests/distributed/test_fsdp_example.py
    checks that no gloo thread is alive when the interpreter starts to exit.
    """
    from torch.distributed.tensor import _collective_utils, _redistribute
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()
    _redistribute.clear_redistribute_planner_cache()
    _redistribute._gen_transform_infos.cache_clear()
    _collective_utils.MeshTopoInfo.build_from_mesh.cache_clear()
    gc.collect()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--structures", default="block_diagonal:32")
    parser.add_argument("--distribute-factors", action="store_true")
    parser.add_argument(
        "--checkpoint", default=None, help="DCP folder, kept (default: a temporary one, removed)"
    )
    args = parser.parse_args()

    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.batch % world or args.steps < 2:
        raise SystemExit(f"needs --steps >= 2 and --batch a multiple of the {world} ranks")
    device = args.device
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        device = f"cuda:{torch.cuda.current_device()}"
    path = [args.checkpoint or (tempfile.mkdtemp(prefix="fsdp_ckpt_") if rank == 0 else None)]
    dist.broadcast_object_list(path)
    failure = run(args, device, path[0])
    dist.barrier()
    if args.checkpoint is None and rank == 0:
        shutil.rmtree(path[0])
    release_process_group()
    if failure is not None:
        raise SystemExit(failure)


if __name__ == "__main__":
    main()
