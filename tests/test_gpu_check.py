"""benchmarks/gpu_check.py: one report whatever happens. Each phase is simulated failing
(exiting, crashing, hanging past its timeout) with the others passing; the report names the
failure and the check goes on. A signal mid-phase still writes the report. Without CUDA the
report says so; ``--dry-run`` (slow) runs every real phase on the CPU."""

from __future__ import annotations

import importlib.util
import json
import signal
import sys
from pathlib import Path

import pytest
import torch

import singd_cuda.ops as ops

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_check.py"


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through it
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[spec.name]


def _passing(result: Path, summary: str) -> list[str]:
    """A phase process that reports success."""
    payload = json.dumps({"status": "passed", "summary": summary, "lines": [f"- {summary}"]})
    code = f"import pathlib; pathlib.Path({str(result)!r}).write_text({payload!r})"
    return [sys.executable, "-c", code, "--result", str(result)]


FAILURES = {
    "exit": ("import sys; print('compiler exploded'); sys.exit(3)", "error", "exited with 3"),
    "crash": ("import os; print('about to abort', flush=True); os.abort()", "error", "exited"),
    "hang": ("import time; print('hanging', flush=True); time.sleep(60)", "timeout", "killed"),
}


def _simulate(gpu_check, tmp_path, failing: dict[str, str], caps: dict | None = None):
    args = gpu_check.parse_args([str(tmp_path / "out")])
    for name in gpu_check.PHASES:
        args.commands[name] = _passing(tmp_path / f"{name}.json", f"{name} fine")
    for name, kind in failing.items():
        code = FAILURES[kind][0]
        args.commands[name] = [sys.executable, "-c", code, "--result", str(tmp_path / "none")]
    args.caps.update(caps or {name: 2.0 for name in gpu_check.PHASES})
    code = gpu_check.orchestrate(args)
    report = (tmp_path / "out" / "gpu_report.md").read_text()
    data = json.loads((tmp_path / "out" / "gpu_report.json").read_text())
    return code, report, data


KINDS = {
    "env": "crash",
    "build": "exit",
    "tests": "hang",
    "bench": "crash",
    "iteration": "exit",
    "graphs": "crash",
    "nccl": "hang",
}


@pytest.mark.parametrize("phase", list(KINDS))
def test_a_failing_phase_still_yields_the_report(gpu_check, tmp_path, phase):
    kind = KINDS[phase]
    code, report, data = _simulate(gpu_check, tmp_path, {phase: kind})
    assert code == 1
    status, summary = FAILURES[kind][1:]
    assert data["phases"][phase]["status"] == status
    assert summary in data["phases"][phase]["summary"]
    assert FAILURES[kind][0].split("print('")[1].split("'")[0] in report  # the output tail
    assert "SOME PHASES DID NOT PASS" in report
    for other in gpu_check.PHASES:
        if other == phase:
            continue
        expected = "skipped" if phase == "build" and other in gpu_check.NEEDS_BUILD else "passed"
        assert data["phases"][other]["status"] == expected, other
        if expected == "passed":
            assert f"{other} fine" in report


def test_all_phases_passing(gpu_check, tmp_path):
    code, report, data = _simulate(gpu_check, tmp_path, {})
    assert code == 0
    assert "every phase passed" in report
    assert set(KINDS) == set(gpu_check.PHASES)
    assert [data["phases"][n]["status"] for n in gpu_check.PHASES] == ["passed"] * len(KINDS)


def test_the_budget_bounds_the_check(gpu_check, tmp_path):
    args = gpu_check.parse_args([str(tmp_path / "out"), "--budget", "8"])
    for name in gpu_check.PHASES:
        args.commands[name] = [sys.executable, "-c", "import time; time.sleep(60)"]
    assert gpu_check.orchestrate(args) == 1
    data = json.loads((tmp_path / "out" / "gpu_report.json").read_text())
    assert data["phases"]["env"]["status"] == "timeout"
    assert "no time left" in data["phases"]["nccl"]["summary"]


def test_a_signal_mid_phase_writes_the_report(gpu_check, tmp_path):
    """SIGTERM (an outer timeout) during a phase: the phase is killed, the report written."""
    signal_parent = "import os, signal, time; os.kill(os.getppid(), signal.SIGTERM); time.sleep(60)"
    args = gpu_check.parse_args([str(tmp_path / "out")])
    args.commands["env"] = _passing(tmp_path / "env.json", "env fine")
    args.commands["build"] = [sys.executable, "-c", signal_parent]
    assert gpu_check.orchestrate(args) == 128 + signal.SIGTERM
    data = json.loads((tmp_path / "out" / "gpu_report.json").read_text())
    assert data["phases"]["env"]["status"] == "passed"
    assert [data["phases"][n]["status"] for n in ("build", "nccl")] == ["interrupted"] * 2
    assert "INTERRUPTED by signal" in (tmp_path / "out" / "gpu_report.md").read_text()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without CUDA")
def test_without_cuda_the_report_says_so(gpu_check, tmp_path):
    assert gpu_check.main([str(tmp_path), "--phases", "env,build"]) == 0
    data = json.loads((tmp_path / "gpu_report.json").read_text())
    assert data["phases"]["env"]["data"]["no_cuda"]
    assert data["phases"]["build"]["status"] == "skipped"
    assert "no CUDA device, nothing measured" in (tmp_path / "gpu_report.md").read_text()


@pytest.mark.slow
@pytest.mark.skipif(not ops.fused_available("cpu"), reason="fused ops not built")
def test_dry_run_runs_every_phase(gpu_check, tmp_path):
    assert gpu_check.main([str(tmp_path), "--dry-run"]) == 0
    report = (tmp_path / "gpu_report.md").read_text()
    assert "DRY RUN" in report
    needles = ("diag_precond_step_ adafisher", "AdaFisher step / torch AdamW", "NHWC", "gloo")
    for needle in (*needles, "GPT-2 iteration, AdaFisher (T=1) / torch AdamW"):
        assert needle in report
    data = json.loads((tmp_path / "gpu_report.json").read_text())
    assert all(p["status"] == "passed" for p in data["phases"].values()), report


@pytest.fixture(scope="module")
def gpu_iteration():
    spec = importlib.util.spec_from_file_location(
        "gpu_iteration", SCRIPT.parent / "gpu_iteration.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through it
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    return module


@pytest.mark.skipif(not ops.fused_available("cpu"), reason="fused ops not built")
def test_the_iteration_table_has_a_row_per_optimizer(gpu_iteration, tmp_path):
    """The GPT-2 iteration phase on a 2-layer GPT-2 on the CPU: every optimizer's row, its
    ratio to AdamW measured in the same run, and the rows a deadline leaves out."""
    pytest.importorskip("transformers")
    iteration = gpu_iteration
    iteration.WARMUP, iteration.TIMED = 1, 2  # the table's shape, not its timings
    labels = [label for label, _ in iteration.optimizers()]
    lines, targets, data = iteration.iteration_report(dry_run=True)
    assert list(data) == labels
    assert data["torch AdamW"]["vs_adamw"] == 1.0
    assert all(row["iteration_ms"] > 0 and row["step_cpu_ms"] > 0 for row in data.values())
    assert len(targets) == 5  # SINGD diagonal at T=10 (both modes) and T=1, AdaFisher (both)
    table = "\n".join(lines)
    assert all(f"| {label} |" in table for label in labels)
    lines, _, data = iteration.iteration_report(dry_run=True, deadline=0.0)
    assert not data and sum("not run: out of time" in line for line in lines) == len(labels)


def test_a_crashing_test_is_recorded_and_the_run_goes_on(gpu_check, tmp_path):
    """A test that kills pytest's process (the first GPU run: a segfault in an op) is named
    as crashed, and the tests after it still run and report."""
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_fake.py").write_text(
        "import os, signal\n"
        "def test_a(): pass\n"
        "def test_b(): os.kill(os.getpid(), signal.SIGSEGV)\n"
        "def test_c(): assert False, 'plainly wrong'\n"
        "def test_d(): os.kill(os.getpid(), signal.SIGSEGV)\n"
        "def test_e(): pass\n"
    )
    command = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider"]
    command += ["--rootdir", str(tmp_path), "tests"]
    code, out, failures = gpu_check.run_pytest_through_crashes(
        command, tmp_path / "junit.xml", tmp_path
    )
    assert code == 0  # the last run, after test_d: test_e alone, passing
    assert "test_e PASSED" in out and "::test_a" not in out
    assert len(failures) == 3
    assert failures[0] == "tests/test_fake.py::test_b: CRASHED the test process (signal 11)"
    assert failures[1] == "tests/test_fake.py::test_c: FAILED (its message is in the log)"
    assert failures[2] == "tests/test_fake.py::test_d: CRASHED the test process (signal 11)"


def _raises():
    raise ValueError("capture refused\nsecond line")


def _segfaults():
    import faulthandler
    import os
    import signal

    faulthandler.disable()  # pytest's handler would print this child's stack into the log
    os.kill(os.getpid(), signal.SIGSEGV)


def _hangs():
    import time

    time.sleep(60)


# Python 3.12+ warns on fork() in a process with threads (this one's OpenMP pool); the
# children here run plain Python only
@pytest.mark.filterwarnings("ignore:.*fork.*:DeprecationWarning")
def test_each_graph_verdict_comes_from_a_process_of_its_own(gpu_iteration):
    """A capture's verdict is what its forked process returns; an exception, a crash or a
    hang in it is the verdict instead, and the next verdict starts afresh."""
    fresh = gpu_iteration.in_fresh_process
    assert fresh(lambda: "yes", timeout=30) == "yes"
    assert fresh(_raises, timeout=30) == "no: ValueError: capture refused"
    assert fresh(_segfaults, timeout=30) == "no: the process died (exit code -11)"
    assert fresh(_hangs, timeout=1) == "no: no verdict in 1 s"
    assert fresh(lambda: "yes", timeout=30) == "yes"
