"""How much of a fused op's host time is paid per tensor handed to it, on the CPU.

The diagonal steps (SINGD diagonal, AdaFisher) make one ``ops.diag_precond_step_`` call
for all their layers, with five lists of one tensor per parameter: parameters, gradients,
momentum buffers, row and column scales. Per model of L layers of Linear(d, d) with a
bias, single-threaded, medians over ``--calls`` calls each:

- ``lists``: that call in SINGD's mode over the 2L parameters (10L tensors);
- ``one stack``: the same op on the same number of elements as one (L d, d + 1) matrix
  (5 tensors): the same arithmetic, the minimal handling;
- ``foreach add``: ``torch._foreach_add_`` of the gradients into the parameters (4L
  tensors, one pass over the same elements), torch's own multi-tensor op;

each timed warm (right after the last call) and cold (after a 32 MiB sweep, as a step finds
the caches in ``host_cost.py``'s default run, where other competitors run in between).
``per tensor``: (lists - one stack) / (10L - 5), what handing over one tensor costs.

    python benchmarks/tensor_count.py --out benchmarks/results/tensor_count.md
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from records import header, publish

from singd_cuda import ops

SWEEP_ELEMENTS = 8 * 1024 * 1024  # 32 MiB of float32: larger than this machine's L3


def diagonal_lists(layers: int, width: int) -> list[list[torch.Tensor]]:
    """The five lists of one diagonal step over ``layers`` Linear(width, width) with a
    bias: weights as (d, d) and biases as (d, 1) matrices, as the optimizers hand them."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(width, width, generator=gen) for _ in range(layers)]
    params += [torch.randn(width, 1, generator=gen) for _ in range(layers)]
    grads = [torch.randn(p.shape, generator=gen) for p in params]
    bufs = [torch.zeros_like(p) for p in params]
    rows = [torch.rand(p.shape[0], generator=gen) for p in params]
    cols = [torch.rand(p.shape[1], generator=gen) for p in params]
    return [params, grads, bufs, rows, cols]


def one_stack(layers: int, width: int) -> list[list[torch.Tensor]]:
    """The same elements as one (layers x width, width + 1) matrix."""
    gen = torch.Generator().manual_seed(0)
    shape = (layers * width, width + 1)
    return [
        [torch.randn(shape, generator=gen)],
        [torch.randn(shape, generator=gen)],
        [torch.zeros(shape)],
        [torch.rand(shape[0], generator=gen)],
        [torch.rand(shape[1], generator=gen)],
    ]


def diagonal_step(lists: list[list[torch.Tensor]]) -> Callable[[], None]:
    def call() -> None:
        ops.diag_precond_step_(*lists, mode="singd", lr=1e-4, momentum=0.9, weight_decay=1e-4)

    return call


def foreach_add(lists: list[list[torch.Tensor]]) -> Callable[[], None]:
    params, grads = lists[0], lists[1]

    def call() -> None:
        torch._foreach_add_(params, grads, alpha=1e-4)

    return call


def timed(call: Callable[[], None], calls: int, sweep: torch.Tensor) -> tuple[float, float]:
    """Median µs of ``call``: warm (right after the last) and after a sweep of ``sweep``."""
    for _ in range(5):
        call()
    warm, cold = [], []
    for _ in range(calls):
        start = time.perf_counter()
        call()
        warm.append(time.perf_counter() - start)
        sweep.add_(1.0)
        start = time.perf_counter()
        call()
        cold.append(time.perf_counter() - start)
    return 1e6 * statistics.median(warm), 1e6 * statistics.median(cold)


def measure(layers: int, width: int, calls: int, sweep: torch.Tensor) -> dict:
    lists = diagonal_lists(layers, width)
    row = {"layers": layers, "width": width, "tensors": sum(map(len, lists))}
    row["lists"] = timed(diagonal_step(lists), calls, sweep)
    row["stack"] = timed(diagonal_step(one_stack(layers, width)), calls, sweep)
    row["foreach"] = timed(foreach_add(lists), calls, sweep)
    extra = row["tensors"] - 5
    pairs = zip(row["lists"], row["stack"], strict=True)
    row["per_tensor"] = tuple((lists_us - stack_us) / extra for lists_us, stack_us in pairs)
    return row


def table(rows: list[dict]) -> list[str]:
    lines = [
        "| layers x Linear(d, d) | tensors | lists µs (warm / cold) | one stack µs "
        "| foreach add µs | per tensor µs | lists per layer µs |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        pair = "{:.1f} / {:.1f}".format
        lines.append(
            f"| {r['layers']} x Linear({r['width']}, {r['width']}) | {r['tensors']} | "
            f"{pair(*r['lists'])} | {pair(*r['stack'])} | {pair(*r['foreach'])} | "
            f"{r['per_tensor'][0]:.3f} / {r['per_tensor'][1]:.3f} | "
            f"{r['lists'][0] / r['layers']:.2f} / {r['lists'][1] / r['layers']:.2f} |"
        )
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default="16,64,256", help="comma-separated layer counts")
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--calls", type=int, default=300, help="timed calls per cell")
    parser.add_argument("--out", type=Path, help="write the markdown record here")
    args = parser.parse_args(argv)
    if not ops.fused_available("cpu"):
        print("the fused CPU ops are not built: nothing to measure")
        return 1
    torch.set_num_threads(1)
    sweep = torch.zeros(SWEEP_ELEMENTS)
    start, load = time.time(), os.getloadavg()[0]
    rows = [measure(int(n), args.width, args.calls, sweep) for n in args.layers.split(",")]
    lines = [
        *header(
            "Host cost per tensor handed to a fused op",
            "tensor_count.py",
            argv or sys.argv[1:],
            start,
            load,
        ),
        *table(rows),
        "",
        "Warm: the call right after the last; cold: after a 32 MiB sweep. One stack: the "
        "same op on the same elements as one matrix (5 tensors). Per tensor: (lists - one "
        "stack) / (tensors - 5).",
    ]
    publish(lines, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
