"""Run examples/fsdp_train.py under torchrun N times in a row and record every run.

    python benchmarks/fsdp_example.py --runs 50 --record

Each run is ``OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2
examples/fsdp_train.py --distribute-factors`` (CPU, gloo; one intra-op thread per rank).
A run passes when it exits with 0, prints no ``terminate called`` (the abort at shutdown
this guards against), reports its resume check held and leaves no checkpoint folder in
its ``TMPDIR``. ``--record`` writes
``benchmarks/results/fsdp_example.md`` after every run, so an interrupted series keeps
the runs it finished.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "fsdp_example.md"
EXAMPLE = ["examples/fsdp_train.py", "--distribute-factors"]
COMMAND = "OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 " + " ".join(EXAMPLE)
RESUMED = "losses after the restore equal the uninterrupted run's, bit for bit"


def run_once() -> dict:
    """One torchrun of the example: exit code, wall seconds, verdicts and rank 0's output."""
    tmp = Path(tempfile.mkdtemp(prefix="fsdp_example_"))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), TMPDIR=str(tmp))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    start = time.monotonic()
    done = subprocess.run(
        [*command, *EXAMPLE], cwd=ROOT, env=env, capture_output=True, text=True, check=False
    )
    output = done.stdout + done.stderr
    left = list(tmp.glob("fsdp_ckpt_*"))
    shutil.rmtree(tmp)
    learning = re.search(r"^mean loss .*$", done.stdout, re.MULTILINE)
    return {
        "exit": done.returncode,
        "seconds": time.monotonic() - start,
        "aborted": "terminate called" in output,
        "resumed": RESUMED in done.stdout,
        "left_checkpoint": bool(left),
        "learning": learning.group(0) if learning else None,
        "stdout": done.stdout,
        "tail": output[-3000:],
    }


def render(runs: list[dict], planned: int) -> str:
    passed = [
        r
        for r in runs
        if r["exit"] == 0 and not r["aborted"] and r["resumed"] and not r["left_checkpoint"]
    ]
    failed = [i for i, r in enumerate(runs, 1) if r not in passed]
    learning = sorted({r["learning"] for r in runs if r["learning"]})
    seconds = sorted(r["seconds"] for r in runs)
    lines = [
        "# The FSDP2 example, run again and again",
        "",
        f"Command (repeated by `python benchmarks/fsdp_example.py --runs {planned} --record`):",
        "",
        "```bash",
        COMMAND,
        "```",
        "",
        f"{datetime.date.today().isoformat()}, {platform.machine()} with {os.cpu_count()} "
        f"cores shared with other jobs, torch {torch.__version__}.",
        "",
        f"**{len(passed)} of {len(runs)} consecutive runs passed** ({planned} planned): exit "
        "code 0, no `terminate called`, the example's own resume check held (the losses "
        "after the DCP restore equal the uninterrupted run's, bit for bit) and its "
        "temporary checkpoint folder was removed.",
        f"Failed runs: {failed or 'none'}. Wall time per run: median "
        f"{seconds[len(seconds) // 2]:.0f} s, slowest {seconds[-1]:.0f} s.",
        "",
        "The learning line of every run (all runs alike):"
        if len(learning) == 1
        else "The learning lines of the runs:",
        "",
        *[f"    {line}" for line in learning],
        "",
        "Rank 0's output of the first run:",
        "",
        "```text",
        runs[0]["stdout"].rstrip(),
        "```",
    ]
    for i in failed:
        lines += ["", f"Run {i}'s last output:", "", "```text", runs[i - 1]["tail"].rstrip(), "```"]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--record", action="store_true")
    args = parser.parse_args()
    runs = []
    for i in range(1, args.runs + 1):
        runs.append(run_once())
        r = runs[-1]
        print(
            f"run {i}: exit {r['exit']}, {r['seconds']:.0f} s, aborted {r['aborted']}, "
            f"resume check {r['resumed']}",
            flush=True,
        )
        if args.record:
            RESULTS.write_text(render(runs, args.runs))


if __name__ == "__main__":
    main()
