"""The frame of a single-threaded benchmark record: its title and the command that made
it (with the date, torch, the machine, the load average before and the run's duration),
printed and, when asked, written to a file."""

from __future__ import annotations

import datetime
import platform
import shlex
import time
from pathlib import Path

import torch


def header(title: str, script: str, argv: list[str], start: float, load: float) -> list[str]:
    """The record's first lines for ``benchmarks/<script>`` run with ``argv``, begun at
    ``start`` (``time.time()``) under load average ``load``, in one thread."""
    command = shlex.join([f"benchmarks/{script}", *argv])
    return [
        f"# {title}",
        "",
        f"`python {command}` — {datetime.date.today()}, torch {torch.__version__}, "
        f"{platform.machine()}, 1 thread; load average before {load:.1f}; run took "
        f"{time.time() - start:.0f} s",
        "",
    ]


def publish(lines: list[str], out: Path | None) -> None:
    """Print the record and write it to ``out`` when given."""
    text = "\n".join(lines)
    print(text)
    if out:
        out.write_text(text + "\n")
