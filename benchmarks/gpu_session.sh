#!/usr/bin/env bash
# One call on the GPU machine (after `bash .gpu/tvm/stage.sh` in the call before): every GPU test, then
# the GPU benchmark. Usage there: source .gpu/deps/setup.sh && bash benchmarks/gpu_session.sh [bench args]
set -uo pipefail
export PYTHONUNBUFFERED=1 CUDA_PATH=${CUDA_PATH:-/usr/local/cuda}
if [[ ${SKIP_TESTS:-0} != 1 ]]; then
  TEST_TIMEOUT=${TEST_TIMEOUT:-300} bash "$(dirname "$0")/gpu_tests.sh"  # every GPU test, in parallel
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,memory.used --format=csv | tee -a "$OUT/gpu.txt"
python3 benchmarks/gpu_benchmark.py --out "$OUT" "$@" 2>&1 | grep -v "^\[" | tee "$OUT/bench.log" | tail -60
