"""Optimizer cost against depth: *statistics + step* time per block on a GPT-style stack.

A pre-norm GPT (width 256, 4 heads, MLP 4x, untied head, 32 tokens x batch 4) of 4, 8
and 16 blocks, T = 10, float32 and bf16 autocast; SINGD diagonal, block_diagonal:32 and
hierarchical:15,15 against torch AdamW (foreach). Measured as in ``vs_peers.py`` (its
Runner: competitors interleaved round-robin with the plain model, which runs no optimizer
and no hooks; *statistics + step* = a competitor's step minus the plain model's, amortized
over a period of T steps). Per block: that time divided by the number of blocks. A cost
that does not grow with depth gives a flat per-block column.

    python benchmarks/depth.py --out benchmarks/results/depth.md
    python benchmarks/depth.py --blocks 4 --dtypes float32 --steps 10  # quick look
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import random
import shlex
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from vs_peers import DTYPES, Products, Runner, amortized_ms, median_ms

WIDTH, HEADS, VOCAB, TOKENS, BATCH = 256, 4, 256, 32, 4
STRUCTURES = {
    "diagonal": "diagonal",
    "block_diagonal": "block_diagonal:32",
    "hierarchical": "hierarchical:15,15",
}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.fc1, self.fc2 = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x):
        batch, tokens, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(batch, tokens, 3, HEADS, -1).unbind(2)
        attention = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(attention.transpose(1, 2).reshape(batch, tokens, WIDTH))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class GPT(nn.Module):
    """Logits flattened to (batch * tokens, vocab), as the Runner's cross-entropy wants."""

    def __init__(self, blocks: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.position = nn.Parameter(torch.zeros(TOKENS, WIDTH))
        self.blocks = nn.Sequential(*(Block() for _ in range(blocks)))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens):
        return self.head(self.norm(self.blocks(self.embed(tokens) + self.position))).flatten(0, 1)


def make_runners(blocks: int, autocast) -> list[Runner]:
    from singd_cuda import SINGD

    torch.manual_seed(0)
    base = GPT(blocks)
    generator = torch.Generator().manual_seed(1)
    data = []
    for _ in range(4):
        tokens = torch.randint(0, VOCAB, (BATCH, TOKENS + 1), generator=generator)
        data.append((tokens[:, :-1], tokens[:, 1:].flatten()))

    def batches(t):
        return data[t % len(data)]

    def runner(name, make_opt, period=1):
        model = GPT(blocks)
        model.load_state_dict(base.state_dict())
        opt = None if make_opt is None else make_opt(model)
        return Runner(name, "-", model, opt, None, batches, autocast, period=period)

    runners = [runner("plain", None)]
    for name, spec in STRUCTURES.items():
        make = lambda m, spec=spec: SINGD(m, lr=1e-3, T=10, structures=spec)  # noqa: E731
        runners.append(runner(f"singd-{name}", make, period=10))
    runners.append(
        runner("adamw-foreach", lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3, foreach=True))
    )
    return runners


def layer_shapes(blocks: int) -> list[tuple[int, int, int]]:
    """(d_K, d_C, N) of every preconditioned layer of GPT(blocks): qkv, proj, fc1, fc2 per
    block and the head; d_K counts the bias column, N = batch x tokens rows."""
    rows = BATCH * TOKENS
    block = [
        (WIDTH + 1, 3 * WIDTH),
        (WIDTH + 1, WIDTH),
        (WIDTH + 1, 4 * WIDTH),
        (4 * WIDTH + 1, WIDTH),
    ]
    return [(d_K, d_C, rows) for d_K, d_C in block * blocks + [(WIDTH + 1, VOCAB)]]


def products_rows(blocks: int, steps: int, warmup: int) -> list[dict]:
    """The matrix products SINGD's math needs on GPT(blocks) (vs_peers.Products: per layer
    torch.mm/bmm, every step the preconditioning and every T steps the factor update),
    amortized over T = 10: the bound that no implementation of the same math beats."""
    rows = []
    for name in ("block_diagonal", "hierarchical"):
        products = Products("gpt", name, 10, shapes=layer_shapes(blocks), spec=STRUCTURES[name])
        for i in range(warmup + steps):
            products.step(timed=i >= warmup)
        ms = amortized_ms(products.times, products.updates, 10)
        rows.append(dict(blocks=blocks, name=f"singd-{name}", products_ms=ms))
    return rows


def run_block(blocks: int, dtype_name: str, steps: int, warmup: int) -> list[dict]:
    runners = make_runners(blocks, DTYPES[dtype_name])
    plain, competitors = runners[0], runners[1:]
    order = random.Random(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i in range(warmup + steps):
            for r in order.sample(runners, len(runners)):
                plain.step(timed=False)  # settles what the previous competitor left behind
                r.step(timed=i >= warmup)
    rows = []
    for r in competitors:
        overhead = amortized_ms(r.times, r.updates, r.period) - median_ms(plain.times)
        rows.append(
            dict(
                blocks=blocks,
                dtype=dtype_name,
                name=r.name,
                overhead_ms=overhead,
                per_block_ms=overhead / blocks,
                plain_ms=median_ms(plain.times),
                error=r.error,
            )
        )
    adamw = next(row["overhead_ms"] for row in rows if row["name"] == "adamw-foreach")
    for row in rows:
        row["vs_adamw"] = row["overhead_ms"] / adamw
    return rows


def report(rows: list[dict], args, elapsed: float) -> str:
    lines = [
        "# Optimizer cost against depth (CPU)",
        "",
        f"Command: `python {' '.join(shlex.quote(a) for a in sys.argv)}`",
        "",
        f"Date: {datetime.datetime.now().isoformat(timespec='minutes')}; machine: "
        f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads); load average before {args.load:.2f}; run took "
        f"{elapsed:.0f} s; {args.steps} timed steps per competitor (after {args.warmup} "
        "warm-up), interleaved with the plain model.",
        "",
        f"GPT-style stack: width {WIDTH}, {HEADS} heads, MLP 4x, untied head, batch {BATCH} "
        f"x {TOKENS} tokens, T = 10. *stats + step*: ms per step (amortized over T) that the "
        "optimizer adds to the plain forward + backward; *per block*: that divided by the "
        "number of blocks; */ AdamW*: against AdamW (foreach) of the same block.",
        "",
        "| dtype | blocks | optimizer | plain fwd+bwd | stats + step | per block | / AdamW |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        head = f"| {row['dtype']} | {row['blocks']} | {row['name']} | "
        if row["error"]:
            lines.append(f"{head}error: {row['error']} | | | |")
            continue
        lines.append(
            f"{head}{row['plain_ms']:.1f} | {row['overhead_ms']:.2f} | "
            f"{row['per_block_ms']:.3f} | {row['vs_adamw']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def products_report(rows: list[dict]) -> str:
    lines = [
        "## The products' own time (float32)",
        "",
        f"Command: `python {' '.join(shlex.quote(a) for a in sys.argv)}`; load average before "
        f"{os.getloadavg()[0]:.2f}; median of 20 rounds after 2 warm-up, amortized over T = 10.",
        "",
        "| blocks | structure | products | per block |",
        "|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['blocks']} | {row['name']} | {row['products_ms']:.2f} | "
            f"{row['products_ms'] / row['blocks']:.3f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", nargs="+", type=int, default=[4, 8, 16])
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument("--steps", type=int, default=20, help="timed steps (2 updates at T=10)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument("--out", type=Path, default=None, help="markdown file to write")
    parser.add_argument(
        "--products-only",
        action="store_true",
        help="time only the matrix products (appended to --out as their own table)",
    )
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from singd_cuda import ops

    ops.fused_available("cpu")
    args.load = os.getloadavg()[0]
    start = time.perf_counter()
    if args.products_only:
        text = products_report([r for b in args.blocks for r in products_rows(b, 20, 2)])
        if args.out:
            args.out.write_text(args.out.read_text() + "\n" + text)
        print(text)
        return 0
    rows = []
    for dtype_name in args.dtypes:
        for blocks in args.blocks:
            rows += run_block(blocks, dtype_name, args.steps, args.warmup)
            print(f"{dtype_name} {blocks} blocks: {time.perf_counter() - start:.0f} s", flush=True)
            text = report(rows, args, time.perf_counter() - start)
            if args.out:  # after every block: a cut run keeps what it measured
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
