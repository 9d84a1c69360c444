#!/usr/bin/env bash
# Issue 39.5 on a lent GPU: the speedup an aerie drafter buys at a real target's cost ratio. An
# 8B-shaped target whose next token is learnable (benchmarks/gpu_random_target.py: Llama-3.1-8B's
# shape, random weights at the tiny DeepSeek-V3 target's spreads, SmolLM2's tokenizer), a drafter
# trained on it through aerie's pipeline (benchmarks/gpu_drafter.py --target: ShareGPT first turns
# answered by the target through SGLang, its states extracted by the hf engine, the train stage),
# served by SGLang 0.5.17 EAGLE-3 (3,1,4) beside the plain server: decode tok/s at batch 1 and 8 on
# MT-bench prompts, with the acceptance it reached. Speed only: the target says nothing about language.
#
# Here, once: `bash benchmarks/gpu_carry.sh --all`, the SGLang 0.5.17 device recipe
# (`mkdir -p .devtools && cp -r ../shared/tools/sglang_on_device .devtools/ &&
#  bash .devtools/sglang_on_device/fetch_wheels.sh`), then `bash benchmarks/gpu_speedup.sh prepare`.
# No GGUF travels: the target is drawn on the device, its tokenizer is chunk1's (SmolLM2's).
# Then, back to back (the machine stays warm ~30 s between calls), each with its carry:
#
#   carry                                                              command
#   .devcarry/wheels .devwheels/chunk1 .devcarry/speed-data .devtools  bash benchmarks/gpu_speedup.sh deps
#   .devwheels/chunk2 .devtools                                        bash benchmarks/gpu_speedup.sh target
#   .devwheels/chunk3 .devtools                                        bash benchmarks/gpu_speedup.sh run regen,extract,train
#   (none)                                                             bash benchmarks/gpu_speedup.sh run train,serve   # again until served
#
# `run` passes its further ARGS to gpu_drafter.py after the defaults below. A call that finds the
# machine cold says COLD and exits 3: start again from `deps`.
set -euo pipefail
cd "$(dirname "$0")/.."
step=${1:?prepare|deps|target|run}
shift || true
L=${L:-/tmp/aerie-speed}
TARGET=${TARGET:-/tmp/aerie-target-8b}
SITE=${SITE:-/tmp/site}
SGSITE=${SGSITE:-/tmp/sgsite}
DGSITE=${DGSITE:-/tmp/site_dg}
export PYTHONPATH=shared:services/extractor:services/trainer:benchmarks:$SITE PYTHONUNBUFFERED=1
export AERIE_SGLANG_PYTHONPATH=$SGSITE:$DGSITE
cold() { test -e "$1" || { echo "COLD: $1 is gone (the machine went back); start again from deps"; exit 3; }; }
# 2,048 ShareGPT first turns answered by the target (<= 384 new tokens), 8 parts; main trained on
# all of it for TOKENS token slots (4 M: the 8B-shaped drafter trains at ~25-30k slots/s, BENCHMARKS.md); served on 80 MT-bench first turns and 100 GSM8K questions for
# the acceptance, and 16 MT-bench prompts x 256 tokens for the speeds at batch 1 and 8.
A=(--target "$TARGET" --data $L/data --work $L/work --store $L/store --out "${OUT:-$L/out}"
   --records "${RECORDS:-2048}" --parts 8 --shard-records 128 --max-new-tokens 384 --tasks 4 --concurrency 64
   --baseline-records 0 --bf16-parts 0 --arms main --serve-arms main --tokens "${TOKENS:-4000000}"
   --batch-tokens 16384 --lr 8.5e-4 --draft-vocab 16384 --max-seq 2048 --eval-prompts 0 --eval-tokens 96
   --mtbench 80 --gsm8k 100 --serve-tokens 256 --speed-prompts 16 --speed-batch 1,8 --eval-concurrency 32
   --serve-parallel 2
   --regen-args "--mem-fraction-static 0.5 --max-running-requests 256 --cuda-graph-max-bs-decode 256"
   --serve-mem "--mem-fraction-static 0.4 --max-total-tokens 65536 --max-running-requests 32 --cuda-graph-max-bs-decode 32")
[ -z "${SERVER_ARGS+x}" ] || A+=(--server-args "$SERVER_ARGS")
[ -z "${SGLANG_PY:-}" ] || A+=(--sglang-python "$SGLANG_PY" --sglang-module "$SGLANG_MOD" --sglang-eagle-module "$SGLANG_EAGLE_MOD")
case $step in
prepare)  # here, on the CPU
  test -f .devcarry/data/sharegpt.jsonl.xz || { echo "run bash benchmarks/gpu_carry.sh --all first"; exit 2; }
  rm -rf .devcarry/speed-data && mkdir -p .devcarry/speed-data
  python3 - <<'EOF'
import lzma
with lzma.open(".devcarry/data/sharegpt.jsonl.xz", "rt") as f, lzma.open(".devcarry/speed-data/sharegpt.jsonl.xz", "wt", preset=9) as out:
    for n, line in enumerate(f):
        if n == 2600:  # the first 2,048 usable records and then some
            break
        out.write(line)
EOF
  cp .devcarry/data/mtbench_question.jsonl .devcarry/data/gsm8k_test.jsonl .devcarry/speed-data/
  du -sb .devcarry/speed-data .devcarry/wheels .devwheels/chunk1 .devwheels/chunk2 .devwheels/chunk3
  ;;
deps)
  mkdir -p $L/data && cp .devcarry/speed-data/* $L/data/
  python3 -m pip install -q --no-index --no-deps --no-compile --target $SITE .devcarry/wheels/*.whl
  python3 -m pip install -q --no-deps --no-index --no-build-isolation --target $SITE ./shared ./services/extractor ./services/trainer
  SITE=$SGSITE bash .devtools/sglang_on_device/run_chunk.sh .devwheels/chunk1  # and SmolLM2's tokenizer in /tmp/tokenizer
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  ;;
target)
  cold $SGSITE/.installed_chunk1
  SITE=$SGSITE bash .devtools/sglang_on_device/run_chunk.sh .devwheels/chunk2
  python3 benchmarks/gpu_random_target.py --tokenizer "${TOKENIZER:-/tmp/tokenizer}" --out "$TARGET" --device cuda \
    --shape "${SHAPE:-llama3-8b}" 2>&1 | tee "$OUT/target.log"
  cp "$TARGET/target.json" "$OUT/"
  ;;
run)
  stages=${1:?stages}
  shift
  cold "$TARGET/config.json"
  if [ -d .devwheels/chunk3 ] && [ ! -f $DGSITE/.installed_chunk3 ]; then
    SITE=$DGSITE bash .devtools/sglang_on_device/run_chunk.sh .devwheels/chunk3
  fi
  set -o pipefail
  status=0
  python3 benchmarks/gpu_drafter.py "${A[@]}" --stages "$stages" --budget-s "${BUDGET_S:-560}" "$@" 2>&1 \
    | grep --line-buffered -v "Decode batch\|Prefill batch" | tee "$OUT/driver.log" || status=$?
  for f in "$OUT"/sglang_*.log; do  # a call returns at most 8 files
    [ -e "$f" ] || continue
    { echo "==== $(basename "$f")"; grep -v "Decode batch\|Prefill batch" "$f" | tail -60; } >> "$OUT/sglang.logs.txt"
    rm -f "$f"
  done
  exit $status
  ;;
*)
  echo "unknown step $step: prepare|deps|target|run"; exit 2
  ;;
esac
