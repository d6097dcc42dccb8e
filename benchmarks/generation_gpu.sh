#!/usr/bin/env bash
# The generation goals on the GPU machine, one step after another, each under its own time limit so that a call
# cut short keeps what the earlier steps measured. Usage there (after `bash .gpu/tvm/stage.sh` in the call
# before, with .gpu/deps and the tuning database's folder carried):
#   DB=.bench/tune.db bash benchmarks/generation_gpu.sh fp16 q4f16 spec
# Steps:
#   topup   tune-model of Llama-2-7B's decode steps (batches 1, 16), prefill chunks (512, 8192) and verify steps
#           (k = 4) for TOPUP seconds (default 140), records added to $OUT/tune.db
#   fp16    generate_benchmark.py at batches 1 and 16 with FP16_AB (default --trace --step-at-a-time --programmatic-launch 4
#           --prefetch-weights 8: the trace and the A/Bs; the last two, in the kernels of decode steps of 1-4 rows,
#           each build again); with COMPILE=1 also torch's best recipe (--compile), 240 s more
#   q4f16   tune-model --quantize q4f16 for Q4_BUDGET seconds (default 110), then the q4f16 benchmark with
#           torch's int4 recipe (--torch-int4 --compile) and Q4_AB (default --programmatic-launch 4 --prefetch-weights 8)
#   fp8     the fp8 build's prefill of 512 tokens at batch 16 (W8A8 chunks on sm_90)
#   spec    speculative_benchmark.py at batch 1, k = 4
#   models  Llama-2-7B, Llama-3.1-8B and Qwen3-8B at batch 1 (each one's share of the floor, in the same run;
#           MODELS: another list)
#   b64     Llama-3-8B at batch 64 (a decode step of 64 sequences of 512 + 32 tokens)
#   decode-gemm  Llama-2-7B's four batch-16 GEMMs: hopper_gemm's wgmma default against its streaming mma.sync
#           kernel's points (gpu_benchmark.py --hand-points gemm --points decode), GB/s beside cuBLAS; then the
#           fused SwiGLU of 16 rows (swiglu_gemm's first points: gated wgmma and gated streaming kernels)
#   decode-int4  Llama-2-7B's four int4 projections (q4f16, groups of 128) at 1 and 16 rows: int4_gemv's first
#           points (CUDA cores: half2 and fp32 products; tensor cores bulk-copied and
#           streamed, 16 rows on 1, 2 and 4 tiles a block),
#           GB/s (--hand-points space), for at most INT4_LIMIT seconds (default 480)
#   decode-attention  kv_cache_decode's points (16 warps and fill among them) against TVM's kernel at batches 1,
#           16 and 64, 32:32 and 32:8 heads, 544 tokens (decode_attention_benchmark.py)
#   tests   pytest -m gpu on the tests this work touches (TESTS files, TEST_FILTER: -k; default: programmatic
#           launch, fp8, int4, the streaming decode GEMMs), in TEST_WORKERS processes (default 4)
# $DB (optional) is copied to $OUT/tune.db first and every step reads and writes that copy, so the records come back.
# $RECORDS (optional): files of `autosched db export` (e.g. a records.jsonl of an earlier session's results) merged
# into that copy first; at the end its records are exported to $OUT/records.jsonl, so that tuning done in one
# call or session carries to the next (records keep their uid: merging one twice adds nothing).
set -uo pipefail
NEED="transformers=transformers" source "$(dirname "$0")/_gpu_env.sh"
db=$OUT/tune.db
# No $DB (or none there yet): the steps start from an empty database (topup creates it).
[[ -f $db || ! -f ${DB:-} ]] || cp "$DB" "$db"
for records in ${RECORDS:-}; do
  python3 -m autosched db import "$records" --db "$db" > /dev/null || { echo "cannot merge $records" >&2; exit 2; }
done
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >> "$OUT/gpu.txt"
llama=hf-llama-7b-layers
gen() {  # generate_benchmark.py ARGS..., its rows in $OUT/$name.json
  local name=$1 limit=$2
  shift 2
  timeout "$limit" python3 benchmarks/generate_benchmark.py --db "$db" --out "$OUT/$name.json" "$@" > "$OUT/$name.log" 2>&1
  echo "$name: exit $?"
}
for step in "$@"; do
  case $step in
    topup) timeout $(( ${TOPUP:-140} + 60 )) python3 -m autosched tune-model $llama --target cuda --dtype float16 \
             --generate --decode-batches 1,16 --prefill-chunks 512,8192 --speculate 4 --time-budget "${TOPUP:-140}" \
             --db "$db" > "$OUT/topup.log" 2>&1; echo "topup: exit $?" ;;
    fp16) read -r -a ab <<< "${FP16_AB:---trace --step-at-a-time --programmatic-launch 4 --prefetch-weights 8}"
          gen fp16 $(( ${COMPILE:+240} + 450 )) --model llama2-7b --batches 1,16 --new 64 "${ab[@]}" ${COMPILE:+--compile} ;;
    q4f16) timeout $(( ${Q4_BUDGET:-110} + 60 )) python3 -m autosched tune-model $llama --target cuda --dtype float16 \
             --generate --decode-batches 1,16 --prefill-chunks 512 --quantize q4f16 --time-budget "${Q4_BUDGET:-110}" \
             --db "$db" > "$OUT/tune_q4f16.log" 2>&1; echo "q4f16 tuning: exit $?"
           read -r -a ab <<< "${Q4_AB:---programmatic-launch 4 --prefetch-weights 8}"
           gen q4f16 480 --model llama2-7b --batches 1,16 --new 64 --quantize q4f16 --torch-int4 --compile "${ab[@]}" ;;
    fp8) gen fp8 200 --model llama2-7b --batches 16 --new 8 --quantize fp8 ;;
    spec) timeout 220 python3 benchmarks/speculative_benchmark.py --model llama2-7b --batches 1 --speculate 4 --new 32 \
            --db "$db" --out "$OUT/spec.json" > "$OUT/spec.log" 2>&1; echo "spec: exit $?" ;;
    models) for model in ${MODELS:-llama2-7b llama3.1-8b qwen3-8b}; do
              gen "$model" 200 --model "$model" --batches 1 --new 64 --step-at-a-time; done ;;
    b64) gen llama3-8b-b64 300 --model llama3-8b --batches 64 --new 32 ;;
    decode-gemm) shapes=(); for s in 16,12288,4096 16,4096,11008 16,4096,4096 16,22016,4096; do shapes+=(--shape "$s"); done
           timeout 420 python3 benchmarks/gpu_benchmark.py --hand-points gemm --points decode "${shapes[@]}" --timeout 60 \
             --out "$OUT/decode_gemm" > "$OUT/decode_gemm.log" 2>&1; echo "decode-gemm: exit $?"
           timeout 150 python3 benchmarks/gpu_benchmark.py --hand-points space --workload swiglu_gemm --points first \
             --shape m=16,n=11008,k=4096 --timeout 60 --out "$OUT/decode_swiglu" > "$OUT/decode_swiglu.log" 2>&1
           echo "decode-swiglu: exit $?" ;;
    decode-int4) shapes=(); for m in 1 16; do for nk in n=12288,k=4096 n=4096,k=4096 n=22016,k=4096 n=4096,k=11008; do
             shapes+=(--shape "m=$m,$nk"); done; done
           timeout "${INT4_LIMIT:-480}" python3 benchmarks/gpu_benchmark.py --hand-points space --workload dequant_gemm \
             --attrs bits=4,group=128 --points first "${shapes[@]}" --timeout 60 --out "$OUT/decode_int4" \
             > "$OUT/decode_int4.log" 2>&1; echo "decode-int4: exit $?" ;;
    decode-attention) timeout 300 python3 benchmarks/decode_attention_benchmark.py --heads 32:32,32:8 --batches 1,16,64 \
             --context 544 --repeat 30 --out "$OUT/decode_attention.json" > "$OUT/decode_attention.log" 2>&1
           echo "decode-attention: exit $?" ;;
    tests) read -r -a files <<< "${TESTS:-tests/test_programmatic_launch.py tests/test_quantize.py tests/test_gpu_run.py}"
           timeout 480 python3 -m pytest -m gpu -q -p no:cacheprovider -n "${TEST_WORKERS:-4}" --dist load \
             -k "${TEST_FILTER:-programmatic or fp8 or int4 or streaming}" \
             "${files[@]}" > "$OUT/tests.log" 2>&1
           echo "tests: exit $?"; tail -3 "$OUT/tests.log" ;;
    *) echo "unknown step '$step': topup, fp16, q4f16, fp8, spec, models, b64, decode-gemm, decode-int4, decode-attention or tests" >&2
       exit 2 ;;
  esac
done
[[ -f $db ]] && python3 -m autosched db export --db "$db" -o "$OUT/records.jsonl" --force > /dev/null
python3 - "$OUT" <<'PY'
import json, pathlib, sys
keys = ("batch", "quantize", "ours_ms_per_step", "floor_ms", "share_of_floor", "ours_prefill_ms",
        "programmatic_ms_per_step", "programmatic_same_tokens", "prefetch_ms_per_step", "prefetch_same_tokens",
        "step_at_a_time_ms_per_step", "step_at_a_time_same_tokens",
        "best_ms_per_step", "int4_best_ms_per_step")
for path in sorted(pathlib.Path(sys.argv[1]).glob("*.json")):
    for row in json.loads(path.read_text()).get("rows", []):
        print(path.stem, {k: row[k] for k in keys if k in row})
PY
