#!/usr/bin/env bash
# One call on the GPU machine (after `bash .gpu/tvm/stage.sh` in the call before): the GPU tests, then
# the GPU benchmark. Usage there: source .gpu/deps/setup.sh && bash benchmarks/gpu_session.sh [bench args]
set -uo pipefail
export PYTHONUNBUFFERED=1 CUDA_PATH=${CUDA_PATH:-/usr/local/cuda}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,memory.used --format=csv | tee "$OUT/gpu.txt"
if [[ ${SKIP_TESTS:-0} != 1 ]]; then
  timeout ${TEST_TIMEOUT:-240} python3 -m pytest -m gpu -q -x -p no:cacheprovider tests/test_gpu_run.py 2>&1 | tail -40 | tee "$OUT/gpu_tests.log"
fi
python3 benchmarks/gpu_benchmark.py --out "$OUT" "$@" 2>&1 | grep -v "^\[" | tee "$OUT/bench.log" | tail -60
