#!/usr/bin/env bash
# The decode kernels and the int4 prefill GEMM (with the fp16 GEMM it is measured against) in one call on
# the GPU machine: their GPU tests first (correctness before speed), then the benchmark rows they are for,
# tuned and timed against torch in the same run (about 8 minutes at the default budget). Usage there,
# after the TVM stage call:
#   source .gpu/deps/setup.sh && bash benchmarks/decode_kernels_gpu.sh
# TIME_BUDGET: tuning seconds per benchmark case (default 25). Writes $OUT/decode_tests.log and
# $OUT/decode_bench/ (gpu_benchmark.py's results).
set -uo pipefail
export PYTHONUNBUFFERED=1 CUDA_PATH=${CUDA_PATH:-/usr/local/cuda}
echo "code digest: $(bash benchmarks/code_digest.sh)" | tee "$OUT/decode_digest.txt"
timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider --tb=short -n 8 tests/test_gpu_run.py \
  -k "split_k or swapped or paged or int4 or dequant or overlapped" > "$OUT/decode_tests.log" 2>&1
tail -15 "$OUT/decode_tests.log"
python3 benchmarks/gpu_benchmark.py --time-budget "${TIME_BUDGET:-25}" --out "$OUT/decode_bench" --cases \
  batch16-gemm-fp16 dequant-int4-decode dequant-int4-prefill gemm-fp16-4096 paged-decode paged-decode-b1-32k \
  paged-decode-gqa8 paged-decode-gqa4-llama3
