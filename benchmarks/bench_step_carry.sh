#!/usr/bin/env bash
# Build .benchcarry/ (git-excluded) for benchmarks/bench_step.py on the lent GPU, here, once:
# SpecForge's `specforge/` package from its source (only for the benchmark: never a project
# dependency) and the py3.12 wheels the device lacks (aerie's pydantic stack; redis, which
# SpecForge imports).
#
#   bash benchmarks/bench_step_carry.sh SPECFORGE_GIT_DIR [COMMIT]     # measured: a6b6b023
#
# Then one device call, carry [".benchcarry"]:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .benchcarry/wheels/*.whl
#   PYTHONPATH=/tmp/site:shared:services/trainer:.benchcarry/sf PYTHONUNBUFFERED=1 \
#     python3 benchmarks/bench_step.py --device cuda --check --out $OUT/step.json
set -euo pipefail
cd "$(dirname "$0")/.."
src=${1:?"give SpecForge's git directory (a clone of github.com/sgl-project/SpecForge)"}
commit=${2:-a6b6b023}
grep -qx '/.benchcarry/' .git/info/exclude || echo '/.benchcarry/' >> .git/info/exclude
rm -rf .benchcarry && mkdir -p .benchcarry/sf .benchcarry/wheels
git --git-dir="$src" archive "$commit" specforge | tar x -C .benchcarry/sf
PY=.venv/bin/python
pins=$($PY -m pip freeze | grep -iE '^(pydantic|pydantic[-_]core|pydantic[-_]settings|annotated[-_]types|typing[-_]inspection|python[-_]dotenv|redis)==')
# shellcheck disable=SC2086
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .benchcarry/wheels $pins
du -sh .benchcarry/*
