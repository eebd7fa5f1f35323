"""Run a script as ``__main__`` (``python exit_threads.py SCRIPT ARGS...``), then report how
many of gloo's threads are still alive when the interpreter starts to exit (Linux).

The report is an ``atexit`` handler registered before the script runs, so it runs after
the script's own handlers, before the interpreter finalises: a gloo thread alive then lives
on into the finalisation, where it can abort the process.
"""

from __future__ import annotations

import atexit
import os
import runpy
import sys
from pathlib import Path


def _report() -> None:
    names = [(task / "comm").read_text().strip() for task in Path("/proc/self/task").iterdir()]
    gloo = sorted(name for name in names if "gloo" in name)
    print(f"rank {os.environ.get('RANK', '?')} gloo threads at exit: {gloo}", flush=True)


if __name__ == "__main__":
    atexit.register(_report)
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
