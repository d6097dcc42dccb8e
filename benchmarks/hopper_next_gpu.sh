#!/usr/bin/env bash
# The kernels written since the last GPU run, checked and measured on the GPU machine in three calls of
# under ten minutes (after the TVM stage call):
#   source .gpu/deps/setup.sh && bash benchmarks/hopper_next_gpu.sh tests      # their GPU tests
#   source .gpu/deps/setup.sh && bash benchmarks/hopper_next_gpu.sh gemm       # GEMM rows, int4 prefill, GQA decode
#   source .gpu/deps/setup.sh && bash benchmarks/hopper_next_gpu.sh attention  # ping-pong attention beside cuDNN
# Correctness first: run `tests` before the others. TIME_BUDGET: tuning seconds per benchmark case
# (default 25). Writes under $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 CUDA_PATH=${CUDA_PATH:-/usr/local/cuda}
echo "code digest: $(bash benchmarks/code_digest.sh)" | tee -a "$OUT/digest.txt"
case "${1:-tests}" in
  tests)
    timeout 500 python3 -m pytest -m gpu -q -p no:cacheprovider --tb=short -n 8 tests/test_gpu_run.py \
      -k "pingpong or paged or dequant or int4" > "$OUT/next_tests.log" 2>&1
    tail -15 "$OUT/next_tests.log" ;;
  gemm)
    python3 benchmarks/gpu_benchmark.py --time-budget "${TIME_BUDGET:-25}" --out "$OUT/next_bench" --cases \
      gemm-fp16-4096 mlp-up-fp16 prefill512-up gemm-awkward dequant-int4-prefill paged-decode-gqa8 \
      paged-decode-gqa4-llama3 ;;
  attention)
    python3 benchmarks/hopper_attention_probe.py --case 1,32,32,2048,128,causal --case 1,32,32,2048,128,full \
      --points '[{"consumers": 2, "block_kv": 128, "stages": 2, "overlap": false, "pingpong": false},
                 {"consumers": 2, "block_kv": 128, "stages": 2, "overlap": false, "pingpong": true},
                 {"consumers": 2, "block_kv": 128, "stages": 3, "overlap": false, "pingpong": true}]' \
      --out "$OUT/attention_probe" > "$OUT/attention_probe.log" 2>&1
    tail -20 "$OUT/attention_probe.log" ;;
  *) echo "usage: hopper_next_gpu.sh tests|gemm|attention" >&2; exit 2 ;;
esac
