#!/usr/bin/env bash
# Prepare .venv-sglang: real SGLang for the tests, in its own venv as in its own container.
# Idempotent: reuses the venv when its stamp matches these pins (and the inference package).
# Fresh build: ~160 s on an idle machine (4 min measured on a busy 2-core one), ~11 GB.
#   scripts/sglang_env.sh            # build or reuse
#   SGLANG_VENV=/path scripts/sglang_env.sh
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${SGLANG_VENV:-.venv-sglang}"
PINS=(sglang==0.5.23 sglang-kernel==0.4.10 accelerate==1.15.0 gguf==0.19.0)
STAMP="$VENV/.aerie-pins"
WANT="${PINS[*]} $(sha256sum services/inference/pyproject.toml | cut -c1-16)"

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" ]] \
   && "$VENV/bin/python" -c "import aerie_sglang, importlib.metadata as m; m.version('sglang')" 2>/dev/null; then
  echo "sglang env: reusing $VENV ($WANT)"; exit 0
fi
echo "sglang env: building $VENV (${PINS[*]}) ..."
[[ -x "$VENV/bin/python" ]] || python3.11 -m venv "$VENV"
"$VENV/bin/pip" install --quiet "${PINS[@]}"   # torch comes from the local wheels (pip constraint)
"$VENV/bin/pip" install --quiet --no-deps -e services/inference
"$VENV/bin/python" -c "import importlib.metadata as m; print('sglang', m.version('sglang'), 'torch', m.version('torch'))"
echo "$WANT" > "$STAMP"
