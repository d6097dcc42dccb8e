#!/usr/bin/env bash
# The serving goals of issue 64 item 8 on the GPU machine: `autosched serve` of our generation artifact against
# `transformers serve --continuous-batching` of the same model, under the same load (serve_benchmark.py), each step
# under its own time limit so that a call cut short keeps what the earlier steps measured. Usage there (after
# `bash .gpu/tvm/stage.sh` in the call before, with .gpu/deps carried; the packages below importable):
#   DB=.bench/tune.db bash benchmarks/serve_gpu.sh prepare            # one call: the model folder and our build
#   bash benchmarks/serve_gpu.sh steps ours                             # the next: the step times, our server
#   bash benchmarks/serve_gpu.sh ours-nocache hf summary                # the next: without prefix cache, transformers
# (no step named: steps ours ours-nocache hf summary). Each command may run at most 10 minutes: split the steps
# over calls as above. Results go to $OUT (one JSON per run and its server's log) and to .bench/serve/last/, which
# later calls on the same machine read; on a fresh machine give the earlier calls' results folder as PREV=DIR.
# The packages the GPU machine lacks (the server, the client, XGrammar), packed here beside TVM:
#   ../shared/tools/gpu-pack $(cat benchmarks/serve_gpu_wheels.txt)
# Steps:
#   prepare  HF (default .bench/serve/llama2-7b-hf): Llama-2-7B's configuration with random fp16 weights and a
#            byte-level BPE tokenizer of its 32000 ids (_random_hf_model.py), unless the folder exists; ARTIFACT
#            (default .bench/serve/llama2-7b-art): `autosched build HF --generate --target cuda --dtype float16`
#            with $DB's records and BUILD_ARGS (default --decode-batches 1,16 --prefill-chunks 512,8192
#            --max-batch 16 --max-seq-len 4096), unless it exists
#   steps    the artifact's decode step at batches 1 and 16 (generate_benchmark.py --artifact: 512-token prompts,
#            128 new tokens: PROMPT, OUTPUT) -> steps.json: (a)'s reference and (b)'s bound (BOUND_MS, default 2x
#            batch 1's step); and the prefill of a prompt 59 tokens past PROMPT, its last 59 through the dynamic
#            function and padded up to a static chunk (steps_offchunk.json)
#   ours     `autosched serve ARTIFACT` (OURS_ARGS more options), one server for: (a) 16 concurrent streams in
#            one wave of 16 requests of PROMPT and OUTPUT tokens (a_ours.json: after their prefill, the decode
#            steps are the batch-16 step of steps.json, and what differs is the server), and 16 streams of 64
#            requests of mixed lengths (a_ours_mixed.json: prefills between the steps); (b) the sweep for the highest Poisson rate whose p99 TPOT stays within the bound
#            (b_ours.json); (c) the shared-prefix load with its prefix cache (c_ours_cache.json)
#   ours-nocache  the same server with --no-prefix-cache: the shared-prefix load (c_ours_nocache.json)
#   hf       `transformers serve HF --continuous-batching` (HF_ARGS more options): the Poisson load at our best rate
#            of (b) (b_hf_rate.json), 16 concurrent streams as (a)'s two loads (a_hf.json,
#            b_hf_concurrency.json: (b)'s comparison where it cannot keep the bound at that rate), the shared-prefix load (c_hf.json: its cache shares a prefix's
#            blocks); HF_SWEEP=1 also its own sweep under the same bound (b_hf_sweep.json)
#   summary  one Markdown table of every run (table.md) and the three goals' numbers (goals.md)
# The load (serve_benchmark.py): prompts log-normal around PROMPT tokens (default 512; sigma 0.5, at most 3x),
# outputs around OUTPUT (default 128; sigma 0.5, at most 4x), held to their drawn length; N requests a run (default
# 64; C_N, default 32, for (c)); the sweep from SWEEP_START requests/s (default 2) with 3 bisections, each run at most
# SWEEP_DURATION seconds of sending (default 40); (c): a PREFIX-token system prompt (default 1024) before each
# prompt, C_RATE requests/s (default 2), C_PROMPT tokens after it (default PROMPT). LOADS: which of `ours`'s loads
# run (default "a a_mixed b c"). The step times use prompts of PROMPT tokens and OUTPUT new tokens.
# Our server gets token ids, transformers the same prompts as text (it takes no ids), tokenized by the same
# tokenizer (HF's) into the same tokens; the tables show the prompt tokens each server counted.
set -uo pipefail
NEED="transformers=transformers openai=openai(+httpx,anyio,distro,jiter,sniffio) fastapi=fastapi uvicorn=uvicorn" \
  source "$(dirname "$0")/_gpu_env.sh"
HF=${HF:-.bench/serve/llama2-7b-hf}
ARTIFACT=${ARTIFACT:-.bench/serve/llama2-7b-art}
PORT=${PORT:-8100}
N=${N:-64}
last=.bench/serve/last
mkdir -p "$last"
PROMPT=${PROMPT:-512} OUTPUT=${OUTPUT:-128} PREFIX=${PREFIX:-1024}
bench=(python3 benchmarks/serve_benchmark.py --port "$PORT" --prompt-len "$PROMPT" --prompt-max $((3 * PROMPT))
       --output-len "$OUTPUT" --output-max $((4 * OUTPUT)) --warmup 4)

result() {  # the path of an earlier result NAME.json: this call's, this machine's last, or $PREV's
  local f
  for f in "$OUT/$1.json" "$last/$1.json" "${PREV:+$PREV/$1.json}"; do
    [[ -n $f && -f $f ]] && { echo "$f"; return 0; }
  done
  return 1
}
keep() { cp "$OUT/$1.json" "$last/" 2>/dev/null; }  # for later calls on this machine

server_pid=
start_server() {  # NAME CMD...: started in its own process group, its output in $OUT/NAME.server.log
  local name=$1
  shift
  setsid "$@" > "$OUT/$name.server.log" 2>&1 &
  server_pid=$!
  python3 - "$PORT" "$server_pid" <<'PY' && return 0
import os, sys, time, urllib.request
port, pid = sys.argv[1], int(sys.argv[2])
began = time.time()
while time.time() - began < 420:
    try:  # exited: gone, or a zombie its shell has not waited for yet
        if open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z":
            sys.exit("it exited")
    except FileNotFoundError:
        sys.exit("it exited")
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5) as r:
            if r.status == 200:
                print(f"server up after {time.time() - began:.0f} s", flush=True)
                sys.exit(0)
    except OSError:
        pass
    time.sleep(1)
sys.exit("no answer in 420 s")
PY
  echo "$name: the server did not answer" >&2
  tail -5 "$OUT/$name.server.log" >&2
  stop_server
  return 1
}
stop_server() {
  [[ -n $server_pid ]] || return 0
  kill -TERM -- "-$server_pid" 2>/dev/null
  for _ in $(seq 30); do kill -0 "$server_pid" 2>/dev/null || break; sleep 0.5; done
  kill -KILL -- "-$server_pid" 2>/dev/null
  wait "$server_pid" 2>/dev/null
  server_pid=
}
trap stop_server EXIT

load() {  # NAME LIMIT LABEL ARGS...: a serve_benchmark.py run against the server up, $OUT/NAME.json
  local name=$1 limit=$2 label=$3
  shift 3
  timeout "$limit" "${bench[@]}" --label "$label" --out "$OUT/$name.json" "$@" > "$OUT/$name.log" 2>&1
  echo "$name: exit $?"
  keep "$name"
  # our server's counters after the run (cumulative since it started): its prefill calls (static chunks or
  # not), decode steps, and seconds in the generator against the engine's own
  python3 -c "import sys, urllib.request; sys.stdout.write(urllib.request.urlopen(sys.argv[1], timeout=10).read().decode())" \
    "http://127.0.0.1:$PORT/metrics" 2>/dev/null | grep -E "^autosched_(generator|engine)_" > "$OUT/$name.metrics.txt"
}

json() {  # FILE EXPR: a value of a result, by a Python expression over d
  python3 -c "import json, sys; d = json.load(open(sys.argv[1])); print($2)" "$1"
}

bound_ms() {  # (b)'s bound: BOUND_MS, or 2x the artifact's batch-1 step
  if [[ -n ${BOUND_MS:-} ]]; then echo "$BOUND_MS"; return; fi
  local steps
  steps=$(result steps) || { echo "no steps.json: run the step 'steps' first, or give BOUND_MS" >&2; return 1; }
  json "$steps" "2 * next(r['ours_ms_per_step'] for r in d['rows'] if r['batch'] == 1)"
}

read -r -a ours_cmd <<< "${OURS_CMD:-python3 -m autosched serve}"  # OURS_CMD: another way to start it
tok=()
[[ -f $HF/tokenizer.json || -f $HF/tokenizer.model ]] && tok=(--tokenizer "$HF")
# The shared-prefix load of (c): C_PROMPT tokens (default PROMPT) after the prefix; another C_PROMPT names its results
# c_ours_cache_qC_PROMPT (and so on)
c_prompt=${C_PROMPT:-$PROMPT}
c_suffix=$([[ $c_prompt != "$PROMPT" ]] && echo "_q$c_prompt")
prefix_load=(--rate "${C_RATE:-2}" --num-requests "${C_N:-32}" --shared-prefix "$PREFIX" --prompt-len "$c_prompt"
             --prompt-max $((3 * c_prompt)))
wants() { [[ " ${LOADS:-a a_mixed b c} " == *" $1 "* ]]; }  # LOADS: which of our server's loads run (default all)

steps_to_run=("$@")
(( ${#steps_to_run[@]} )) || steps_to_run=(steps ours ours-nocache hf summary)
for step in "${steps_to_run[@]}"; do
  case $step in
    prepare)
      if [[ ! -f $HF/config.json ]]; then
        timeout 400 python3 benchmarks/_random_hf_model.py "$HF" --config llama2-7b --device cuda > "$OUT/prepare_hf.log" 2>&1
        echo "prepare hf: exit $?"
      fi
      if [[ ! -f $ARTIFACT/manifest.json ]]; then
        read -r -a build_args <<< "${BUILD_ARGS:---decode-batches 1,16 --prefill-chunks 512,8192 --max-batch 16 --max-seq-len 4096}"
        timeout 540 python3 -m autosched build "$HF" --generate --target cuda --dtype float16 "${build_args[@]}" \
          ${DB:+--db "$DB"} -o "$ARTIFACT" > "$OUT/prepare_build.log" 2>&1
        echo "prepare build: exit $?"; tail -2 "$OUT/prepare_build.log"
      fi ;;
    steps)
      timeout 300 python3 benchmarks/generate_benchmark.py --artifact "$ARTIFACT" --batches 1,16 --prompt "$PROMPT" \
        --new "$OUTPUT" --out "$OUT/steps.json" > "$OUT/steps.log" 2>&1
      echo "steps: exit $?"; keep steps
      # a prompt that is no static chunk: its remainder goes through the dynamic prefill (the server's prompts vary)
      timeout 120 python3 benchmarks/generate_benchmark.py --artifact "$ARTIFACT" --batches 1 --prompt $((PROMPT + 59)) \
        --new 8 --pad-prefill-ab --out "$OUT/steps_offchunk.json" > "$OUT/steps_offchunk.log" 2>&1
      echo "steps off-chunk: exit $?"; keep steps_offchunk ;;
    ours)
      read -r -a more <<< "${OURS_ARGS:-}"
      start_server ours "${ours_cmd[@]}" "$ARTIFACT" --port "$PORT" "${more[@]}" || continue
      # (a): one wave of 16 requests of the step's lengths, so that the decode steps are the benchmark's batch-16
      # step and the server's cost is what differs; then 16 streams of mixed lengths, joining as others finish
      wants a && load a_ours 150 "autosched serve" --concurrency 16 --num-requests 16 --prompt-sigma 0 --output-sigma 0 \
        "${tok[@]}"
      wants a_mixed && load a_ours_mixed 150 "autosched serve" --concurrency 16 --num-requests "$N" "${tok[@]}"
      if wants b && bound=$(bound_ms); then
        load b_ours 330 "autosched serve" --sweep-p99-tpot-bound "$bound" --sweep-start "${SWEEP_START:-2}" \
          --duration "${SWEEP_DURATION:-40}" --num-requests "$N" "${tok[@]}"
      fi
      wants c && load "c_ours_cache$c_suffix" 90 "autosched serve, prefix cache" "${prefix_load[@]}" "${tok[@]}"
      stop_server ;;
    ours-nocache)
      read -r -a more <<< "${OURS_ARGS:-}"
      start_server ours_nocache "${ours_cmd[@]}" "$ARTIFACT" --port "$PORT" --no-prefix-cache "${more[@]}" || continue
      load "c_ours_nocache$c_suffix" 90 "autosched serve, --no-prefix-cache" "${prefix_load[@]}" "${tok[@]}"
      stop_server ;;
    hf)
      python3 -c "import accelerate" 2>/dev/null || { echo "hf: transformers serve needs accelerate (device_map)" >&2; continue; }
      read -r -a more <<< "${HF_ARGS:-}"
      # its GET /v1/models lists the Hugging Face cache, and answers 500 where there is no such folder
      export HF_HUB_CACHE=${HF_HUB_CACHE:-$PWD/.bench/hf-hub-cache}
      mkdir -p "$HF_HUB_CACHE"
      start_server hf python3 -m transformers.cli.transformers serve "$HF" --continuous-batching \
        --device "${HF_DEVICE:-cuda}" --dtype "${HF_DTYPE:-float16}" --host 127.0.0.1 --port "$PORT" "${more[@]}" || continue
      hf_load=(--prompt-mode text --eos hf)
      if ours=$(result b_ours) && rate=$(json "$ours" "d.get('sweep', {}).get('best_rate') or ''") && [[ -n $rate ]]; then
        load b_hf_rate 240 "transformers serve --continuous-batching" --rate "$rate" --num-requests "$N" "${hf_load[@]}"
      else
        echo "hf: no best rate of ours (b_ours.json): no run at it"
      fi
      load a_hf 240 "transformers serve --continuous-batching" --concurrency 16 --num-requests 16 --prompt-sigma 0 \
        --output-sigma 0 "${hf_load[@]}"
      load b_hf_concurrency 240 "transformers serve --continuous-batching" --concurrency 16 --num-requests "$N" "${hf_load[@]}"
      load c_hf 120 "transformers serve --continuous-batching" "${prefix_load[@]}" "${hf_load[@]}"
      if [[ ${HF_SWEEP:-0} == 1 ]] && bound=$(bound_ms); then
        load b_hf_sweep 330 "transformers serve --continuous-batching" --sweep-p99-tpot-bound "$bound" \
          --sweep-start "${SWEEP_START:-2}" --duration "${SWEEP_DURATION:-40}" --num-requests "$N" "${hf_load[@]}"
      fi
      stop_server ;;
    summary)
      files=()
      for name in a_ours a_hf a_ours_mixed b_hf_concurrency b_ours b_hf_rate b_hf_sweep c_ours_cache c_ours_nocache c_hf; do
        f=$(result $name) && files+=("$f")
      done
      python3 benchmarks/serve_benchmark.py --table "${files[@]}" > "$OUT/table.md" && cat "$OUT/table.md"
      python3 - "$OUT" "$last" "${PREV:-}" "${BOUND_MS:-}" "$PREFIX" <<'PY' | tee "$OUT/goals.md"
import json, math, pathlib, sys
folders = [pathlib.Path(p) for p in sys.argv[1:4] if p]
def load(name):
    for folder in folders:
        if (folder / f"{name}.json").is_file():
            return json.loads((folder / f"{name}.json").read_text())
steps = load("steps")
step = {r["batch"]: r["ours_ms_per_step"] for r in steps["rows"]} if steps else {}
bound = float(sys.argv[4]) if sys.argv[4] else (2 * step[1] if 1 in step else None)
def only(result, pick=lambda run: True):
    runs = [r for r in (result or {}).get("runs", []) if pick(r)]
    return runs[-1]["summary"] if runs else None
a, mixed = only(load("a_ours")), only(load("a_ours_mixed"))
if a and 16 in step:
    print(f"(a) 16 concurrent streams, one wave: our TPOT p50 {a['tpot_ms']['p50']:.2f} ms, p99 {a['tpot_ms']['p99']:.2f} "
          f"ms; the artifact's batch-16 decode step {step[16]:.2f} ms: {a['tpot_ms']['p50'] / step[16]:.2f}x "
          f"({a['output_tokens_per_s']:.0f} output tokens/s)")
if mixed and 16 in step:
    print(f"    16 streams of mixed lengths (prefills between the steps): TPOT p50 {mixed['tpot_ms']['p50']:.2f} ms: "
          f"{mixed['tpot_ms']['p50'] / step[16]:.2f}x")
b = load("b_ours")
best = (b or {}).get("sweep", {}).get("best_rate")
if b and bound:
    at = only(b, lambda run: run["rate"] == best)
    print(f"(b) bound {bound:.2f} ms{'' if sys.argv[4] else f' (2x our batch-1 step {bound / 2:.2f} ms)'}: our highest "
          f"rate within it {f'{best:g} req/s' if best else 'none (not even the lowest tried)'}"
          + (f", {at['output_tokens_per_s']:.0f} output tokens/s, p99 TPOT {at['tpot_ms']['p99']:.2f} ms" if at else ""))
    hf = only(load("b_hf_rate"))
    if hf and at:
        kept = hf["failed"] == 0 and hf["tpot_ms"]["p99"] <= bound
        print(f"    transformers serve at {best} req/s: {hf['output_tokens_per_s']:.0f} output tokens/s, p99 TPOT "
              f"{hf['tpot_ms']['p99']:.2f} ms ({'within' if kept else 'beyond'} the bound); ours/theirs "
              f"{at['output_tokens_per_s'] / hf['output_tokens_per_s']:.2f}x")
    hs = load("b_hf_sweep")
    if hs:
        print(f"    transformers serve's highest rate within the bound: {hs.get('sweep', {}).get('best_rate')} req/s")
    for ours, theirs, what in ((mixed, only(load("b_hf_concurrency")), "of mixed lengths"),
                               (a, only(load("a_hf")), "in one wave")):
        if ours and theirs:
            print(f"    at 16 concurrent streams {what}: ours {ours['output_tokens_per_s']:.0f}, transformers serve "
                  f"{theirs['output_tokens_per_s']:.0f} output tokens/s "
                  f"({ours['output_tokens_per_s'] / theirs['output_tokens_per_s']:.2f}x); p99 TPOT "
                  f"{ours['tpot_ms']['p99']:.2f} vs {theirs['tpot_ms']['p99']:.2f} ms")
cached, uncached = only(load("c_ours_cache")), only(load("c_ours_nocache"))
if cached and uncached:
    print(f"(c) {sys.argv[5]}-token shared prefix: our TTFT p50 {cached['ttft_ms']['p50']:.1f} ms with the prefix cache, "
          f"{uncached['ttft_ms']['p50']:.1f} ms without: {uncached['ttft_ms']['p50'] / cached['ttft_ms']['p50']:.2f}x")
off = load("steps_offchunk")
if off:
    print("    a prompt past its whole chunks: prefill " + ", ".join(
        f"{r['ours_prefill_ms']:.1f} ms {'padded up to a static chunk' if r['pad_prefill'] else 'with a dynamic call'}"
        for r in off["rows"]) + f" ({off['rows'][0]['prompt']} tokens)")
hfc = only(load("c_hf"))
if hfc:
    print(f"    transformers serve (its cache shares prefix blocks): TTFT p50 {hfc['ttft_ms']['p50']:.1f} ms")
PY
      ;;
    *) echo "unknown step '$step': prepare, steps, ours, ours-nocache, hf or summary" >&2; exit 2 ;;
  esac
done
