"""``singd-harness ablate``: why does a second-order optimizer lose on a task (the LM)?

Runs AdamW once (the reference: its mean final held-out loss is the target) and one
optimizer (SINGD by default) in a list of variants, each changing one thing from the
base run: the learning rate of the AdamW fallback that trains embeddings and norms
(fixed 3e-3, tied to AdamW's tuned value, or other fixed values), ``T``, ``damping``,
the structure, ``loss_average``, and the number of steps (with AdamW re-run at that
length). Each variant is an ordinary grid (``--set``, ``--structures``, ``--steps``) in
its own folder with its own report; ``ablations.md`` puts every variant found in the
folder side by side (so later invocations can add variants; a variant or reference already
in the folder is not run again, so an interrupted ablation resumes).
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from pathlib import Path

from .optimizers import OPTIMIZERS
from .stats import summarize

#: name -> (``--set`` changes of the ablated optimizer, SINGD structure or None for the
#: base one, steps as a multiple of the base run's).
VARIANTS: dict[str, tuple[list[str], str | None, int]] = {
    "base": ([], None, 1),
    "fallback lr tied to AdamW's": (["fallback_lr=adamw"], None, 1),
    "fallback lr 1e-3": (["fallback_lr=0.001"], None, 1),
    "fallback lr 1e-2": (["fallback_lr=0.01"], None, 1),
    "T=1": (["T=1"], None, 1),
    "T=50": (["T=50"], None, 1),
    "damping 1e-3": (["damping=0.001"], None, 1),
    "damping 1e-1": (["damping=0.1"], None, 1),
    "structure dense": ([], "dense", 1),
    "structure diagonal": ([], "diagonal", 1),
    "loss_average=batch": (["loss_average=batch"], None, 1),
    "steps x4": ([], None, 4),
    "steps x4, fallback lr tied": (["fallback_lr=adamw"], None, 4),
}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="singd-harness ablate",
        description="One optimizer in one-change-at-a-time variants against AdamW on one "
        "task; writes each variant's grid and ablations.md.",
    )
    p.add_argument("--task", default="lm", help="the task (default: lm)")
    p.add_argument(
        "--optimizer",
        default="singd",
        choices=list(OPTIMIZERS),
        help="the ablated optimizer (default: singd)",
    )
    p.add_argument("--structure", default="block_diagonal:32", help="SINGD's base structure")
    p.add_argument("--steps", type=int, default=200, help="steps of the base run (default 200)")
    p.add_argument("--seeds", nargs="+", default=["0", "1", "2"], metavar="SEED")
    p.add_argument(
        "--variants",
        nargs="+",
        choices=list(VARIANTS),
        default=list(VARIANTS),
        metavar="V",
        help=f"of: {'; '.join(VARIANTS)} (default: all)",
    )
    p.add_argument("--precision", default="fp32", help="model precision (default fp32)")
    p.add_argument("--workers", default=None, help="worker processes (default: one per core)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", type=Path, required=True, metavar="DIR")
    return p


def run_ablate(argv: list[str], run_train: Callable[[list[str]], Path]) -> Path:
    """Run the variants ``argv`` names, each grid through ``run_train`` (the grid
    command's function, handed in by the CLI); returns the output folder."""
    args = parser().parse_args(argv)
    common = ["--tasks", args.task, "--seeds", *args.seeds, "--precisions", args.precision]
    common += ["--factors", "fp32", "--device", args.device]
    common += ["--workers", args.workers] if args.workers else []
    for name in args.variants:
        changes, structure, factor = VARIANTS[name]
        steps = factor * args.steps
        reference = args.out / f"adamw-{steps}"
        if not (reference / "results.json").exists():
            _say(f"ablate: AdamW reference, {steps} steps")
            run_train(
                [*common, "--optimizers", "adamw", "--steps", str(steps), "--out", str(reference)]
            )
        folder = args.out / _slug(name)
        if (folder / "results.json").exists():
            _say(f"ablate: {name} already in {folder}")
            continue
        grid = [*common, "--optimizers", args.optimizer, "--steps", str(steps)]
        grid += ["--structures", structure or args.structure, "--out", str(folder)]
        grid += ["--set", *(f"{args.optimizer}.{c}" for c in changes)] if changes else []
        _say(f"ablate: {name}")
        run_train(grid)
    rows = [  # every variant in the folder, also those of earlier invocations
        _row(name, args.out / _slug(name), args.out / f"adamw-{factor * args.steps}")
        for name, (_, _, factor) in VARIANTS.items()
        if (args.out / _slug(name) / "results.json").exists()
    ]
    text = _markdown(args, rows)
    (args.out / "ablations.md").write_text(text)
    _say(text)
    return args.out


def _say(text: str) -> None:
    print(text, flush=True)


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name).strip("-").lower()


def _runs(folder: Path) -> list[dict]:
    return json.loads((folder / "results.json").read_text())["runs"]


def _row(name: str, folder: Path, reference: Path) -> list[str]:
    """One row: variant, settings, loss, accuracy, failed seeds, steps to AdamW's loss."""
    adamw = summarize([r["final_loss"] for r in _runs(reference) if r["final_loss"] is not None])
    runs = _runs(folder)
    finals = summarize([r["final_loss"] for r in runs if r["final_loss"] is not None])
    accs = summarize([r["final_accuracy"] for r in runs if r["final_accuracy"] is not None])
    reached = []
    for r in runs:
        hits = [
            s
            for s, loss in zip(r["eval_steps"], r["eval_loss"], strict=True)
            if adamw and loss is not None and loss <= adamw.mean
        ]
        reached.append(hits[0] if hits else None)
    got = [s for s in reached if s is not None]
    hp = runs[0]["hparams"]
    label = runs[0]["label"]
    return [
        name,
        label + " " + ", ".join(f"{k}={v}" for k, v in sorted(hp.items())),
        "nan"
        if finals is None
        else f"{finals.mean:.4f}" + (f" ± {finals.std:.4f}" * (finals.n > 1)),
        "—" if accs is None else f"{100 * accs.mean:.1f}",
        f"{sum(r['final_loss'] is None for r in runs)}/{len(runs)}",
        "—" if adamw is None else f"{adamw.mean:.4f}",
        f"{statistics.median(got):.0f} ({len(got)}/{len(runs)})" if got else "not reached",
        str(runs[0]["steps"]),
    ]


def _markdown(args, rows: list[list[str]]) -> str:
    from .report import markdown_table

    headers = ["variant", "optimizer and settings", "held-out loss", "acc %", "failed"]
    headers += ["AdamW's loss (target)", "steps to target (seeds)", "steps"]
    return (
        f"# Ablations: {args.optimizer} on {args.task} ({args.precision}, seeds "
        f"{' '.join(args.seeds)})\n\nEach variant changes one thing from the base run; "
        "the target is AdamW's mean final held-out loss at the same number of steps "
        "(its tuned learning rate). Each variant's folder holds its full report.\n\n"
        + markdown_table(headers, rows)
        + "\n"
    )
