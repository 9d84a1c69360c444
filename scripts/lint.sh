#!/usr/bin/env bash
# Lint and format checks (ruff.toml); scripts/test.sh runs this first. Fix with: .venv/bin/ruff format . && .venv/bin/ruff check --fix .
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/ruff check --no-cache .
.venv/bin/ruff format --no-cache --check .
