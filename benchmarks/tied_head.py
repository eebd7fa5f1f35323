"""First step of a tied against an untied output head (issue 30, item 12).

A tiny Hugging Face GPT-2 built from a config (vocabulary 854, width 64, 2 layers, no
dropout), one batch of 8 x 32 tokens (Zipf-distributed, or uniform), one optimizer step
from the same initialisation, and the loss on that batch before and after: with the head
tied to the token embedding (GPT-2's default: the head's Kronecker factors precondition
the summed gradient of both uses) and untied (a copy; the embedding then trains with the
AdamW fallback). Library defaults except the learning rate.

    python benchmarks/tied_head.py --out benchmarks/results/tied_head.md
"""

from __future__ import annotations

import argparse
import datetime
import shlex
import sys
import warnings
from pathlib import Path

import torch
from torch import nn

from singd_cuda import KFAC, SINGD, AdaFisher

VOCAB = 854
OPTIMIZERS = {
    "K-FAC": KFAC,
    "SINGD": SINGD,
    "AdaFisher": AdaFisher,
    "AdamW": lambda model, lr: torch.optim.AdamW(model.parameters(), lr=lr),
}


def gpt2(tied: bool, seed: int = 0) -> nn.Module:
    """The tiny GPT-2 LM; untied: the head holds a copy of the embedding's weight."""
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(seed)
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=64, n_embd=64, n_layer=2, n_head=2, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    model = transformers.GPT2LMHeadModel(config)
    if not tied:
        model.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone())
    return model


def tokens(zipf: bool, seed: int = 1) -> torch.Tensor:
    """(8, 32) int64 token ids."""
    generator = torch.Generator().manual_seed(seed)
    if not zipf:
        return torch.randint(0, VOCAB, (8, 32), generator=generator)
    weights = 1.0 / torch.arange(1, VOCAB + 1, dtype=torch.float64)
    return torch.multinomial(weights, 8 * 32, replacement=True, generator=generator).view(8, 32)


def first_step(name: str, tied: bool, lr: float, zipf: bool) -> tuple[float, float]:
    """(loss before, loss after) one step on the same batch."""
    model = gpt2(tied)
    optimizer = OPTIMIZERS[name](model, lr=lr)
    batch = tokens(zipf)
    before = model(batch, labels=batch).loss
    before.backward()
    optimizer.step()
    with torch.no_grad():
        after = model(batch, labels=batch).loss
    return before.item(), after.item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lrs", type=float, nargs="+", default=[1e-2, 3e-2, 1e-1])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    header = "| tokens | lr | loss before | " + " | ".join(
        f"{name} tied | {name} untied" for name in OPTIMIZERS
    )
    lines = [header + " |", "|" + "---|" * (3 + 2 * len(OPTIMIZERS))]
    for zipf in (True, False):
        for lr in args.lrs:
            cells = []
            for name in OPTIMIZERS:
                for tied in (True, False):
                    before, after = first_step(name, tied, lr, zipf)
                    cells.append(f"{after:.2f}")
            kind = "Zipf" if zipf else "uniform"
            lines.append(f"| {kind} | {lr:g} | {before:.2f} | " + " | ".join(cells) + " |")
            print(lines[-1], flush=True)
    if args.out:
        command = shlex.join(["python", *sys.argv])
        args.out.write_text(
            "# First step, tied against untied output head\n\n"
            f"`{command}` — {datetime.date.today()}, torch {torch.__version__}, cpu, 1 "
            "thread. Loss on the batch after one step from the same initialisation (the "
            "tiny GPT-2 of the script's docstring; library defaults but the lr).\n\n"
            + "\n".join(lines)
            + "\n"
        )


if __name__ == "__main__":
    main()
