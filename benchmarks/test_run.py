"""Record the size of the default test run and, with ``--run``, its duration.

    python benchmarks/test_run.py --record          # count: pytest --collect-only
    python benchmarks/test_run.py --run --record    # run the default selection, timed

``--record`` writes ``benchmarks/results/test_run.json``; the README and Getting started
quote it through ``docs/hooks.py:test_run_sentence`` (``tests/docs`` checks their copies).
A count-only record keeps the duration of the last timed run, marked with its own date.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "test_run.json"


def _pytest(*args: str) -> tuple[str, float]:
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise SystemExit(f"pytest failed ({done.returncode}):\n{done.stdout[-3000:]}")
    return done.stdout, time.monotonic() - start


def _count(summary: str, word: str) -> int:
    found = re.search(rf"(\d+) {word}", summary)
    return int(found.group(1)) if found else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", action="store_true", help="run the tests, timed")
    parser.add_argument("--record", action="store_true")
    args = parser.parse_args()
    record = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    today = datetime.date.today().isoformat()
    output, seconds = _pytest(*([] if args.run else ["--collect-only"]))
    summary = output.strip().splitlines()[-1]
    if args.run:
        selected = sum(_count(summary, w) for w in ("passed", "skipped", "xfailed", "xpassed"))
        record["duration"] = {
            "seconds": round(seconds),
            "date": today,
            "machine": f"{platform.machine()}, {os.cpu_count()} cores",
            "summary": summary,
        }
    else:
        selected = int(re.search(r"(\d+)(?:/\d+)? tests? collected", summary).group(1))
    record.update(
        selected=selected, deselected=_count(summary, "deselected"), date=today, summary=summary
    )
    print(json.dumps(record, indent=2))
    if args.record:
        RESULTS.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
