#!/usr/bin/env bash
# Install everything for work and tests into .venv (idempotent; safe to run again).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || "${PYTHON:-python3}" -m venv .venv
.venv/bin/pip install -q --disable-pip-version-check -r requirements-dev.txt
# kustomize (its Go library) for scripts/deploy_checks; its metadata says Python 3.14, the wheel runs on 3.11
.venv/bin/pip install -q --disable-pip-version-check --ignore-requires-python pykustomize==0.1.4
.venv/bin/pip install -q --disable-pip-version-check --no-deps -r requirements-data.txt
echo "aerie: set up in .venv ($(.venv/bin/python -c 'import aerie; print(aerie.__version__)'))"
