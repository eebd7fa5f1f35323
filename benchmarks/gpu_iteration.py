"""The whole training iteration on GPT-2 small: forward + backward + ``optimizer.step()``.

Used by ``benchmarks/gpu_check.py`` (phases ``iteration`` and ``graphs``); runnable alone:

    python benchmarks/gpu_iteration.py            # GPT-2 small (124M), bf16 autocast, 8 x 1024
    python benchmarks/gpu_iteration.py --dry-run  # a 2-layer GPT-2 on the CPU (checks the script)

Per optimizer (fused AdamW, SINGD diagonal and block_diagonal:32 at T=10 and T=1, AdaFisher,
K-FAC) it reports:

- ``iteration ms``: the mean iteration over a multiple of every T in the table, one device
  synchronisation at the end (the host may run ahead, as in a real loop), and its ratio to
  fused AdamW's iteration measured in the same run;
- ``step ms``: ``optimizer.step()`` alone (synchronised before and after);
- from ``torch.profiler`` over the same iterations: the step's CPU time (host work, the
  Python and the kernel launches) and its GPU time (the kernels the step launched), and
  their ratio: above 1 the step is host-bound (the GPU waits for the host).

K-FAC runs with ``T=1, T_inv=10**9``: it inverts once, in the warm-up, and is measured
between inversions. The GPT-2 head is tied to the input embedding (768 -> 50257), so K-FAC
keeps a dense 50257 x 50257 output factor (9.4 GiB in float32) and its Gram product every
step: that is K-FAC's cost on this model, and why the row is last.

``graphs`` tries to capture one ``optimizer.step()`` (a step without statistics) in a CUDA
graph (``torch.cuda.graph``) for each optimizer, each in a forked process of its own, and
reports whether it captures, and if not, the first line of the error (a device->host read
inside the step stops a capture).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout, not whichever singd_cuda is installed

TARGET_VS_ADAMW = 1.1  # GPT-2 small iteration with SINGD diagonal or AdaFisher / fused AdamW
WARMUP = 3  # iterations before timing: the first statistics step, warm start, first inversion
TIMED = 10  # a multiple of every T below, so T=10 rows include their statistics step


@dataclass(frozen=True)
class Size:
    """The model and batch: a GPT-2 config's width, depth and heads, tokens per row."""

    layers: int
    width: int
    heads: int
    vocab: int
    batch: int
    sequence: int


FULL = Size(layers=12, width=768, heads=12, vocab=50257, batch=8, sequence=1024)
DRY = Size(layers=2, width=64, heads=2, vocab=256, batch=2, sequence=32)
GRAPHS = Size(layers=2, width=256, heads=4, vocab=1024, batch=4, sequence=128)


def optimizers() -> list[tuple[str, Callable]]:
    """(label, model -> optimizer) for every row, fused AdamW first (the baseline)."""
    import torch

    from singd_cuda import KFAC, SINGD, AdaFisher

    lm = {"loss_average": "batch+sequence"}  # the LM loss is a mean over batch x sequence

    def adamw(model, capturable=False):
        fused = next(model.parameters()).is_cuda
        params = model.parameters()
        if fused:
            return torch.optim.AdamW(params, lr=1e-4, fused=True, capturable=capturable)
        return torch.optim.AdamW(params, lr=1e-4, foreach=True)

    device = {"nonfinite": "device"}  # skips decided on the device: no read per step
    return [
        ("torch AdamW", adamw),
        ("SINGD diagonal T=10", lambda m: SINGD(m, lr=1e-4, structures="diagonal", **lm)),
        (
            "SINGD diagonal T=10, nonfinite='device'",
            lambda m: SINGD(m, lr=1e-4, structures="diagonal", **lm, **device),
        ),
        ("SINGD diagonal T=1", lambda m: SINGD(m, lr=1e-4, structures="diagonal", T=1, **lm)),
        ("AdaFisher (T=1)", lambda m: AdaFisher(m, lr=1e-4, **lm)),
        ("AdaFisher (T=1), nonfinite='device'", lambda m: AdaFisher(m, lr=1e-4, **lm, **device)),
        ("SINGD block_diagonal:32 T=10", lambda m: SINGD(m, lr=1e-4, **lm)),
        ("SINGD block_diagonal:32 T=1", lambda m: SINGD(m, lr=1e-4, T=1, **lm)),
        ("K-FAC T=1 (between inversions)", lambda m: KFAC(m, lr=1e-4, T=1, T_inv=10**9, **lm)),
    ]


def gpt2(size: Size, device):
    """A Hugging Face GPT-2 built from a config (no download), its head tied to the input
    embedding as in the released model, in float32 on ``device``."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=size.layers,
        n_embd=size.width,
        n_head=size.heads,
        vocab_size=size.vocab,
        n_positions=size.sequence,
    )
    return GPT2LMHeadModel(config).to(device)


class Loop:
    """One model, one optimizer and one batch of random tokens; ``iteration()`` is the
    training step a user writes (bf16 autocast on CUDA, float32 on the CPU)."""

    def __init__(self, size: Size, device, make_optimizer: Callable) -> None:
        import torch

        self.device = device
        self.model = gpt2(size, device)
        self.optimizer = make_optimizer(self.model)
        generator = torch.Generator().manual_seed(1)
        tokens = torch.randint(0, size.vocab, (size.batch, size.sequence), generator=generator)
        self.tokens = tokens.to(device)

    def forward_backward(self) -> None:
        import torch

        self.optimizer.zero_grad(set_to_none=True)
        with torch.autocast(self.device.type, torch.bfloat16, enabled=self.device.type == "cuda"):
            loss = self.model(input_ids=self.tokens, labels=self.tokens).loss
        loss.backward()

    def iteration(self) -> None:
        self.forward_backward()
        self.optimizer.step()

    def sync(self) -> None:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def close(self) -> None:
        remove = getattr(self.optimizer, "remove_hooks", None)
        if remove is not None:
            remove()


def measure_row(loop: Loop) -> dict:
    """Iteration and step times (ms) and the profiler's CPU and GPU time of the step."""
    from torch.profiler import ProfilerActivity, profile, record_function

    for _ in range(WARMUP):
        loop.iteration()
    loop.sync()
    start = time.perf_counter()
    for _ in range(TIMED):
        loop.iteration()
    loop.sync()
    iteration = (time.perf_counter() - start) / TIMED

    steps = []
    for _ in range(TIMED):
        loop.forward_backward()
        loop.sync()
        start = time.perf_counter()
        loop.optimizer.step()
        loop.sync()
        steps.append(time.perf_counter() - start)

    activities = [ProfilerActivity.CPU]
    if loop.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        for _ in range(TIMED):
            loop.forward_backward()
            with record_function("benchmark.optimizer_step"):
                loop.optimizer.step()
        loop.sync()
    marks = [e for e in prof.events() if e.name == "benchmark.optimizer_step"]
    cpu_ms = sum(e.cpu_time_total for e in marks) / 1e3 / TIMED
    gpu_ms = sum(e.device_time_total for e in marks) / 1e3 / TIMED
    return {
        "iteration_ms": iteration * 1e3,
        "step_ms": statistics.mean(steps) * 1e3,
        "step_median_ms": statistics.median(steps) * 1e3,
        "step_cpu_ms": cpu_ms,
        "step_gpu_ms": gpu_ms if loop.device.type == "cuda" else None,
    }


def iteration_report(dry_run: bool, deadline: float | None = None) -> tuple[list, list, dict]:
    """Markdown lines, targets and data of the iteration table. Rows run in order while the
    longest row so far still fits before ``deadline`` (time.monotonic()); rows left are
    reported as not run."""
    import torch

    device = torch.device("cpu" if dry_run else "cuda")
    size = DRY if dry_run else FULL
    precision = "float32 (CPU)" if dry_run else "bf16 autocast"
    lines = [
        f"- model: Hugging Face GPT-2, {size.layers} layers, width {size.width}, vocab "
        f"{size.vocab} (tied head), batch {size.batch} x {size.sequence}, {precision}; "
        f"{WARMUP} warm-up iterations, {TIMED} timed; torch AdamW is fused=True on CUDA "
        "(foreach on the CPU)",
        "",
        "| optimizer | iteration ms | / AdamW | step ms | step CPU ms | step GPU ms | CPU / GPU |",
        "|---|---|---|---|---|---|---|",
    ]
    data: dict = {}
    targets: list[dict] = []
    baseline = None
    longest = 0.0  # seconds of the longest row so far
    for label, make in optimizers():
        if deadline is not None and time.monotonic() + longest > deadline:
            lines.append(f"| {label} | not run: out of time | | | | | |")
            continue
        started = time.monotonic()
        loop = Loop(size, device, make)
        try:
            row = measure_row(loop)
        except torch.OutOfMemoryError as exc:
            lines.append(f"| {label} | out of memory: {str(exc).splitlines()[0][:80]} | | | | | |")
            continue
        finally:
            loop.close()
            del loop
            if device.type == "cuda":
                torch.cuda.empty_cache()
        longest = max(longest, time.monotonic() - started)
        if baseline is None:
            baseline = row["iteration_ms"]
        row["vs_adamw"] = row["iteration_ms"] / baseline
        data[label] = row
        gpu = row["step_gpu_ms"]
        ratio = f"{row['step_cpu_ms'] / gpu:.1f}" if gpu else "n/a"
        lines.append(
            f"| {label} | {row['iteration_ms']:.1f} | {row['vs_adamw']:.2f}x | "
            f"{row['step_ms']:.2f} | {row['step_cpu_ms']:.2f} | "
            f"{'n/a' if gpu is None else f'{gpu:.2f}'} | {ratio} |"
        )
        print(lines[-1], flush=True)  # a phase killed mid-table still shows its rows
        if label.startswith(("SINGD diagonal", "AdaFisher")):
            met = row["vs_adamw"] <= TARGET_VS_ADAMW
            targets.append(
                {
                    "what": f"GPT-2 iteration, {label} / torch AdamW",
                    "value": f"{row['vs_adamw']:.2f}x",
                    "target": f"<= {TARGET_VS_ADAMW}x",
                    "met": met,
                }
            )
    return lines, targets, data


def in_fresh_process(verdict: Callable[[], str], timeout: float) -> str:
    """What ``verdict()`` returns, run in a forked child: a failed CUDA graph capture can
    leave the CUDA context broken for whatever runs after it in the same process (the first
    GPU run's later captures all failed after the first failure). An exception, a crash or
    ``timeout`` seconds is the verdict instead. The caller must not have initialised CUDA
    (a forked child cannot use a CUDA context of its parent)."""
    import multiprocessing

    context = multiprocessing.get_context("fork")
    receive, send = context.Pipe(duplex=False)
    child = context.Process(target=_send_verdict, args=(verdict, send))
    child.start()
    send.close()
    try:
        result = receive.recv() if receive.poll(timeout) else f"no: no verdict in {timeout:.0f} s"
    except EOFError:  # the child died without a verdict
        child.join()
        result = f"no: the process died (exit code {child.exitcode})"
    finally:
        receive.close()
        child.join(5)
        if child.is_alive():
            child.kill()
            child.join()
    return result


def _send_verdict(verdict: Callable[[], str], send) -> None:
    try:
        result = verdict()
    except Exception as exc:  # the verdict is the finding
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        result = f"no: {type(exc).__name__}: {first[:160]}"
    send.send(result)
    send.close()


def _captures(make: Callable) -> str:
    """Whether one ``optimizer.step()`` (after WARMUP iterations and a backward without
    statistics) captures in a CUDA graph and replays: "yes", or the exception propagates."""
    import torch

    loop = Loop(GRAPHS, torch.device("cuda"), make)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(WARMUP):
            loop.iteration()
        loop.forward_backward()  # step WARMUP + 1: no statistics at T=10
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        loop.optimizer.step()
    graph.replay()
    torch.cuda.synchronize()
    return "yes"


def graphs_report(dry_run: bool, timeout: float = 20.0) -> tuple[list, dict]:
    """Whether one ``optimizer.step()`` of each optimizer captures in a CUDA graph, each
    tried in a process of its own (:func:`in_fresh_process`, ``timeout`` s each)."""
    import os

    # NVML answers is_available without initialising CUDA here, so the children can fork
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
    import torch

    if dry_run or not torch.cuda.is_available():
        return ["- CUDA graphs: not tried (no CUDA device)"], {}
    lines = ["| optimizer | captures in a CUDA graph |", "|---|---|"]
    data = {}
    for label, make in optimizers():
        if label.startswith("K-FAC"):
            continue  # the small model below has no 50257-wide head; K-FAC's step is the same code
        if label == "torch AdamW":

            def make(model, make=make):
                return make(model, capturable=True)

        data[label] = in_fresh_process(lambda make=make: _captures(make), timeout)
        lines.append(f"| {label} | {data[label]} |")
        print(lines[-1], flush=True)
    return lines, data


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="a 2-layer GPT-2 on the CPU")
    args = parser.parse_args(argv)
    lines, targets, _ = iteration_report(args.dry_run)
    graph_lines, _ = graphs_report(args.dry_run)
    print("\n".join([*lines, "", *graph_lines]))
    for target in targets:
        print(f"- {target['what']}: {target['value']} (target {target['target']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
