"""The two training tasks, built from data that ships with installed packages.

* ``digits``: scikit-learn's bundled 8x8 handwritten digits (``load_digits``, 1797
  images), a fixed 80/20 train/test split, classified by a :class:`DigitsCNN`.
* ``lm``: a character-level language model on the source text of a few Python
  standard-library modules (read from their installed files), trained with a small
  :class:`GPT`; the last 10 % of the text is held out.

Batches depend only on the seed, so every optimizer and precision mode sees the same
data in the same order.
"""

from __future__ import annotations

import argparse
import inspect
import os
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .models import GPT, DigitsCNN, GPTConfig

#: Standard-library modules whose source makes the LM corpus (read in this order).
CORPUS_MODULES = (os, inspect, argparse, textwrap)
#: Newline and printable ASCII; any other character maps to one extra "unknown" id.
VOCAB = "\n" + "".join(chr(c) for c in range(32, 127))
CONTEXT = 32
#: Training steps per run when ``--steps`` is not given.
DEFAULT_STEPS = {"digits": 150, "lm": 150}


@dataclass(frozen=True)
class Task:
    """A model family, its training and held-out data, and its loss."""

    name: str
    description: str
    batch_size: int
    loss_average: str  # what the loss is a mean over: "batch" or "batch+sequence"
    make_model: Callable[[], nn.Module]
    train_x: Tensor
    train_y: Tensor
    eval_x: Tensor
    eval_y: Tensor

    def batch_indices(self, steps: int, seed: int) -> Tensor:
        """(steps, batch_size) indices into the training set, fixed by ``seed``.

        Shuffled epochs, drawn without replacement within an epoch.
        """
        gen = torch.Generator().manual_seed(seed)
        n = self.train_x.shape[0]
        epochs = -(-steps * self.batch_size // n)
        order = torch.cat([torch.randperm(n, generator=gen) for _ in range(epochs)])
        return order[: steps * self.batch_size].view(steps, self.batch_size)

    @staticmethod
    def loss(logits: Tensor, target: Tensor) -> Tensor:
        """Mean cross-entropy in float32 over every position of ``logits``."""
        return F.cross_entropy(logits.float().flatten(0, -2), target.flatten())


def digits_task() -> Task:
    """Digits classification with a BatchNorm CNN (batch 64, 1437 train / 360 test)."""
    from sklearn.datasets import load_digits

    images, labels = load_digits(return_X_y=True)
    x = torch.tensor(images, dtype=torch.float32).view(-1, 1, 8, 8) / 16.0
    y = torch.tensor(labels, dtype=torch.long)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    train, test = order[:1437], order[1437:]
    mean, std = x[train].mean(), x[train].std()
    x = (x - mean) / std
    return Task(
        name="digits",
        description="sklearn digits 8x8, CNN with BatchNorm",
        batch_size=64,
        loss_average="batch",
        make_model=DigitsCNN,
        train_x=x[train],
        train_y=y[train],
        eval_x=x[test],
        eval_y=y[test],
    )


def corpus_text() -> str:
    """The concatenated source of :data:`CORPUS_MODULES`."""
    return "".join(Path(m.__file__).read_text(encoding="utf-8") for m in CORPUS_MODULES)


def encode(text: str) -> Tensor:
    """Character ids under :data:`VOCAB` (unknown characters -> ``len(VOCAB)``)."""
    table = {ch: i for i, ch in enumerate(VOCAB)}
    return torch.tensor([table.get(ch, len(VOCAB)) for ch in text], dtype=torch.long)


def lm_task() -> Task:
    """Character LM on standard-library source: context 32, batch 16, 64 held-out windows."""
    ids = encode(corpus_text())
    split = int(0.9 * len(ids))
    windows = ids[:split].unfold(0, CONTEXT + 1, 1)  # every training window, a view
    held_out = ids[split:]
    starts = torch.linspace(0, len(held_out) - CONTEXT - 1, 64).long()
    held = torch.stack([held_out[s : s + CONTEXT + 1] for s in starts.tolist()])
    config = GPTConfig(vocab=len(VOCAB) + 1, context=CONTEXT, dim=64, depth=2, heads=4)
    return Task(
        name="lm",
        description=f"char LM on stdlib source ({len(ids) // 1000} k chars), 2-layer GPT",
        batch_size=16,
        loss_average="batch+sequence",
        make_model=lambda: GPT(config),
        train_x=windows[:, :-1],
        train_y=windows[:, 1:],
        eval_x=held[:, :-1],
        eval_y=held[:, 1:],
    )


#: Task name -> builder.
TASKS: dict[str, Callable[[], Task]] = {"digits": digits_task, "lm": lm_task}
