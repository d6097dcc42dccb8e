#!/usr/bin/env bash
# Every GPU test (`python -m pytest -m gpu`) on the GPU machine, each result written to $OUT/gpu_tests.log as
# it comes (a call cut off by its time limit still brings back what ran). Usage there:
#   bash benchmarks/gpu_tests.sh [more pytest arguments]
#   GPU_TEST_SHARD=1/2 bash benchmarks/gpu_tests.sh, then GPU_TEST_SHARD=2/2 ...: half of the tests a call
#   (every other test, benchmarks/_gpu_shard.sh), where all of them take longer than one call.
# The tests run in GPU_TEST_WORKERS processes (pytest-xdist, in the test extra): they check results, not
# speed, and one at a time they take longer than one 10-minute call. Tests that fail, and those a run cut off
# by TEST_TIMEOUT never finished (benchmarks/_outcomes.sh), run once more, two at a time, into
# gpu_tests_rerun.log: many processes at once can run the GPU out of memory while preparing inputs; a test
# that fails in both logs is a real failure. Each is then reported, in the output and in
# gpu_tests_rerun_report.txt, as FLAKY (failed, then passed on the re-run: a flaky test to fix, not a pass),
# FAILED, or UNFINISHED then PASSED (cut off, then passed). The GPU's memory in use is sampled every 5 s into
# gpu_memory.log, to tell a failure of memory (CUDA out of memory with many processes) from one of the code.
set -uo pipefail
NEED="xdist=pytest-xdist pytest_timeout=pytest-timeout" source "$(dirname "$0")/_gpu_env.sh"
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv | tee "$OUT/gpu.txt"
# The files themselves are named (the GPU machine's .git can be older than the files it was sent).
echo "code digest: $(bash benchmarks/code_digest.sh)" | tee -a "$OUT/gpu.txt"
nvidia-smi --query-gpu=timestamp,memory.used,memory.total --format=csv,noheader -l 5 > "$OUT/gpu_memory.log" 2>&1 &
memory_sampler=$!
trap 'kill $memory_sampler 2>/dev/null' EXIT
export AUTOSCHED_FAILURE_LOG=$OUT/gpu_tests_failures.log  # each failure's traceback as it comes (tests/conftest.py); the re-run: its own log
expected=$OUT/gpu_tests_expected.txt
bash benchmarks/_gpu_shard.sh "${GPU_TEST_SHARD:-1/1}" "$@" > "$expected"
[[ -s $expected ]] || { echo "no GPU tests in shard ${GPU_TEST_SHARD:-1/1}" >&2; exit 2; }
if [[ -n ${GPU_TEST_SHARD:-} ]]; then
  echo "shard $GPU_TEST_SHARD: $(wc -l < "$expected") tests" | tee -a "$OUT/gpu.txt"
  mapfile -t shard < "$expected"
  set -- "${shard[@]}"
fi
timeout "${TEST_TIMEOUT:-570}" python3 -m pytest -m gpu -v -p no:cacheprovider --timeout 300 --tb=short --durations 20 \
  -n "${GPU_TEST_WORKERS:-8}" --dist load "$@" 2>&1 \
  | tee "$OUT/gpu_tests.log" | grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|error|^E |s call|s setup" | cut -c1-400 | tail -100
bash benchmarks/_outcomes.sh "$OUT/gpu_tests.log" "$expected" > "$OUT/gpu_tests_outcomes.txt"
mapfile -t redo < <(bash benchmarks/_outcomes.sh --to-rerun "$OUT/gpu_tests_outcomes.txt" | cut -d' ' -f1)
if [ "${#redo[@]}" -gt 0 ]; then
  echo "re-running ${#redo[@]} failed or unfinished test(s), two at a time:"
  AUTOSCHED_FAILURE_LOG=$OUT/gpu_tests_rerun_failures.log timeout "${RERUN_TIMEOUT:-240}" python3 -m pytest -m gpu -v -p no:cacheprovider --timeout 300 --tb=short -n 2 --dist load \
    "${redo[@]}" 2>&1 | tee "$OUT/gpu_tests_rerun.log" | grep -E "PASSED|FAILED|ERROR|passed|failed|^E " | cut -c1-400
  bash benchmarks/_rerun_report.sh "$OUT/gpu_tests_outcomes.txt" "$OUT/gpu_tests_rerun.log" \
    | tee "$OUT/gpu_tests_rerun_report.txt"
fi
