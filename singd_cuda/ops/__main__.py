"""``python -m singd_cuda.ops build [--cuda] [--verbose]``: prebuild the fused ops.

``build`` compiles (or finds in the cache) the CPU op library; ``--cuda`` also compiles and
links the CUDA library, which needs ``nvcc`` but no GPU. Both are loaded and every op is
checked for a kernel of each built kind. Exits nonzero on a compile or link error (with the
compiler output) or a missing kernel.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from . import _build


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m singd_cuda.ops")
    commands = parser.add_subparsers(dest="command", required=True)
    build = commands.add_parser("build", help="build the fused op libraries into the cache")
    build.add_argument(
        "--cuda", action="store_true", help="also build the CUDA ops (needs nvcc, not a GPU)"
    )
    build.add_argument("--verbose", action="store_true", help="show the compiler commands")
    args = parser.parse_args(argv)

    kinds = ("cpu", "cuda") if args.cuda else ("cpu",)
    for kind in kinds:
        start = time.perf_counter()
        _build.load(kind, strict=True, verbose=args.verbose)
        seconds = time.perf_counter() - start
        print(f"singd_cuda: {kind} ops ready in {seconds:.1f} s ({_build.build_dir(kind)})")
    missing = [
        f"{name} ({kind})"
        for kind in kinds
        for name in _build.OP_NAMES
        if not torch._C._dispatch_has_kernel_for_dispatch_key(f"singd_cuda::{name}", kind.upper())
    ]
    if missing:
        print(f"singd_cuda: no kernel registered for {', '.join(missing)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
