#!/usr/bin/env bash
# The decode kernels (and the overlapped attention) in one call on the GPU machine: their GPU tests first
# (correctness before speed), then the benchmark rows they are for, tuned and timed against torch in the
# same run, and the attention template's points beside torch's flash and cuDNN backends. Usage there,
# after the TVM stage call:
#   source .gpu/deps/setup.sh && bash benchmarks/decode_kernels_gpu.sh
# TIME_BUDGET: tuning seconds per benchmark case (default 30). Writes $OUT/decode_tests.log and
# $OUT/decode_bench/ (gpu_benchmark.py's results).
set -uo pipefail
export PYTHONUNBUFFERED=1 CUDA_PATH=${CUDA_PATH:-/usr/local/cuda}
echo "code digest: $(bash benchmarks/code_digest.sh)" | tee "$OUT/decode_digest.txt"
timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider --tb=short -n 8 tests/test_gpu_run.py \
  -k "split_k or swapped or paged or int4 or dequant or overlapped" > "$OUT/decode_tests.log" 2>&1
tail -15 "$OUT/decode_tests.log"
python3 benchmarks/gpu_benchmark.py --time-budget "${TIME_BUDGET:-30}" --out "$OUT/decode_bench" --cases \
  batch16-gemm-fp16 dequant-int4-decode paged-decode paged-decode-b1-32k paged-decode-gqa8
python3 benchmarks/hopper_attention_probe.py --case 1,32,32,2048,128,causal --case 1,32,32,2048,128,full \
  --points '[{"consumers": 2, "block_kv": 128, "stages": 2, "overlap": false},
             {"consumers": 2, "block_kv": 128, "stages": 2, "overlap": true}]' \
  --out "$OUT/attention_probe" > "$OUT/attention_probe.log" 2>&1
tail -20 "$OUT/attention_probe.log"
