"""benchmarks/host_cost.py loaded as a module, for the tests that use its read counter."""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "host_cost.py"


@contextlib.contextmanager
def loaded() -> Iterator[ModuleType]:
    """The script as a fresh module; the benchmarks folder is on ``sys.path`` meanwhile (it
    imports vs_peers beside it), and vs_peers is forgotten afterwards."""
    sys.path.insert(0, str(SCRIPT.parent))
    spec = importlib.util.spec_from_file_location("host_cost", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(SCRIPT.parent))
        sys.modules.pop("vs_peers", None)
