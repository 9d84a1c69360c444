#!/usr/bin/env bash
# Lint, format and type checks (ruff.toml, mypy.ini); scripts/test.sh runs this first. Fix with: .venv/bin/ruff format . && .venv/bin/ruff check --fix .
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/ruff check --no-cache .
.venv/bin/ruff format --no-cache --check .
.venv/bin/python -m mypy   # strict on the core, checked on the app and services; cache in .cache/mypy (mypy.ini)
