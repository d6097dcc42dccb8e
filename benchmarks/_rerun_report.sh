#!/usr/bin/env bash
# What the re-run of failed tests says about each (used by gpu_tests.sh): a test that failed in the first
# run and passed in the re-run is FLAKY (it passes or fails by something other than the code: memory
# pressure, timing); one that failed in both is FAILED; one the re-run never reached is NOT RE-RUN.
# Usage: bash benchmarks/_rerun_report.sh FIRST_LOG RERUN_LOG   (pytest -v logs, with or without xdist)
set -uo pipefail
first=$1 rerun=$2
mapfile -t failed < <(grep -E "^FAILED " "$first" | sed -E 's/^FAILED ([^ ]+).*/\1/' | sort -u)
# "tests/x.py::t PASSED [ 50%]" (one process) or "[gw0] [ 50%] PASSED tests/x.py::t" (pytest-xdist).
outcome() {  # the tests of a log with outcome $1
  sed -nE "s/^([^ ]+::[^ ]+) $1.*/\\1/p; s/^.*$1 ([^ ]+::[^ ]+).*/\\1/p" "$rerun" 2>/dev/null | sort -u
}
passed=$(outcome PASSED) failed_again=$(outcome FAILED)
flaky=0 hard=0
for test in "${failed[@]}"; do
  if grep -qxF -- "$test" <<< "$passed"; then
    echo "FLAKY: $test (failed, then passed when re-run)"
    flaky=$((flaky + 1))
  elif grep -qxF -- "$test" <<< "$failed_again"; then
    echo "FAILED: $test (failed in both runs)"
    hard=$((hard + 1))
  else
    echo "NOT RE-RUN: $test (failed; the re-run has no result for it)"
    hard=$((hard + 1))
  fi
done
echo "re-run summary: ${#failed[@]} failed at first, $flaky flaky, $hard not passing"
