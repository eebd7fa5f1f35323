"""Where AdaFisher's host time per layer goes, on the tiny model of ``host_cost.py``.

Its ``build("tiny")``: 64 x (Linear(16, 16) + Tanh), batch 8, cross-entropy, one
thread. Two measurements:

- **Capture**: forward, backward and step timed separately (``time.perf_counter``), per
  layer, medians over interleaved iterations of four models: the plain model (no
  optimizer, no hooks), AdaFisher as it is, AdaFisher with the output side's square sum
  replaced by a copy of cached zeros (``input side only``), and AdaFisher with both
  replaced so (``no square sums``). The differences attribute the backward's overhead:
  the output side's reduction with its wrapper (real - input side only), the input side's
  one op (:func:`singd_cuda.ops.input_sum_squares`) with its wrapper (input side only - no
  square sums), and the capture's staging, planning and commit (no square sums - plain).
  The variants change the statistics, so only their times mean anything.
- **Step**: ``torch.profiler`` over AdaFisher's steps alone: the step's total and its
  self time (outside every op: its Python), and the ops with the most self time.

    python benchmarks/capture_cost.py --out benchmarks/results/capture_cost.md
"""

from __future__ import annotations

import argparse
import datetime
import os
import shlex
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from host_cost import MODELS, build

from singd_cuda import AdaFisher
from singd_cuda.curvature.layers import SquareSums

MODEL = "tiny"
LAYERS, WIDTH, BATCH, _ = MODELS[MODEL]


def _variants() -> dict[str, tuple[Callable, Callable]]:
    """name -> (SquareSums.inputs, SquareSums.outputs) while that variant runs."""
    zeros_in, zeros_out = torch.zeros(WIDTH + 1), torch.zeros(WIDTH)
    return {
        "AdaFisher": (SquareSums.inputs, SquareSums.outputs),
        "input side only (output side: cached zeros)": (
            SquareSums.inputs,
            lambda sums, g, dtype: zeros_out.clone(),
        ),
        "no square sums (cached zeros)": (
            lambda sums, x, dtype, weight=1.0: zeros_in.clone(),
            lambda sums, g, dtype: zeros_out.clone(),
        ),
    }


def _phases(model, optimizer, x, y) -> tuple[float, float, float]:
    """(forward, backward, step) µs per layer of one iteration."""
    (optimizer or model).zero_grad(set_to_none=True)
    start = time.perf_counter()
    out = model(x)
    forward = time.perf_counter()
    loss = F.cross_entropy(out, y)
    before_backward = time.perf_counter()
    loss.backward()
    backward = time.perf_counter()
    if optimizer is not None:
        optimizer.step()
    step = time.perf_counter()
    scale = 1e6 / LAYERS
    return (
        (forward - start) * scale,
        (backward - before_backward) * scale,
        (step - backward) * scale,
    )


def capture(iterations: int) -> dict[str, tuple[float, float, float]]:
    """name -> median (forward, backward, step) µs per layer, the rows interleaved."""
    plain, x, y = build(MODEL)
    model, _, _ = build(MODEL)
    optimizer = AdaFisher(model, lr=1e-4)
    variants = _variants()
    kept = (SquareSums.inputs, SquareSums.outputs)
    plain_name = "plain model (no optimizer, no hooks)"
    times: dict[str, list] = {plain_name: [], **{name: [] for name in variants}}

    def one_round(record: bool) -> None:
        sample = _phases(plain, None, x, y)
        if record:
            times[plain_name].append(sample)
        for name, (inputs, outputs) in variants.items():
            SquareSums.inputs, SquareSums.outputs = inputs, outputs
            try:
                sample = _phases(model, optimizer, x, y)
            finally:
                SquareSums.inputs, SquareSums.outputs = kept
            if record:
                times[name].append(sample)

    for _ in range(5):
        one_round(record=False)
    for _ in range(iterations):
        one_round(record=True)
    return {
        name: tuple(statistics.median(s[i] for s in samples) for i in range(3))
        for name, samples in times.items()
    }


def step_profile(steps: int) -> tuple[float, float, float, list[tuple[str, float, float]]]:
    """(unprofiled step µs/layer (median), profiled step total, its self time, top ops as
    (name, calls per step, self µs per layer))."""
    model, x, y = build(MODEL)
    optimizer = AdaFisher(model, lr=1e-4)
    for _ in range(10):
        _phases(model, optimizer, x, y)
    unprofiled = statistics.median(_phases(model, optimizer, x, y)[2] for _ in range(steps))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the profiler's note on toggling CPU collection
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                prof.toggle_collection_dynamic(False, [ProfilerActivity.CPU])
                optimizer.zero_grad(set_to_none=True)
                F.cross_entropy(model(x), y).backward()
                prof.toggle_collection_dynamic(True, [ProfilerActivity.CPU])
                optimizer.step()
    events = prof.key_averages()
    per_layer = 1.0 / (steps * LAYERS)
    step = next(e for e in events if e.key.startswith("Optimizer.step#"))
    ops = sorted(
        (e for e in events if not e.key.startswith("Optimizer.step#")),
        key=lambda e: -e.self_cpu_time_total,
    )[:8]
    top = [(e.key, e.count / steps, e.self_cpu_time_total * per_layer) for e in ops]
    return unprofiled, step.cpu_time_total * per_layer, step.self_cpu_time_total * per_layer, top


def report(iterations: int, steps: int) -> list[str]:
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    phases = capture(iterations)
    unprofiled, total, self_time, top = step_profile(steps)
    command = "python benchmarks/capture_cost.py " + shlex.join(sys.argv[1:])
    lines = [
        "# Where AdaFisher's host time per layer goes",
        "",
        f"`{command.strip()}` — {datetime.date.today()}, torch {torch.__version__}, cpu, 1 thread; "
        f"load average before {load_before:.1f}, after {os.getloadavg()[0]:.1f}; "
        f"run took {time.perf_counter() - started:.0f} s",
        "",
        f"### The capture: {LAYERS} x Linear({WIDTH}, {WIDTH}), batch {BATCH}, medians of "
        f"{iterations} interleaved iterations, µs per layer",
        "",
        "| model | forward | backward | step |",
        "|---|---|---|---|",
    ]
    lines += [f"| {name} | {f:.1f} | {b:.1f} | {s:.1f} |" for name, (f, b, s) in phases.items()]
    plain, real, inputs, zeros = phases.values()
    lines += [
        "",
        "The backward's overhead over the plain model's, attributed:",
        "",
        "| part | µs per layer |",
        "|---|---|",
        f"| the output side's reduction and its wrapper | {real[1] - inputs[1]:.1f} |",
        f"| the input side's op (`input_sum_squares`: the reduction, 1/N and w, the bias "
        f"entry) and its wrapper | {inputs[1] - zeros[1]:.1f} |",
        f"| staging, planning and commit (the capture's Python) | {zeros[1] - plain[1]:.1f} |",
        f"| the forward hooks (forward over the plain model's) | {real[0] - plain[0]:.1f} |",
        "",
        f"### The step: torch.profiler over {steps} steps, µs per layer",
        "",
        f"Unprofiled step (median): {unprofiled:.1f}. Profiled: {total:.1f} in all, of which "
        f"{self_time:.1f} outside every op (the step's own Python).",
        "",
        "| op | calls per step | self µs per layer |",
        "|---|---|---|",
    ]
    lines += [f"| `{name}` | {calls:.0f} | {us:.2f} |" for name, calls, us in top]
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=200)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    text = "\n".join(report(args.iterations, args.steps)) + "\n"
    if args.out is not None:
        args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
