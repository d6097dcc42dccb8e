#!/usr/bin/env bash
# The transformers families at real dimensions (examples/hf.py: two decoder layers of each family's real
# model, fp16) through benchmarks/model_benchmark.py on the GPU machine. Families are dealt out over the
# host's GPUs: each GPU runs its families one after another (CUDA_VISIBLE_DEVICES set per process, so a
# tuning run's timings never share a GPU), the GPUs at once. Usage there:
#   bash benchmarks/hf_models_gpu.sh llama qwen2 mistral gemma phi3 gpt2
# CONFIGS (default "1:512 16:1": a 512-token prefill and a batch-16 decode step), TIME_BUDGET (tuning
# seconds per config, default 60). Each family writes $OUT/hf/<family>/results_cuda.{json,md} (with each
# tuned build's per-kernel times) and its log $OUT/hf_<family>.log; the rows are combined into
# $OUT/hf/results_cuda.md at the end. Delete $OUT/hf/*/model_cuda.db* before the call ends if the files
# coming back would be too many.
set -uo pipefail
NEED="transformers=transformers" source "$(dirname "$0")/_gpu_env.sh"
gpus=$(nvidia-smi -L | wc -l)
read -r -a configs <<< "${CONFIGS:-1:512 16:1}"
run_family() {
  local family=$1 model
  model=$(python3 -c "from autosched.examples.hf import REAL; print('hf-$family-' + REAL['$family'][0] + '-layers')")
  python3 benchmarks/model_benchmark.py --target cuda --model "$model" --configs "${configs[@]}" --trials 1024 \
    --time-budget "${TIME_BUDGET:-60}" --profile --out "$OUT/hf/$family" > "$OUT/hf_$family.log" 2>&1
  echo "$family on GPU $CUDA_VISIBLE_DEVICES: exit $? ($(grep -c '"model"' "$OUT/hf_$family.log") configs done)"
}
for ((gpu = 0; gpu < gpus; gpu++)); do
  (
    export CUDA_VISIBLE_DEVICES=$gpu
    i=0
    for family in "$@"; do
      if (( i % gpus == gpu )); then run_family "$family"; fi
      i=$((i + 1))
    done
  ) &
done
wait
python3 benchmarks/model_benchmark.py --combine "$OUT"/hf/*/results_cuda.json --out "$OUT/hf" > /dev/null \
  && cat "$OUT/hf/results_cuda.md"
