"""Command line: ``singd-harness [options]`` trains the grid, times its cells (the timing
pass, :mod:`.timing`) and writes a report; ``singd-harness timing FOLDER`` (re)times a
recorded grid; ``singd-harness tune`` sweeps the learning rates; ``singd-harness memory``
compares optimizer-state memory on standard architectures.

Progress is printed as one flushed line per finished run (with an ETA), so it works in a
pipe and in CI; each finished run is appended to ``runs.jsonl`` in the output folder as
the grid goes. ``--resume`` continues an interrupted grid in the same folder: the runs
already in its ``runs.jsonl`` are loaded instead of run again.
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import sys
import time
from collections import Counter
from dataclasses import asdict
from datetime import datetime
from pathlib import Path

import torch

from .. import structures as structure_registry
from . import tune as tuning
from .data import DEFAULT_STEPS, PAPER_ACCURACY, PAPER_LOGISTIC_ACCURACY, TASKS
from .memory import MEMORY_MODELS, measure
from .optimizers import (
    FIXED_SETTINGS,
    HEAVYBALL_OPTIMIZERS,
    OPTIMIZERS,
    STRUCTURES,
    OptimizerChoice,
    expand,
    label_name,
    parse_value,
    parse_variant,
)
from .peers import INSTALL_HINT, heavyball_available
from .pool import default_workers, run_grid
from .precision import FACTOR_DTYPES, NO_FACTORS, PRECISIONS
from .report import (
    SCHEMA,
    cell_row,
    cells,
    headers,
    is_timed,
    markdown_table,
    memory_rows,
    memory_table,
    plot_curves,
    plot_memory,
    plot_memory_rows,
    plot_time_to_target,
    run_record,
    task_table,
    text_table,
    write_json,
)
from .runner import EVALUATIONS, RunResult, RunSpec
from .stats import RULE
from .timing import BLOCK, ROUNDS, Timing, agreement, time_cells

#: The default grid, the harness's purpose in about 5 minutes on a 2-core CPU: the CNN and
#: the character GPT, K-FAC beside SINGD, AdaFisher and AdamW, in fp32, bf16 autocast, fp16
#: autocast + GradScaler and pure bf16, x fp32 and bf16 factors, 3 seeds, at the short
#: step counts of :data:`QUICK_STEPS` (bf16 and fp16 matmuls and convolutions are
#: emulated, slowly, on a CPU). ``--full`` runs every task, optimizer, structure,
#: precision and factor dtype at :data:`DEFAULT_STEPS`.
DEFAULT_GRID = {
    "tasks": ["mnist1d_cnn", "lm"],
    "optimizers": ["adamw", "kfac", "adafisher", "singd"],
    "structures": ["block_diagonal:32"],
    "precisions": ["fp32", "bf16-amp", "fp16-amp", "bf16-pure"],
    "factors": ["fp32", "bf16"],
    "seeds": [0, 1, 2],
}
#: What the default grid leaves out, as the report states it.
DEFAULT_SCOPE = (
    "The default grid: {steps}; left out (run them with the options or `--full`): the "
    "MNIST-1D MLP and the LLaMA, the peers (momentum SGD, SOAP, PSGD-Kron, Muon), IKFAC, "
    "SINGD structures other than block_diagonal:32, pure bf16 with stochastic rounding, "
    "pure fp16 (a pure-fp16 step costs 3-10x an fp32 one on a CPU) and fp16 factors. "
    "`--full` runs all of them at the full step counts ({full})."
)
FULL_GRID = {
    "tasks": ["mnist1d_mlp", "mnist1d_cnn", "lm", "llama_lm"],
    "optimizers": list(OPTIMIZERS),
    "structures": list(STRUCTURES),
    "precisions": list(PRECISIONS),
    "factors": list(FACTOR_DTYPES),
    "seeds": [0, 1, 2],
}
#: Seeds of the tuning sweep: apart from the grid's, so that no reported run is a tuning run.
TUNE_SEEDS = [100]
#: Steps per task in the default grid (``--full`` and ``tune`` use DEFAULT_STEPS).
QUICK_STEPS = {
    "mnist1d_mlp": 500,
    "mnist1d_cnn": 200,
    "lm": 40,
    "llama_lm": 100,
    "digits": 100,
    "digits_vit": 100,
}


def say(text: str = "") -> None:
    """Print one line and flush, so progress shows in a pipe."""
    print(text, flush=True)


def structure_arg(text: str) -> str:
    """A structure spec as given, once the registry accepts it."""
    try:
        structure_registry.get(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def variant_arg(text: str) -> str:
    """An optimizer of the grid as given, ``"adamw"`` or a variant with fixed library
    keywords, ``"singd+graft=adam+kfac_approx=reduce"``, once it parses."""
    try:
        parse_variant(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def lr_arg(text: str) -> tuple[str | None, float]:
    """``"0.01"`` (every optimizer), ``"singd=0.05"`` (every variant of one optimizer) or
    ``"singd+graft=adam=3e-4"`` (one variant)."""
    name, _, value = text.rpartition("=")
    if name:
        variant_arg(name)
    try:
        lr = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"'{text}' is not a learning rate; use a number or NAME=NUMBER with NAME one of "
            f"{', '.join(OPTIMIZERS)} or a variant such as singd+graft=adam"
        ) from None
    if not lr > 0:
        raise argparse.ArgumentTypeError(f"learning rate must be positive, got '{text}'")
    return name or None, lr


def grid_arg(text: str) -> tuple[str, tuple[dict[str, float], ...]]:
    """``"singd+graft=adam=1e-4,3e-4,1e-3"``: (optimizer or variant, its lr trials)."""
    target, _, values = text.rpartition("=")
    try:
        lrs = [float(v) for v in values.split(",")]
    except ValueError:
        lrs = []
    if not target or not lrs or not all(lr > 0 for lr in lrs):
        raise argparse.ArgumentTypeError(f"'{text}' is not OPT=LR,LR,... (e.g. adamw=3e-4,1e-3)")
    variant_arg(target)
    return target, tuple({"lr": lr} for lr in lrs)


def prune_arg(text: str) -> tuple[float, float]:
    """``"3.0@0.3"``: (held-out loss, fraction of the steps)."""
    loss, _, fraction = text.partition("@")
    try:
        value = (float(loss), float(fraction))
    except ValueError:
        value = None
    if value is None or not 0 < value[1] <= 1:
        raise argparse.ArgumentTypeError(f"'{text}' is not LOSS@FRACTION (e.g. 3.0@0.3)")
    return value


def set_arg(text: str) -> tuple[str, str, float | str]:
    """``"singd.T=50"``, ``"singd.fallback_lr=adamw"`` (tied to AdamW's learning rate on
    the task) or ``"muon.fallback_lr=0.01"``: (optimizer, keyword, value)."""
    target, _, value = text.partition("=")
    name, _, key = target.partition(".")
    if name not in OPTIMIZERS or not key or not value:
        raise argparse.ArgumentTypeError(
            f"'{text}' is not OPT.KEY=VALUE with OPT one of {', '.join(OPTIMIZERS)} "
            "(e.g. singd.T=50, singd.fallback_lr=adamw)"
        )
    return name, key, parse_value(value)


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
    """Add --out and --device."""
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


def add_grid(p: argparse.ArgumentParser, tune: bool) -> None:
    """The options that choose a grid (None = from the default or --full grid)."""
    p.add_argument(
        "--full", action="store_true", help="every task, optimizer, structure and precision"
    )
    p.add_argument(
        "--tasks",
        nargs="+",
        choices=list(TASKS),
        metavar="TASK",
        help=f"of {', '.join(TASKS)} (default: {', '.join(DEFAULT_GRID['tasks'])})",
    )
    p.add_argument(
        "--optimizers",
        nargs="+",
        type=variant_arg,
        metavar="OPT",
        help=f"of {', '.join(OPTIMIZERS)} (default: {', '.join(DEFAULT_GRID['optimizers'])}); "
        "a variant with fixed library keywords is NAME+KEY=VALUE[+KEY=VALUE], e.g. "
        "singd+graft=adam or kfac+kfac_approx=reduce: a cell of its own",
    )
    p.add_argument(
        "--structures",
        nargs="+",
        type=structure_arg,
        metavar="S",
        help="SINGD structures, e.g. block_diagonal:16 (default: "
        f"{', '.join(DEFAULT_GRID['structures'])}; --full: {', '.join(STRUCTURES)})",
    )
    if not tune:
        p.add_argument(
            "--precisions",
            nargs="+",
            choices=list(PRECISIONS),
            metavar="P",
            help=f"model precisions, of {', '.join(PRECISIONS)} "
            f"(default: {', '.join(DEFAULT_GRID['precisions'])})",
        )
        p.add_argument(
            "--factors",
            nargs="+",
            choices=list(FACTOR_DTYPES),
            metavar="F",
            help="factor precisions of the second-order optimizers, of "
            f"{', '.join(FACTOR_DTYPES)} (default: both)",
        )
    p.add_argument(
        "--steps",
        type=positive_int,
        metavar="N",
        help="training steps per run (default: per task, "
        + ", ".join(f"{k} {v}" for k, v in QUICK_STEPS.items())
        + "; --full and tune: "
        + ", ".join(f"{k} {v}" for k, v in DEFAULT_STEPS.items())
        + ")",
    )
    p.add_argument(
        "--seeds",
        nargs="+",
        type=int,
        metavar="SEED",
        help="seeds; each changes initialisation and batch order "
        f"(default: {' '.join(map(str, DEFAULT_GRID['seeds'] if not tune else TUNE_SEEDS))})",
    )
    p.add_argument(
        "--workers",
        type=positive_int,
        metavar="N",
        help="worker processes, one intra-op thread each (default: one per core "
        "on the CPU, 1 on CUDA)",
    )


def train_parser() -> argparse.ArgumentParser:
    """The parser of the training grid (the default command)."""
    p = argparse.ArgumentParser(
        prog="singd-harness",
        description="Train MNIST-1D (the paper's MLP and CNN) and a character LM over "
        "optimizers x structures x model precision x factor precision x seeds; report "
        "held-out loss and accuracy (mean ± std), verdicts against fp32, time to AdamW's "
        "loss, and optimizer-state memory.",
        epilog="Sub-commands: 'singd-harness tune --help' (learning-rate sweep), "
        "'singd-harness ablate --help' (why an optimizer loses: one change at a time), "
        "'singd-harness memory --help' (optimizer-state memory on ResNet-18, ViT-tiny, "
        "GPT-tiny).",
    )
    add_grid(p, tune=False)
    p.add_argument(
        "--lr",
        nargs="+",
        type=lr_arg,
        default=[],
        metavar="LR",
        help="override the tuned learning rates: NUMBER for all or NAME=NUMBER",
    )
    p.add_argument(
        "--set",
        nargs="+",
        type=set_arg,
        default=[],
        metavar="OPT.KEY=VALUE",
        help="ablations: a keyword of one optimizer, e.g. singd.T=50, singd.damping=1e-3, "
        "singd.loss_average=batch, singd.fallback_lr=1e-2, or singd.fallback_lr=adamw "
        "(the AdamW learning rate of the task, tuned or --lr); muon.fallback_lr sets "
        "Muon's AdamW part (default 3e-3 for all)",
    )
    p.add_argument(
        "--tune",
        action="store_true",
        help="re-tune the learning rates (fp32 sweep) before the grid, and use them",
    )
    p.add_argument(
        "--no-timing",
        action="store_true",
        help="skip the timing pass; the report's times are then the parallel grid's own "
        "(labelled so, noisy)",
    )
    add_timing(p)
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue the grid in the --out folder: runs already recorded in its "
        "runs.jsonl with the same task, optimizer, structure, precision, factors, seed, "
        "steps and hyperparameters are loaded, not run again, and reported with the new "
        "ones; the others run seed by seed (every cell's first seed before any second). "
        f"Records of other runs move to {SUPERSEDED}",
    )
    return add_common(p, "<timestamp>")


def add_timing(p: argparse.ArgumentParser) -> None:
    """--timing-rounds and --timing-block."""
    p.add_argument(
        "--timing-rounds",
        type=positive_int,
        default=ROUNDS,
        metavar="N",
        help=f"timed blocks per cell in the timing pass (default: {ROUNDS})",
    )
    p.add_argument(
        "--timing-block",
        type=positive_int,
        default=BLOCK,
        metavar="N",
        help="training steps per timed block; keep it a multiple of the optimizers' T "
        f"(default: {BLOCK})",
    )


def timing_parser() -> argparse.ArgumentParser:
    """The parser of ``singd-harness timing``."""
    p = argparse.ArgumentParser(
        prog="singd-harness timing",
        description="Time the cells of a recorded grid in one process, one thread, the "
        "cells interleaved (its first seed's configuration of each cell), write "
        "timing.json and rebuild report.md and results.json with those times.",
    )
    p.add_argument("folder", type=Path, help="the output folder of a grid")
    add_timing(p)
    p.add_argument(
        "--device",
        type=device_arg,
        default="auto",
        help="auto (CUDA when available, else CPU), cpu, cuda or cuda:N",
    )
    return p


def tune_parser() -> argparse.ArgumentParser:
    """The parser of ``singd-harness tune``."""
    p = argparse.ArgumentParser(
        prog="singd-harness tune",
        description="Sweep each optimizer's learning rate on a log grid (the other settings "
        "at the library defaults), fp32, the same number of trials per optimizer; write the "
        "chosen values and the sweep table.",
    )
    add_grid(p, tune=True)
    p.add_argument(
        "--precision",
        choices=list(PRECISIONS),
        default="fp32",
        help="the model precision of every trial (fp32 factors; default: fp32)",
    )
    p.add_argument(
        "--grid",
        nargs="+",
        type=grid_arg,
        default=[],
        metavar="OPT=LR,LR,...",
        help="the learning rates to try for one optimizer or variant (e.g. "
        "singd+graft=adam=1e-4,3e-4,1e-3) instead of its table grid; every optimizer of "
        "the sweep must have the same number of trials",
    )
    p.add_argument(
        "--prune",
        type=prune_arg,
        metavar="LOSS@FRACTION",
        help="stop a trial at its first evaluation at or after FRACTION of its steps whose "
        "held-out loss is above LOSS (e.g. 3.0@0.3); it scores as failed. One rule for "
        "every optimizer, recorded with the sweep",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue the sweep in the --out folder: trials already in its runs.jsonl "
        "are loaded, not run again",
    )
    p.add_argument(
        "--record",
        action="store_true",
        help="write the chosen values into singd_cuda/harness/tuned.py (the "
        "values the default run uses), with this command",
    )
    return add_common(p, "tune-<timestamp>")


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
        "--structures",
        nargs="+",
        type=structure_arg,
        default=list(STRUCTURES),
        metavar="S",
        help=f"SINGD structures (default: {', '.join(STRUCTURES)})",
    )
    p.add_argument(
        "--factor-dtype",
        choices=["float32", "bfloat16", "float16"],
        default="float32",
        help="dtype of the Kronecker factors (default: float32)",
    )
    p.add_argument(
        "--graft",
        choices=["adam", "rms"],
        default=None,
        help="graft of the preconditioned optimizers' layers (kfac, adafisher, singd, "
        "ikfac; default: none); 'adam' adds one second-moment buffer per weight and bias",
    )
    return add_common(p, "memory-<timestamp>")


def grid_values(args: argparse.Namespace, key: str):
    """An option's value, else the --full or default grid's."""
    value = getattr(args, key, None)
    if value is not None:
        return value
    return (FULL_GRID if args.full else DEFAULT_GRID)[key]


def steps_for(args: argparse.Namespace, tasks: list[str], quick: bool) -> dict[str, int]:
    table = QUICK_STEPS if quick and not args.full else DEFAULT_STEPS
    return {t: args.steps or table[t] for t in tasks}


def output_folder(args: argparse.Namespace, prefix: str) -> Path:
    out = args.out or Path("harness_runs") / datetime.now().strftime(f"{prefix}%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    return out


def command_line(name: str, argv: list[str]) -> str:
    return shlex.join(["python", "-m", "singd_cuda.harness", *([name] if name else []), *argv])


class Progress:
    """One flushed line per finished run: count, run, outcome, elapsed time and an ETA,
    and the run appended to ``runs.jsonl``. The ETA prices each remaining run at the
    mean seconds per step measured so far on its task (on all tasks before any of its
    own finished), divided by the number of workers."""

    def __init__(self, specs: list[RunSpec], out: Path, workers: int) -> None:
        self.remaining = Counter(s.task for s in specs for _ in range(s.steps))
        self.per_step: dict[str, list[float]] = {}  # task -> [seconds, steps] finished
        self.total, self.done, self.workers = len(specs), 0, max(1, workers)
        self.start = time.perf_counter()
        path = out / "runs.jsonl"
        torn = path.exists() and path.stat().st_size and not path.read_bytes().endswith(b"\n")
        self.log = path.open("a")
        if torn:  # the last line of a killed grid: start the next record on its own line
            self.log.write("\n")

    def eta(self) -> float:
        seconds = sum(v[0] for v in self.per_step.values())
        steps = sum(v[1] for v in self.per_step.values())
        overall = seconds / max(steps, 1)
        total = 0.0
        for task, left in self.remaining.items():
            mine = self.per_step.get(task)
            total += left * (mine[0] / mine[1] if mine else overall)
        return total / self.workers

    def __call__(self, r: RunResult) -> None:
        s = r.spec
        self.done += 1
        self.remaining[s.task] -= s.steps
        record = self.per_step.setdefault(s.task, [0.0, 0])
        record[0] += r.wall_s
        record[1] += max(len(r.step_ms), 1)
        elapsed = time.perf_counter() - self.start
        what = f"{s.task} {s.optimizer.label} {s.precision}/{s.factor} seed {s.seed}"
        if r.stable:
            outcome = f"loss {r.final_loss:.4f} acc {100 * r.final_accuracy:.1f}%"
        else:
            outcome = r.status + (f" ({r.error})" if r.error else "")
        say(
            f"[{self.done:>{len(str(self.total))}}/{self.total}] {what}: {outcome} "
            f"({r.wall_s:.1f} s) | elapsed {_clock(elapsed)}, ETA {_clock(self.eta())}"
        )
        self.log.write(json.dumps(run_record(r)) + "\n")
        self.log.flush()

    def close(self) -> float:
        self.log.close()
        return time.perf_counter() - self.start


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes}:{secs:02d}"


def run_specs(specs: list[RunSpec], args, out: Path) -> tuple[list[RunResult], float]:
    workers = args.workers or default_workers(args.device)
    say(
        f"{len(specs)} runs on {args.device} with {min(workers, len(specs))} worker(s), "
        "one thread each; partial results in " + str(out / "runs.jsonl")
    )
    progress = Progress(specs, out, min(workers, len(specs)))
    results = run_grid(specs, args.device, workers, progress)
    return results, progress.close()


def run_tune(argv: list[str], name: str = "tune") -> tuple[Path, dict]:
    """Run the sweep ``argv`` describes; returns (output folder, chosen values)."""
    parser = tune_parser()
    args = parser.parse_args(argv)
    require_heavyball(parser, grid_values(args, "optimizers"))
    tasks = grid_values(args, "tasks")
    choices = expand(grid_values(args, "optimizers"), grid_values(args, "structures"))
    seeds = args.seeds or TUNE_SEEDS
    steps = steps_for(args, tasks, quick=False)
    if args.resume and args.out is None:
        parser.error("--resume needs --out, the folder of the sweep to continue")
    grids, given = {}, dict(args.grid)
    for choice in choices:  # a variant's own --grid, else its optimizer's
        points = given.get(choice.variant, given.get(choice.name))
        if points is not None:
            grids[choice.label] = points
    trials = {len(grids.get(c.label, OPTIMIZERS[c.name].tune_grid)) for c in choices}
    if len(trials) > 1:
        parser.error(
            f"--grid gives the optimizers {sorted(trials)} trials; give every one the same "
            "number (the tuning budget is equal)"
        )
    out = output_folder(args, "tune-")
    say(
        f"singd-harness tune: {len(tasks)} tasks x {len(choices)} optimizers x "
        f"{trials.pop()} trials x {len(seeds)} seeds, {args.precision}"
    )
    specs = tuning.trial_specs(tasks, choices, steps, seeds, args.precision, grids, args.prune)
    recorded = resume(out, specs) if args.resume else {}
    todo = [s for s in specs if s not in recorded]
    new, elapsed = run_specs(todo, args, out) if todo else ([], 0.0)
    done = {**recorded, **{r.spec: r for r in new}}
    results = [done[s] for s in specs]
    chosen, rows = tuning.choose(results)
    meta = {
        "command": command_line(name, argv),
        "created": tuning.now(),
        "elapsed_s": elapsed,
        "steps": steps,
        "seeds": seeds,
    }
    tuning.write_outputs(out, chosen, rows, meta)
    say(tuning.sweep_markdown(rows, chosen))
    if args.record:
        tuning.record(chosen, meta)
        say(f"Recorded in {tuning.TUNED_MODULE}")
    say(f"Tuned in {elapsed:.0f} s. Results: {out / 'sweep.md'} (tuned.json)")
    return out, chosen


def require_heavyball(parser: argparse.ArgumentParser, names: list[str]) -> None:
    """Exit with the fix when a chosen optimizer needs heavyball and it is missing."""
    missing = [n for n in map(label_name, names) if n in HEAVYBALL_OPTIMIZERS]
    if missing and not heavyball_available():
        parser.error(f"{', '.join(missing)} need heavyball: {INSTALL_HINT}")


def learning_rates(overrides: list[tuple[str | None, float]], choice, hp: dict) -> dict:
    """``hp`` with the --lr overrides that apply to ``choice`` (all, its optimizer, or
    its variant), in order."""
    hp = dict(hp)
    for target, lr in overrides:
        if _targets(target, choice):
            hp["lr"] = lr
    return hp


def _targets(target: str | None, choice: OptimizerChoice) -> bool:
    return target in (None, choice.name, choice.variant)


def build_specs(args, tasks, choices, steps) -> tuple[list[RunSpec], dict]:
    """The grid's runs and, per (task, label), the hyperparameters and their source."""
    specs, settings = [], {}
    precisions, factors = grid_values(args, "precisions"), grid_values(args, "factors")
    for task in tasks:
        for choice in choices:
            hp, source = tuning.hparams_for(task, choice)
            hp = learning_rates(args.lr, choice, hp)
            if any(_targets(t, choice) for t, _ in args.lr):
                source = "--lr"
            changes = [(key, value) for name, key, value in args.set if name == choice.name]
            for key, value in changes:
                if key == "fallback_lr" and value == "adamw":
                    adamw, _ = tuning.hparams_for(task, OptimizerChoice("adamw"))
                    value = learning_rates(args.lr, OptimizerChoice("adamw"), adamw)["lr"]
                hp[key] = value
            if changes:
                source += " + --set"
            settings[(task, choice.label)] = (hp, source)
            for precision in precisions:
                if PRECISIONS[precision].stochastic_rounding and not choice.has_factors:
                    continue  # AdamW has no stochastic rounding
                for factor in factors if choice.has_factors else [NO_FACTORS]:
                    for seed in grid_values(args, "seeds"):
                        hparams = tuple(sorted(hp.items()))
                        specs.append(
                            RunSpec(task, choice, precision, factor, seed, steps[task], hparams)
                        )
    return specs, settings


def report_markdown(meta: dict, table_cells: dict, settings: dict, tasks: list[str]) -> str:
    """The whole ``report.md``."""
    seeds = meta["config"]["seeds"]
    lines = [
        "# singd-harness report",
        "",
        f"Command: `{meta['command']}`  ",
        f"Created {meta['created']} on {meta['device']} ({meta['machine']}), torch "
        f"{meta['torch']}; {meta['run_count']} runs"
        + (
            f" ({meta['resumed']} of them loaded from runs.jsonl with --resume, recorded by "
            "an earlier invocation; the time is that of the others)"
            if meta.get("resumed")
            else ""
        )
        + f" in {meta['elapsed_s']:.0f} s with {meta['workers']} worker(s).",
        "",
        "## Verdict rule",
        "",
        RULE,
        "",
        f"Seeds per cell: {len(seeds)} ({', '.join(map(str, seeds))}). Numbers are mean ± "
        "sample standard deviation over the seeds that stayed finite; 'failed seeds' counts "
        "the others (non-finite, error, or diverged). Steps to target: the steps until the "
        "held-out loss first reaches AdamW's fp32 final held-out loss (mean over its seeds; "
        "in a grid without fp32 AdamW, that of its first model precision), checked at every "
        f"evaluation ({meta['evaluations']} per run); median over seeds, 'not reached' when "
        "the median seed does not reach it, (k/n) when only k seeds do. Seconds to target: "
        "those steps x the step time; 'time vs AdamW' divides by AdamW's own in the same "
        "model precision (fp32 where AdamW does not run, bf16-pure-sr).",
        "",
        "## How the times were taken",
        "",
        times_note(meta),
        "",
        *([meta["scope"], ""] if meta.get("scope") else []),
        "## Settings",
        "",
    ]
    rows = []
    for (task, label), (hp, source) in settings.items():
        name = label_name(label)
        fixed = ", ".join(f"{k}={v}" for k, v in FIXED_SETTINGS[name].items()) or "—"
        hps = ", ".join(f"{k}={fmt_value(v)}" for k, v in sorted(hp.items()))
        rows.append([task, label, hps, source, fixed])
    lines += [
        markdown_table(
            ["task", "optimizer", "tuned", "source", "other non-default settings"], rows
        ),
        "",
        "Everything else is the library (or heavyball) default. K-FAC, AdaFisher, SINGD and "
        "IKFAC train parameters outside Linear/Conv2d (norms, embeddings) with their "
        "built-in AdamW, and Muon all but the hidden matrices with heavyball's AdamW, at "
        "lr 3e-3 unless `fallback_lr` is listed above. Tuned values come from "
        "`singd_cuda/harness/tuned.py`"
        + (f" (`{meta['tuned_command']}`)." if meta.get("tuned_command") else "."),
        "",
    ]
    for task in tasks:
        lines += [
            f"## {task}: {TASKS_DESCRIPTIONS.get(task, '')}",
            "",
            f"{meta['config']['steps'][task]} steps per run.",
            "",
        ]
        lines += [task_table(task, table_cells), ""]
        if task in PAPER_ACCURACY:
            lines += paper_comparison(task, table_cells)
        lines += [f"![curves](curves_{task}.png)", ""]
    lines += [
        "## Time to target",
        "",
        "![time to target](time_to_target.png)",
        "",
        "## Optimizer-state memory (fp32 model)",
        "",
    ]
    for task in tasks:
        lines += [
            f"{task}:",
            "",
            markdown_table(
                ["optimizer", "fp32 factors (or none) MiB", "bf16 factors MiB"],
                memory_rows(task, table_cells),
            ),
            "",
        ]
    lines += ["![memory](memory.png)", ""]
    return "\n".join(lines)


TASKS_DESCRIPTIONS: dict[str, str] = {}


def times_note(meta: dict) -> str:
    """Where the report's times come from, with the timing pass's settings and its
    wall-clock/CPU agreement, or the warning that they are the parallel grid's."""
    timing = meta.get("timing")
    if not timing:
        return (
            f"Times: the grid's own step times, measured with {meta['workers']} worker(s) "
            "running side by side and whatever else shared the machine (columns labelled "
            "'parallel grid'): rough; `singd-harness timing FOLDER` re-times the cells."
        )
    clock = "process CPU time" if timing["clock"] == "cpu" else "wall clock"
    ratio = timing.get("wall_over_clock")
    agreement = (
        f"wall clock / {clock} per step: {ratio:.2f} (median over the cells; about 1 "
        "when nothing else competed for the core)"
        if ratio and timing["clock"] == "cpu"
        else ""
    )
    return (
        f"Times (columns labelled 'timed'): from the timing pass of {timing['created']}, "
        "in one process with one thread, nothing else of the harness running: each cell's first "
        f"seed, a {timing['warmup_steps']}-step warm-up, then {timing['rounds']} rounds of "
        f"{timing['block']} steps, the cells interleaved; a round's time is its mean per "
        f"step by the {clock}; shown as median [min–max] over the rounds. 'time vs AdamW' "
        "multiplies the steps ratio by the round-by-round step-time ratio. "
        + (agreement + ". " if agreement else "")
        + f"The pass took {timing['elapsed_s']:.0f} s. The grid's own step times "
        "(`median_step_ms` in runs.jsonl) ran beside other runs and are not used here."
    )


def fmt_value(value) -> str:
    """A hyperparameter as the report shows it: numbers in ``g`` format."""
    return f"{value:g}" if isinstance(value, int | float) else str(value)


def paper_comparison(task: str, table_cells: dict) -> list[str]:
    """Test accuracy in fp32 next to the MNIST-1D paper's table."""
    rows = [
        ["paper: logistic regression (Adam, 6000 steps)", f"{100 * PAPER_LOGISTIC_ACCURACY:.0f}"],
        [
            f"paper: {task.split('_')[1].upper()} (Adam, 6000 steps)",
            f"{100 * PAPER_ACCURACY[task]:.0f}",
        ],
    ]
    for (t, label, precision, factor), cell in table_cells.items():
        if t == task and precision == "fp32" and factor in ("fp32", NO_FACTORS):
            rows.append([f"{label} (here, fp32)", cell_row(cell)[4]])
    return [
        "Test accuracy (%) against the MNIST-1D paper (Greydanus & Kobak, arXiv 2011.14439):",
        "",
        markdown_table(["model / optimizer", "test accuracy %"], rows),
        "",
    ]


def run_train(argv: list[str]) -> Path:
    """Run the grid described by ``argv``; returns the output folder."""
    parser = train_parser()
    args = parser.parse_args(argv)
    if args.resume and args.out is None:
        parser.error("--resume needs --out, the folder of the grid to continue")
    require_heavyball(parser, grid_values(args, "optimizers"))
    tasks = grid_values(args, "tasks")
    choices = expand(grid_values(args, "optimizers"), grid_values(args, "structures"))
    steps = steps_for(args, tasks, quick=True)
    out = output_folder(args, "")
    say(
        f"singd-harness: {len(tasks)} tasks x {len(choices)} optimizers x "
        f"{len(grid_values(args, 'precisions'))} precisions x factors "
        f"{'/'.join(grid_values(args, 'factors'))} x {len(grid_values(args, 'seeds'))} seeds; "
        f"output {out}"
    )
    tuned_command = tuning.tuned.COMMAND
    if args.tune:
        tune_argv = [
            "--tasks",
            *tasks,
            "--optimizers",
            *grid_values(args, "optimizers"),
            "--structures",
            *grid_values(args, "structures"),
            "--out",
            str(out / "tune"),
            "--device",
            str(args.device),
        ]
        tune_argv += ["--steps", str(args.steps)] if args.steps else []
        tune_argv += ["--workers", str(args.workers)] if args.workers else []
        _, chosen = run_tune(tune_argv)
        for task, values in chosen.items():
            tuning.tuned.TUNED.setdefault(task, {}).update(values)
        tuned_command = command_line("tune", tune_argv)
    specs, settings = build_specs(args, tasks, choices, steps)
    recorded = resume(out, specs) if args.resume else {}
    todo = [s for s in specs if s not in recorded]
    if args.resume:
        seeds = grid_values(args, "seeds")
        todo.sort(key=lambda s: seeds.index(s.seed))  # stable: grid order within a seed
    new, elapsed = run_specs(todo, args, out) if todo else ([], 0.0)
    done = {**recorded, **{r.spec: r for r in new}}
    results = [done[s] for s in specs]
    if not args.no_timing:
        run_timing_pass(specs, args.device, args.timing_rounds, args.timing_block, out)
    meta = {
        "command": command_line("", argv),
        "created": datetime.now().isoformat(timespec="seconds"),
        "device": str(args.device),
        "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "elapsed_s": elapsed,
        "run_count": len(specs),
        "resumed": len(recorded),
        "workers": min(args.workers or default_workers(args.device), max(len(todo), 1)),
        "evaluations": EVALUATIONS,
        "tuned_command": tuned_command,
        "rule": RULE,
        "config": {
            "tasks": tasks,
            "optimizers": [c.label for c in choices],
            "precisions": grid_values(args, "precisions"),
            "factors": grid_values(args, "factors"),
            "seeds": grid_values(args, "seeds"),
            "steps": steps,
            "hparams": {f"{t}/{label}": hp for (t, label), (hp, _) in settings.items()},
        },
    }
    settings_json = {f"{t}/{label}": [hp, source] for (t, label), (hp, source) in settings.items()}
    meta["settings"] = settings_json
    if args.full:
        meta["scope"] = "`--full`: every task, optimizer, structure and precision."
    elif argv_is_default(args):
        meta["scope"] = DEFAULT_SCOPE.format(
            steps=", ".join(f"{t} {n} steps" for t, n in steps.items()),
            full=", ".join(f"{t} {n}" for t, n in DEFAULT_STEPS.items()),
        )
    write_report(out, meta, results)
    return out


def argv_is_default(args: argparse.Namespace) -> bool:
    """Whether the grid is the default one (no option changed what runs)."""
    keys = ("tasks", "optimizers", "structures", "precisions", "factors", "seeds", "steps")
    chosen = args.full or args.lr or args.set
    return not chosen and all(getattr(args, k) is None for k in keys)


#: The timing pass's record in an output folder (read by ``report``).
TIMING_FILE = "timing.json"


def run_timing_pass(
    specs: list[RunSpec], device: torch.device, rounds: int, block: int, out: Path
) -> dict:
    """Time one configuration per cell of ``specs`` (:func:`.timing.time_cells`) and
    write ``timing.json``; returns its content."""
    keys = list(dict.fromkeys(s.cell for s in specs))
    say(
        f"timing pass: {len(keys)} cells x {rounds} rounds of {block} steps (after a "
        f"{block}-step warm-up), one process, one thread, cells interleaved"
    )
    started = time.perf_counter()
    tasks = {name: TASKS[name]() for name in dict.fromkeys(s.task for s in specs)}
    timings = time_cells(
        specs,
        tasks,
        device,
        rounds,
        block,
        on_round=lambda r: say(
            f"  timing round {r + 1}/{rounds} done | elapsed "
            f"{_clock(time.perf_counter() - started)}"
        ),
    )
    payload = {
        "schema": SCHEMA + ":timing",
        "created": datetime.now().isoformat(timespec="seconds"),
        "device": str(device),
        "clock": next(iter(timings.values())).clock if timings else None,
        "rounds": rounds,
        "block": block,
        "warmup_steps": block,
        "threads": 1,
        "elapsed_s": time.perf_counter() - started,
        "wall_over_clock": agreement(timings),
        "cells": [t.record() for t in timings.values()],
    }
    (out / TIMING_FILE).write_text(json.dumps(payload, indent=1))
    failed = [t for t in timings.values() if t.error]
    say(
        f"timing pass: {payload['elapsed_s']:.0f} s; wall/CPU time per step "
        + (f"{payload['wall_over_clock']:.2f}" if payload["wall_over_clock"] else "—")
        + " (about 1: nothing else competed)"
        + (f"; {len(failed)} cell(s) without a time (non-finite or error)" if failed else "")
    )
    return payload


def load_timing(out: Path) -> dict | None:
    """The ``timing.json`` of an output folder, or None."""
    path = out / TIMING_FILE
    return json.loads(path.read_text()) if path.exists() else None


def timing_summary(payload: dict | None) -> dict | None:
    """``timing.json`` without its cells, as results.json and the report carry it."""
    return None if payload is None else {k: v for k, v in payload.items() if k != "cells"}


#: Where ``--resume`` moves the records of ``runs.jsonl`` that are not runs of its grid.
SUPERSEDED = "runs_superseded.jsonl"


def read_runs(path: Path) -> list[dict]:
    """The records of a ``runs.jsonl``, skipping a line that is not JSON (the last line
    of a grid killed while writing it)."""
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if line.strip():
                say(f"{path}: skipped a line that is not a whole record: {line[:60]}...")
    return records


def resume(out: Path, specs: list[RunSpec]) -> dict[RunSpec, RunResult]:
    """The runs of ``specs`` already recorded in ``out/runs.jsonl`` (the first record
    of each). Any other record (another learning rate, step count, ...; a duplicate; a
    torn line) moves to :data:`SUPERSEDED`, so ``runs.jsonl`` holds this grid's runs
    only and ``report`` of the folder, if this grid is interrupted too, mixes nothing."""
    path = out / "runs.jsonl"
    if not path.exists():
        say(f"--resume: no {path} yet; running all {len(specs)} runs")
        return {}
    wanted, found, kept, moved = set(specs), {}, [], []
    lines = path.read_text().splitlines()
    for line in lines:
        try:
            result = result_from_record(json.loads(line))
        except (json.JSONDecodeError, KeyError, TypeError):
            result = None
        if result is not None and result.spec in wanted and result.spec not in found:
            found[result.spec] = result
            kept.append(line)
        elif line.strip():
            moved.append(line)
    if moved:
        with (out / SUPERSEDED).open("a") as log:
            log.write("".join(line + "\n" for line in moved))
        temporary = path.with_suffix(".jsonl.tmp")
        temporary.write_text("".join(line + "\n" for line in kept))
        temporary.replace(path)
    say(
        f"--resume: {len(found)} of the {len(specs)} runs already in {path}; running the "
        f"other {len(specs) - len(found)}"
        + (f"; {len(moved)} other record(s) moved to {out / SUPERSEDED}" if moved else "")
    )
    return found


def write_report(out: Path, meta: dict, results: list[RunResult]) -> None:
    """results.json, report.md and the plots of a finished (or partial) grid, with the
    times of its timing pass (``timing.json``) where there is one, and the tables on the
    terminal, ending with the report's path."""
    payload = load_timing(out)
    timings = {}
    if payload is not None:
        timings = {t.key: t for t in map(Timing.from_record, payload["cells"])}
    meta = {**meta, "timing": timing_summary(payload)}
    table_cells = cells(results, timings)
    timed = is_timed(table_cells)
    tasks = list(dict.fromkeys(r.spec.task for r in results))
    for name in tasks:
        TASKS_DESCRIPTIONS[name] = TASKS[name]().description
    if "settings" not in meta:  # written before the sources were recorded
        hparams = meta["config"]["hparams"]
        meta["settings"] = {key: [hp, "as recorded"] for key, hp in hparams.items()}
    settings = {
        tuple(key.split("/", 1)): (hp, source) for key, (hp, source) in meta["settings"].items()
    }
    write_json(out / "results.json", meta, results, table_cells)
    for name in tasks:
        plot_curves(out / f"curves_{name}.png", name, table_cells)
    plot_time_to_target(out / "time_to_target.png", table_cells)
    plot_memory(out / "memory.png", table_cells)
    (out / "report.md").write_text(report_markdown(meta, table_cells, settings, tasks))
    for name in tasks:
        rows = [cell_row(c, timed) for k, c in table_cells.items() if k[0] == name]
        say()
        say(f"{name}: {TASKS_DESCRIPTIONS[name]}, {meta['config']['steps'][name]} steps")
        say(text_table(headers(timed), rows))
    say()
    say(times_note(meta))
    say()
    say(
        f"{len(results)} runs in {meta['elapsed_s']:.0f} s. Report: {out / 'report.md'} "
        "(results.json, runs.jsonl, timing.json, curves_*.png, time_to_target.png, memory.png)"
    )


def report_parser() -> argparse.ArgumentParser:
    """The parser of ``singd-harness report``."""
    p = argparse.ArgumentParser(
        prog="singd-harness report",
        description="Rebuild report.md, results.json and the plots of an output folder from "
        "its runs (results.json, or runs.jsonl of an interrupted grid).",
    )
    p.add_argument("folder", type=Path, help="the output folder of a grid")
    return p


def run_report(argv: list[str]) -> Path:
    """Rebuild the report of a grid's output folder (also of a partial, interrupted one)."""
    out = report_parser().parse_args(argv).folder
    done = out / "results.json"
    if done.exists():
        payload = json.loads(done.read_text())
        skip = ("schema", "cells", "runs", "timing")
        meta = {k: v for k, v in payload.items() if k not in skip}
        records = payload["runs"]
        meta.setdefault("run_count", len(records))
    else:
        records = read_runs(out / "runs.jsonl")
        meta = partial_meta(records)
    write_report(out, meta, [result_from_record(r) for r in records])
    return out


def run_timing(argv: list[str]) -> Path:
    """Time the cells of a recorded grid and rebuild its report with those times."""
    args = timing_parser().parse_args(argv)
    done = args.folder / "results.json"
    if done.exists():
        records = json.loads(done.read_text())["runs"]
    else:
        records = read_runs(args.folder / "runs.jsonl")
    specs = [result_from_record(r).spec for r in records]
    run_timing_pass(specs, args.device, args.timing_rounds, args.timing_block, args.folder)
    return run_report([str(args.folder)])


def partial_meta(records: list[dict]) -> dict:
    """Metadata for the report of an interrupted grid, from its runs alone."""
    settings = {f"{r['task']}/{r['label']}": [r["hparams"], "as run"] for r in records}
    return {
        "command": "(interrupted grid; report rebuilt from runs.jsonl)",
        "created": datetime.now().isoformat(timespec="seconds"),
        "device": "?",
        "machine": f"{platform.machine()}",
        "torch": torch.__version__,
        "elapsed_s": sum(r.get("wall_s", 0.0) for r in records),
        "run_count": len(records),
        "workers": "?",
        "evaluations": EVALUATIONS,
        "tuned_command": None,
        "rule": RULE,
        "settings": settings,
        "config": {
            "tasks": list(dict.fromkeys(r["task"] for r in records)),
            "optimizers": list(dict.fromkeys(r["label"] for r in records)),
            "precisions": list(dict.fromkeys(r["precision"] for r in records)),
            "factors": list(dict.fromkeys(r["factor"] for r in records)),
            "seeds": sorted({r["seed"] for r in records}),
            "steps": {r["task"]: r["steps"] for r in records},
        },
    }


def result_from_record(r: dict) -> RunResult:
    """The :class:`RunResult` of one JSON run record (:func:`run_record`)."""
    spec = RunSpec(
        r["task"],
        OptimizerChoice(r["optimizer"], r["structure"], tuple(map(tuple, r.get("options", [])))),
        r["precision"],
        r["factor"],
        r["seed"],
        r["steps"],
        tuple(sorted(r["hparams"].items())),
        tuple(r["prune"]) if r.get("prune") else None,
    )
    result = RunResult(spec)
    for name in ("train_loss", "eval_steps", "eval_loss", "eval_accuracy", "eval_seconds"):
        setattr(result, name, r[name])
    result.first_nonfinite_step = r["first_nonfinite_step"]
    result.pruned_at = r.get("pruned_at")
    result.error = r["error"]
    result.state_bytes = r["state_bytes"]
    result.wall_s = r.get("wall_s", 0.0)
    steps_run, median = r["steps_run"], r["median_step_ms"]
    result.step_ms = [median] * steps_run if median is not None else []
    return result


def run_memory(argv: list[str]) -> Path:
    """Measure optimizer-state memory as ``argv`` says; returns the output folder."""
    parser = memory_parser()
    args = parser.parse_args(argv)
    require_heavyball(parser, args.optimizers)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[
        args.factor_dtype
    ]
    choices = expand(args.optimizers, args.structures)
    out = output_folder(args, "memory-")
    say(
        f"singd-harness memory: {len(args.models)} models x {len(choices)} optimizers on "
        f"{args.device}, factors in {args.factor_dtype}, graft {args.graft}"
    )
    rows = []
    for model in args.models:
        for choice in choices:
            rows.append(measure(model, choice, dtype, args.device, args.graft))
        say(f"  {model} done")
    tables = [memory_table(m, [r for r in rows if r.model == m]) for m in args.models]
    (out / "report.txt").write_text("\n\n".join(tables) + "\n")
    for table in tables:
        say(table)
        say()
    payload = {
        "schema": SCHEMA + ":memory",
        "created": datetime.now().isoformat(timespec="seconds"),
        "device": str(args.device),
        "torch": torch.__version__,
        "factor_dtype": args.factor_dtype,
        "graft": args.graft,
        "rows": [asdict(r) for r in rows],
    }
    (out / "memory.json").write_text(json.dumps(payload, indent=1))
    plot_memory_rows(out / "memory.png", rows)
    say(f"Results: {out} (memory.json, report.txt, memory.png)")
    return out


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m singd_cuda.harness`` and ``singd-harness``."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["memory"]:
        run_memory(argv[1:])
    elif argv[:1] == ["tune"]:
        run_tune(argv[1:])
    elif argv[:1] == ["report"]:
        run_report(argv[1:])
    elif argv[:1] == ["timing"]:
        run_timing(argv[1:])
    elif argv[:1] == ["ablate"]:
        from .ablate import run_ablate

        run_ablate(argv[1:], run_train)
    else:
        run_train(argv)
    return 0


__all__ = ["OptimizerChoice", "main"]
