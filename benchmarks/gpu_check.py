"""One GPU check of the fused ops (issue 4), under 8 minutes on an H200.

1. builds the CUDA ops (``singd_cuda.ops._build.load("cuda", strict=True)``);
2. runs ``pytest -m gpu tests/ops``;
3. on an MLP of at least 100M parameters (default 8 x Linear 4096 with bias: 134M):
   - the fused diagonal-SINGD and AdaFisher step: achieved memory bandwidth of the one
     ``diag_precond_step_`` call (bytes it must move: read W, G, buffer; write W, buffer)
     and of the whole ``optimizer.step()`` (non-update steps, T large), against a
     device-to-device copy of the same number of bytes measured in the same run;
   - their step time against torch AdamW (fused=True) on the same model;
   - the statistics (FIM construction: diag(aᵀa), diag(gᵀg) of every layer) of the fused
     path against the reference path (``SINGD_CUDA_FUSED=0``) and against materialising
     a and g as the dense rules do; plus a conv layer (no unfolded patches on the fused
     path);
4. writes a markdown table with the targets (>= 70% of copy bandwidth, <= 1.2x fused
   AdamW, statistics >= 5x faster than the reference path) to ``--out``.

    python benchmarks/gpu_check.py --out benchmarks/results/gpu_check.md

Without CUDA it says so and exits 0 without measuring. ``--dry-run`` runs the measuring
and reporting logic on the CPU with a tiny model (no build, no pytest) to check the script.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout, not whichever singd_cuda is installed

TARGET_BANDWIDTH = 0.70  # fraction of device-to-device copy bandwidth
TARGET_VS_ADAMW = 1.2  # step time / torch fused AdamW
TARGET_STATISTICS = 5.0  # reference statistics time / fused


@contextlib.contextmanager
def fused_env(fused: bool):
    old = os.environ.get("SINGD_CUDA_FUSED")
    os.environ["SINGD_CUDA_FUSED"] = "1" if fused else "0"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("SINGD_CUDA_FUSED", None)
        else:
            os.environ["SINGD_CUDA_FUSED"] = old


def timer(device: torch.device, fn: Callable[[], object], reps: int, warmup: int = 3) -> float:
    """Median seconds of ``fn`` over ``reps`` calls (device-synchronised)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def make_mlp(width: int, depth: int, device, dtype=torch.float32) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for i in range(depth):
        layers.append(nn.Linear(width, width))
        if i < depth - 1:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers).to(device=device, dtype=dtype)


def backward(model: nn.Module, x: torch.Tensor) -> None:
    model.zero_grad(set_to_none=False)
    model(x).float().square().mean().backward()


def build_and_test(args) -> list[str]:
    """Build the CUDA ops and run the GPU tests; returns report lines."""
    from singd_cuda.ops import _build

    lines = []
    start = time.perf_counter()
    ok = _build.load("cuda", strict=True, verbose=args.verbose)
    lines.append(
        f"- CUDA ops build/load: {'ok' if ok else 'FAILED'} ({time.perf_counter() - start:.0f} s)"
    )
    start = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "tests/ops"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=args.pytest_timeout,
    )
    tail = (result.stdout.strip().splitlines() or ["(no output)"])[-1]
    verdict = "passed" if result.returncode == 0 else f"FAILED (exit {result.returncode})"
    lines.append(
        f"- `pytest -m gpu tests/ops`: {verdict}: {tail} ({time.perf_counter() - start:.0f} s)"
    )
    if result.returncode != 0:
        sys.stderr.write(result.stdout[-4000:] + result.stderr[-2000:])
    return lines


def step_rows(args, device) -> tuple[list[tuple], list[str]]:
    """Bandwidth and step time of the fused diagonal / AdaFisher step vs copy and AdamW."""
    from singd_cuda import SINGD, ops

    model = make_mlp(args.width, args.depth, device)
    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    x = torch.randn(args.batch, args.width, device=device)
    rows, notes = (
        [],
        [
            f"- model: {args.depth} x Linear {args.width} (+bias), {n / 1e6:.1f}M parameters, "
            f"batch {args.batch}, float32"
        ],
    )

    # device-to-device copy of the bytes one diag step must move (5 x 4 bytes per element:
    # read W, G, buffer; write W, buffer), as one read + one write stream
    moved = 5 * 4 * n
    src = torch.empty(moved // 8, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    t_copy = timer(device, lambda: dst.copy_(src), args.reps)  # noqa: F821
    copy_bw = 2 * src.numel() * 4 / t_copy
    rows.append(
        ("device-to-device copy", f"{t_copy * 1e3:.3f}", f"{copy_bw / 1e9:.0f}", "1.00", "-", "")
    )
    del src, dst

    backward(model, x)
    adamw = torch.optim.AdamW(
        params,
        lr=1e-4,
        fused=device.type == "cuda",
        foreach=None if device.type == "cuda" else True,
    )
    t_adamw = timer(device, adamw.step, args.reps)
    adamw_bytes = 7 * 4 * n  # read W, G, m, v; write W, m, v
    rows.append(
        (
            "torch AdamW (fused)" if device.type == "cuda" else "torch AdamW (foreach)",
            f"{t_adamw * 1e3:.3f}",
            f"{adamw_bytes / t_adamw / 1e9:.0f}",
            f"{adamw_bytes / t_adamw / copy_bw:.2f}",
            "1.00",
            "",
        )
    )
    del adamw
    checks = []
    for label, kwargs in (
        ("SINGD diagonal", dict(structures="diagonal")),
        ("AdaFisher", dict(structures="adafisher")),
    ):
        torch.manual_seed(0)
        with fused_env(True):
            opt = SINGD(model, lr=1e-6, T=10**9, **kwargs)  # T huge: statistics once, then none
            opt.step()  # the update step (statistics of the first backward)
            backward(model, x)  # no statistics captured from here on
            t_step = timer(device, opt.step, args.reps)
            # the one fused call alone, on the optimizer's own lists
            group = opt.param_groups[0]
            layers = opt.layers
            states = [[opt.state[p] for p in layer.params] for layer in layers]
            rule = opt.rule_for(group)
            calls = []
            original = ops.diag_precond_step_

            def capture(*a, calls=calls, original=original, **k):
                calls.append((a, k))
                return original(*a, **k)

            ops.diag_precond_step_ = capture
            try:
                rule.apply_many(layers, group, states, None, group["step"], 0)
            finally:
                ops.diag_precond_step_ = original
            (a, k) = calls[0]
            t_kernel = timer(
                device, lambda a=a, k=k, original=original: original(*a, **k), args.reps
            )
            opt.remove_hooks()
        bw_kernel = moved / t_kernel
        bw_step = moved / t_step
        rows.append(
            (
                f"{label}: diag_precond_step_ (1 call, {len(a[0])} tensors)",
                f"{t_kernel * 1e3:.3f}",
                f"{bw_kernel / 1e9:.0f}",
                f"{bw_kernel / copy_bw:.2f}",
                f"{t_kernel / t_adamw:.2f}",
                "",
            )
        )
        rows.append(
            (
                f"{label}: optimizer.step()",
                f"{t_step * 1e3:.3f}",
                f"{bw_step / 1e9:.0f}",
                f"{bw_step / copy_bw:.2f}",
                f"{t_step / t_adamw:.2f}",
                "",
            )
        )
        checks.append((label, bw_kernel / copy_bw, bw_step / copy_bw, t_step / t_adamw))
        del opt
    for label, frac_kernel, frac_step, ratio in checks:
        notes.append(
            f"- {'met' if frac_kernel >= TARGET_BANDWIDTH else 'MISSED'}: {label} fused kernel at "
            f"{100 * frac_kernel:.0f}% of copy bandwidth (target >= {100 * TARGET_BANDWIDTH:.0f}%; "
            f"whole step incl. the non-finite check: {100 * frac_step:.0f}%)"
        )
        notes.append(
            f"- {'met' if ratio <= TARGET_VS_ADAMW else 'MISSED'}: {label} step / fused AdamW = "
            f"{ratio:.2f} (target <= {TARGET_VS_ADAMW})"
        )
    return rows, notes


def statistics_rows(args, device) -> tuple[list[tuple], list[str]]:
    """FIM construction time (diag(aᵀa), diag(gᵀg) of every layer) fused vs reference."""
    from singd_cuda.curvature.layers import (
        Layer,
        grad_output_matrix,
        grad_output_sum_squares,
        input_matrix,
        input_sum_squares,
    )

    cases = []
    width = args.width
    x = torch.randn(args.stat_rows, width, device=device)
    gy = torch.randn(args.stat_rows, width, device=device)
    lin = nn.Linear(width, width).to(device)
    cases.append(
        (
            f"Linear {width}, {args.stat_rows} rows, x {args.depth} layers",
            Layer("fc", lin, lin.weight, lin.bias),
            x,
            gy,
            args.depth,
        )
    )
    b, c, hw = args.conv
    conv = nn.Conv2d(c, c, 3, padding=1).to(device)
    xc = torch.randn(b, c, hw, hw, device=device)
    gc = torch.randn(b, c, hw, hw, device=device)
    cases.append(
        (
            f"Conv2d {c}->{c} 3x3, {b}x{hw}x{hw}",
            Layer("conv", conv, conv.weight, conv.bias),
            xc,
            gc,
            1,
        )
    )

    def diag_stats(layer, xi, gi):
        return input_sum_squares(layer, xi, torch.float32), grad_output_sum_squares(
            layer, gi, "batch", torch.float32
        )

    def materialised(layer, xi, gi):
        a = input_matrix(layer, xi, torch.float32)
        g = grad_output_matrix(layer, gi, "batch", torch.float32)
        return a.square().sum(0), g.square().sum(0)

    rows, notes = [], []
    for name, layer, xi, gi, times in cases:
        with fused_env(True):
            fused_out = diag_stats(layer, xi, gi)
            t_fused = times * timer(
                device, lambda layer=layer, xi=xi, gi=gi: diag_stats(layer, xi, gi), args.reps
            )
        with fused_env(False):
            ref_out = diag_stats(layer, xi, gi)
            t_ref = times * timer(
                device, lambda layer=layer, xi=xi, gi=gi: diag_stats(layer, xi, gi), args.reps
            )
            t_mat = times * timer(
                device, lambda layer=layer, xi=xi, gi=gi: materialised(layer, xi, gi), args.reps
            )
        err = max(
            ((f - r).abs().max() / r.abs().max().clamp_min(1e-30)).item()
            for f, r in zip(fused_out, ref_out, strict=True)
        )
        rows.append(
            (
                name,
                f"{t_fused * 1e3:.3f}",
                f"{t_ref * 1e3:.3f}",
                f"{t_mat * 1e3:.3f}",
                f"{t_ref / t_fused:.1f}",
                f"{t_mat / t_fused:.1f}",
                f"{err:.1e}",
            )
        )
        verdict = "met" if t_ref / t_fused >= TARGET_STATISTICS else "MISSED"
        notes.append(
            f"- {verdict}: statistics {name}: reference / fused = {t_ref / t_fused:.1f} "
            f"(target >= {TARGET_STATISTICS}); materialised / fused = {t_mat / t_fused:.1f}"
        )
    return rows, notes


def table(header: tuple, rows: list[tuple]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return lines


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="markdown file to write")
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument(
        "--stat-rows", type=int, default=8192, help="rows of a and g for the statistics"
    )
    parser.add_argument(
        "--conv", type=int, nargs=3, default=[64, 256, 32], metavar=("B", "C", "HW")
    )
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--pytest-timeout", type=int, default=240)
    parser.add_argument("--skip-tests", action="store_true", help="no build / pytest step")
    parser.add_argument(
        "--dry-run", action="store_true", help="tiny sizes on the CPU: checks the script only"
    )
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    if args.dry_run:
        args.width, args.depth, args.batch, args.stat_rows = 64, 2, 8, 32
        args.conv, args.reps, args.skip_tests = [2, 4, 8], 3, True
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        device = torch.device("cpu")
    elif not torch.cuda.is_available():
        print(
            "gpu_check: CUDA is not available on this machine; nothing measured (the GPU "
            "figures stay unmeasured). Run it on a GPU machine, or --dry-run to check the "
            "script on the CPU."
        )
        return 0
    else:
        device = torch.device("cuda")
    start = time.perf_counter()
    lines = [
        "# GPU check of the fused ops"
        + (" (DRY RUN on the CPU: not a measurement)" if args.dry_run else ""),
        "",
    ]
    lines.append(f"Command: `python {' '.join(shlex.quote(a) for a in sys.argv)}`")
    lines.append("")
    name = (
        torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or "cpu"
    )
    lines.append(
        f"Date: {datetime.datetime.now().isoformat(timespec='minutes')}; device: {name}; "
        f"torch {torch.__version__}; medians of {args.reps} reps."
    )
    lines.append("")
    notes = []
    if not args.skip_tests:
        notes += build_and_test(args)
    rows, step_notes = step_rows(args, device)
    lines += ["## Step: bandwidth and time", ""]
    lines += table(("what", "ms", "GB/s", "/ copy bandwidth", "/ AdamW time", ""), rows)
    stat_rows, stat_notes = statistics_rows(args, device)
    lines += ["", "## Statistics (FIM construction)", ""]
    lines += table(
        (
            "case",
            "fused ms",
            "reference ms",
            "materialised ms",
            "ref / fused",
            "mat / fused",
            "max rel. diff",
        ),
        stat_rows,
    )
    lines += [
        "",
        "## Checks and targets",
        "",
        *notes,
        *step_notes,
        *stat_notes,
        "",
        f"Took {time.perf_counter() - start:.0f} s.",
    ]
    text = "\n".join(lines) + "\n"
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
