"""CPU step time of torch.compile(model) against the eager model, per optimizer.

The MLP of ``benchmarks/vs_peers.py`` (3 x Linear 512, ReLU, batch 128, float32). For
each optimizer two copies of the model (same weights, same batches): one eager, one
``torch.compile(model, fullgraph=True)`` (Inductor); ``optimizer.step()`` stays eager in
both (compiling it is refused: README, "torch.compile"). After warm-up steps (the
compilations, statistics and non-statistics graphs) the timed steps (zero_grad, forward,
backward, step) alternate between the two copies, so load from other processes hits both
alike. Reported: median ms per step of each, and eager / compiled (> 1: compiled is
faster). Every optimizer takes statistics every step (T = 1) except where ``--T`` says.
Run once single-threaded and once with the default threads.

    python benchmarks/compile.py --out benchmarks/results/compile.md
    python benchmarks/compile.py --steps 5  # a quick look
"""

from __future__ import annotations

import argparse
import copy
import datetime
import os
import platform
import shlex
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from vs_peers import make_model

from singd_cuda import KFAC, SINGD, AdaFisher

OPTIMIZERS = {
    "adamw": lambda m, T: torch.optim.AdamW(m.parameters(), lr=1e-3),
    "singd-diagonal": lambda m, T: SINGD(m, lr=1e-3, T=T, structures="diagonal"),
    "singd-dense": lambda m, T: SINGD(m, lr=1e-3, T=T, structures="dense"),
    "adafisher": lambda m, T: AdaFisher(m, lr=1e-3, T=T),
    "kfac": lambda m, T: KFAC(m, lr=1e-3, T=T),
}


def step_time(model, run, opt, batch) -> float:
    x, y = batch
    start = time.perf_counter()
    opt.zero_grad()
    F.cross_entropy(run(x), y).backward()
    opt.step()
    return time.perf_counter() - start


def measure(name: str, T: int, steps: int, warmup: int) -> tuple[float, float]:
    """(eager, compiled) median seconds per step."""
    model, batches = make_model("mlp")
    twin = copy.deepcopy(model)
    eager_opt, compiled_opt = OPTIMIZERS[name](model, T), OPTIMIZERS[name](twin, T)
    compiled = torch.compile(twin, fullgraph=True)
    times: dict[str, list[float]] = {"eager": [], "compiled": []}
    for t in range(warmup + steps):
        pairs = [("eager", model, model, eager_opt), ("compiled", twin, compiled, compiled_opt)]
        if t % 2:
            pairs.reverse()
        for key, m, run, opt in pairs:
            seconds = step_time(m, run, opt, batches(t))
            if t >= warmup:
                times[key].append(seconds)
    return statistics.median(times["eager"]), statistics.median(times["compiled"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--T", type=int, default=1)
    parser.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS))
    parser.add_argument("--out", type=str, default=None)
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    default_threads = torch.get_num_threads()
    rows = []
    for threads in (1, default_threads):
        torch.set_num_threads(threads)
        for name in args.optimizers:
            eager, compiled = measure(name, args.T, args.steps, args.warmup)
            rows.append((threads, name, eager * 1e3, compiled * 1e3, eager / compiled))
            print(
                f"threads={threads} {name}: eager {eager * 1e3:.2f} ms, "
                f"compiled {compiled * 1e3:.2f} ms, eager/compiled {eager / compiled:.2f}",
                flush=True,
            )
    command = "python " + shlex.join(["benchmarks/compile.py", *sys.argv[1:]])
    lines = [
        "# torch.compile(model) against eager (CPU)",
        "",
        f"Command: `{command}`",
        "",
        f"Date: {datetime.datetime.now(datetime.UTC):%Y-%m-%dT%H:%M} UTC; machine: "
        f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}; load average "
        f"before {load_before:.2f}, after {os.getloadavg()[0]:.2f}; run took "
        f"{time.perf_counter() - started:.0f} s; {args.steps} timed steps per copy (after "
        f"{args.warmup} warm-up), alternating; T = {args.T}.",
        "",
        "MLP of benchmarks/vs_peers.py (3 x Linear 512, batch 128, float32); median ms per "
        "step (zero_grad, forward, backward, optimizer.step); *eager / compiled* > 1: the "
        "compiled model is faster.",
        "",
        "| threads | optimizer | eager ms | compiled ms | eager / compiled |",
        "|---|---|---|---|---|",
        *(f"| {t} | {n} | {e:.2f} | {c:.2f} | {r:.2f} |" for t, n, e, c, r in rows),
        "",
    ]
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
