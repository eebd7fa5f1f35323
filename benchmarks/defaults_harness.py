"""Evidence for the library defaults on the harness tasks: for each candidate setting
of SINGD's (or AdaFisher's) defaults, a learning-rate sweep on MNIST-1D (MLP, CNN) and
the character LM, fp32, one seed, the harness's own runs (``singd_cuda.harness``).

A candidate is ``NAME=OPTIMIZER;key=value;...`` (OPTIMIZER: ``singd:<structure>`` or
``adafisher``); the table gives the final held-out loss per learning rate and the best.

    python benchmarks/defaults_harness.py --out benchmarks/results/defaults_harness.md \\
        --candidates 'warm=singd:block_diagonal:32' 'cold=singd:block_diagonal:32;warm_start=False'
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from defaults import _value

from singd_cuda.harness.data import DEFAULT_STEPS
from singd_cuda.harness.optimizers import OptimizerChoice
from singd_cuda.harness.pool import run_grid
from singd_cuda.harness.runner import RunSpec


def parse(spec: str) -> tuple[str, OptimizerChoice, dict]:
    name, rest = spec.split("=", 1)
    kind, *pairs = rest.split(";")
    settings = {}
    for pair in pairs:
        key, value = pair.split("=")
        settings[key] = _value(key, value)
    choice = OptimizerChoice(*kind.split(":", 1))
    return name, choice, settings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--candidates", nargs="+", required=True)
    parser.add_argument("--tasks", nargs="+", default=["mnist1d_mlp", "mnist1d_cnn", "lm"])
    parser.add_argument("--lrs", nargs="+", type=float, default=[1e-3, 1e-2, 1e-1])
    parser.add_argument("--seed", type=int, default=100)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    candidates = [parse(c) for c in args.candidates]
    specs, labels = [], []
    for task in args.tasks:
        for name, choice, settings in candidates:
            for lr in args.lrs:
                hparams = tuple(sorted({**settings, "lr": lr}.items()))
                factor = "fp32" if choice.has_factors else "-"
                specs.append(
                    RunSpec(task, choice, "fp32", factor, args.seed, DEFAULT_STEPS[task], hparams)
                )
                labels.append((task, name, lr))
    start = time.time()
    results = run_grid(specs, torch.device("cpu"), args.workers, lambda r: None)
    lines = [
        f"`python {' '.join(shlex.quote(a) for a in sys.argv)}`",
        "",
        f"fp32, seed {args.seed}, steps {[DEFAULT_STEPS[t] for t in args.tasks]}; final held-out"
        " loss per lr (accuracy in brackets); 'failed' = non-finite or diverged.",
        "",
        "| task | candidate | " + " | ".join(f"lr {lr:g}" for lr in args.lrs) + " | best |",
        "|---|---|" + "---|" * (len(args.lrs) + 1),
    ]
    table: dict[tuple[str, str], list] = {}
    for (task, name, _), result in zip(labels, results, strict=True):
        table.setdefault((task, name), []).append(result)
    for (task, name), runs in table.items():
        cells, best = [], None
        for r in runs:
            loss, acc = r.final_loss, r.final_accuracy
            if loss is None or r.diverged:
                cells.append("failed")
                continue
            cells.append(f"{loss:.3f}" + (f" ({100 * acc:.1f} %)" if acc is not None else ""))
            best = loss if best is None else min(best, loss)
        best_text = "—" if best is None else f"{best:.3f}"
        lines.append(f"| {task} | {name} | " + " | ".join(cells) + f" | {best_text} |")
        print(lines[-1], flush=True)
    lines += ["", f"{time.time() - start:.0f} s, {args.workers} workers"]
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
