#!/usr/bin/env bash
# The kernels written since the last GPU run, checked and measured on the GPU machine in calls of under ten
# minutes each (after the TVM stage call), each as `source .gpu/deps/setup.sh && bash benchmarks/hopper_next_gpu.sh MODE`:
#   tests      their GPU tests: hopper_attention's ping-pong with overlap and KV tiles of 160/176,
#              paged_decode's L2 prefetch (plus hopper_gemm's multicast and whole waves)
#   attention  hand-picked hopper_attention points beside torch's flash and cuDNN backends
#   profile [CASE ...]  Nsight Compute's counters of the best points found (benchmarks/profile_kernels.py)
#   decode     the memory-bound rows of the issues (paged decode, GQA, int4 decode GEMV), searched
#   probe      hand-picked hopper_gemm points beside cuBLAS
#   gemm       the GEMM rows of the issue, searched
#   flush      the L2 flush's cost, then the memory-bound rows under both flushes
#   model B:T  the whole model beside torch.compile and its max-autotune mode (one or two configs per call)
#   multicast  hopper_gemm v5 (multicast's CTA-scope release): its GPU tests, the awkward GEMM's points with
#              and without multicast beside cuBLAS, then GEMM rows searched (CASES, default gemm-awkward)
#   int4       int4_gemv v3's GPU tests, the read floor, lane and tensor-core points at 1 and 8 rows, a search
#   gqa        paged_decode v5's GQA 8:1 points timed, then the GQA decode rows searched
#   timeline   the whole model's kernels traced beside torch.compile (DB=a database of tuned records)
# Correctness first: run `tests` before the others. TIME_BUDGET: tuning seconds per benchmark case
# (default 30). Writes under $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 CUDA_PATH=${CUDA_PATH:-/usr/local/cuda}
echo "code digest: $(bash benchmarks/code_digest.sh)" | tee -a "$OUT/digest.txt"
case "${1:-tests}" in
  tests)
    timeout 500 python3 -m pytest -m gpu -q -p no:cacheprovider --tb=short -n 8 tests/test_gpu_run.py \
      -k "multicast or whole_wave or pingpong or split_k or swapped" > "$OUT/next_tests.log" 2>&1
    timeout 500 python3 -m pytest -m gpu -q -p no:cacheprovider --tb=short -n 8 tests/test_gpu_run.py \
      -k "attention or paged or int4" > "$OUT/next_tests_decode_attention.log" 2>&1
    tail -15 "$OUT/next_tests.log" "$OUT/next_tests_decode_attention.log" ;;
  attention)
    # POINTS: a JSON list of points instead of these.
    P=${POINTS:-'[{"consumers":2,"block_kv":128,"stages":3,"overlap":false,"pingpong":true},
        {"consumers":2,"block_kv":160,"stages":2,"overlap":false,"pingpong":true},
        {"consumers":2,"block_kv":176,"stages":2,"overlap":false,"pingpong":true},
        {"consumers":2,"block_kv":176,"stages":2,"overlap":true,"pingpong":true},
        {"consumers":2,"block_kv":176,"stages":2,"overlap":false,"pingpong":false}]'}
    timeout 560 python3 benchmarks/hopper_attention_probe.py --case 1,32,32,2048,128,full \
      --case 1,32,32,2048,128,causal --points "$P" --timeout 60 --out "$OUT/attention" > "$OUT/attention.log" 2>&1
    tail -c 5000 "$OUT/attention.log" ;;
  profile)
    # Nsight Compute's counters of the best points found (benchmarks/profile_kernels.py), a case per process.
    shift
    ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    for c in ${*:-int4-decode paged-gqa8 attention-noncausal gemm-awkward}; do
      timeout 150 "$ncu" --clock-control none -k regex:main_kernel --launch-skip 2 --launch-count 1 \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy \
        --section LaunchStats --section SchedulerStats --section ComputeWorkloadAnalysis \
        python3 benchmarks/profile_kernels.py "$c" > "$OUT/ncu_$c.txt" 2>&1
      echo "== $c"; grep -E "^    (Duration|DRAM Throughput|Memory Throughput|Compute \(SM\) Throughput|Achieved Occupancy|Registers Per Thread|No Eligible|Issued Warp Per Scheduler|Warp Cycles Per Issued)" \
        "$OUT/ncu_$c.txt" | head -12
    done ;;
  decode)
    timeout 560 python3 benchmarks/gpu_benchmark.py --time-budget "${TIME_BUDGET:-30}" --out "$OUT/decode_bench" \
      --cases paged-decode-gqa8 paged-decode-gqa4-llama3 dequant-int4-decode > "$OUT/decode_bench.log" 2>&1
    tail -12 "$OUT/decode_bench.log" ;;
  probe)
    # Each point in its own process with a timeout (a deadlock costs its timeout, not the call).
    P='[{"consumers":2,"wg_rows":64,"block_n":256,"stages":4,"group_m":8,"persistent":true},
        {"consumers":2,"wg_rows":64,"block_n":256,"stages":4,"group_m":8,"persistent":true,"multicast":"b"},
        {"consumers":2,"wg_rows":64,"block_n":256,"stages":4,"group_m":8,"persistent":true,"multicast":"a"},
        {"consumers":2,"wg_rows":64,"block_n":256,"stages":4,"group_m":8,"persistent":false,"multicast":"b"},
        {"consumers":2,"wg_rows":64,"block_n":168,"stages":5,"group_m":8,"persistent":true},
        {"consumers":2,"wg_rows":64,"block_n":168,"stages":5,"group_m":8,"persistent":true,"multicast":"a"},
        {"consumers":2,"wg_rows":128,"block_n":192,"stages":4,"group_m":8,"persistent":true,"pingpong":true}]'
    timeout 560 python3 benchmarks/hopper_probe.py --shape 4096,4096,4096 --shape 2048,11008,4096 \
      --shape 512,11008,4096 --shape 1000,4000,3000 --points "$P" --timeout 40 --out "$OUT/probe" \
      > "$OUT/probe.log" 2>&1
    tail -c 4000 "$OUT/probe.log" ;;
  gemm)
    python3 benchmarks/gpu_benchmark.py --time-budget "${TIME_BUDGET:-30}" --out "$OUT/next_bench" --cases \
      gemm-fp16-4096 mlp-up-fp16 mlp-up-bf16 prefill512-up prefill512-o gemm-awkward ;;
  flush)
    python3 benchmarks/l2_flush_probe.py --out "$OUT/flush" > "$OUT/flush_probe.log" 2>&1
    cat "$OUT/flush_probe.log"
    for flush in write read; do
      python3 benchmarks/gpu_benchmark.py --time-budget "${TIME_BUDGET:-15}" --flush "$flush" --out "$OUT/bench_$flush" \
        --cases gemv-11008 dequant-int4-decode paged-decode paged-decode-gqa8 > "$OUT/bench_$flush.log" 2>&1
      tail -8 "$OUT/bench_$flush.log"
    done ;;
  model)
    shift
    timeout 580 python3 benchmarks/model_benchmark.py --target cuda --configs "${@:-1:512}" \
      --time-budget "${TIME_BUDGET:-60}" --profile --max-autotune --out "$OUT/model" > "$OUT/model.log" 2>&1
    tail -12 "$OUT/model.log" ;;
  multicast)
    # hopper_gemm v5 (multicast's stage release at CTA scope): its GPU tests, the awkward GEMM's points with
    # and without multicast beside cuBLAS, then GEMM rows searched (CASES: benchmark cases to search).
    timeout 240 python3 -m pytest -m gpu -q -p no:cacheprovider --tb=short -n 8 tests/test_gpu_run.py \
      -k "multicast" > "$OUT/multicast_tests.log" 2>&1
    tail -3 "$OUT/multicast_tests.log"
    B='"consumers":2,"wg_rows":64,"block_n":256,"group_m":1'
    P="[{$B,\"stages\":3,\"persistent\":false},{$B,\"stages\":3,\"persistent\":false,\"multicast\":\"b\"},
        {$B,\"stages\":3,\"persistent\":false,\"multicast\":\"a\"},{$B,\"stages\":4,\"persistent\":false,\"multicast\":\"b\"},
        {$B,\"stages\":4,\"persistent\":true,\"multicast\":\"b\"},
        {\"consumers\":2,\"wg_rows\":128,\"block_n\":128,\"group_m\":1,\"stages\":4,\"persistent\":false,\"multicast\":\"a\"}]"
    timeout 150 python3 benchmarks/hopper_probe.py --shape 1000,4000,3000 --points "$P" --timeout 40 --out "$OUT/probe" \
      > "$OUT/probe.log" 2>&1
    grep -o '"ratio": [0-9.]*' "$OUT/probe.log"
    timeout 400 python3 benchmarks/gpu_benchmark.py --time-budget "${TIME_BUDGET:-30}" --out "$OUT/bench" \
      --cases ${CASES:-gemm-awkward} > "$OUT/bench.log" 2>&1
    tail -8 "$OUT/bench.log" ;;
  int4)
    # int4_gemv v3 (the product on mma.sync, weights bulk-copied into shared memory): its GPU tests, the
    # read floor of the decode GEMVs' sizes, the lane kernel's best points beside tensor-core points at one
    # and eight rows (timed, checked first), then a search of the decode case.
    timeout 300 python3 -m pytest -m gpu -q -p no:cacheprovider --tb=short -n 8 tests/test_gpu_run.py \
      -k "int4" > "$OUT/int4_tests.log" 2>&1
    tail -3 "$OUT/int4_tests.log"
    timeout 120 python3 benchmarks/read_floor.py --mb 23.28 90.2 --out "$OUT/read_floor.json" > "$OUT/read_floor.log" 2>&1
    cat "$OUT/read_floor.log"
    M='"unroll":false,"half_products":false,"mma":true'
    P="[{\"warps\":1,\"rows_per_warp\":4,\"unroll\":true,\"half_products\":true,\"mma\":false},
        {\"warps\":1,\"rows_per_warp\":2,\"unroll\":true,\"half_products\":true,\"mma\":false},
        $(for w in 1 2 4 8; do for r in 1 2 4; do printf '{"warps":%s,"rows_per_warp":%s,%s},' $w $r "$M"; done; done | sed 's/,$//')]"
    timeout 300 python3 benchmarks/profile_kernels.py int4-decode int4-decode-b8 --launches 0 --time --points "$P" \
      > "$OUT/int4_points.log" 2>&1
    cat "$OUT/int4_points.log"
    timeout 200 python3 benchmarks/gpu_benchmark.py --time-budget "${TIME_BUDGET:-30}" --out "$OUT/int4_bench" \
      --cases dequant-int4-decode > "$OUT/int4_bench.log" 2>&1
    tail -4 "$OUT/int4_bench.log" ;;
  gqa)
    # paged_decode v5 (groups of at most 8 heads keep half the accumulators; CTAs per SM): GQA 8:1 points
    # timed, each checked first, then a search of the GQA cases against torch and the copy bandwidth.
    # warps,unroll,split,prefetch,ctas_per_sm
    GRID="8,1,2,1,1 8,1,2,2,1 4,1,2,1,1 4,1,4,1,1 8,1,4,1,1 8,2,2,0,1 4,2,4,0,1 4,4,4,0,1
          4,1,4,1,3 4,1,4,1,4 8,1,4,1,2 4,2,4,0,3 4,1,4,2,3 2,1,8,1,4"
    P="[$(for q in $GRID; do IFS=, read -r w u s f c <<< "$q"
          printf '{"warps":%s,"unroll":%s,"split":%s,"mma":true,"prefetch":%s,"ctas_per_sm":%s},' "$w" "$u" "$s" "$f" "$c"
        done | sed 's/,$//')]"
    timeout 200 python3 benchmarks/profile_kernels.py paged-gqa8 --launches 0 --time --points "$P" > "$OUT/gqa_points.log" 2>&1
    cat "$OUT/gqa_points.log"
    timeout 200 python3 benchmarks/gpu_benchmark.py --time-budget "${TIME_BUDGET:-30}" --out "$OUT/gqa_bench" \
      --cases paged-decode-gqa8 paged-decode-gqa4-llama3 > "$OUT/gqa_bench.log" 2>&1
    tail -8 "$OUT/gqa_bench.log" ;;
  timeline)
    # Where the whole model's time goes between kernels (benchmarks/model_timeline.py), from a database.
    timeout 400 python3 benchmarks/model_timeline.py --db "${DB:?a database of tuned records}" --config "${2:-16:512}" \
      --out "$OUT/timeline.json" > "$OUT/timeline.log" 2>&1
    tail -40 "$OUT/timeline.log" ;;
  *) echo "usage: hopper_next_gpu.sh tests|attention|profile|decode|probe|gemm|flush|model|multicast|int4|gqa|timeline [batch:tokens ...]" >&2; exit 2 ;;
esac
