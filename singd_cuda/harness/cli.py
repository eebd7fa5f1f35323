"""Command line: ``singd-harness [options]`` trains the grid; ``singd-harness memory``
compares optimizer-state memory on standard architectures."""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from dataclasses import asdict
from datetime import datetime
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.text import Text

from .. import structures as structure_registry
from .data import DEFAULT_STEPS, TASKS
from .memory import MEMORY_MODELS, measure
from .optimizers import OPTIMIZERS, STRUCTURES, expand
from .precision import PRECISIONS
from .report import (
    DEGRADED_RATIO,
    SCHEMA,
    cells,
    memory_table,
    plot_losses,
    plot_memory,
    plot_memory_rows,
    task_table,
    verdicts,
    write_json,
)
from .runner import RunSpec, train


def emit(console: Console, path: Path, renderables: list) -> None:
    """Print ``renderables`` to the console and, as plain text, to ``path``."""
    with path.open("w") as file:
        for target in (console, Console(file=file, width=130)):
            for item in renderables:
                target.print(item)


def progress_bar(console: Console) -> Progress:
    """A transient rich progress display: description, bar, done/total, elapsed time."""
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn())
    return Progress(*columns, TimeElapsedColumn(), console=console, transient=True)


def structure_arg(text: str) -> str:
    """A structure spec as given, once the registry accepts it."""
    try:
        structure_registry.get(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def lr_arg(text: str) -> tuple[str | None, float]:
    """``"0.01"`` (every optimizer) or ``"singd=0.05"`` (one optimizer)."""
    name, _, value = text.rpartition("=")
    if name and name not in OPTIMIZERS:
        raise argparse.ArgumentTypeError(
            f"unknown optimizer '{name}' in '{text}'; valid optimizers: {', '.join(OPTIMIZERS)}"
        )
    try:
        lr = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"'{text}' is not a learning rate; use a number or NAME=NUMBER with NAME one of "
            f"{', '.join(OPTIMIZERS)}"
        ) from None
    if not lr > 0:
        raise argparse.ArgumentTypeError(f"learning rate must be positive, got '{text}'")
    return name or None, lr


def positive_int(text: str) -> int:
    """A positive integer."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got '{text}'")
    return value


def device_arg(text: str) -> torch.device:
    """``auto`` (CUDA when available, else CPU), ``cpu``, ``cuda`` or ``cuda:N``."""
    if text == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(text)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(
            f"unknown device '{text}'; valid devices: auto, cpu, cuda, cuda:N"
        )
    if device.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"device '{text}': CUDA is not available here; use cpu")
    return device


def add_common(p: argparse.ArgumentParser, folder: str) -> argparse.ArgumentParser:
    """Add the options both commands share: --structures, --out and --device."""
    p.add_argument(
        "--structures",
        nargs="+",
        type=structure_arg,
        default=list(STRUCTURES),
        metavar="S",
        help="SINGD structures, optionally with parameters such as block_diagonal:16 "
        f"(default: {', '.join(STRUCTURES)})",
    )
    p.add_argument(
        "--out", type=Path, metavar="DIR", help=f"output folder (default: ./harness_runs/{folder})"
    )
    p.add_argument(
        "--device",
        type=device_arg,
        default="auto",
        help="auto (CUDA when available, else CPU), cpu, cuda or cuda:N",
    )
    return p


def train_parser() -> argparse.ArgumentParser:
    """The parser of the training grid (the default command)."""
    default_lrs = ", ".join(f"{name} {entry.lr:g}" for name, entry in OPTIMIZERS.items())
    p = argparse.ArgumentParser(
        prog="singd-harness",
        description="Train small models over optimizers x structures x precision modes and "
        "report which stay stable in which precision, and their optimizer-state memory.",
        epilog="Sub-command: 'singd-harness memory --help' compares optimizer-state memory "
        "per structure on ResNet-18, ViT-tiny and GPT-tiny.",
    )
    p.add_argument(
        "--tasks",
        nargs="+",
        choices=list(TASKS),
        default=list(TASKS),
        metavar="TASK",
        help=f"tasks to train (default: all of {', '.join(TASKS)})",
    )
    p.add_argument(
        "--optimizers",
        nargs="+",
        choices=list(OPTIMIZERS),
        default=list(OPTIMIZERS),
        metavar="OPT",
        help=f"optimizers (default: all of {', '.join(OPTIMIZERS)})",
    )
    p.add_argument(
        "--precisions",
        nargs="+",
        choices=list(PRECISIONS),
        default=list(PRECISIONS),
        metavar="P",
        help=f"precision modes (default: all of {', '.join(PRECISIONS)})",
    )
    p.add_argument(
        "--steps",
        type=positive_int,
        metavar="N",
        help="training steps per run (default: per task, "
        + ", ".join(f"{name} {steps}" for name, steps in DEFAULT_STEPS.items())
        + ")",
    )
    p.add_argument(
        "--seeds",
        nargs="+",
        type=int,
        default=[0],
        metavar="SEED",
        help="seeds; each changes initialisation and batch order (default: 0)",
    )
    p.add_argument(
        "--lr",
        nargs="+",
        type=lr_arg,
        default=[],
        metavar="LR",
        help=f"learning rates: NUMBER for all or NAME=NUMBER (defaults: {default_lrs})",
    )
    return add_common(p, "<timestamp>")


FACTOR_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def memory_parser() -> argparse.ArgumentParser:
    """The parser of ``singd-harness memory``."""
    p = argparse.ArgumentParser(
        prog="singd-harness memory",
        description="Optimizer-state bytes (measured and by formula) and peak step memory per "
        "optimizer and structure, one training step with a batch of 2 on each model.",
    )
    p.add_argument(
        "--models",
        nargs="+",
        choices=list(MEMORY_MODELS),
        default=list(MEMORY_MODELS),
        metavar="MODEL",
        help=f"models (default: all of {', '.join(MEMORY_MODELS)})",
    )
    p.add_argument(
        "--optimizers",
        nargs="+",
        choices=list(OPTIMIZERS),
        default=["adamw", "kfac", "adafisher", "singd"],
        metavar="OPT",
        help=f"optimizers, of {', '.join(OPTIMIZERS)} (default: all but ikfac, "
        "whose state equals singd:dense)",
    )
    p.add_argument(
        "--factor-dtype",
        choices=list(FACTOR_DTYPES),
        default="float32",
        help="dtype of the Kronecker factors (default: float32)",
    )
    return add_common(p, "memory-<timestamp>")


def run_memory(argv: list[str], console: Console) -> Path:
    """Measure optimizer-state memory as ``argv`` says; returns the output folder."""
    args = memory_parser().parse_args(argv)
    dtype = FACTOR_DTYPES[args.factor_dtype]
    choices = expand(args.optimizers, args.structures)
    out = args.out or Path("harness_runs") / datetime.now().strftime("memory-%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    console.print(
        f"[bold]singd-harness memory[/]: {len(args.models)} models x {len(choices)} "
        f"optimizers on {args.device}, factors in {args.factor_dtype}"
    )
    rows = []
    progress = progress_bar(console)
    with progress:
        bar = progress.add_task("memory", total=len(args.models) * len(choices))
        for model in args.models:
            for choice in choices:
                progress.update(bar, description=f"{model} {choice.label}")
                rows.append(measure(model, choice, dtype, args.device))
                progress.advance(bar)
    tables = [memory_table(m, [r for r in rows if r.model == m]) for m in args.models]
    emit(console, out / "report.txt", tables)
    payload = {
        "schema": SCHEMA + ":memory",
        "created": datetime.now().isoformat(timespec="seconds"),
        "device": str(args.device),
        "torch": torch.__version__,
        "factor_dtype": args.factor_dtype,
        "rows": [asdict(r) for r in rows],
    }
    (out / "memory.json").write_text(json.dumps(payload, indent=1))
    plot_memory_rows(out / "memory.png", rows)
    console.print(f"Results: [bold]{out}[/] (memory.json, report.txt, memory.png)")
    return out


def learning_rates(overrides: list[tuple[str | None, float]]) -> dict[str, float]:
    """Optimizer name -> lr: the table's defaults, then the overrides in order."""
    lrs = {name: entry.lr for name, entry in OPTIMIZERS.items()}
    for name, lr in overrides:
        lrs.update({name: lr} if name else dict.fromkeys(lrs, lr))
    return lrs


def run_train(argv: list[str], console: Console) -> Path:
    """Run the grid described by ``argv``; returns the output folder."""
    args = train_parser().parse_args(argv)
    lrs = learning_rates(args.lr)
    tasks = {name: TASKS[name]() for name in args.tasks}
    choices = expand(args.optimizers, args.structures)
    specs = [
        RunSpec(task, choice, precision, seed, args.steps or DEFAULT_STEPS[task], lrs[choice.name])
        for task in args.tasks
        for choice in choices
        for precision in args.precisions
        for seed in args.seeds
    ]
    out = args.out or Path("harness_runs") / datetime.now().strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    console.print(
        f"[bold]singd-harness[/]: {len(specs)} runs on {args.device} "
        f"({len(tasks)} tasks x {len(choices)} optimizers x {len(args.precisions)} precisions "
        f"x {len(args.seeds)} seeds)"
    )
    start = time.perf_counter()
    progress = progress_bar(console)
    results = []
    with progress:
        grid = progress.add_task("grid", total=len(specs))
        run = progress.add_task("run")
        for spec in specs:
            label = f"{spec.task} {spec.optimizer.label} {spec.precision} seed {spec.seed}"
            progress.reset(run, total=spec.steps, description=f"  {label}")
            results.append(
                train(tasks[spec.task], spec, args.device, lambda _: progress.advance(run))
            )
            progress.advance(grid)
    elapsed = time.perf_counter() - start
    table_cells = cells(results)
    lines = verdicts(table_cells)
    width = max(len(label) for label in lines)
    emit(
        console,
        out / "report.txt",
        [task_table(name, task.description, table_cells) for name, task in tasks.items()]
        + [
            f"[bold]Verdicts[/] (ok / degraded: best loss > {DEGRADED_RATIO}x fp32's / "
            "failed: non-finite, error or diverged):"
        ]
        + [Text.assemble(f"  {label:<{width}}  ", line) for label, line in lines.items()],
    )
    meta = {
        "created": datetime.now().isoformat(timespec="seconds"),
        "device": str(args.device),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "elapsed_s": elapsed,
        "config": {
            "tasks": {name: task.description for name, task in tasks.items()},
            "optimizers": args.optimizers,
            "structures": args.structures,
            "precisions": args.precisions,
            "seeds": args.seeds,
            "steps": {name: args.steps or DEFAULT_STEPS[name] for name in tasks},
            "lr": {name: lrs[name] for name in args.optimizers},
        },
    }
    write_json(out / "results.json", meta, results, table_cells)
    for name in tasks:
        plot_losses(out / f"loss_{name}.png", name, results)
    plot_memory(out / "memory.png", table_cells)
    console.print(
        f"Finished {len(specs)} runs in {elapsed:.0f} s. Results: [bold]{out}[/] "
        "(results.json, report.txt, loss_*.png, memory.png)"
    )
    return out


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m singd_cuda.harness`` and ``singd-harness``."""
    argv = sys.argv[1:] if argv is None else argv
    console = Console(width=None if sys.stdout.isatty() else 130)
    if argv[:1] == ["memory"]:
        run_memory(argv[1:], console)
    else:
        run_train(argv, console)
    return 0
