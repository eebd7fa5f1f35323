"""Per-rank optimizer state, step time and bytes per step of SINGD under FSDP2.

Run once per world size (CPU, gloo), e.g.
    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 benchmarks/fsdp.py
and ``--record`` appends the rank-0 table rows to ``benchmarks/results/fsdp.md``.

The model is a Hugging Face LLaMA built from a config (no download), every decoder layer
and the root ``fully_shard``-ed, trained on random tokens. For SINGD with and without
``distribute_factors`` (and AdamW for scale) it reports, on rank 0 and as the maximum
over the ranks: the optimizer state this rank holds (factors; buffers shaped like the
local shards), the median ``opt.step()`` time and the median forward+backward time, and
the payload of the collectives per step averaged over ``--steps`` steps (T = 5: one
update step in five): what ``opt.step()`` sends (all-reduce buffers, gathered
all-gather outputs, all-to-all inputs) next to what FSDP's backward reduce-scatters
(its input: the padded gradients) and its forward/backward all-gathers.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from transformers import LlamaConfig, LlamaForCausalLM

from singd_cuda import SINGD
from singd_cuda.optim.finite import tensors_of

RESULTS = Path(__file__).parent / "results" / "fsdp.md"
COLLECTIVES = ("all_reduce", "all_gather_single", "reduce_scatter_single", "all_to_all_single")


class Counter:
    """Bytes per collective name while ``phase`` is set (wraps torch.distributed)."""

    def __init__(self) -> None:
        self.phase: str | None = None
        self.bytes: dict[tuple[str, str], int] = defaultdict(int)
        for name in COLLECTIVES:
            setattr(dist, name, self._wrap(name, getattr(dist, name)))

    def _wrap(self, name, fn):
        def wrapper(*args, **kwargs):
            if self.phase is not None:  # the larger buffer: gathered / scattered whole
                tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
                self.bytes[(self.phase, name)] += max(t.numel() * t.element_size() for t in tensors)
            return fn(*args, **kwargs)

        return wrapper


def build(args, kind: str):
    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 8 // 3 // 8 * 8,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=args.seq,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    if kind == "adamw":
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt = SINGD(
        model,
        lr=1e-3,
        structures=args.structures,
        T=5,
        distribute_factors=kind == "singd-owned",
    )
    return model, opt


def state_bytes(model, opt) -> tuple[int, int]:
    """(factor bytes, buffer bytes) this rank holds: buffers are the state entries
    shaped like the (local) parameters, factors the rest."""
    factors = buffers = 0
    for param, state in opt.state.items():
        local = param.to_local() if hasattr(param, "to_local") else param
        for value in tensors_of(state):
            size = value.numel() * value.element_size()
            if hasattr(value, "to_local"):
                value = value.to_local()
                size = value.numel() * value.element_size()
            if value.shape == local.shape:
                buffers += size
            else:
                factors += size
    return factors, buffers


def measure(args, kind: str, counter: Counter) -> dict[str, float]:
    model, opt = build(args, kind)
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(rank)
    per_rank = args.batch // world
    step_times, fb_times = [], []
    counter.bytes.clear()
    for step in range(args.warmup + args.steps):
        tokens = torch.randint(0, args.vocab, (per_rank, args.seq), generator=gen)
        counting = step >= args.warmup
        opt.zero_grad()
        counter.phase = "fsdp" if counting else None
        start = time.perf_counter()
        model(input_ids=tokens, labels=tokens).loss.backward()
        middle = time.perf_counter()
        counter.phase = "step" if counting else None
        opt.step()
        end = time.perf_counter()
        counter.phase = None
        if counting:
            fb_times.append(middle - start)
            step_times.append(end - middle)
    factors, buffers = state_bytes(model, opt)
    per_step = {k: v / args.steps for k, v in counter.bytes.items()}
    return {
        "factors": factors,
        "buffers": buffers,
        "step_ms": 1e3 * statistics.median(step_times),
        "fb_ms": 1e3 * statistics.median(fb_times),
        "step_bytes": sum(v for (phase, _), v in per_step.items() if phase == "step"),
        "reduce_scatter": per_step.get(("fsdp", "reduce_scatter_single"), 0.0),
        "fsdp_all_gather": per_step.get(("fsdp", "all_gather_single"), 0.0),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    parser.add_argument("--structures", default="block_diagonal:32")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--record", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    counter = Counter()
    world = dist.get_world_size()
    rows = []
    for kind in ("adamw", "singd", "singd-owned"):
        result = measure(args, kind, counter)
        gathered = [None] * world
        dist.all_gather_object(gathered, result)
        worst = {k: max(r[k] for r in gathered) for k in result}
        mib = 2.0**-20
        rows.append(
            f"| {world} | {kind} | {result['factors'] * mib:.2f} / {worst['factors'] * mib:.2f} "
            f"| {result['buffers'] * mib:.2f} | {result['step_ms']:.1f} / {worst['step_ms']:.1f} "
            f"| {result['fb_ms']:.1f} | {result['step_bytes'] * mib:.3f} "
            f"| {result['reduce_scatter'] * mib:.3f} | {result['fsdp_all_gather'] * mib:.3f} |"
        )
    if dist.get_rank() == 0:
        print("\n".join(rows))
        if args.record:
            with RESULTS.open("a") as out:
                out.write("\n".join(rows) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
