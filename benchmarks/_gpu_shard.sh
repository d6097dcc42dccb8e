#!/usr/bin/env bash
# The GPU test ids of shard I of N (every N-th test, from the I-th), one per line: GPU_TEST_SHARD=I/N makes
# benchmarks/gpu_tests.sh run them, so that the GPU tests can be spread over calls of 10 minutes each.
# Usage: bash benchmarks/_gpu_shard.sh I/N [more pytest arguments]
set -uo pipefail
spec=$1
shift
shard=${spec%/*}
shards=${spec#*/}
if ! [[ $shard =~ ^[0-9]+$ && $shards =~ ^[0-9]+$ ]] || ((shard < 1 || shard > shards)); then
  echo "GPU_TEST_SHARD must be I/N with 1 <= I <= N (e.g. 1/2), not $spec" >&2
  exit 2
fi
python3 -m pytest -m gpu --collect-only -q -n 0 -p no:cacheprovider -p no:randomly "$@" 2>/dev/null \
  | grep "::" | awk -v i="$shard" -v n="$shards" '(NR - 1) % n == i - 1'
