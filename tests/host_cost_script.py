"""A script of benchmarks/ loaded as a module (host_cost.py by default), for the tests that
use it."""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@contextlib.contextmanager
def loaded(name: str = "host_cost") -> Iterator[ModuleType]:
    """benchmarks/``name``.py as a fresh module; the benchmarks folder is on ``sys.path``
    meanwhile (the scripts import each other and vs_peers), and those imports are forgotten
    afterwards."""
    sys.path.insert(0, str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(BENCHMARKS))
        for imported in ("vs_peers", "host_cost", "records"):
            sys.modules.pop(imported, None)
