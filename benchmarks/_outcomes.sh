#!/usr/bin/env bash
# The tests of a pytest -v log (one process or pytest-xdist) and their outcomes, a "test OUTCOME" line each.
# With EXPECTED (a file of test ids, one a line), also "test UNFINISHED" for each expected test the log has no
# outcome for: a run cut off by its time limit prints no summary, and its last tests never finish.
# Usage: bash benchmarks/_outcomes.sh LOG [EXPECTED]
#        bash benchmarks/_outcomes.sh --to-rerun OUTCOMES   (the lines of OUTCOMES, this script's output, whose
#        test is to run again: FAILED, ERROR or UNFINISHED)
set -uo pipefail
if [[ $1 == --to-rerun ]]; then
  awk '$2 == "FAILED" || $2 == "ERROR" || $2 == "UNFINISHED"' "$2"
  exit 0
fi
log=$1 expected=${2:-}
# "tests/x.py::t PASSED [ 50%]" (one process) or "[gw0] [ 50%] PASSED tests/x.py::t" (pytest-xdist).
words="PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS"
outcomes=$(sed -nE "s/^([^ ]+::[^ ]+) ($words)( .*)?$/\\1 \\2/p; s/^\\[gw[0-9]+\\] \\[ *[0-9]+%\\] ($words) ([^ ]+::[^ ]+).*/\\2 \\1/p" \
  "$log" 2>/dev/null | sort -u)
[[ -n $outcomes ]] && echo "$outcomes"
if [[ -n $expected ]]; then
  grep -vxF -f <(cut -d' ' -f1 <<< "$outcomes") "$expected" | sed 's/$/ UNFINISHED/'
fi
exit 0
