#!/usr/bin/env bash
# What the re-run of failed and unfinished tests says about each (used by gpu_tests.sh): a test that failed in
# the first run and passed in the re-run is FLAKY (it passes or fails by something other than the code: memory
# pressure, timing); one that failed in both is FAILED; one the first run never finished (cut off by its time
# limit) and the re-run passed is UNFINISHED, then PASSED; one the re-run never reached is NOT RE-RUN.
# Usage: bash benchmarks/_rerun_report.sh FIRST_OUTCOMES RERUN_LOG   (_outcomes.sh's lines; a pytest -v log)
set -uo pipefail
first=$1 rerun=$2
outcomes=$(dirname "$0")/_outcomes.sh
mapfile -t redo < <(bash "$outcomes" --to-rerun "$first")
again=$(bash "$outcomes" "$rerun")
flaky=0 hard=0 cut=0
for line in "${redo[@]}"; do
  test=${line% *} was=${line##* }
  now=$(awk -v t="$test" '$1 == t {print $2}' <<< "$again")
  if [[ $now == PASSED && $was == UNFINISHED ]]; then
    echo "UNFINISHED, then PASSED: $test (cut off by the first run's time limit; passed when re-run)"
    cut=$((cut + 1))
  elif [[ $now == PASSED ]]; then
    echo "FLAKY: $test (failed, then passed when re-run)"
    flaky=$((flaky + 1))
  elif [[ -n $now ]]; then
    echo "FAILED: $test ($was, then $now when re-run)"
    hard=$((hard + 1))
  else
    echo "NOT RE-RUN: $test ($was; the re-run has no result for it)"
    hard=$((hard + 1))
  fi
done
echo "re-run summary: ${#redo[@]} re-run, $cut unfinished then passed, $flaky flaky, $hard not passing"
