"""Combinations people use, each against its single-process counterpart.

* DDP with a tied head: a tiny language model whose output head shares its weight with
  the input ``nn.Embedding`` (as Hugging Face GPT-2 does);
* DDP + ``torch.compile`` (the ``aot_eager`` backend: no C++ compiler needed);
* FSDP2 with bf16 autocast, and with fp16 autocast and a GradScaler.

Rank r of N trains on samples [r·B/N, (r+1)·B/N) of each batch with a mean loss.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from singd_cuda import KFAC, SINGD, AdaFisher

from ..loops import backward_and_step
from .fsdp_scenarios import full_params, make_model, shard_model

BATCH, STEPS, VOCAB, SEQ = 8, 5, 11, 4


class TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 6)
        self.mix = nn.Linear(6, 6)
        self.head = nn.Linear(6, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens):
        return self.head(torch.tanh(self.mix(self.embed(tokens))))


def _tokens(seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen) for _ in range(STEPS)]


def _shard(tensor, rank: int, world: int):
    size = tensor.shape[0] // world
    return tensor[rank * size : (rank + 1) * size]


TIED_OPTIMIZERS = {
    "singd": lambda m: SINGD(m, structures="dense", lr=0.01, lr_cov=0.1, T=2, loss_average="batch"),
    "kfac": lambda m: KFAC(m, lr=0.05, T=2),
    "adafisher": lambda m: AdaFisher(m, lr=0.05, T=2),
}


def run_tied(config: dict, rank: int = 0, world: int = 1) -> dict[str, Any]:
    """DDP (world > 1; FSDP2 with ``config["fsdp"]``: the head and the embedding in the
    root's unit, whose gradients FSDP2 reduce-scatters in its final backward callback) on
    the tied model (untied with ``config["untied"]``), optionally compiled; SINGD unless
    ``config["optimizer"]``."""
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = TiedLM().double()
    if config.get("untied"):
        model.head.weight = nn.Parameter(model.embed.weight.detach().clone())
    if world > 1 and config.get("fsdp"):
        from torch.distributed.fsdp import fully_shard

        fully_shard(model.mix)
        fully_shard(model)  # the embedding and the head: one unit
    opt = TIED_OPTIMIZERS[config.get("optimizer", "singd")](model)
    wrapped = model
    if world > 1 and not config.get("fsdp"):
        wrapped = DistributedDataParallel(model)
    if config.get("compile"):
        wrapped = torch.compile(wrapped, backend="aot_eager")
    for tokens in _tokens():
        tokens = _shard(tokens, rank, world)
        opt.zero_grad()
        logits = wrapped(tokens[:, :-1])
        F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1)).backward()
        opt.step()
    layers = sorted(layer.name for layer in opt.layers)
    return {"params": full_params(model), "layers": layers}


def run_fsdp_amp(config: dict, rank: int = 0, world: int = 1) -> dict[str, Any]:
    """The FSDP test MLP under autocast (``config["amp"]``: "bf16" or "fp16"; fp16 with
    a GradScaler, ShardedGradScaler when sharded)."""
    model = make_model(torch.float32)
    if world > 1:
        shard_model(model)
    opt = SINGD(model, structures=config["structures"], lr=0.01, lr_cov=0.1, T=2)
    amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "none": torch.float32}[
        config["amp"]
    ]
    scaler = None
    if config["amp"] == "fp16":
        if world > 1:
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            scaler = ShardedGradScaler("cpu", init_scale=2.0**8)
        else:
            scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    gen = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        x = torch.randn(BATCH, 6, generator=gen)
        y = torch.randint(0, 3, (BATCH,), generator=gen)
        x, y = _shard(x, rank, world), _shard(y, rank, world)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=amp_dtype, enabled=config["amp"] != "none"):
            loss = F.cross_entropy(model(x).float(), y)
        backward_and_step(loss, opt, scaler)
    return {"params": full_params(model), "steps": opt.param_groups[0]["step"]}


def run_many(rank: int, world: int, jobs: list[tuple[str, dict]]) -> list[dict]:
    kinds = {"tied": run_tied, "fsdp-amp": run_fsdp_amp}
    return [kinds[kind](config, rank, world) for kind, config in jobs]
