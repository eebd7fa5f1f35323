#!/usr/bin/env bash
# Prove that a non-editable `pip install .` into a fresh virtual environment ships csrc/ and
# that the installed package JIT-builds and runs its fused CPU ops from those sources (empty
# build cache, run outside the repository). torch and the other dependencies come from the
# current interpreter (--system-site-packages, its pip and setuptools too), so nothing is
# downloaded.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

start=$SECONDS
python -m venv --system-site-packages --without-pip "$tmp/venv"
"$tmp/venv/bin/python" -m pip install -q --no-deps --no-build-isolation "$repo"
cd "$tmp"
SINGD_CUDA_CACHE_DIR="$tmp/cache" "$tmp/venv/bin/python" - "$repo" <<'PY'
import pathlib
import sys

import torch

import singd_cuda
from singd_cuda import ops
from singd_cuda.ops import _build

repo = pathlib.Path(sys.argv[1]).resolve()
package = pathlib.Path(singd_cuda.__file__).resolve().parent
assert repo not in package.parents, f"imported the checkout, not the install: {package}"


def sources(root: pathlib.Path) -> list[str]:
    return sorted(
        str(p.relative_to(root)) for p in root.rglob("*") if p.suffix in _build.SOURCE_SUFFIXES
    )


assert sources(package / "csrc") == sources(repo / "csrc"), "csrc/ is not shipped whole"
assert ops.fused_available("cpu"), "the fused CPU ops did not build from the installed csrc/"
x = torch.randn(7, 3)
torch.testing.assert_close(ops.col_sum_squares(x), x.square().sum(0))
print(f"check_wheel: {len(sources(package / 'csrc'))} sources shipped and built from {package}")
PY
echo "check_wheel: done in $((SECONDS - start)) s"
