"""CPU speed of the structured factors: project_gram and K @ X against dense.

For every structure and size d, times ``S.project_gram(Y)`` (Y: N x d) and
``K.matmul(X)`` (X: d x N) in float32 on the CPU, takes the median over
``--reps`` repetitions after warm-up, and writes a markdown table with the
dense/structure ratios and the Toeplitz scaling from d=2048 to d=8192.

    python benchmarks/structures.py --sizes 512 2048 8192 --reps 15 --threads 1 2 \
        --out benchmarks/results/structures.md

Each thread count (``torch.set_num_threads``) gets its own section: single-threaded is
the stable measure on a shared machine.

A structure that fails to build or run (e.g. not implemented yet) is reported
as such and skipped.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from singd_cuda import structures
from singd_cuda.structures import toeplitz

DEFAULT_SPECS = [
    "dense",
    "diagonal",
    "block_diagonal:32",
    "low_rank:8",
    "tril_toeplitz",
    "triu_toeplitz",
    "hierarchical:15,15",
]
OPS = ("project_gram", "matmul")
SPEEDUP_TARGET = 10.0  # every non-dense structure at d=2048, both ops
TOEPLITZ_SCALING_TARGET = 6.0  # Toeplitz time at d=8192 / time at d=2048
TOEPLITZ = ("tril_toeplitz", "triu_toeplitz")
FFT_FLOOR = "FFTs alone"  # a row of the tables, not a structure


def random_member(S, d: int, generator: torch.Generator):
    """A float32 member near the identity, built from its parts (no d x d temporary)."""
    K = S.eye(d, dtype=torch.float32)
    for part in K.parts.values():
        noise = torch.randn(part.shape, generator=generator, dtype=torch.float32)
        part.add_(noise, alpha=0.01)
    return K


def bench_size(specs: list[str], d: int, n: int, reps: int, warmup: int) -> dict[str, dict]:
    """{spec: {op: (median_s, min_s) or an error message}} at one size.

    Repetitions run round-robin over every (structure, op), so a burst of load
    from other processes hits all of them alike instead of one structure.
    """
    generator = torch.Generator().manual_seed(0)
    Y = torch.randn(n, d, generator=generator)
    X = torch.randn(d, n, generator=generator)
    results: dict[str, dict[str, object]] = {spec: {} for spec in specs}
    calls: dict[tuple[str, str], Callable[[], object]] = {}
    for spec in specs:
        try:
            S = structures.get(spec)
            K = random_member(S, d, generator)
        except Exception as error:  # not implemented yet, or broken: report and skip
            results[spec] = {op: f"{type(error).__name__}: {error}" for op in OPS}
            continue
        candidates = {
            "project_gram": lambda S=S: S.project_gram(Y),
            "matmul": lambda K=K: K.matmul(X),
        }
        for op, fn in candidates.items():
            try:
                for _ in range(warmup):
                    fn()
            except Exception as error:
                results[spec][op] = f"{type(error).__name__}: {error}"
            else:
                calls[spec, op] = fn
    # The floor of the Toeplitz FFT paths: only the FFTs of the padded rows, on signals
    # already padded (project_gram: one rfft; K @ X: an rfft and an irfft).
    n_fft = toeplitz._fft_length(d)
    padded = torch.nn.functional.pad(Y, (0, n_fft - d))
    spectrum = torch.fft.rfft(padded)
    results[FFT_FLOOR] = {}
    calls[FFT_FLOOR, "project_gram"] = lambda: torch.fft.rfft(padded)
    calls[FFT_FLOOR, "matmul"] = lambda: (torch.fft.rfft(padded), torch.fft.irfft(spectrum))
    times: dict[tuple[str, str], list[float]] = {key: [] for key in calls}
    for _ in range(reps):
        for key, fn in calls.items():
            start = time.perf_counter()
            fn()
            times[key].append(time.perf_counter() - start)
    for (spec, op), samples in times.items():
        results[spec][op] = (statistics.median(samples), min(samples))
    return results


def fmt_ms(seconds: float) -> str:
    ms = seconds * 1e3
    return f"{ms:.3f}" if ms < 1 else f"{ms:.2f}" if ms < 100 else f"{ms:.0f}"


def build_report(results, specs, sizes, n, reps, warmup, command, load) -> tuple[str, bool | None]:
    """The markdown report and whether every target was met (where measurable)."""
    lines = [
        "# Structure benchmark (CPU, float32)",
        "",
        f"Command: `{command}`",
        "",
        f"Machine: nproc={os.cpu_count()}, torch {torch.__version__}, "
        f"torch threads={torch.get_num_threads()}, {platform.machine()} "
        f"({platform.processor() or 'unknown cpu'}), Python {platform.python_version()}, "
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC.",
        f"Load average (1 min) before / after: {load[0]:.2f} / {load[1]:.2f} "
        "(other processes on the machine add noise).",
        "",
        f"Median wall time in ms over {reps} repetitions (run round-robin over all "
        f"structures and ops at each d) after {warmup} warm-up calls "
        f"(min in parentheses); `×` is the dense/structure ratio of the medians. "
        f"project_gram: Y of shape {n} × d; matmul: K @ X with X of shape d × {n}.",
        "",
        f"*{FFT_FLOOR}*: the FFTs of the Toeplitz paths only (torch.fft on the {n} rows, "
        "zero-padded beforehand to the FFT length those paths use: one rfft for "
        "project_gram, an rfft and an irfft for K @ X), timed in the same rounds: the "
        "bound of an FFT formulation, next to the Toeplitz rows.",
        "",
        "`tril_toeplitz` and `triu_toeplitz` share one project_gram code path, so the gap "
        "between their project_gram times shows the noise level (each call finds the cache "
        "in the state the previous, different call left it in).",
    ]
    all_met: bool | None = True if {2048, 8192} <= set(sizes) else None
    for op in OPS:
        lines += ["", f"## {op}", ""]
        header = "| structure | " + " | ".join(f"d={d}" for d in sizes) + " |"
        lines += [header, "|---" * (len(sizes) + 1) + "|"]
        for spec in [*specs, FFT_FLOOR]:
            cells = []
            for d in sizes:
                entry = results[spec][d][op]
                if isinstance(entry, str):
                    cells.append("n/a")
                    continue
                median, minimum = entry
                cell = f"{fmt_ms(median)} ({fmt_ms(minimum)})"
                dense = results.get("dense", {}).get(d, {}).get(op)
                if spec != "dense" and isinstance(dense, tuple):
                    cell += f" ×{dense[0] / median:.1f}"
                cells.append(cell)
            lines.append(f"| `{spec}` | " + " | ".join(cells) + " |")

    lines += ["", "## Targets", ""]
    if 2048 in sizes and "dense" in specs:
        for op in OPS:
            dense = results["dense"][2048][op]
            for spec in specs:
                if spec == "dense":
                    continue
                entry = results[spec][2048][op]
                if isinstance(entry, str) or isinstance(dense, str):
                    lines.append(f"- {op} `{spec}` d=2048: not measured")
                    all_met = False
                    continue
                ratio = dense[0] / entry[0]
                met = ratio >= SPEEDUP_TARGET
                all_met = all_met and met
                lines.append(
                    f"- {op} `{spec}` d=2048: dense/structure = {ratio:.1f} "
                    f"(target >= {SPEEDUP_TARGET:g}): {'met' if met else 'NOT met'}"
                )
    if 2048 in sizes and 8192 in sizes:
        for spec in (s for s in specs if s in TOEPLITZ):
            for op in OPS:
                small, large = results[spec][2048][op], results[spec][8192][op]
                if isinstance(small, str) or isinstance(large, str):
                    lines.append(f"- {op} `{spec}` d=8192 vs d=2048: not measured")
                    all_met = False
                    continue
                ratio = large[0] / small[0]
                met = ratio <= TOEPLITZ_SCALING_TARGET
                all_met = all_met and met
                lines.append(
                    f"- {op} `{spec}` time d=8192 / d=2048 = {ratio:.2f} "
                    f"(target <= {TOEPLITZ_SCALING_TARGET:g}): {'met' if met else 'NOT met'}"
                )
    errors = [
        f"- `{spec}` d={d} {op}: {results[spec][d][op]}"
        for spec in specs
        for d in sizes
        for op in OPS
        if isinstance(results[spec][d][op], str)
    ]
    if errors:
        lines += ["", "## Not measured", "", *errors]
    if all_met is None:
        lines.append("- not evaluated: the targets need d=2048 and d=8192")
    return "\n".join(lines) + "\n", all_met


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--reps", type=int, default=15, help="timed repetitions (median)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed calls first")
    parser.add_argument("--n", type=int, default=256, help="rows of Y / columns of X")
    parser.add_argument("--structures", nargs="+", default=DEFAULT_SPECS)
    parser.add_argument(
        "--threads",
        type=int,
        nargs="+",
        default=[1, torch.get_num_threads()],
        help="torch.set_num_threads values, one report section each (default: 1 and torch's)",
    )
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/structures.md"))
    args = parser.parse_args(argv)

    command = "python " + shlex.join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])])
    sections, verdicts = [], []
    for threads in dict.fromkeys(args.threads):  # in order, each once
        torch.set_num_threads(threads)
        load_before = os.getloadavg()[0]
        rows = [*args.structures, FFT_FLOOR]
        results: dict[str, dict[int, dict[str, object]]] = {spec: {} for spec in rows}
        for d in args.sizes:
            at_size = bench_size(args.structures, d, args.n, args.reps, args.warmup)
            for spec in rows:
                results[spec][d] = at_size[spec]
                shown = {
                    op: (f"{r[0] * 1e3:.3f} ms" if isinstance(r, tuple) else "n/a")
                    for op, r in at_size[spec].items()
                }
                print(
                    f"threads={threads} {spec:>20} d={d:<6} "
                    + "  ".join(f"{k}={v}" for k, v in shown.items())
                )
        load_after = os.getloadavg()[0]
        report, all_met = build_report(
            results,
            args.structures,
            args.sizes,
            args.n,
            args.reps,
            args.warmup,
            command,
            (load_before, load_after),
        )
        title, body = report.split("\n", 1)
        sections.append(f"{title} — {threads} thread{'s' if threads > 1 else ''}\n{body}")
        verdicts.append(all_met)
    report = "\n".join(sections)
    print()
    print(report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(report)
    all_met = None if None in verdicts else all(verdicts)
    verdict = "not evaluated (needs d=2048 and 8192)" if all_met is None else all_met
    print(f"written to {args.out}; all targets met: {verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
