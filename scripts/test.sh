#!/usr/bin/env bash
# The test command (README): set up, start what the tests need, run them, stop what we started.
# Extra arguments go to pytest (e.g. scripts/test.sh -k store).
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d /tmp/aerie-test.XXXXXX)
started_redis=""
sglang_env=""
cleanup() {
  [ -n "$sglang_env" ] && kill -- "-$sglang_env" 2>/dev/null || true
  [ -n "${AERIE_TEST_S3_PGID:-}" ] && kill -- "-$AERIE_TEST_S3_PGID" 2>/dev/null || true
  [ -n "$started_redis" ] && kill "$(cat "$work/redis.pid")" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT
# SGLang in its own venv, as in its own container (reused when ready): built while .venv is set up
setsid bash scripts/sglang_env.sh > "$work/sglang_env.log" 2>&1 &  # its own process group: stopped whole
sglang_env=$!
bash scripts/setup.sh
bash scripts/lint.sh          # ruff lint + format check, mypy: fails fast, before any service starts
if ! wait "$sglang_env"; then
  sglang_env=""; cat "$work/sglang_env.log"; echo "scripts/sglang_env.sh failed" >&2; exit 1
fi
sglang_env=""
cat "$work/sglang_env.log"
if ! .venv/bin/python -c 'import redis; redis.Redis(socket_connect_timeout=1).ping()' 2>/dev/null; then
  redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no \
    --pidfile "$work/redis.pid" --logfile "$work/redis.log"
  started_redis=1
  for _ in $(seq 50); do .venv/bin/python -c 'import redis; redis.Redis().ping()' 2>/dev/null && break; sleep 0.2; done
fi
.venv/bin/python -m tests.services s3 --dir "$work/s3" --env-file "$work/s3.env"
source "$work/s3.env"
export AERIE_REQUIRE_SGLANG=1   # SGLang tests must run here, never skip
# two worker processes: the files with SGLang tests on one, one after another (a server takes 3-4
# GB), the other files on the other, a file at a time (tests/conftest.py); more or fewer workers:
# AERIE_TEST_WORKERS=N (0: one process)
.venv/bin/python -m pytest -n "${AERIE_TEST_WORKERS:-2}" --dist loadgroup "$@"
