#!/usr/bin/env bash
# On the GPU machine: run the qmv variants (build there if the binary built here does not run).
set -uo pipefail
cd "$(dirname "$0")"
if ! ./build/qmv_bench; then
  echo "carried binary failed; building here"
  mkdir -p build && nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -Xptxas -v -o build/qmv_bench qmv_bench.cu 2> build/ptxas.txt && ./build/qmv_bench
fi
