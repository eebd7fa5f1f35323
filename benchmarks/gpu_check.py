"""One GPU check of the fused ops: one command, one report, whatever happens.

    python benchmarks/gpu_check.py benchmarks/results/gpu

writes ``gpu_report.md`` and ``gpu_report.json`` into the folder. The check runs as
phases, each in its own process under its own timeout, within a total budget (default
560 s, so it fits a 10-minute device call including the first build):

1. ``env``: torch, CUDA, the device, ``nvcc``;
2. ``build``: ``python -m singd_cuda.ops build --cuda`` (compiles and loads both op
   libraries; the first build on a machine takes minutes);
3. ``tests``: ``pytest -m gpu tests/ops tests/gpu`` (the GPU tests: bitwise parity with the
   CPU and the reference, launches, opcheck, reductions, training runs); a test that kills
   the process is recorded as crashed and the run goes on after it;
4. ``bench``: achieved bandwidth of the fused kernels as a fraction of a device-to-device
   copy of the same bytes measured in the same run (target >= 70 %), and the diagonal
   SINGD / AdaFisher ``optimizer.step()`` against ``torch.optim.AdamW(fused=True)`` on the
   same parameters (target <= 1.2x);
5. ``iteration``: the whole training iteration (forward + backward + step) on GPT-2 small
   (124M, bf16 autocast, batch 8 x 1024) for fused AdamW, SINGD diagonal and
   block_diagonal:32 (T=10 and T=1), AdaFisher and K-FAC: iteration and step time, the ratio
   to fused AdamW (target <= 1.1x for SINGD diagonal and AdaFisher) and the step's CPU and
   GPU time from ``torch.profiler`` (``benchmarks/gpu_iteration.py``);
6. ``graphs``: whether one ``optimizer.step()`` of each optimizer captures in a CUDA graph;
7. ``nccl``: the distributed path of the gloo tests (packed all-reduce of the statistics,
   all-gather of distributed factors) over NCCL: 2 processes on 2 GPUs when there are two,
   else a 1-process NCCL world (its collectives only: NCCL refuses two ranks on one GPU).

A phase that fails, crashes or runs out of time is recorded with the tail of its output
and the check goes on (phases that need a build are skipped when it failed). The report is
rewritten after every phase and on SIGTERM/SIGINT, so even an outer kill leaves the
report of every finished phase. The exit code is 0 when every phase passed, else 1.

Without CUDA it says so in the report and measures nothing. ``--dry-run`` runs every phase
on the CPU with tiny sizes (CPU build, the GPU tests skipping, gloo instead of NCCL) to
check the script itself.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout, not whichever singd_cuda is installed

TARGET_BANDWIDTH = 0.70  # fraction of device-to-device copy bandwidth on the same bytes
TARGET_VS_ADAMW = 1.2  # optimizer.step() time / torch AdamW(fused=True) step time
DEFAULT_BUDGET = 560.0  # seconds for the whole check (a 10-minute device call, with its start)
# Longest each phase may run (the remaining budget may cut it shorter).
PHASE_CAPS = {
    "env": 60.0,
    "build": 330.0,
    "tests": 150.0,
    "bench": 90.0,
    "iteration": 150.0,
    "graphs": 75.0,
    "nccl": 60.0,
}
PHASES = tuple(PHASE_CAPS)
NEEDS_BUILD = ("tests", "bench", "iteration", "graphs")
REPORT_MD = "gpu_report.md"
REPORT_JSON = "gpu_report.json"
LOG_TAIL = 3000  # characters of a failed phase's output kept in the report
CRASH_RERUNS = 5  # tests that may kill the pytest process before the phase gives up
RESULT_WORDS = ("PASSED", "FAILED", "SKIPPED", "ERROR", "XFAIL", "XPASS")


# ---------------------------------------------------------------------------------------
# Orchestration (the parent process imports neither torch nor singd_cuda)
# ---------------------------------------------------------------------------------------


@dataclass
class PhaseResult:
    """What one phase reports. ``status``: passed, failed, error (crashed), timeout,
    skipped or interrupted."""

    status: str
    summary: str = ""
    seconds: float = 0.0
    lines: list[str] = field(default_factory=list)
    targets: list[dict] = field(default_factory=list)
    data: dict = field(default_factory=dict)
    log_tail: str = ""


class SignalledError(Exception):
    """SIGTERM or SIGINT reached the check."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"signal {signum}")
        self.signum = signum


def phase_command(
    name: str, args: argparse.Namespace, result_file: Path, timeout: float
) -> list[str]:
    """The command that runs phase ``name`` in a fresh process killed after ``timeout`` s."""
    command = [sys.executable, str(Path(__file__).resolve()), str(args.out_dir)]
    command += ["--phase", name, "--result", str(result_file), "--timeout", f"{timeout:.0f}"]
    if args.dry_run:
        command.append("--dry-run")
    return command


def run_phase(name: str, command: list[str], timeout: float, log: Path, state: dict) -> PhaseResult:
    """Runs ``command`` in its own process group with output to ``log``; the phase's own
    JSON result when it wrote one, else a result made from its exit and output."""
    result_file = Path(command[command.index("--result") + 1]) if "--result" in command else None
    if result_file is not None:
        result_file.unlink(missing_ok=True)
    start = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen(
            command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        state["running"] = proc
        try:
            returncode = proc.wait(timeout=max(timeout, 1.0))
            timed_out = False
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            returncode, timed_out = proc.returncode, True
        except BaseException:  # a signal (its handler killed the group): reap, pass it on
            _kill_group(proc)
            raise
        finally:
            state["running"] = None
    seconds = time.monotonic() - start
    tail = log.read_text(errors="replace")[-LOG_TAIL:]
    result = None
    if result_file is not None and result_file.exists():
        try:
            result = PhaseResult(**json.loads(result_file.read_text()))
        except (ValueError, TypeError) as exc:
            tail += f"\n(unreadable phase result: {exc})"
    if timed_out:
        partial = f"; it had reported: {result.summary}" if result else ""
        result = PhaseResult("timeout", f"killed after {seconds:.0f} s (limit){partial}")
    elif result is None:
        result = PhaseResult("error", f"exited with {returncode} without a result")
    elif returncode != 0 and result.status == "passed":
        result.status, result.summary = "error", f"exited with {returncode}; {result.summary}"
    result.summary = (result.summary.strip().splitlines() or [""])[0][:300]
    result.seconds = seconds
    if result.status != "passed":
        result.log_tail = tail
    return result


def _signal_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def _kill_group(proc: subprocess.Popen) -> None:
    _signal_group(proc)
    proc.wait()


def write_report(out_dir: Path, header: dict, results: dict[str, PhaseResult]) -> None:
    """gpu_report.md and gpu_report.json from the phases so far (atomic replace)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    payload = {**header, "phases": {name: asdict(r) for name, r in results.items()}}
    targets = [t for r in results.values() for t in r.targets]
    payload["targets"] = targets
    _atomic_write(out_dir / REPORT_JSON, json.dumps(payload, indent=2) + "\n")
    _atomic_write(out_dir / REPORT_MD, markdown(header, results, targets))


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def markdown(header: dict, results: dict[str, PhaseResult], targets: list[dict]) -> str:
    title = "# GPU check of the fused ops"
    if header.get("dry_run"):
        title += " (DRY RUN on the CPU: not a measurement)"
    lines = [title, ""]
    lines.append(f"Command: `{header['command']}`  ")
    lines.append(f"Started {header['started']}; budget {header['budget']:.0f} s; ")
    lines.append(f"{header.get('state', '')}")
    if header.get("error"):
        lines += ["", "```", header["error"].rstrip(), "```"]
    lines += ["", "## Phases", "", "| phase | status | seconds | summary |", "|---|---|---|---|"]
    for name in PHASES:
        r = results.get(name)
        if r is None:
            lines.append(f"| {name} | not run | - | |")
        else:
            summary = r.summary.replace("|", "\\|").replace("\n", " ")
            lines.append(f"| {name} | {r.status} | {r.seconds:.0f} | {summary} |")
    if targets:
        lines += ["", "## Targets", "", "| what | value | target | verdict |", "|---|---|---|---|"]
        for t in targets:
            verdict = "met" if t["met"] else "MISSED"
            lines.append(f"| {t['what']} | {t['value']} | {t['target']} | {verdict} |")
    for name in PHASES:
        r = results.get(name)
        if r is None or not r.lines:
            continue
        lines += ["", f"## {name}", "", *r.lines]
    failed = [(n, r) for n, r in results.items() if r.log_tail]
    for name, r in failed:
        lines += ["", f"## Output of {name} ({r.status}, last {LOG_TAIL} characters)", ""]
        lines += ["```", r.log_tail.rstrip(), "```"]
    return "\n".join(lines) + "\n"


def orchestrate(args: argparse.Namespace) -> int:
    out_dir = args.out_dir
    logs = out_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    deadline = started + args.budget
    header = {
        "command": "python " + " ".join(shlex.quote(a) for a in sys.argv),
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "budget": args.budget,
        "dry_run": args.dry_run,
        "state": "running",
    }
    results: dict[str, PhaseResult] = {}
    state: dict = {"running": None}

    def on_signal(signum, frame):
        proc = state.get("running")
        if proc is not None:
            # no wait here: the handler may run inside proc.wait(), which holds the
            # Popen's lock (a second wait would deadlock); run_phase reaps it
            _signal_group(proc)
        raise SignalledError(signum)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        write_report(out_dir, header, results)
        for name in args.phases:
            remaining = deadline - time.monotonic()
            if (
                name in NEEDS_BUILD
                and results.get("build", PhaseResult("passed")).status != "passed"
            ):
                results[name] = PhaseResult("skipped", "the build did not pass")
            elif results.get("env") is not None and results["env"].data.get("no_cuda"):
                results[name] = PhaseResult("skipped", "CUDA is not available")
            elif remaining < 5:
                results[name] = PhaseResult("timeout", "not run: no time left in the budget")
            else:
                result_file = logs / f"{name}.json"
                timeout = min(args.caps.get(name, PHASE_CAPS[name]), remaining - 2)
                command = args.commands.get(name) or phase_command(name, args, result_file, timeout)
                results[name] = run_phase(name, command, timeout, logs / f"{name}.log", state)
            write_report(out_dir, header, results)
        passed = all(r.status in ("passed", "skipped") for r in results.values())
        no_cuda = results.get("env") is not None and results["env"].data.get("no_cuda")
        header["state"] = (
            f"finished in {time.monotonic() - started:.0f} s: "
            + ("no CUDA device, nothing measured" if no_cuda else "")
            + ("every phase passed" if passed and not no_cuda else "")
            + ("" if passed else "SOME PHASES DID NOT PASS")
        )
        code = 0 if passed else 1
    except SignalledError as exc:
        header["state"] = (
            f"INTERRUPTED by signal {exc.signum} after {time.monotonic() - started:.0f} s"
        )
        for name in args.phases:
            results.setdefault(name, PhaseResult("interrupted", "the check was stopped"))
        code = 128 + exc.signum
    except BaseException as exc:  # the report is written whatever happens
        header["state"] = f"the check itself failed: {type(exc).__name__}: {exc}"
        header["error"] = traceback.format_exc()[-LOG_TAIL:]
        code = 1
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        write_report(out_dir, header, results)
    print((out_dir / REPORT_MD).read_text())
    return code


# ---------------------------------------------------------------------------------------
# Phases (each runs in its own process: python gpu_check.py OUT --phase NAME --result FILE)
# ---------------------------------------------------------------------------------------


def phase_env(args) -> PhaseResult:
    import platform
    import shutil

    import torch

    lines = [
        f"- python {platform.python_version()}, torch {torch.__version__} "
        f"(CUDA {torch.version.cuda}), {platform.platform()}"
    ]
    data: dict = {"torch": torch.__version__, "torch_cuda": torch.version.cuda}
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            lines.append(
                f"- cuda:{i}: {props.name}, {props.total_memory / 2**30:.0f} GiB, "
                f"{props.multi_processor_count} SMs, capability {props.major}.{props.minor}"
            )
        data["devices"] = torch.cuda.device_count()
        data["device_name"] = torch.cuda.get_device_name(0)
    elif not args.dry_run:
        data["no_cuda"] = True
        lines.append("- CUDA is not available: nothing is measured")
    from singd_cuda.ops import _build

    home = _build.cuda_home()
    nvcc = Path(home) / "bin" / "nvcc" if home else None
    if nvcc is not None and nvcc.exists():
        version = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True).stdout
        lines.append(f"- nvcc: {nvcc} ({version.strip().splitlines()[-1]})")
    else:
        lines.append(f"- nvcc: none found (CUDA_HOME={home}; nvcc on PATH: {shutil.which('nvcc')})")
    lines.append(f"- TORCH_CUDA_ARCH_LIST for the build: {_build.cuda_arch_list()}")
    summary = data.get("device_name", "no CUDA device" if data.get("no_cuda") else "CPU (dry run)")
    return PhaseResult("passed", summary, lines=lines, data=data)


def _tee(command: list[str], cwd: Path = ROOT) -> tuple[int, str]:
    """Runs ``command``, streaming its output into this phase's log; (exit code, output)."""
    collected = []
    with subprocess.Popen(
        command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    ) as proc:
        for line in proc.stdout:
            print(line, end="", flush=True)
            collected.append(line)
    return proc.returncode, "".join(collected)


def phase_build(args) -> PhaseResult:
    command = [sys.executable, "-m", "singd_cuda.ops", "build"]
    if not args.dry_run:
        command.append("--cuda")
    returncode, out = _tee(command)
    ready = [line for line in out.splitlines() if "ops ready" in line]
    lines = [f"- `{' '.join(command[1:])}`: exit {returncode}", *(f"- {r}" for r in ready)]
    if returncode != 0:
        return PhaseResult("failed", f"exit {returncode}", lines=lines)
    return PhaseResult("passed", "; ".join(r.split(" (")[0] for r in ready), lines=lines)


def _reported_tests(out: str) -> tuple[dict[str, str], str | None]:
    """From ``pytest -v`` output: each node id that reported a result, with the result, and
    the one that was running when the process died (its line has no result), if any."""
    reported, running = {}, None
    for line in out.splitlines():
        node, _, rest = line.partition(" ")
        if "::" in node and not line.startswith(" "):
            word = rest.split(" ", 1)[0]
            if word in RESULT_WORDS:
                reported[node] = word
                running = None
            else:
                running = node
    return reported, running


def _junit_failures(junit: Path) -> list[str]:
    """ "node: message" of each failed or erroring test case in a JUnit XML report."""
    import xml.etree.ElementTree as ET

    failures = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        for kind in ("failure", "error"):
            problem = case.find(kind)
            if problem is not None:
                message = (problem.get("message") or "").strip().splitlines()[:1]
                failures.append(f"{case.get('classname')}::{case.get('name')}: {message}")
    return failures


def run_pytest_through_crashes(
    command: list[str], junit: Path, cwd: Path = ROOT
) -> tuple[int, str, list[str]]:
    """Runs ``command`` (``pytest -v ...``) with ``--junitxml``; when a test kills the
    process (a segfault in an op), records it, deselects it and every test that already
    reported, and runs on, at most ``CRASH_RERUNS`` times. (last exit code, last output,
    failures as "node: message", crashed tests included; a run that crashed wrote no
    report, so its failures are named from its output, their messages left in the log)."""
    done: list[str] = []
    failures: list[str] = []
    for attempt in range(CRASH_RERUNS + 1):
        part = junit.with_suffix(f".{attempt}.xml")
        part.unlink(missing_ok=True)
        skip = [f"--deselect={node}" for node in done]
        returncode, out = _tee([*command[:3], f"--junitxml={part}", *skip, *command[3:]], cwd)
        reported, crashed = _reported_tests(out)
        if returncode >= 0 or crashed is None:
            if part.exists():
                failures += _junit_failures(part)
            break
        failures += [
            f"{node}: {word} (its message is in the log)"
            for node, word in reported.items()
            if word in ("FAILED", "ERROR")
        ]
        failures.append(f"{crashed}: CRASHED the test process (signal {-returncode})")
        done += [*reported, crashed]
    return returncode, out, failures


def phase_tests(args) -> PhaseResult:
    junit = args.result.with_suffix(".xml")
    paths = ["tests/gpu"] if args.dry_run else ["tests/ops", "tests/gpu"]
    command = [sys.executable, "-m", "pytest", "-v", "-m", "gpu", "-p", "no:cacheprovider"]
    command += ["--maxfail=30", *paths]
    returncode, out, failures = run_pytest_through_crashes(command, junit)
    tail = (out.strip().splitlines() or ["(no output)"])[-1].strip("= ")
    crashed = [f for f in failures if "CRASHED" in f]
    if crashed:
        tail = f"{len(crashed)} test(s) crashed the process; after them: {tail}"
    lines = [f"- `pytest {' '.join(command[3:])}`: exit {returncode}: {tail}"]
    lines += [f"- FAILED {f}" for f in failures[:40]]
    status = "passed" if returncode == 0 and not failures else "failed"
    return PhaseResult(status, tail, lines=lines, data={"failures": failures})


def _timer(device, fn: Callable[[], object], reps: int, inner: int = 1) -> float:
    """Median seconds of one ``fn`` call over ``reps`` timings of ``inner`` calls each."""
    import torch

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(3):
        fn()
    sync()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        sync()
        times.append((time.perf_counter() - start) / inner)
    return statistics.median(times)


def _target(what: str, value: float, target: float, higher_is_better: bool, unit: str = "") -> dict:
    met = value >= target if higher_is_better else value <= target
    sign = ">=" if higher_is_better else "<="
    return {
        "what": what,
        "value": f"{value:.2f}{unit}",
        "target": f"{sign} {target}{unit}",
        "met": met,
    }


def phase_bench(args) -> PhaseResult:
    import torch
    from torch import nn

    from singd_cuda import SINGD, AdaFisher, ops

    device = torch.device("cpu" if args.dry_run else "cuda")
    width, depth, batch, reps = (64, 2, 8, 3) if args.dry_run else (4096, 8, 64, 20)
    inner = 1 if args.dry_run else 5
    if not ops.fused_available(device):
        return PhaseResult("failed", f"the fused ops are not available on {device}")
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for i in range(depth):
        layers += [nn.Linear(width, width)] + ([nn.ReLU()] if i < depth - 1 else [])
    model = nn.Sequential(*layers).to(device)
    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    x = torch.randn(batch, width, device=device)

    def backward():
        model.zero_grad(set_to_none=False)
        model(x).square().mean().backward()

    lines = [f"- model: {depth} x Linear {width} (+bias), {n / 1e6:.1f}M float32 parameters"]
    targets, rows, data = [], [], {}

    copy_cache: dict[int, float] = {}

    def copy_bandwidth(nbytes: int) -> float:
        """Bytes per second of a device-to-device copy moving ``nbytes`` (read + write)."""
        if nbytes not in copy_cache:
            src = torch.empty(max(nbytes // 8, 1), dtype=torch.float32, device=device)
            dst = torch.empty_like(src)
            t = _timer(device, lambda: dst.copy_(src), reps, inner)
            copy_cache[nbytes] = 2 * src.numel() * 4 / t
        return copy_cache[nbytes]

    def bandwidth_row(what, nbytes, seconds, gate: bool):
        fraction = nbytes / seconds / copy_bandwidth(nbytes)
        rows.append(
            (what, f"{seconds * 1e3:.3f}", f"{nbytes / seconds / 1e9:.0f}", f"{fraction:.2f}")
        )
        data[what] = {"ms": seconds * 1e3, "fraction_of_copy": fraction}
        if gate:
            targets.append(_target(f"{what}: / copy bandwidth", fraction, TARGET_BANDWIDTH, True))

    # the fused diagonal step on the model's own tensors (one call, every layer)
    weights = [p if p.dim() == 2 else p.view(-1, 1) for p in params]
    grads = [torch.randn_like(w) for w in weights]
    bufs = [torch.zeros_like(w) for w in weights]
    row_scales = [torch.rand(w.shape[0], device=device) + 0.5 for w in weights]
    col_scales = [torch.rand(w.shape[1], device=device) + 0.5 for w in weights]
    moved = 5 * 4 * n  # read W, G, buffer; write W, buffer
    for mode in ("singd", "adafisher"):
        kwargs = dict(mode=mode, lr=1e-9, momentum=0.9, damping=1e-3, step=1)

        def call(kwargs=kwargs):
            ops.diag_precond_step_(weights, grads, bufs, row_scales, col_scales, **kwargs)

        bandwidth_row(f"diag_precond_step_ {mode}", moved, _timer(device, call, reps, inner), True)

    # optimizer.step() (no statistics: T huge) against torch AdamW on the same parameters
    backward()
    fused_adamw = device.type == "cuda"
    adamw = torch.optim.AdamW(params, lr=1e-9, fused=fused_adamw, foreach=not fused_adamw or None)
    t_adamw = _timer(device, adamw.step, reps, inner)
    adamw_name = "torch AdamW (fused)" if fused_adamw else "torch AdamW (foreach)"
    bandwidth_row(adamw_name, 7 * 4 * n, t_adamw, False)
    del adamw
    for label, make in (
        ("SINGD diagonal", lambda: SINGD(model, lr=1e-9, T=10**9, structures="diagonal")),
        ("AdaFisher", lambda: AdaFisher(model, lr=1e-9, T=10**9)),
    ):
        opt = make()
        backward()
        opt.step()  # the update step with the statistics of this backward
        backward()  # no statistics captured from here on
        t_step = _timer(device, opt.step, reps, inner)
        opt.remove_hooks()
        del opt
        bandwidth_row(f"{label} optimizer.step()", moved, t_step, False)
        targets.append(
            _target(f"{label} step / {adamw_name}", t_step / t_adamw, TARGET_VS_ADAMW, False, "x")
        )
        data[f"{label} step / AdamW"] = t_step / t_adamw

    # the statistics reductions (read once: bytes of the input)
    cases = []
    rows_n = 64 if args.dry_run else 8192
    cases.append(
        (f"col_sum_squares ({rows_n}, {width})", torch.randn(rows_n, width, device=device), {})
    )
    b, c, hw = (2, 4, 8) if args.dry_run else (64, 256, 32)
    conv = torch.randn(b, c, hw, hw, device=device)
    small = torch.randn(4 * b, 2 * c, 7, 7, device=device)
    for layout, fmt in (("NCHW", torch.contiguous_format), ("NHWC", torch.channels_last)):
        cases.append(
            (
                f"col_sum_squares dim=1 {tuple(conv.shape)} {layout}",
                conv.to(memory_format=fmt),
                {"dim": 1},
            )
        )
        cases.append(
            (
                f"col_sum_squares dim=1 {tuple(small.shape)} {layout}",
                small.to(memory_format=fmt),
                {"dim": 1},
            )
        )
        cases.append(
            (
                f"conv2d_patch_sum_squares 3x3 {tuple(conv.shape)} {layout}",
                conv.to(memory_format=fmt),
                {"kernel_size": 3, "padding": 1},
            )
        )
    for what, tensor, kwargs in cases:
        fn = ops.conv2d_patch_sum_squares if "kernel_size" in kwargs else ops.col_sum_squares
        seconds = _timer(device, lambda fn=fn, t=tensor, k=kwargs: fn(t, **k), reps, inner)
        bandwidth_row(what, tensor.numel() * 4, seconds, True)

    header = "| what | ms | GB/s | / copy bandwidth (same bytes) |"
    lines += ["", header, "|---|---|---|---|"]
    lines += [f"| {' | '.join(row)} |" for row in rows]
    missed = [t["what"] for t in targets if not t["met"]]
    summary = f"{len(targets) - len(missed)} of {len(targets)} targets met"
    # targets are reported, not gating: a missed one is a finding, not a broken check
    return PhaseResult("passed", summary, lines=lines, targets=targets, data=data)


def _without_transformers() -> PhaseResult | None:
    """The skipped result of a GPT-2 phase when transformers is missing, else None."""
    import importlib.util

    if importlib.util.find_spec("transformers") is None:
        return PhaseResult("skipped", "transformers is not installed (the models extra)")
    return None


def phase_iteration(args) -> PhaseResult:
    import gpu_iteration

    from singd_cuda import ops

    if (skipped := _without_transformers()) is not None:
        return skipped
    device = "cpu" if args.dry_run else "cuda"
    if not ops.fused_available(device):
        return PhaseResult("failed", f"the fused ops are not available on {device}")
    # leave the last rows out rather than be killed mid-table
    deadline = time.monotonic() + 0.7 * args.timeout
    lines, targets, data = gpu_iteration.iteration_report(args.dry_run, deadline)
    missed = [t["what"] for t in targets if not t["met"]]
    summary = f"{len(data)} optimizers; {len(targets) - len(missed)} of {len(targets)} targets met"
    return PhaseResult("passed", summary, lines=lines, targets=targets, data=data)


def phase_graphs(args) -> PhaseResult:
    import gpu_iteration

    if (skipped := _without_transformers()) is not None:
        return skipped
    lines, data = gpu_iteration.graphs_report(args.dry_run)
    captured = [label for label, verdict in data.items() if verdict == "yes"]
    summary = f"{len(captured)} of {len(data)} steps capture" if data else "not tried"
    return PhaseResult("passed", summary, lines=lines, data=data)


def _nccl_rank(rank: int, world: int, port: int, backend: str, out: str) -> None:
    """One rank of the NCCL check: collectives, then the optimizers' distributed path."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from singd_cuda import SINGD
    from singd_cuda.distributed import comm
    from tests.distributed import scenarios

    path = Path(out)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
            device = torch.device("cuda", torch.cuda.current_device())
        else:
            device = torch.device("cpu")
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=45),
        )
        value = torch.full((5,), float(rank + 1), dtype=torch.float64, device=device)
        comm.all_reduce_sum_(value)
        assert torch.all(value == world * (world + 1) / 2), value
        gathered = torch.empty(world * 3, device=device)
        comm.all_gather_(gathered, torch.full((3,), float(rank), device=device))
        expected = torch.arange(world, dtype=torch.float32).repeat_interleave(3)
        assert torch.equal(gathered.cpu(), expected), gathered
        results = {}
        for structures in ("dense", "diagonal"):
            model = scenarios.make_model(dtype=torch.float64).to(device)
            opt = SINGD(
                model, lr=0.1, lr_cov=0.1, T=2, structures=structures, distribute_factors=True
            )
            for x, y in scenarios.batches(steps=4, dtype=torch.float64):
                x, y = scenarios.shard(x, rank, world), scenarios.shard(y, rank, world)
                opt.zero_grad()
                F.cross_entropy(model(x.to(device)), y.to(device)).backward()
                opt.step()
            results[structures] = [p.detach().cpu() for p in model.parameters()]
        dist.barrier()
        dist.destroy_process_group()
        torch.save(results, path / f"{rank}.pt")
    except BaseException:
        (path / f"{rank}.err").write_text(traceback.format_exc())
        raise SystemExit(1) from None


def _nccl_launch(world: int, backend: str, timeout: float) -> tuple[list | None, str]:
    """Each rank's results, or None and why not."""
    import tempfile

    import torch
    import torch.multiprocessing as mp

    from tests.distributed.launch import free_port

    context = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as out:
        port = free_port()
        procs = [
            context.Process(target=_nccl_rank, args=(rank, world, port, backend, out))
            for rank in range(world)
        ]
        for proc in procs:
            proc.start()
        deadline = time.monotonic() + timeout
        for proc in procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        hung = [rank for rank, proc in enumerate(procs) if proc.is_alive()]
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
        errors = [
            (Path(out) / f"{rank}.err").read_text()
            for rank in range(world)
            if (Path(out) / f"{rank}.err").exists()
        ]
        if errors:
            return None, errors[0].strip().splitlines()[-1] + "\n" + errors[0][-3000:]
        if hung:
            return None, f"ranks {hung} hung for {timeout:.0f} s"
        return [torch.load(Path(out) / f"{r}.pt") for r in range(world)], ""


def phase_nccl(args) -> PhaseResult:
    import torch

    backend = "gloo" if args.dry_run else "nccl"
    if backend == "nccl" and not torch.distributed.is_nccl_available():
        return PhaseResult("failed", "this torch build has no NCCL")
    lines = []
    # NCCL refuses two ranks on one GPU ("Duplicate GPU detected", the first GPU run)
    if backend == "nccl" and (gpus := torch.cuda.device_count()) < 2:
        per_rank, why = None, f"NCCL needs a GPU per rank; this machine has {gpus}"
    else:
        per_rank, why = _nccl_launch(2, backend, timeout=40)
    if per_rank is not None:
        world = 2
        for structures in per_rank[0]:
            for p, q in zip(per_rank[0][structures], per_rank[1][structures], strict=True):
                if not torch.equal(p, q):
                    return PhaseResult("failed", f"{structures}: the 2 ranks' parameters differ")
        lines.append(
            f"- {backend}, 2 processes on {torch.cuda.device_count() if backend == 'nccl' else 0}"
            " GPU(s): collectives and SINGD dense/diagonal with distribute_factors=True; the "
            "ranks end with identical parameters"
        )
    else:
        lines.append(f"- {backend}, 2 processes: not possible here ({why.splitlines()[0]})")
        per_rank, why = _nccl_launch(1, backend, timeout=40)
        if per_rank is None:
            lines += ["", "```", why, "```"]
            summary = f"1-process {backend} world failed: {why.splitlines()[0]}"
            return PhaseResult("failed", summary, lines=lines)
        world = 1
        lines.append(
            f"- {backend}, 1-process world: all_reduce and all_gather through "
            "singd_cuda.distributed.comm, SINGD trains (one rank: the optimizer does not "
            "synchronise)"
        )
    return PhaseResult("passed", f"{backend} world of {world}", lines=lines, data={"world": world})


PHASE_FUNCTIONS = {
    "env": phase_env,
    "build": phase_build,
    "tests": phase_tests,
    "bench": phase_bench,
    "iteration": phase_iteration,
    "graphs": phase_graphs,
    "nccl": phase_nccl,
}


def run_one_phase(args) -> int:
    """Phase process: runs one phase and writes its PhaseResult as JSON to --result."""
    try:
        result = PHASE_FUNCTIONS[args.phase](args)
    except BaseException:
        trace = traceback.format_exc()
        print(trace, file=sys.stderr)
        result = PhaseResult("error", trace.strip().splitlines()[-1], lines=["```", trace, "```"])
    _atomic_write(args.result, json.dumps(asdict(result)) + "\n")
    return 0 if result.status == "passed" else 1


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path, help="folder for gpu_report.md / .json and logs")
    parser.add_argument("--budget", type=float, default=DEFAULT_BUDGET, help="seconds in all")
    parser.add_argument(
        "--phases", default=",".join(PHASES), help=f"comma-separated subset of {PHASES}"
    )
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU")
    parser.add_argument("--phase", choices=PHASES, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--timeout", type=float, default=60.0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.phases = [p for p in args.phases.split(",") if p]
    unknown = set(args.phases) - set(PHASES)
    if unknown:
        parser.error(f"unknown phases {sorted(unknown)}; choose from {PHASES}")
    args.caps = dict(PHASE_CAPS)
    args.commands = {}  # phase -> command overriding the phase process (tests)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.phase:
        return run_one_phase(args)
    return orchestrate(args)


if __name__ == "__main__":
    raise SystemExit(main())
