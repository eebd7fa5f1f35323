#!/usr/bin/env bash
# Build the fused ops once: the CPU library, and the CUDA library compiled and linked for
# TORCH_CUDA_ARCH_LIST (default 9.0) without needing a GPU. Both are loaded and checked for
# a kernel of every op; any compile or link error fails the script. Prints the build times.
set -euo pipefail
cd "$(dirname "$0")/.."

export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"

start=$SECONDS
python -m singd_cuda.ops build --cuda
echo "build_ops: done in $((SECONDS - start)) s"
