"""Whole training iterations on real model shapes, against AdamW: ResNet-18, GPT-2, LLaMA.

Real models have many shape groups (ResNet-18: 21 layers in 13 shapes; a transformer
block: 4 to 7 Linear shapes), unlike ``host_cost.py``'s one-shape stack. Per model, on the
CPU, single-threaded (``torch.set_num_threads(1)``), float32, every competitor interleaved
round-robin with the plain model (forward + backward, no optimizer, no hooks), the same
weights and batches for all:

- ``resnet18``: torchvision's ResNet-18 (10 classes, built without weights), 8 x 3 x 32 x 32;
- ``gpt2`` / ``llama``: Hugging Face GPT-2 / LLaMA built from a config (nothing
  downloaded): vocab 1024, width 128, 4 layers, 4 heads, batch 4 x 64 tokens.

Per competitor: the iteration (forward + backward + step, median, amortized over a period
of T steps as ``vs_peers.amortized_ms``) and its ratio to AdamW (foreach)'s iteration, and
the overhead (the iteration minus the plain model's forward + backward) and its ratio to
AdamW's overhead.

    python benchmarks/models_iteration.py --out benchmarks/results/models_iteration.md
    python benchmarks/models_iteration.py --models gpt2 --steps 5  # quick look
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from records import header, publish
from vs_peers import amortized_ms, median_ms

from singd_cuda import KFAC, SINGD, AdaFisher

VOCAB, WIDTH, LAYERS, HEADS, TOKENS, BATCH = 1024, 128, 4, 4, 64, 4


def optimizers(model_name: str) -> dict[str, tuple[int, Callable]]:
    """name -> (T, model -> optimizer); AdamW (foreach) is the baseline. No K-FAC on
    ResNet-18: its dense factors (up to 4608 x 4608 for the 3 x 3 x 512 convolutions) cost
    seconds per iteration here, which is not the host cost this measures."""
    rows = {
        "AdamW (foreach)": (1, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-4, foreach=True)),
        "AdaFisher (T=1)": (1, lambda m: AdaFisher(m, lr=1e-4)),
        "SINGD diagonal T=1": (1, lambda m: SINGD(m, lr=1e-4, structures="diagonal", T=1)),
        "SINGD diagonal T=10": (10, lambda m: SINGD(m, lr=1e-4, structures="diagonal", T=10)),
        "SINGD block_diagonal:32 T=1": (1, lambda m: SINGD(m, lr=1e-4, T=1)),
        "SINGD block_diagonal:32 T=10": (10, lambda m: SINGD(m, lr=1e-4, T=10)),
        "K-FAC T=10 (between inversions)": (
            10,
            lambda m: KFAC(m, lr=1e-4, T=10, T_inv=10**9),
        ),
    }
    if model_name == "resnet18":
        del rows["K-FAC T=10 (between inversions)"]
    return rows


def build(name: str) -> tuple[nn.Module, Callable[[nn.Module], torch.Tensor]]:
    """(model, model -> loss of the fixed batch), the same weights for every competitor."""
    torch.manual_seed(0)
    if name == "resnet18":
        import torchvision

        model = torchvision.models.resnet18(num_classes=10)
        x, y = torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))
        return model, lambda m: F.cross_entropy(m(x), y)
    import transformers

    transformers.logging.set_verbosity_error()  # config remarks about the small vocab
    if name == "llama":
        config = transformers.LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=WIDTH,
            intermediate_size=4 * WIDTH,
            num_hidden_layers=LAYERS,
            num_attention_heads=HEADS,
            num_key_value_heads=HEADS,
            max_position_embeddings=TOKENS,
        )
        model = transformers.LlamaForCausalLM(config)
    else:
        config = transformers.GPT2Config(
            vocab_size=VOCAB, n_positions=TOKENS, n_embd=WIDTH, n_layer=LAYERS, n_head=HEADS
        )
        model = transformers.GPT2LMHeadModel(config)
    tokens = torch.randint(0, VOCAB, (BATCH, TOKENS))
    return model, lambda m: m(tokens, labels=tokens).loss


class Competitor:
    def __init__(self, model_name: str, T: int, make) -> None:
        self.model, self.loss = build(model_name)
        self.opt = make(self.model) if make is not None else None
        self.T, self.t = T, 0
        self.times: list[float] = []
        self.updates: list[bool] = []

    def iteration(self, timed: bool) -> None:
        start = time.perf_counter()
        for p in self.model.parameters():
            p.grad = None
        self.loss(self.model).backward()
        if self.opt is not None:
            self.opt.step()
        if timed:
            self.times.append(time.perf_counter() - start)
            self.updates.append(self.t % self.T == 0)
        self.t += 1


def measure(model_name: str, steps: int) -> tuple[float, list[dict]]:
    plain = Competitor(model_name, 1, None)
    competitors = {
        n: Competitor(model_name, T, make) for n, (T, make) in optimizers(model_name).items()
    }
    everyone = [plain, *competitors.values()]
    for _ in range(3):  # warm-up: first statistics, warm start, the one inversion
        for c in everyone:
            c.iteration(timed=False)
    for _ in range(steps):  # round-robin: load changes hit every competitor alike
        for c in everyone:
            c.iteration(timed=True)
    base = median_ms(plain.times)
    rows = [
        {"optimizer": n, "iteration_ms": amortized_ms(c.times, c.updates, c.T)}
        for n, c in competitors.items()
    ]
    adamw = rows[0]["iteration_ms"]
    for row in rows:
        row["vs_adamw"] = row["iteration_ms"] / adamw
        row["overhead_ms"] = row["iteration_ms"] - base
        row["overhead_vs_adamw"] = row["overhead_ms"] / (adamw - base)
    return base, rows


def table(model_name: str, base: float, rows: list[dict], steps: int) -> list[str]:
    model, _ = build(model_name)
    params = sum(p.numel() for p in model.parameters())
    lines = [
        f"### {model_name}: {params / 1e6:.1f} M parameters, {steps} timed steps "
        f"(plain forward + backward {base:.1f} ms)",
        "",
        "| optimizer | iteration ms | / AdamW | overhead ms | overhead / AdamW's |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['optimizer']} | {r['iteration_ms']:.1f} | {r['vs_adamw']:.2f}x | "
            f"{r['overhead_ms']:.1f} | {r['overhead_vs_adamw']:.2f}x |"
        )
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="resnet18,gpt2,llama", help="comma-separated")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per competitor")
    parser.add_argument("--out", type=Path, help="write the markdown record here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")  # LargeFactorWarning and friends are not the subject
    start, load = time.time(), os.getloadavg()[0]
    sections = []
    for name in args.models.split(","):
        sections += [*table(name, *measure(name, args.steps), args.steps), ""]
    lines = [
        *header(
            "Whole iterations on real model shapes, against AdamW",
            "models_iteration.py",
            sys.argv[1:],
            start,
            load,
        ),
        *sections,
        "Iteration: forward + backward + step, median, amortized over T (the T=10 rows include "
        "their statistics step once per 10). Overhead: the iteration minus the plain model's "
        "forward + backward (no optimizer, no hooks), against AdamW's overhead.",
    ]
    publish(lines, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
