#!/usr/bin/env bash
# Every GPU test in one call on the GPU machine, each result written to $OUT/gpu_tests.log as it comes
# (a call cut off by its time limit still brings back what ran). Usage there, after
# `bash .gpu/tvm/stage.sh` in the call before:
#   source .gpu/deps/setup.sh && bash benchmarks/gpu_tests.sh [more pytest arguments]
# The GPU machine's image has transformers (5.17 in 2026-11), so gpu-pack needs only alembic mako. The
# tests run in GPU_TEST_WORKERS processes (pytest-xdist, also in that image): they check results, not
# speed, and run one at a time they took more than one 10-minute call (each model build is ~50 s of CPU).
set -uo pipefail
export PYTHONUNBUFFERED=1 CUDA_PATH=${CUDA_PATH:-/usr/local/cuda}
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv | tee "$OUT/gpu.txt"
# The GPU machine's .git can be older than the files it was sent (it printed the session's first commit),
# so the files themselves are named: the same command in a checkout gives the same digest for the same code.
echo "code digest: $(bash benchmarks/code_digest.sh)" | tee -a "$OUT/gpu.txt"
timeout "${TEST_TIMEOUT:-570}" python3 -m pytest -m gpu -v -p no:cacheprovider --timeout 300 --tb=short --durations 20 \
  -n "${GPU_TEST_WORKERS:-8}" "$@" 2>&1 \
  | tee "$OUT/gpu_tests.log" | grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|error|^E |s call|s setup" | cut -c1-400 | tail -100
# Tests that failed run once more, two at a time, into gpu_tests_rerun.log: with 14 processes the GPU once
# ran out of memory (2026-12-02: three tests failed preparing their inputs). Both logs are the record; a
# test that fails in both is a real failure, and one that passes only alone is reported as such.
mapfile -t failed < <(grep -E "^FAILED " "$OUT/gpu_tests.log" | sed -E 's/^FAILED ([^ ]+).*/\1/')
if [ "${#failed[@]}" -gt 0 ]; then
  echo "re-running ${#failed[@]} failed test(s), two at a time:"
  timeout "${RERUN_TIMEOUT:-240}" python3 -m pytest -m gpu -v -p no:cacheprovider --timeout 300 --tb=short -n 2 \
    "${failed[@]}" 2>&1 | tee "$OUT/gpu_tests_rerun.log" | grep -E "PASSED|FAILED|ERROR|passed|failed|^E " | cut -c1-400
fi

