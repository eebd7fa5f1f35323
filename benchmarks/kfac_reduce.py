"""What ``kfac_approx="reduce"`` saves in the capture on the harness's LLaMA task.

The ``llama_lm`` model (:func:`singd_cuda.harness.models.llama_small`: 4 blocks, width
128, SwiGLU 384, untied head) on its batch of 16 windows of 128 tokens, SINGD
``block_diagonal:32`` with T = 1 (every step captures), ``loss_average="batch+sequence"``
as the task trains. Per setting: the rows and bytes of the a and g matrices one backward
pass hands the layer rules (summed over the preconditioned layers), and the median time
of a forward + backward that captures, a full step, and a forward + backward of the
plain model (no optimizer, no hooks), interleaved round-robin.

    python benchmarks/kfac_reduce.py --out benchmarks/results/kfac_reduce.md
    python benchmarks/kfac_reduce.py --repeats 3  # quick look
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from singd_cuda import SINGD
from singd_cuda.harness.data import LLAMA_CONTEXT
from singd_cuda.harness.models import llama_small

BATCH, VOCAB = 16, 256
APPROXIMATIONS = ("expand", "reduce")


def loss_of(model, x, y):
    logits = model(x)
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def recorded_matrices(opt) -> list[tuple[int, int, int]]:
    """Wrap ``opt._accumulate`` to record (rows, bytes of a, bytes of g) of each call."""
    seen = []
    accumulate = opt._accumulate

    def recording(layer, group, pending, a, g):
        seen.append((a.shape[0], a.numel() * a.element_size(), g.numel() * g.element_size()))
        return accumulate(layer, group, pending, a, g)

    opt._accumulate = recording
    return seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    base = llama_small(VOCAB, LLAMA_CONTEXT)
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, VOCAB, (BATCH, LLAMA_CONTEXT), generator=gen)
    y = torch.randint(0, VOCAB, (BATCH, LLAMA_CONTEXT), generator=gen)

    plain = copy.deepcopy(base)
    runs = {}
    for approx in APPROXIMATIONS:
        model = copy.deepcopy(base)
        opt = SINGD(
            model,
            lr=1e-4,
            T=1,
            structures="block_diagonal:32",
            loss_average="batch+sequence",
            kfac_approx=approx,
        )
        runs[approx] = (model, opt, recorded_matrices(opt))
    times = {key: [] for key in ("plain", *APPROXIMATIONS)}
    steps = {approx: [] for approx in APPROXIMATIONS}
    for repeat in range(args.repeats + 1):  # the first round warms up
        start = time.perf_counter()
        plain.zero_grad()
        loss_of(plain, x, y).backward()
        elapsed = time.perf_counter() - start
        if repeat:
            times["plain"].append(elapsed)
        for approx, (model, opt, seen) in runs.items():
            seen.clear()
            opt.zero_grad()
            start = time.perf_counter()
            loss_of(model, x, y).backward()
            middle = time.perf_counter()
            opt.step()
            end = time.perf_counter()
            if repeat:
                times[approx].append(middle - start)
                steps[approx].append(end - middle)

    lines = [
        "# K-FAC-reduce on the harness's LLaMA (capture rows, bytes, time)",
        "",
        f"`python benchmarks/kfac_reduce.py --repeats {args.repeats} --threads {args.threads}`"
        f" (torch {torch.__version__}, CPU, {args.threads} threads; batch {BATCH} x "
        f"{LLAMA_CONTEXT} tokens; SINGD block_diagonal:32, T = 1; medians of "
        f"{args.repeats}).",
        "",
        "| kfac_approx | layers | rows of a and g per layer | a bytes | g bytes "
        "| fwd+bwd ms (plain) | fwd+bwd ms with capture | step ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    plain_ms = 1e3 * statistics.median(times["plain"])
    for approx, (_, _, seen) in runs.items():
        rows = sorted({r for r, _, _ in seen})
        a_bytes = sum(a for _, a, _ in seen)
        g_bytes = sum(g for _, _, g in seen)
        lines.append(
            f"| {approx} | {len(seen)} | {', '.join(map(str, rows))} | "
            f"{a_bytes / 2**20:.2f} MiB | {g_bytes / 2**20:.2f} MiB | {plain_ms:.0f} | "
            f"{1e3 * statistics.median(times[approx]):.0f} | "
            f"{1e3 * statistics.median(steps[approx]):.0f} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
