#!/usr/bin/env bash
# Compiles the CUDA kernels to PTX. Run where nvcc exists (the GPU machine); the output is
# committed, so building dlbridge never needs a CUDA toolkit. compute_75 PTX is JIT-compiled by the
# driver for the GPU it runs on.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=crates/dlbridge/src/backend/cuda/kernels
out=${1:-$dir}
nvcc --version | tail -n 2
for src in "$dir"/*.cu; do
    name=$(basename "$src" .cu)
    nvcc -ptx -O3 -arch=compute_75 -o "$out/$name.ptx" "$src"
    nvcc -cubin -O3 -arch=sm_90 --resource-usage -o /tmp/"$name".cubin "$src" 2>&1 | grep -E "Function|registers|spill" || true
done
