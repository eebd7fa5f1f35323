#!/usr/bin/env bash
# Build the fused ops once: the CPU library, and the CUDA library compiled and linked for
# TORCH_CUDA_ARCH_LIST (default 9.0) without needing a GPU. Both are loaded and checked for
# a kernel of every op; any compile or link error fails the script. Prints the build times.
# When cuobjdump is at hand, also checks that the CUDA kernels contain no contracted
# multiply-add (FFMA/DFMA outside the IEEE division routines): the bitwise parity of the
# fused CUDA ops with the CPU and the reference depends on it (nvcc --fmad=false).
set -euo pipefail
cd "$(dirname "$0")/.."

export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"

start=$SECONDS
python -m singd_cuda.ops build --cuda
echo "build_ops: done in $((SECONDS - start)) s"

cuobjdump="$(command -v cuobjdump || true)"
[ -z "$cuobjdump" ] && [ -x "$CUDA_HOME/bin/cuobjdump" ] && cuobjdump="$CUDA_HOME/bin/cuobjdump"
if [ -z "$cuobjdump" ]; then
  echo "build_ops: no cuobjdump; the no-FMA check of the CUDA kernels is skipped"
  exit 0
fi
library="$(python -c 'from singd_cuda.ops import _build; print(_build.library_path("cuda"))')"
"$cuobjdump" -sass "$library" | python -c '
import re, sys
functions = re.split(r"\n\s*Function : ", sys.stdin.read())[1:]
contracted = [f.split("\n", 1)[0] for f in functions
              if re.search(r"\b(FFMA|DFMA)\b", f) and not re.search(r"MUFU\.RCP", f)]
print(f"build_ops: {len(functions)} kernels, {len(contracted)} with a contracted multiply-add")
sys.exit(1 if contracted or not functions else 0)
'
