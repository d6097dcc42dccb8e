#!/usr/bin/env bash
# One call on the GPU machine: every GPU test (benchmarks/gpu_tests.sh), then the GPU benchmark. Usage there:
#   bash benchmarks/gpu_session.sh [gpu_benchmark.py arguments]      (SKIP_TESTS=1: the benchmark alone)
set -uo pipefail
source "$(dirname "$0")/_gpu_env.sh"
if [[ ${SKIP_TESTS:-0} != 1 ]]; then
  TEST_TIMEOUT=${TEST_TIMEOUT:-300} bash benchmarks/gpu_tests.sh
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,memory.used --format=csv | tee -a "$OUT/gpu.txt"
python3 benchmarks/gpu_benchmark.py --out "$OUT" "$@" 2>&1 | grep -v "^\[" | tee "$OUT/bench.log" | tail -60
